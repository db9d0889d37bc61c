"""A plain-torch stand-in for flash-attn's private API, for tests on machines without it.

flash-attn has no CPU build, yet ``ring_flash_attn`` imports it at module level and
DeepSpeed's ``FPDT_Attention`` refuses to build without it. Both only call the private
``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward``
(2.7+ signatures), so this module provides those two in plain torch:

* layout ``[batch, seq, heads, head_dim]``; GQA (query head ``i`` uses KV head
  ``i // (Hq / Hk)``); causal masks aligned bottom-right like flash-attn (query ``i``
  sees keys ``j <= i + Sk - Sq``), a row with no visible key gives out 0 and lse +inf;
* scores and softmax in fp32 (fp64 for fp64 inputs); ``out`` in the input dtype,
  ``lse`` fp32 ``[batch, heads, seq_q]``; backward writes ``dq, dk, dv`` into the
  caller's buffers and returns ``softmax_d`` (rowsum(dout * out)) fp32 ``[b, h, seq_q]``;
* dropout, sliding windows, softcap and ALiBi are refused (nothing here uses them);
* the varlen functions (packed ``[total, heads, head_dim]`` with cumulative lengths, LSE
  ``[heads, total_q]``) run each sequence through the two above; ``import ring_flash_attn``
  imports them, and ``methods.core.kernels``' flash-attn kernel calls them with documents;
* the public ``flash_attn.flash_attn_func`` (autograd through the two functions above),
  because yunchang imports it when it finds flash-attn and its ``UlyssesAttention`` calls it.

``install_if_missing()`` puts the module tree ``flash_attn`` / ``flash_attn.flash_attn_interface``
into ``sys.modules`` with proper ``__spec__`` (so ``importlib.util.find_spec`` and the method
registry see it) and does nothing when a real flash-attn is importable. It is for tests
only: the ``methods`` package never imports this file.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator

import torch

__version__ = "2.8.3+standin"  # DeepSpeed's FPDT picks its call signature by version (>= 2.7)
_MODULES = ("flash_attn", "flash_attn.flash_attn_interface")


def _refuse_unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes) -> None:
    if dropout_p:
        raise NotImplementedError("flash-attn stand-in: dropout_p must be 0")
    if (window_size_left, window_size_right) not in ((-1, -1), (None, None)):
        raise NotImplementedError("flash-attn stand-in: sliding windows are not supported")
    if softcap:
        raise NotImplementedError("flash-attn stand-in: softcap must be 0")
    if alibi_slopes is not None:
        raise NotImplementedError("flash-attn stand-in: ALiBi is not supported")


def _probs(q, k, softmax_scale, causal):
    """Scores ``[b, hq, sq, sk]`` in the compute dtype, the visibility mask and the group size."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    groups = q.shape[2] // k.shape[2]
    qf = q.to(compute).transpose(1, 2)
    kf = k.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * softmax_scale
    visible = None
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        rows = torch.arange(sq, device=q.device)[:, None]
        cols = torch.arange(sk, device=q.device)[None, :]
        visible = cols <= rows + (sk - sq)
        s = s.masked_fill(~visible, float("-inf"))
    return s, compute, groups


def _flash_attn_forward(
    q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
    alibi_slopes, return_softmax,
):
    """``(out, softmax_lse, S_dmask, rng_state)`` like flash-attn 2.7+ (the last two are None)."""
    _refuse_unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    s, compute, groups = _probs(q, k, softmax_scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isinf(lse) & (lse < 0)
    p = torch.exp(s - lse.masked_fill(empty, 0.0).unsqueeze(-1)).masked_fill(empty.unsqueeze(-1), 0.0)
    vf = v.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1)
    out = torch.matmul(p, vf).transpose(1, 2).to(q.dtype).contiguous()
    lse = lse.masked_fill(empty, float("inf")).float()
    return out, lse, None, None


