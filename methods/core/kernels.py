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

Conventions: ``lse`` is fp32 ``[B, Hq, Sq]``; ``causal`` needs ``Sq == Sk`` (top-left and
bottom-right alignment coincide, so every kernel agrees); GQA maps query head ``i`` to KV
head ``i // (Hq // Hk)``.
"""
from __future__ import annotations

import importlib
import math
import os
from typing import Protocol

import torch

ENV_VAR = "CPBENCH_KERNEL"


class Kernel(Protocol):
    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention kernels take [batch, seq, heads, head_dim] tensors")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})"
        )
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal attention needs equal query and key lengths, got {q.shape[1]} and {k.shape[1]}"
        )


class TorchKernel:
    """PyTorch's fused flash attention ops (CPU and CUDA variants), GQA native."""

    name = "torch"

    def forward(self, q, k, v, causal, scale):
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

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        qt, kt, vt, ot, dot = (t.transpose(1, 2) for t in (q, k, v, out, dout))
        if q.device.type == "cpu":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dot, qt, kt, vt, ot, lse, 0.0, causal, scale=scale
            )
        else:
            empty = torch.empty(0, dtype=torch.int32, device=q.device)
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dot.contiguous(), qt, kt, vt, ot, lse, empty, empty,
                q.shape[1], k.shape[1], 0.0, causal, seed, seed, scale=scale,
            )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class MathKernel:
    """Reference kernel: fp32 scores and softmax, any device. Quadratic memory."""

    name = "math"

    @staticmethod
    def _scores(q, k, causal, scale):
        groups = q.shape[2] // k.shape[2]
        qf = q.float().transpose(1, 2)
        kf = k.float().transpose(1, 2).repeat_interleave(groups, dim=1)
        s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        if causal:
            mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
            s = s.masked_fill(mask, float("-inf"))
        return s, groups

    def forward(self, q, k, v, causal, scale):
        s, groups = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        vf = v.float().transpose(1, 2).repeat_interleave(groups, dim=1)
        out = torch.matmul(p, vf).transpose(1, 2).to(q.dtype)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        s, groups = self._scores(q, k, causal, scale)
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
    """Dao's flash-attn (2.7+ private API), imported lazily so a missing install costs nothing."""

    name = "flash-attn"

    def __init__(self) -> None:
        try:
            self._fa = importlib.import_module("flash_attn.flash_attn_interface")
        except ImportError as err:
            raise ValueError(
                "kernel 'flash-attn' needs the flash_attn package, which is not importable here "
                f"({err}); install it on a CUDA machine (pip install flash-attn) or use kernel='torch'"
            ) from None

    def forward(self, q, k, v, causal, scale):
        out, lse, *_ = self._fa._flash_attn_forward(
            q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
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


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel):
        out, lse = kernel.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.kernel = causal, scale, kernel
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    kernel: Kernel | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable local attention returning ``(out, lse)``; lse is not differentiable."""
    _check(q, k, v, causal)
    kernel = kernel or get_kernel()
    scale = softmax_scale(q.shape[-1]) if scale is None else scale
    return _Attention.apply(q, k, v, causal, scale, kernel)


def attention(q, k, v, causal: bool, kernel: Kernel | None = None, scale: float | None = None):
    """Differentiable local attention (BSHD in, BSHD out)."""
    return attention_with_lse(q, k, v, causal, kernel, scale)[0]


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
