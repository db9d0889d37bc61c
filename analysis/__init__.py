"""Regenerate the paper's tables and figures from result rows (``results/**/*.jsonl``).

* ``analysis.load``: rows into a flat DataFrame (``load_rows``), the paper's numbers (``load_paper``).
* ``analysis.tables``: one function per table (paper and ours side by side), and ``compare_methods``.
* ``analysis.figures``: one function per figure.
* ``analysis.report``: everything into ``paper_figs/`` with an index (``python -m analysis figs``).
* ``analysis/notebooks/``: jupytext notebooks calling the above, one per table/figure group.

Analysis reads rows only: it never runs a model and does not import torch.
"""
