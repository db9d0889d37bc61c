"""Benchmarks of the context-parallel attention methods (README.md, section "Layout").

* ``models``: Llama-style decoder over any method, named configs, parameter and FLOP counts.
* ``step``: one training step with the paper's memory levers (``StepConfig``).
* ``trial``: one trial in ``real``, ``emulated`` or ``simulated`` mode -> one result row.
* ``rows``: the result-row schema, validated JSON Lines, ``trial_key``.
* ``maxctx``: maximum-context search; ``launch``: real ranks; ``hardware``: device presets
  and link models; ``workspace``: attention-kernel scratch model; ``simulate``: fake
  tensors, fake process group, memory tracking.
* ``python -m bench``: the CLI (``cli``).
"""
