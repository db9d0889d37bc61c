"""Regenerate the paper's tables and figures from result rows (``results/**/*.jsonl``).

* ``analysis.load``: rows into a flat DataFrame (``load_rows``), the paper's numbers (``load_paper``).
* ``analysis.tables``: one function per table (paper and ours side by side), and ``compare_methods``.
* ``analysis.figures``: one function per figure.
* ``analysis.report``: everything into ``paper_figs/`` with an index (``python -m analysis figs``).
* ``analysis/notebooks/``: jupytext notebooks calling the above, one per table/figure group.

* ``analysis.fidelity_report``, ``analysis.steptime_report``, ``analysis.plan_report`` (with
  ``analysis.plan_figure``), ``analysis.gpu_report``: the renderers of what ``bench`` computes
  (fidelity, the modelled Table 3, plans, real GPU rows against their simulation); ``bench``'s
  commands and ``scripts/gpu/compare.py`` call them, so every generated table has one writer.
* ``analysis.derived``: those outputs regenerated from committed data for ``make figs``.

The tables and figures of rows never run a model and do not import torch; the renderers of
``bench``'s results import ``bench`` (and so torch), and ``analysis.derived`` computes through
it from committed data, simulating nothing.
"""
