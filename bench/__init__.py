"""Benchmarks of the context-parallel attention methods, one trial at a time.

Layered so that each part imports only those above it (``tests/test_imports.py``):

* ``bench.model``: the model under test (``config``: shapes, named configs, FLOPs;
  ``decoder``: the Llama-style decoder over any registered method).
* ``bench.training``: the training step (``config``: ``TrainingConfig``, what the step does, as data;
  ``step``: FSDP2, checkpointing with host offload, tiling, chunked loss; ``presets``: named
  configurations such as ``upipe-best``).
* ``bench.measure``: one trial -> one row (``config``: ``MeasurementConfig``, how the step is measured,
  and ``StepConfig``, both; ``trial``: the ``Trial`` type; ``run``: the three modes real / emulated /
  simulated; ``simulate``: fake tensors, fake process group, memory tracking; ``launch``: real ranks).
* ``bench.stackmodel``: what models the paper's setup (device presets and link models, the stacks'
  terms, the allocator replay, the kernels' scratch, step counts and the step-time model, fidelity).
* ``bench.search``: trials that decide other trials (``autochunk``: ``chunk_heads=auto``;
  ``maxctx``: the max-context search; ``plan``: the planner).
* ``bench.cli``: ``python -m bench``.

Rows, sizes and the vocabulary live in ``records`` (torch-free). The repository's layout is in
docs/README.md, section "Layout".
"""

# Before anything imports torch: the simulated CUDA device (bench.stackmodel.simcuda) can only be
# loaded first. It does nothing on a CUDA build of torch or when torch is already imported.
from .stackmodel import simcuda as _simcuda  # noqa: E402

_simcuda.preload()
