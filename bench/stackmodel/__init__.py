"""The paper's training stack as a model, on top of the lean simulation in ``bench.measure``.

``bench.measure`` is what the benchmark is: a trial run for real, emulated, or simulated with fake
tensors and a fake process group, which gives the memory the step's own tensors hold. This package
models what a real GPU stack adds around that step, and how long it takes:

* ``stack``: the stack's terms (the paper's TorchTitan setup, or the lean one), applied by the
  resolver before anything runs;
* ``allocator``: the CUDA caching allocator, replayed over the step's allocations (reserved peaks);
* ``workspace`` and ``fake_flash_attn``: the attention kernels' scratch and flash-attn's kernels
  where flash-attn is not installed;
* ``simcuda``: the simulated CUDA device that lets the GPU code path run on a CPU;
* ``stepcount``, ``counts``, ``hardware`` and ``steptime``: what a step computes and sends, and the
  modelled step time from those counts on a device preset and its links;
* ``simmode``: one dispatch mode for the per-operator counters (and the memory tracker) of a simulated step;
* ``fidelity`` and ``steptime_fit``: both models against the paper's published numbers.
"""
