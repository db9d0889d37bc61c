"""The suite's records layer: vocabulary, sizes, units, the row schema, trial identity, row files.

Torch-free by design (``tests/test_records.py`` checks ``sys.modules``): the sweeps, the
analysis and any tool reading results import this, not the benchmark.

    from records import Row, read_rows, trial_key, Mode, parse_size, human, GiB
"""
from __future__ import annotations

from .identity import key_string, requested_options, trial_key
from .provenance import cpu_name, environment
from .schema import SCHEMA_VERSION, Environment, Figures, Row, RowError, validate_row
from .sizes import human, parse_size, scan
from .store import BadLine, append_rows, encode, finished_keys, read_rows
from .units import GiB, KiB, MiB
from .vocab import FIDELITY_ANCHOR_NOTE, DType, Kind, Mode, Scope, Status, Vocab, fidelity_anchor_note

__all__ = [
    "FIDELITY_ANCHOR_NOTE", "SCHEMA_VERSION", "BadLine", "DType", "Environment", "Figures", "GiB", "Kind", "KiB",
    "MiB", "Mode", "Row", "RowError", "Scope", "Status", "Vocab", "append_rows", "cpu_name", "encode", "environment",
    "fidelity_anchor_note", "finished_keys", "human", "key_string", "parse_size", "read_rows", "requested_options",
    "scan", "trial_key", "validate_row",
]
