"""Emulated runs with the attention kernels' arithmetic skipped: real memory at lengths whose
attention would take hours on one GPU.

Why. An emulated trial (``bench.measure.run``: each deciding rank of a C-rank job on one GPU in turn, a fake process
group) measures the real caching allocator, FSDP2's real streams, the real checkpoint offloads
and the real library code. Its cost is the attention: at the paper's long-context points (3M
tokens on 8 ranks, 4M on 16) one rank's causal attention is 10^17-10^18 FLOPs a step, far longer
on one GPU than everything else in the step (docs/modes.md, section "Emulated"). What decides
memory there is not the attention's values but its allocations, which are known exactly: the
kernels' outputs, and the scratch their backward allocates for the length of the call. So with
``StepConfig.attention_math="skip"`` (emulated mode only; ``Trial.validate`` refuses it
elsewhere) the step runs under :class:`SkipAttentionMath`, which answers each attention kernel
call with zero-filled outputs of the kernel's shapes, dtypes and strides (from the op's meta
implementation), zeroes the buffers the kernel would write, and holds the backward's scratch
while the call lasts. Every other operation of the step runs for real. Values (the loss, the
gradients) are then meaningless, and the row says so; memory is what the real kernels would
leave, and the step time is everything but the attention.

Which calls (``is_skipped``: ``SKIPPED_ATEN`` and the ``cpab_sim`` namespace):

* torch's fused flash attention, ``aten._scaled_dot_product_flash_attention`` (CUDA) and
  ``..._for_cpu`` with their backward ops: what our methods' ``torch`` kernel
  (``methods.core.kernels``) and torch's context parallel call. On CUDA the backward also holds
  flash-attn 2's ``mha_bwd`` scratch (torch's CUDA kernel is flash-attn 2's,
  ``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``): ``dq_accum`` and
  ``softmax_d``, with GQA the query-head-expanded dK/dV, as ``bench.stackmodel.workspace``'s
  ``fa2`` sizes them. On CPU nothing (CPU has no allocator statistics; ``MemTracker`` never
  sees a CPU kernel's internal buffers).
* the kernels of the memory-faithful flash-attn 2 and 3 (``bench.stackmodel.fake_flash_attn``,
  ``cpab_sim::*``), installed for the wrapped libraries (yunchang, ring-flash-attn, DeepSpeed
  FPDT) where no flash-attn is installed, as in simulated mode. Their Python entry points
  already allocate what flash-attn's C++ ones do, scratch included; the kernel op allocates
  nothing more.

Other attention kernels (memory-efficient, cuDNN, math) are not intercepted and compute as
usual. ``calls`` counts the calls answered, so a run that skipped nothing can say so.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..stackmodel.workspace import workspace_shapes

aten = torch.ops.aten
FLASH_BACKWARD_CUDA = aten._scaled_dot_product_flash_attention_backward.default
SKIPPED_ATEN = (
    aten._scaled_dot_product_flash_attention.default,
    FLASH_BACKWARD_CUDA,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)
SIM_NAMESPACE = "cpab_sim"  # bench.stackmodel.fake_flash_attn's kernel ops
NOTE = ("attention arithmetic skipped (bench.measure.skipmath): the attention kernels returned zeros of their "
        "real shapes and held their real scratch; memory is the real step's, values and the loss are not, "
        "and the step time leaves out the attention kernels")


def is_skipped(func) -> bool:
    """Whether ``func`` (an ``OpOverload``) is an attention kernel this mode answers."""
    return func in SKIPPED_ATEN or getattr(func, "namespace", None) == SIM_NAMESPACE


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _written_args(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors the op's schema says it writes (``mutates_args`` of a custom op), flattened."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                written.append(t)
    return written


class SkipAttentionMath(TorchDispatchMode):
    """Answers the attention kernels' calls without their arithmetic (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_skipped(func):
            return func(*args, **kwargs)
        self.calls[str(func.overloadpacket)] += 1
        device = next(x.device for x in args if isinstance(x, torch.Tensor))
        scratch = []
        if func is FLASH_BACKWARD_CUDA:  # mha_bwd's buffers, alive while the call lasts
            q, k = args[1], args[2]  # (grad_out, query, key, ...) in [B, H, S, d]
            scratch = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in workspace_shapes("fa2", q, k)]
        for t in _written_args(func, args, kwargs):
            t.zero_()
        shapes = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))

        def real(x):
            if isinstance(x, torch.Tensor) and x.device.type == "meta":
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device).zero_()
            return x

        out = tree_map(real, shapes)
        del scratch
        return out
