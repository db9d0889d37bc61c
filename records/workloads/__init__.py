"""Packed-document workloads: document-length distributions as data, and a trial's ``docs``.

    from records.workloads import DocsSpec, names, sample, summary
    sample("prolong64k", 128 << 10, seed=1)   # lengths that Documents.from_lengths takes
    DocsSpec.parse("prolong64k:1").fields(128 << 10)   # what a row records

``distributions``: the named distributions (``data/``, each with its source) and seeded packing;
``spec``: ``DocsSpec``, the documents of one trial as the CLI, a sweep spec and a row write them.
Torch-free, as the rest of ``records``.
"""
from __future__ import annotations

from .distributions import Distribution, get, names, sample, summary
from .spec import DocsSpec, check_fields, identity, parse_lengths

__all__ = ["DocsSpec", "Distribution", "check_fields", "get", "identity", "names", "parse_lengths", "sample",
           "summary"]
