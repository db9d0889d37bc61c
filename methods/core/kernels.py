"""Local attention with log-sum-exp, forward and backward: the only place kernels are called.

Every method works in the ``[batch, seq, heads, head_dim]`` (BSHD) layout and calls
``get_kernel(...)`` once at build time, then ``kernel.forward`` / ``kernel.backward``
(inside its own autograd function) or ``attention(...)`` (plain autograd). Keeping
every kernel behind one small interface is what lets a result row say exactly which
kernel produced its numbers, and lets the simulator see only what a kernel allocates.

Kernels (``KERNELS``):

* ``torch``: PyTorch's fused flash attention, ``aten._scaled_dot_product_flash_attention_for_cpu``
  on CPU and ``aten._scaled_dot_product_flash_attention`` on CUDA, with their backward ops.
  Both return the LSE (fp32, ``[B, H, S]``) and take GQA natively (query heads a multiple of
  KV heads), so KV heads are never repeated in memory. Under ``FakeTensorMode`` their fake
  implementations allocate exactly ``out`` and ``lse``, which is what makes simulation honest.
* ``flash-attn``: Dao's flash-attn private ``_flash_attn_forward/_backward`` (2.7+ signatures)
  when importable (CUDA only in practice).
* ``math``: plain fp32 matmul-softmax-matmul. Materialises the score matrix: for tests only.

Conventions: ``lse`` is fp32 ``[B, Hq, Sq]``; GQA maps query head ``i`` to KV head
``i // (Hq // Hk)``.

Causal masks and the query offset. ``causal`` with ``q_offset`` (an int >= 0, default 0) lets
query ``i`` see keys ``j <= i + q_offset``: ``q_offset`` is the global position of the first
query relative to the first key, so a rank's block of queries can attend to a longer key
range that starts before it (all-gathered K/V, a chunk of an earlier prefix). ``q_offset = 0``
with ``Sq == Sk`` is plain causal attention, the one case where top-left and bottom-right
alignment coincide and every library kernel agrees; it is the only causal call the fused
kernels get. Anything else is split by ``offset_blocks`` into at most three blocks that each
are non-causal or causal on equal lengths (keys before the diagonal, the square diagonal block,
and queries past the last key, which see every key), computed with the native kernel and
merged by log-sum-exp (``blockwise_forward`` / ``blockwise_backward``), so no mask is ever
materialised. What each kernel does with a causal call:

* ``torch``: native for ``q_offset = 0, Sq == Sk``; otherwise blockwise. Extra memory forward:
  for the rows that merge two blocks, ``merge_partials``' fp32 temporaries (a few fp32 buffers of
  those rows' output size) and the second block's output; backward: fp32 accumulators for dq,
  dk, dv (``Sq + 2 Sk`` rows at fp32) and one block's gradients at a time in the input dtype.
  (The aten CPU op would take an explicit ``attn_mask``, an ``Sq x Sk`` tensor: quadratic,
  which is what the split avoids.)
* ``flash-attn``: native when ``q_offset == Sk - Sq`` (its bottom-right alignment, which covers
  ``Sq == Sk`` at offset 0); otherwise blockwise, at the same cost as ``torch``.
* ``math``: an explicit boolean ``[Sq, Sk]`` mask on the fp32 scores it materialises anyway.

Without ``causal`` the offset has no meaning and is ignored (checked, not used), so a method can
pass its layout's offset whether or not the spec is causal.
"""
from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

ENV_VAR = "CPBENCH_KERNEL"