def _flash_attn_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
    window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
):
    """Gradients written into ``dq, dk, dv``; returns ``softmax_d`` fp32 ``[b, h, seq_q]``."""
    _refuse_unsupported(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    s, compute, groups = _probs(q, k, softmax_scale, causal)
    p = torch.exp(s - softmax_lse.to(compute).unsqueeze(-1))  # +inf lse (empty row) gives 0
    dof = dout.to(compute).transpose(1, 2)
    vf = v.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1)
    kf = k.to(compute).transpose(1, 2).repeat_interleave(groups, dim=1)
    qf = q.to(compute).transpose(1, 2)
    delta = (dof * out.to(compute).transpose(1, 2)).sum(-1)
    dp = torch.matmul(dof, vf.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq_ = torch.matmul(ds, kf) * softmax_scale
    dk_ = torch.matmul(ds.transpose(-1, -2), qf) * softmax_scale
    dv_ = torch.matmul(p.transpose(-1, -2), dof)

    def fold(t):  # sum the query heads that share one KV head
        b, h, n, d = t.shape
        return t.view(b, h // groups, groups, n, d).sum(2)

    dq.copy_(dq_.transpose(1, 2))
    dk.copy_(fold(dk_).transpose(1, 2))
    dv.copy_(fold(dv_).transpose(1, 2))
    return delta.float()


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal):
        out, lse, _, _ = _flash_attn_forward(q, k, v, 0.0, softmax_scale, causal, -1, -1, 0.0, None, False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal = softmax_scale, causal
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, ctx.softmax_scale, ctx.causal,
                             -1, -1, 0.0, None, False)
        return dq, dk, dv, None, None


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """flash-attn 2's public function: ``out`` (or ``(out, lse, None)`` with return_attn_probs)."""
    _refuse_unsupported(dropout_p, window_size[0], window_size[1], softcap, alibi_slopes)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse = _FlashAttnFunc.apply(q, k, v, softmax_scale, causal)
    return (out, lse, None) if return_attn_probs else out


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """``(query rows, key rows)`` slices of each packed sequence."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"flash-attn stand-in: {len(cq) - 1} query sequences but {len(ck) - 1} key sequences")
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def _flash_attn_varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
    window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False, **_ignored,
):
    """Packed sequences (``[total, heads, head_dim]``), each through ``_flash_attn_forward``;
    ``(out, softmax_lse [heads, total_q], None, None)`` like flash-attn 2.7+."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for rq, rk in _sequences(cu_seqlens_q, cu_seqlens_k):
        o, l_, _, _ = _flash_attn_forward(q[None, rq], k[None, rk], v[None, rk], dropout_p, softmax_scale, causal,
                                          window_size_left, window_size_right, softcap, alibi_slopes, False)
        out[rq], lse[:, rq] = o[0], l_[0]
    return out, lse, None, None


def _flash_attn_varlen_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
    rng_state=None, **_ignored,
):
    """Gradients of each packed sequence written into ``dq, dk, dv``; returns ``softmax_d`` ``[heads, total_q]``."""
    delta = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for rq, rk in _sequences(cu_seqlens_q, cu_seqlens_k):
        delta[:, rq] = _flash_attn_backward(
            dout[None, rq], q[None, rq], k[None, rk], v[None, rk], out[None, rq], softmax_lse[None, :, rq],
            dq[None, rq], dk[None, rk], dv[None, rk], dropout_p, softmax_scale, causal,
            window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
        )[0]
    return delta


def real_flash_attn_available() -> bool:
    """Whether a real flash_attn is on the path (ignores this stand-in in ``sys.modules``)."""
    return importlib.machinery.PathFinder.find_spec("flash_attn") is not None


def is_installed() -> bool:
    return getattr(sys.modules.get("flash_attn"), "__standin__", False)


def _module(name: str, package: bool) -> types.ModuleType:
    spec = importlib.machinery.ModuleSpec(name, loader=None, origin=__file__, is_package=package)
    module = importlib.util.module_from_spec(spec)
    module.__standin__ = True
    return module


def install_if_missing() -> bool:
    """Register the stand-in as ``flash_attn`` unless flash-attn is importable; True if active.

    Module-level and argument-free so it can be a rank-pool worker's ``setup``.
    """
    if is_installed():
        return True
    if "flash_attn" in sys.modules or real_flash_attn_available():
        return False
    pkg = _module("flash_attn", package=True)
    pkg.__version__ = __version__
    iface = _module("flash_attn.flash_attn_interface", package=False)
    for fn in (_flash_attn_forward, _flash_attn_backward, _flash_attn_varlen_forward, _flash_attn_varlen_backward):
        setattr(iface, fn.__name__, fn)
    pkg.flash_attn_interface = iface
    pkg.flash_attn_func = iface.flash_attn_func = flash_attn_func
    sys.modules["flash_attn"] = pkg
    sys.modules["flash_attn.flash_attn_interface"] = iface
    return True


@contextlib.contextmanager
def installed_for_the_call() -> Iterator[None]:
    """The stand-in registered for the ``with`` block where it is not already, and removed after it
    only then: for a rank of a pool whose ranks do not install it (tests/bench's), running a library
    wrapper that imports flash-attn."""
    added = not is_installed() and install_if_missing()
    try:
        yield
    finally:
        if added:
            uninstall()


def uninstall() -> None:
    """Remove the stand-in from ``sys.modules`` (a no-op when it is not installed)."""
    if is_installed():
        for name in _MODULES:
            sys.modules.pop(name, None)
