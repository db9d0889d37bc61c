"""Attention-kernel workspaces, which simulation does not otherwise see.

Under FakeTensorMode a kernel allocates exactly what its fake implementation returns. A
real flash-attention **backward** also allocates scratch buffers for the duration of the
call, and at long context they are large: an fp32 accumulator for dQ (twice the bytes of
dQ itself), and with grouped-query attention fp32 (FA3) or query-head-expanded (FA2)
buffers for dK and dV. Which buffers, and how large, is a property of the kernel library,
so the model is a stated option (``StepConfig.kernel_workspace``, recorded in the row's
levers), applied only in simulated mode:

* ``none``: nothing beyond the returned tensors (what torch's fake kernels allocate).
* ``fa2`` (flash-attn 2 ``mha_bwd``, also what torch's CUDA flash backward is built on):
  ``dq_accum`` fp32 ``[B, S_q', H_q, d']`` and ``softmax_d`` fp32 ``[B, H_q, S_q']``; with
  GQA (``H_q != H_k``), ``dk_expanded`` and ``dv_expanded`` ``[B, S_k, H_q, d]`` in the input
  dtype.
* ``fa3`` (flash-attn 3 Hopper backward, the kernel of the paper's runs): ``dq_accum`` fp32
  ``[B, H_q, S_q' * d']``, ``softmax_lse_log2`` and ``dpsum`` fp32 ``[B, H_q, S_q']``; with
  GQA, ``dk_accum`` and ``dv_accum`` fp32 ``[B, H_k, S_k' * d']``.

``S'`` is the length rounded up to 128 and ``d'`` the head dim rounded up to 32 (no change
for the paper's 128). The buffers are allocated just before the backward op runs and freed
when it returns, so the memory tracker sees them exactly while the kernel would hold them.

The buffers are sized on the kernels a rank runs. An SDPA op on DTensors (``torch-cp``: torch's
context parallel) carries the tensors' *global* shape; the mode hands it back to DTensor, whose
handler runs the ring's local kernels, and those come back through the mode and are sized here;
DTensor's shape propagation of the global op (``stepcount.in_shape_propagation``) is not a kernel.
Sizing the global op would charge a rank the whole sequence's scratch
(docs/stacks.md, section "Kernel scratch").
"""
from __future__ import annotations

import torch

from ..measure.config import KERNEL_WORKSPACES
from .simmode import Counter
from .stepcount import in_shape_propagation

MODELS = KERNEL_WORKSPACES


def _up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def workspace_shapes(model: str, q: torch.Tensor, k: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Scratch buffers of one backward call; ``q``/``k`` in the ops' ``[B, H, S, d]`` layout."""
    if model == "none":
        return []
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    sq_r, sk_r, d_r = _up(sq, 128), _up(sk, 128), _up(d, 32)
    f32 = torch.float32
    if model == "fa2":
        out = [((b, sq_r, hq, d_r), f32), ((b, hq, sq_r), f32)]
        if hq != hk:
            out += [((b, sk, hq, d), q.dtype), ((b, sk, hq, d), q.dtype)]
        return out
    if model == "fa3":
        out = [((b, hq, sq_r * d_r), f32), ((b, hq, sq_r), f32), ((b, hq, sq_r), f32)]
        if hq != hk:
            out += [((b, hk, sk_r * d_r), f32), ((b, hk, sk_r * d_r), f32)]
        return out
    raise ValueError(f"unknown kernel workspace model {model!r}; choose one of {list(MODELS)}")


def _backward_ops() -> set:
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            aten._scaled_dot_product_flash_attention_backward.default}


class KernelWorkspace(Counter):
    """Allocates the modelled scratch buffers around every flash-attention backward call.

    Enter it inside the memory tracker (so the tracker sees the allocations); inside a
    ``SimulationMode`` it is one of its counters (``bench.stackmodel.simmode``), and the buffers it
    makes are dispatched to the tracker below that mode. ``calls`` and ``peak_call_bytes`` say how
    much was modelled."""

    def __init__(self, model: str) -> None:
        super().__init__()
        if model not in MODELS:
            raise ValueError(f"unknown kernel workspace model {model!r}; choose one of {list(MODELS)}")
        self.model = model
        self.ops = _backward_ops()
        self.calls = 0
        self.peak_call_bytes = 0

    def before(self, func, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
        """The scratch buffers of a backward call, held while it runs (a DTensor's op never reaches here:
        its shape is the global one, and DTensor's handler, torch-cp's ring, runs the local kernels, which
        come back through the counter)."""
        if func not in self.ops or self.model == "none" or in_shape_propagation():
            return None
        q, k = args[1], args[2]
        shapes = workspace_shapes(self.model, q, k)
        with self.dispatching_below():  # the memory tracker must see them
            buffers = [torch.empty(shape, dtype=dtype, device=q.device) for shape, dtype in shapes]
        self.calls += 1
        self.peak_call_bytes = max(self.peak_call_bytes, sum(t.numel() * t.element_size() for t in buffers))
        return buffers