class Kernel(Protocol):
    """What a method calls: BSHD in, ``(out, lse)`` out, and the matching backward.

    ``q_offset`` (see the module docstring) is a keyword with default 0, so a kernel wrapper
    that does not take it still serves every call made without an offset.
    """

    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, q_offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
        q_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, q_offset: int = 0) -> None:
    """Refuse shapes and offsets the kernels would misread, before any kernel runs."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention kernels take [batch, seq, heads, head_dim] tensors")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})"
        )
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(
            f"q_offset must be an int >= 0 (the position of the first query relative to the first key, "
            f"so that every query sees at least key 0), got {q_offset!r}"
        )


def offset_blocks(sq: int, sk: int, q_offset: int) -> list[tuple[slice, list[tuple[slice, bool]]]]:
    """The causal-with-offset mask (query ``i`` sees key ``j <= i + q_offset``) as kernel calls.

    Returns ``[(query rows, [(key columns, causal), ...]), ...]``: the row ranges are disjoint
    and cover ``[0, sq)``; within one row range the column blocks are disjoint and their union
    is exactly what those rows see; every block is either unmasked or causal on a square block
    (equal lengths, where every kernel's causal flag means the same). Rows ``[0, m)`` with
    ``m = min(sq, sk - q_offset)`` see all keys before ``q_offset`` and the square diagonal block
    ``[q_offset, q_offset + m)`` causally; rows from ``m`` on lie past the last key and see every
    key. Why: library kernels disagree on (or refuse) causal masks of unequal lengths, and an
    explicit mask costs ``sq * sk`` memory; this split costs neither.
    """
    m = max(0, min(sq, sk - q_offset))
    groups: list[tuple[slice, list[tuple[slice, bool]]]] = []
    if m:
        parts = [(slice(0, q_offset), False)] if q_offset else []
        groups.append((slice(0, m), parts + [(slice(q_offset, q_offset + m), True)]))
    if m < sq:
        groups.append((slice(m, sq), [(slice(0, sk), False)]))
    return groups


NativeForward = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
NativeBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Tensor]]


def blockwise_forward(
    native: NativeForward, q: Tensor, k: Tensor, v: Tensor, scale: float, q_offset: int
) -> tuple[Tensor, Tensor]:
    """Causal attention with a query offset from ``native(q, k, v, causal, scale)`` calls.

    ``native`` only ever sees unmasked blocks or causal square blocks (``offset_blocks``).
    Rows covered by two blocks are merged by log-sum-exp in fp32 (``merge_partials``) and cast
    back to the input dtype; rows with one block keep the kernel's output as is.
    """
    outs, lses = [], []
    for rows, parts in offset_blocks(q.shape[1], k.shape[1], q_offset):
        out = lse = None
        for cols, causal in parts:
            blk_out, blk_lse = native(q[:, rows], k[:, cols], v[:, cols], causal, scale)
            if len(parts) == 1:
                out, lse = blk_out, blk_lse
            else:
                out, lse = merge_partials(out, lse, blk_out, blk_lse)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def blockwise_backward(
    native: NativeBackward, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    scale: float, q_offset: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``blockwise_forward`` from ``native(dout, q, k, v, out, lse, causal, scale)`` calls.

    Each block's backward gets the final ``out`` and ``lse`` of its rows: with them a flash
    backward recomputes that block's share of the softmax exactly (as ring attention does), so
    the blocks' gradients add up to the full one. They are summed in fp32 (keys before the
    offset get contributions from two row ranges) and cast to the input dtypes.
    """
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for rows, parts in offset_blocks(q.shape[1], k.shape[1], q_offset):
        for cols, causal in parts:
            dq_b, dk_b, dv_b = native(
                dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows],
                lse[:, :, rows].contiguous(), causal, scale,
            )
            dq[:, rows] += dq_b
            dk[:, cols] += dk_b
            dv[:, cols] += dv_b
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TorchKernel:
    """PyTorch's fused flash attention ops (CPU and CUDA variants), GQA native.

    Causal calls other than ``q_offset = 0`` on equal lengths go through ``blockwise_forward``:
    the ops' causal flag has no offset (PyTorch aligns an unequal-length causal mask top-left,
    pytorch/pytorch#108108, which the CPU op does on 2.13, i.e. only ``q_offset = 0``), and
    their ``attn_mask`` would be an ``Sq x Sk`` tensor.
    """

    name = "torch"

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, q_offset: int = 0
    ) -> tuple[Tensor, Tensor]:
        if causal and (q_offset or q.shape[1] != k.shape[1]):
            return blockwise_forward(self._forward, q, k, v, scale, q_offset)
        return self._forward(q, k, v, causal, scale)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        causal: bool, scale: float, q_offset: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if causal and (q_offset or q.shape[1] != k.shape[1]):
            return blockwise_backward(self._backward, dout, q, k, v, out, lse, scale, q_offset)
        return self._backward(dout, q, k, v, out, lse, causal, scale)

    @staticmethod
    def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, causal, scale=scale
            )
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                qt, kt, vt, 0.0, causal, False, scale=scale
            )[:2]
        return out.transpose(1, 2), lse

    @staticmethod
    def _backward(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        qt, kt, vt, ot, dot = (t.transpose(1, 2) for t in (q, k, v, out, dout))
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot, qt, kt, vt, ot, lse, 0.0, causal, scale=scale
            )
        else:
            # no cumulative sequence lengths: None reaches the op as an undefined tensor, which
            # selects the dense backward (a defined one, even empty, selects flash-attn's varlen
            # backward, which then refuses "batch size must be positive": seen on an H100)
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            # the kernel needs a unit stride on head_dim only (flash-attn's mha_bwd checks
            # dout.stride(-1) == 1); a BSHD tensor viewed as BHSD has it, so no copy is made
            dot = dot if dot.stride(-1) == 1 else dot.contiguous()
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dot, qt, kt, vt, ot, lse, None, None,
                q.shape[1], k.shape[1], 0.0, causal, seed, seed, scale=scale,
            )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class MathKernel:
    """Reference kernel: fp32 scores and softmax, any device. Quadratic memory.

    The causal mask (with any ``q_offset``) is explicit: a boolean ``[Sq, Sk]`` tensor, small
    next to the ``[B, H, Sq, Sk]`` fp32 scores this kernel materialises anyway.
    """

    name = "math"

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, q_offset: int = 0) -> tuple[Tensor, int]:
        groups = q.shape[2] // k.shape[2]
        qf = q.float().transpose(1, 2)
        kf = k.float().transpose(1, 2).repeat_interleave(groups, dim=1)
        s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        if causal:  # key j is hidden from query i when j > i + q_offset
            mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1 + q_offset)
            s = s.masked_fill(mask, float("-inf"))
        return s, groups

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, q_offset: int = 0
    ) -> tuple[Tensor, Tensor]:
        s, groups = self._scores(q, k, causal, scale, q_offset)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        vf = v.float().transpose(1, 2).repeat_interleave(groups, dim=1)
        out = torch.matmul(p, vf).transpose(1, 2).to(q.dtype)
        return out, lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        causal: bool, scale: float, q_offset: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        s, groups = self._scores(q, k, causal, scale, q_offset)
        p = torch.exp(s - lse.unsqueeze(-1))
        dof = dout.float().transpose(1, 2)
        vf = v.float().transpose(1, 2).repeat_interleave(groups, dim=1)
        kf = k.float().transpose(1, 2).repeat_interleave(groups, dim=1)
        qf = q.float().transpose(1, 2)
        dv = torch.matmul(p.transpose(-1, -2), dof)
        dp = torch.matmul(dof, vf.transpose(-1, -2))
        delta = (dof * out.float().transpose(1, 2)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, kf) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qf) * scale

        def fold(t: torch.Tensor) -> torch.Tensor:  # sum the query heads sharing one KV head
            b, h, s_, d = t.shape
            return t.view(b, h // groups, groups, s_, d).sum(2)

        dk, dv = fold(dk), fold(dv)
        return (
            dq.transpose(1, 2).to(q.dtype),
            dk.transpose(1, 2).to(k.dtype),
            dv.transpose(1, 2).to(v.dtype),
        )


class FlashAttnKernel:
    """Dao's flash-attn (2.7+ private API), imported lazily so a missing install costs nothing.

    Its causal mask is aligned bottom-right (query ``i`` sees ``j <= i + Sk - Sq``), so a call
    with ``q_offset == Sk - Sq`` is native; any other causal offset goes through
    ``blockwise_forward``, whose blocks are unmasked or square.
    """

    name = "flash-attn"

    def __init__(self) -> None:
        try:
            self._fa = importlib.import_module("flash_attn.flash_attn_interface")
        except ImportError as err:
            raise ValueError(
                "kernel 'flash-attn' needs the flash_attn package, which is not importable here "
                f"({err}); install it on a CUDA machine (pip install flash-attn) or use kernel='torch'"
            ) from None

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, q_offset: int = 0
    ) -> tuple[Tensor, Tensor]:
        if causal and q_offset != k.shape[1] - q.shape[1]:
            return blockwise_forward(self._forward, q, k, v, scale, q_offset)
        return self._forward(q, k, v, causal, scale)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        causal: bool, scale: float, q_offset: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if causal and q_offset != k.shape[1] - q.shape[1]:
            return blockwise_backward(self._backward, dout, q, k, v, out, lse, scale, q_offset)
        return self._backward(dout, q, k, v, out, lse, causal, scale)

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse, *_ = self._fa._flash_attn_forward(
            q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False
        )
        return out, lse

    def _backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            dout.contiguous(), q, k, v, out, lse, dq, dk, dv,
            0.0, scale, causal, -1, -1, 0.0, None, False, None,
        )
        return dq, dk, dv


KERNELS: dict[str, type] = {"torch": TorchKernel, "math": MathKernel, "flash-attn": FlashAttnKernel}
_default: str | None = None


def default_kernel_name() -> str:
    """The kernel used when a method is built without ``kernel=``: env, then selection, then 'torch'."""
    return os.environ.get(ENV_VAR) or _default or "torch"


def select_kernel(name: str | None) -> None:
    """Choose the process-wide default kernel once (e.g. from a CLI flag)."""
    global _default
    if name is not None:
        get_kernel(name)  # validate now, not at first use
    _default = name


def get_kernel(name: str | None = None) -> Kernel:
    """Resolve a kernel by name (``None``: the default); unknown names list the choices."""
    name = name or default_kernel_name()
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}")
    return KERNELS[name]()


def flash_attn_dtype(who: str, x: torch.Tensor, cpu_fp32: torch.dtype) -> torch.dtype:
    """The dtype a library that calls flash-attn itself is handed: fp16/bf16 as is; anything
    else refused on CUDA (flash-attn computes in half precision only); on CPU, where the tests'
    plain-torch stand-in serves, full precision runs as ``cpu_fp32`` (a wrapper picks fp64 where
    its library's fp32 backward aliases a buffer)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.dtype
    if x.device.type == "cuda":
        raise ValueError(
            f"{who}: flash-attn computes in float16/bfloat16 only, got {x.dtype}; cast the block and its "
            "input to bfloat16"
        )
    return cpu_fp32


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


class _Attention(torch.autograd.Function):
    """Plain autograd around one kernel call. The offset is passed to the kernel only when it
    is not 0, so a kernel wrapper without a ``q_offset`` parameter (methods/offload.py records
    the tensors of each call) serves every call made without an offset."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel, q_offset):
        extra = {"q_offset": q_offset} if q_offset else {}
        out, lse = kernel.forward(q, k, v, causal, scale, **extra)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.kernel, ctx.extra = causal, scale, kernel, extra
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale, **ctx.extra)
        return dq, dk, dv, None, None, None, None


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    kernel: Kernel | None = None,
    scale: float | None = None,
    q_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable local attention returning ``(out, lse)``; lse is not differentiable.

    With ``causal``, query ``i`` sees keys ``j <= i + q_offset`` (``q_offset``: the global
    position of the first query relative to the first key; see the module docstring for what
    each kernel does with it). ``q_offset`` is ignored without ``causal``.
    """
    _check(q, k, v, causal, q_offset)
    kernel = kernel or get_kernel()
    scale = softmax_scale(q.shape[-1]) if scale is None else scale
    return _Attention.apply(q, k, v, causal, scale, kernel, q_offset)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    kernel: Kernel | None = None,
    scale: float | None = None,
    q_offset: int = 0,
) -> torch.Tensor:
    """Differentiable local attention (BSHD in, BSHD out); ``q_offset`` as in ``attention_with_lse``."""
    return attention_with_lse(q, k, v, causal, kernel, scale, q_offset)[0]


def merge_partials(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets.

    ``out`` is kept in fp32 (ring/chunked methods accumulate many blocks, and bf16
    accumulation drifts: a common complaint against ring attention implementations).
    ``lse`` is ``[B, H, S]``, outputs are BSHD.
    """
    block_out = block_out.float()
    if out is None:
        return block_out, block_lse.clone()
    new_lse = torch.logaddexp(lse, block_lse)
    w_old = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse
