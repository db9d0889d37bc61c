"""A memory-faithful flash-attn for simulated mode: shapes and allocations only, no arithmetic.

Several methods wrap libraries that call flash-attn themselves (yunchang: ``yc-*``;
ring-flash-attn: ``rfa-zigzag``; DeepSpeed FPDT: ``ds-fpdt``). flash-attn has no CPU build,
so without this module those methods cannot be simulated here. Real flash-attn >= 2.7
registers its own custom ops with fake implementations, so **a real flash-attn always wins**:
``installed()`` does nothing when one is importable (or when something else already sits in
``sys.modules`` as ``flash_attn``, such as the tests' plain-torch stand-in). It is used by
simulated mode (``bench.measure.run.measure_simulated``) and by emulated runs that skip the
attention arithmetic (``--attention-math skip``: ``bench.measure.skipmath`` answers its kernels
on real tensors), never in real mode or in an emulated run that computes.

What it provides (``install``/``installed``): the module tree ``flash_attn`` (``__version__``
2.8.3, ``flash_attn_func``, ``flash_attn_varlen_func``) and ``flash_attn.flash_attn_interface``
(``_flash_attn_forward``/``_flash_attn_backward`` with the 2.7+ signatures, the varlen
forms, ``flash_attn_func``), and flash-attn 3's top-level ``flash_attn_interface``
(``_flash_attn_forward``/``_flash_attn_backward``/``flash_attn_func`` as yunchang 0.6.4's
``attn_type="fa3"`` calls them). The kernels are torch custom ops in the ``cpab_sim``
namespace; their real implementation refuses (they exist only for simulation), their fake
implementation returns the kernel's outputs.

Where the allocations are made. torch's ``MemTracker`` sees a tensor only when it is created
by an operator dispatched through it; what a fake implementation allocates internally and
drops is invisible to it. So the Python entry functions here play the part of flash-attn's
C++ entry points (``mha_fwd``/``mha_bwd``): they allocate what those allocate, with the same
shapes and dtypes and for the same lifetime (the scratch is dropped when the call returns),
and the ``cpab_sim`` ops are the kernels, which write into the buffers they are given. What
is allocated, from Dao-AILab/flash-attention's sources:

flash-attn 2, ``csrc/flash_attn/flash_api.cpp``:

* ``mha_fwd``: ``out`` ``[B, Sq, H, d_v]`` like q (head dim padded to a multiple of 8, and
  q/k/v padded copies while the call runs, when it is not one), ``softmax_lse`` fp32
  ``[B, H, Sq]``, ``rng_state`` int64 ``[2]``, ``p`` ``[B, H, Sq', Sk']`` only with
  ``return_softmax`` (which needs dropout). The split-KV accumulators of
  ``set_params_splitkv`` exist only when ``num_splits_heuristic`` picks more than one split,
  i.e. when ``B * H * ceil(Sq / 64)`` is below 80% of twice the SM count (decoding shapes,
  never a training step's): not modelled.
* ``mha_bwd``: ``dq``/``dk``/``dv`` are the caller's buffers (``empty_like`` when it passes
  None, dropped at return as the 2.7+ Python wrapper returns only ``softmax_d``);
  ``softmax_d`` fp32 ``[B, H, Sq']`` returned; scratch for the call: ``dq_accum`` fp32
  ``[B, Sq', H, d']`` (``deterministic``: ``[nsplits, B, Sq', H, d']`` zeros with
  ``nsplits = ceil(SM_COUNT / (B * H))``), with GQA (``Hk != H``) ``dk_expanded``/``dv_expanded``
  ``[B, Sk, H, d]`` in the input dtype (summed into dk/dv at the end), and ``dout`` padded
  when its head dim is not a multiple of 8. ``Sq' = ceil(Sq / 128) * 128``; ``d'`` is the
  head dim rounded to 32 (256 above 192). These are ``bench.stackmodel.workspace``'s ``fa2``
  buffers (``softmax_d`` there counted as scratch, here as the returned tensor it is).

flash-attn 3, ``hopper/flash_api.cpp`` (Hopper, so SM90 tile sizes):

* ``mha_fwd``: ``out`` like q (bf16 for fp8 inputs), ``softmax_lse`` fp32 ``[B, H, Sq]``
  (split-KV accumulators, as above, not modelled).
* ``mha_bwd``: ``softmax_d`` and ``softmax_lse_log2`` fp32 ``[B, H, Sq']``, ``dq_accum`` fp32
  ``[B, H, Sq' * d']``, with GQA ``dk_accum``/``dv_accum`` fp32 zeros ``[B, Hk, Sk' * d']``,
  ``dq_semaphore`` int32 ``[ceil(Sq / kBlockM), B, H]`` (with GQA and ``deterministic``, dk/dv
  semaphores too); ``Sq'``/``Sk'`` rounded to the SM90 tiles ``kBlockM``/``kBlockN`` (64/128
  for a causal head dim 128, 80/128 non-causal), ``d'`` the head dim rounded to 64/96/128/192/256.
  ``mha_bwd`` returns all of them; the Python wrapper keeps ``softmax_d`` only.

Dropout, ALiBi, windows and softcap change no allocation above (beyond ``p``) and are accepted;
the varlen functions exist because libraries import them, and refuse to run (no wrapped
library calls them).
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import math
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from methods.core.registry import SIMULATION_PROVIDES

__version__ = "2.8.3"  # DeepSpeed FPDT picks its call signature by version (>= 2.7.0); yunchang by >= 2.6.3
SM_COUNT = 132  # H100 SXM: only the deterministic FA2 backward's dq_accum depends on it
PROVIDES = SIMULATION_PROVIDES  # what simulated mode supplies (methods.core.registry)
FA2_MODULES = ("flash_attn", "flash_attn.flash_attn_interface")
FA3_MODULE = "flash_attn_interface"
SIM_ONLY = "exists only for simulated mode (FakeTensorMode), it computes nothing"


def _up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _refuse(op: str):
    return RuntimeError(f"cpab_sim::{op} {SIM_ONLY}; install flash-attn for real runs")


# ---------------------------------------------------------------------------------- shapes
def fa2_head_rounded(d: int) -> int:
    """flash-attn 2's ``head_size_rounded`` (``mha_fwd``/``mha_bwd``)."""
    d8 = _up(d, 8)
    return _up(d8, 32) if d8 <= 192 else 256


def fa2_backward_scratch(q: Tensor, k: Tensor, v: Tensor, deterministic: bool = False,
                         sm_count: int = SM_COUNT) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``mha_bwd``'s buffers that live only during the call (``q``/``k``/``v`` in BSHD)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    sq_r, d_r = _up(sq, 128), fa2_head_rounded(d)
    f32 = torch.float32
    if deterministic:
        nsplits = math.ceil(sm_count / (b * h))
        out = {"dq_accum": ((nsplits, b, sq_r, h, d_r), f32)}
    else:
        out = {"dq_accum": ((b, sq_r, h, d_r), f32)}
    if hk != h:
        out["dk_expanded"] = ((b, sk, h, d), q.dtype)
        out["dv_expanded"] = ((b, sk, h, v.shape[3]), q.dtype)
    return out


def fa2_softmax_d_shape(q: Tensor) -> tuple[int, ...]:
    b, sq, h, _ = q.shape
    return (b, h, _up(sq, 128))


def fa3_head_rounded(d: int) -> int:
    """flash-attn 3's ``round_up_headdim``."""
    for limit in (64, 96, 128, 192):
        if d <= limit:
            return limit
    return 256


def fa3_tiles(d: int, causal: bool, local: bool = False, softcap: float = 0.0) -> tuple[int, int]:
    """SM90 ``(kBlockM, kBlockN)`` of ``hopper/flash_api.cpp``'s ``mha_bwd``."""
    d_r = fa3_head_rounded(d)
    if d_r <= 64:
        block_m = 96 if causal and softcap > 0 else 128
    elif d_r <= 96:
        block_m = 64
    elif d_r <= 128:
        block_m = 64 if causal or local or softcap > 0 else 80
    else:
        block_m = 64
    block_n = 128 if d_r <= 128 else (96 if d_r <= 192 else 80)
    return block_m, block_n


def _fa3_mask(window: tuple[int, int], causal: bool, sq: int, sk: int) -> tuple[bool, bool]:
    """``(is_causal, is_local)`` after ``mha_bwd``'s window normalisation."""
    left, right = window
    if left >= sk - 1:
        left = -1
    if right >= sq - 1:
        right = -1
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    return is_causal, (left >= 0 or right >= 0) and not is_causal


def fa3_backward_buffers(q: Tensor, k: Tensor, causal: bool, window: tuple[int, int] = (-1, -1),
                         softcap: float = 0.0, deterministic: bool = False
                         ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``mha_bwd``'s (FA3) buffers besides dq/dk/dv, ``softmax_d`` included."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    is_causal, is_local = _fa3_mask(window, causal, sq, sk)
    block_m, block_n = fa3_tiles(d, is_causal, is_local, softcap)
    sq_r, sk_r, d_r = _up(sq, block_m), _up(sk, block_n), fa3_head_rounded(d)
    f32, i32 = torch.float32, torch.int32
    out = {
        "softmax_d": ((b, h, sq_r), f32),
        "softmax_lse_log2": ((b, h, sq_r), f32),
        "dq_accum": ((b, h, sq_r * d_r), f32),
    }
    if hk != h:
        out["dk_accum"] = ((b, hk, sk_r * d_r), f32)
        out["dv_accum"] = ((b, hk, sk_r * d_r), f32)
    out["dq_semaphore"] = ((math.ceil(sq / block_m), b, h), i32)
    if hk != h and deterministic:
        out["dk_semaphore"] = ((math.ceil(sk / block_n), b, hk), i32)
        out["dv_semaphore"] = ((math.ceil(sk / block_n), b, hk), i32)
    return out


def nbytes(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in shapes.values())


def _allocate(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], device) -> dict[str, Tensor]:
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in shapes.items()}


# ---------------------------------------------------------------------------------- the kernels
@torch.library.custom_op("cpab_sim::fa2_fwd", mutates_args=())
def fa2_fwd(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool,
            return_softmax: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """flash-attn 2's forward kernel: ``(out_padded, softmax_lse, p, rng_state)``."""
    raise _refuse("fa2_fwd")


@fa2_fwd.register_fake
def _fa2_fwd_fake(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, _up(v.shape[3], 8)))
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    if return_softmax:
        p = q.new_empty((b, h, _up(sq, 128), _up(k.shape[1], 128)))
    else:
        p = q.new_empty((0,))
    rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
    return out, lse, p, rng_state


@torch.library.custom_op("cpab_sim::fa2_bwd", mutates_args=("dq", "dk", "dv", "dq_accum", "dk_expanded", "dv_expanded"))
def fa2_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
            dq: Tensor, dk: Tensor, dv: Tensor, dq_accum: Tensor, dk_expanded: Tensor | None,
            dv_expanded: Tensor | None, dropout_p: float, softmax_scale: float, causal: bool,
            deterministic: bool) -> Tensor:
    """flash-attn 2's backward kernel: writes dq/dk/dv (through the scratch), returns ``softmax_d``."""
    raise _refuse("fa2_bwd")


@fa2_bwd.register_fake
def _fa2_bwd_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, dq_accum, dk_expanded, dv_expanded,
                  dropout_p, softmax_scale, causal, deterministic):
    return torch.empty(fa2_softmax_d_shape(q), dtype=torch.float32, device=q.device)


@torch.library.custom_op("cpab_sim::fa3_fwd", mutates_args=())
def fa3_fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """flash-attn 3's forward kernel: ``(out, softmax_lse)``."""
    raise _refuse("fa3_fwd")


@fa3_fwd.register_fake
def _fa3_fwd_fake(q, k, v, softmax_scale, causal):
    b, sq, h, _ = q.shape
    fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    out = torch.empty((b, sq, h, v.shape[3]), dtype=torch.bfloat16 if fp8 else q.dtype, device=q.device)
    return out, torch.empty((b, h, sq), dtype=torch.float32, device=q.device)


@torch.library.custom_op("cpab_sim::fa3_bwd", mutates_args=("dq", "dk", "dv", "scratch"))
def fa3_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
            dq: Tensor, dk: Tensor, dv: Tensor, scratch: list[Tensor], softmax_scale: float,
            causal: bool) -> Tensor:
    """flash-attn 3's backward kernel: writes dq/dk/dv (through the scratch), returns ``softmax_d``."""
    raise _refuse("fa3_bwd")


@fa3_bwd.register_fake
def _fa3_bwd_fake(dout, q, k, v, out, softmax_lse, dq, dk, dv, scratch, softmax_scale, causal):
    (shape, dtype) = fa3_backward_buffers(q, k, causal)["softmax_d"]
    return torch.empty(shape, dtype=dtype, device=q.device)


# ---------------------------------------------------------------------------------- flash-attn 2 API
def _contig(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _pad8(x: Tensor) -> Tensor:
    d = x.shape[-1]
    return x if d % 8 == 0 else F.pad(x, (0, 8 - d % 8))


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
                        softcap=0.0, alibi_slopes=None, return_softmax=False):
    """flash-attn 2.7+ ``_flash_attn_forward``: ``(out_padded, softmax_lse, S_dmask, rng_state)``."""
    q, k, v = (_contig(x) for x in (q, k, v))
    qp, kp, vp = _pad8(q), _pad8(k), _pad8(v)  # mha_fwd's padded copies, alive during the call
    out, lse, p, rng_state = fa2_fwd(qp, kp, vp, float(dropout_p), float(softmax_scale), bool(causal),
                                     bool(return_softmax))
    del qp, kp, vp
    return out, lse, p, rng_state


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                         deterministic=False, rng_state=None):
    """flash-attn 2.7+ ``flash_attn_interface._flash_attn_backward``: fills dq/dk/dv, returns ``softmax_d``."""
    dout, q, k, v, out = (_contig(x) for x in (dout, q, k, v, out))
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    dout_padded = _pad8(dout)
    scratch = _allocate(fa2_backward_scratch(q, k, v, deterministic), q.device)
    softmax_d = fa2_bwd(dout_padded, q, k, v, out, softmax_lse, dq, dk, dv, scratch["dq_accum"],
                        scratch.get("dk_expanded"), scratch.get("dv_expanded"), float(dropout_p),
                        float(softmax_scale), bool(causal), bool(deterministic))
    del scratch, dout_padded
    return softmax_d


def _varlen_refused(*args, **kwargs):
    raise NotImplementedError(
        "simulated flash-attn: the varlen functions are not modelled (no wrapped library calls them)")


_flash_attn_varlen_forward = _flash_attn_varlen_backward = flash_attn_varlen_func = _varlen_refused


class _FlashAttnFunc(torch.autograd.Function):
    """flash-attn 2's ``FlashAttnFunc``: saves q/k/v (padded), ``out_padded``, lse and rng_state."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_softmax):
        d_og = q.shape[3]
        q, k, v = _pad8(q), _pad8(k), _pad8(v)
        out_padded, lse, s_dmask, rng_state = _flash_attn_forward(
            q, k, v, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes,
            return_softmax and dropout_p > 0)
        ctx.save_for_backward(q, k, v, out_padded, lse, rng_state)
        ctx.args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic)
        out = out_padded[..., :d_og]
        return (out, lse, s_dmask) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, out, lse, rng_state = ctx.saved_tensors
        dropout_p, scale, causal, window, softcap, alibi, deterministic = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_og = dout.shape[-1]
        _flash_attn_backward(_pad8(dout), q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal,
                             window[0], window[1], softcap, alibi, deterministic, rng_state)
        return (dq[..., :d_og], dk[..., :d_og], dv[..., :d_og]) + (None,) * 8


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2's public ``flash_attn_func`` (autograd); ``(out, lse, S_dmask)`` with return_attn_probs."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    return _FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), softcap,
                                alibi_slopes, deterministic, return_attn_probs)


# ---------------------------------------------------------------------------------- flash-attn 3 API
def _fa3_refuse_unmodelled(**given) -> None:
    used = sorted(name for name, value in given.items() if value is not None)
    if used:
        raise NotImplementedError(f"simulated flash-attn 3: {', '.join(used)} not modelled")


def fa3_forward(q, k, v, k_new=None, v_new=None, qv=None, out=None, cu_seqlens_q=None, cu_seqlens_k=None,
                cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
                seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    """flash-attn 3's ``flash_attn_interface._flash_attn_forward`` (the keywords yunchang 0.6.4 passes):
    ``(out, softmax_lse)``."""
    _fa3_refuse_unmodelled(k_new=k_new, v_new=v_new, qv=qv, out=out, cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_k=cu_seqlens_k, page_table=page_table, rotary_cos=rotary_cos)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    q, k, v = (_contig(x) for x in (q, k, v))
    return fa3_fwd(q, k, v, float(softmax_scale), bool(causal))


def fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                 sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                 softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False,
                 sm_margin=0):
    """flash-attn 3's ``flash_attn_interface._flash_attn_backward``: fills dq/dk/dv, returns ``softmax_d``."""
    _fa3_refuse_unmodelled(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sequed_q=sequed_q,
                           sequed_k=sequed_k)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    dout, q, k, v, out = (_contig(x) for x in (dout, q, k, v, out))
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    shapes = fa3_backward_buffers(q, k, causal, tuple(window_size), softcap, deterministic)
    shapes.pop("softmax_d")  # the kernel's returned tensor
    scratch = _allocate(shapes, q.device)
    for name in ("dk_accum", "dv_accum"):  # torch::zeros in mha_bwd
        if name in scratch:
            scratch[name].zero_()
    softmax_d = fa3_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, list(scratch.values()),
                        float(softmax_scale), bool(causal))
    del scratch
    return softmax_d


class _FlashAttn3Func(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, window_size, softcap, deterministic):
        out, lse = fa3_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (softmax_scale, causal, window_size, softcap, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, causal, window, softcap, deterministic = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fa3_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, softmax_scale=scale, causal=causal,
                     window_size=window, softcap=softcap, deterministic=deterministic)
        return dq, dk, dv, None, None, None, None, None


def fa3_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
             window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
             deterministic=False, sm_margin=0, return_attn_probs=False):
    """flash-attn 3's public ``flash_attn_func`` (autograd): ``out``, ``(out, lse)`` with return_attn_probs."""
    _fa3_refuse_unmodelled(qv=qv)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse = _FlashAttn3Func.apply(q, k, v, softmax_scale, causal, tuple(window_size), softcap, deterministic)
    return (out, lse) if return_attn_probs else out


# ---------------------------------------------------------------------------------- installation
def real_available(name: str) -> bool:
    """Whether a real module ``name`` is on the path (``sys.modules`` entries not consulted)."""
    return importlib.machinery.PathFinder.find_spec(name) is not None


def _module(name: str, package: bool, **attrs) -> types.ModuleType:
    spec = importlib.machinery.ModuleSpec(name, loader=None, origin=__file__, is_package=package)
    module = importlib.util.module_from_spec(spec)
    if package:
        module.__path__ = []
    module.__cpab_simulated__ = True
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def is_ours(name: str) -> bool:
    return getattr(sys.modules.get(name), "__cpab_simulated__", False)


def install() -> list[str]:
    """Put the simulated flash-attn 2 and 3 into ``sys.modules`` where no other is importable or
    already imported; returns the module names installed now (empty when all were there)."""
    done = []
    if "flash_attn" not in sys.modules and not real_available("flash_attn"):
        iface = _module(
            "flash_attn.flash_attn_interface", False, _flash_attn_forward=_flash_attn_forward,
            _flash_attn_backward=_flash_attn_backward, _flash_attn_varlen_forward=_flash_attn_varlen_forward,
            _flash_attn_varlen_backward=_flash_attn_varlen_backward, flash_attn_func=flash_attn_func,
            flash_attn_varlen_func=flash_attn_varlen_func)
        pkg = _module("flash_attn", True, __version__=__version__, flash_attn_func=flash_attn_func,
                      flash_attn_varlen_func=flash_attn_varlen_func, flash_attn_interface=iface)
        sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"] = pkg, iface
        done += list(FA2_MODULES)
    if FA3_MODULE not in sys.modules and not real_available(FA3_MODULE):
        sys.modules[FA3_MODULE] = _module(FA3_MODULE, False, _flash_attn_forward=fa3_forward,
                                          _flash_attn_backward=fa3_backward, flash_attn_func=fa3_func)
        done.append(FA3_MODULE)
    return done


def uninstall(names=FA2_MODULES + (FA3_MODULE,)) -> None:
    """Remove this module's entries from ``sys.modules`` (others are left alone)."""
    for name in names:
        if is_ours(name):
            del sys.modules[name]


# Modules that bind flash-attn's functions when first imported: (module, attribute, provider).
BINDINGS = (
    ("yunchang.kernels.attention", "_flash_attn_forward", "flash_attn.flash_attn_interface"),
    ("ring_flash_attn.zigzag_ring_flash_attn", "_flash_attn_forward", "flash_attn.flash_attn_interface"),
    ("deepspeed.sequence.fpdt_layer", "_flash_attn_forward", "flash_attn.flash_attn_interface"),
)


def check_bindings() -> None:
    """Refuse (one line) when a library imported earlier in this process bound a flash-attn
    other than the one now in ``sys.modules`` (or found none): it would not call it."""
    problems = []
    yc = sys.modules.get("yunchang.globals")
    if yc is not None and "flash_attn" in sys.modules and not yc.HAS_FLASH_ATTN:
        problems.append("yunchang (imported without flash-attn)")
    for module, attr, provider in BINDINGS:
        mod, prov = sys.modules.get(module), sys.modules.get(provider)
        if mod is None or prov is None:
            continue
        bound, current = getattr(mod, attr, None), getattr(prov, "_flash_attn_forward", None)
        if bound is not current:
            problems.append(f"{module} (bound to {'no flash-attn' if bound is None else 'another flash-attn'})")
    if problems:
        raise ValueError(
            f"{'; '.join(problems)} was imported before the simulated flash-attn was installed and keeps "
            "what it found then; run the simulation in a fresh process: python -m bench run --mode simulated ...")


def needs_it(requires: tuple[str, ...]) -> bool:
    """Whether a method with these requirements calls flash-attn through a library."""
    return any(mod in PROVIDES for mod in requires)


def check_fresh() -> None:
    """Before a simulation that will install this flash-attn (none is importable now): refuse
    (one line) when a library that decides at import whether flash-attn exists, and binds its
    functions then, was already imported in this process (it found none)."""
    if "flash_attn" in sys.modules or real_available("flash_attn"):
        return
    stale = sorted({m for m in ("yunchang.globals", *(b[0] for b in BINDINGS)) if m in sys.modules})
    if stale:
        raise ValueError(
            f"{', '.join(stale)} was imported in this process before the simulated flash-attn could be "
            "installed and keeps what it found then (no flash-attn); run the simulation in a fresh process: "
            "python -m bench run --mode simulated ...")


@contextlib.contextmanager
def installed(check: bool = True) -> Iterator[list[str]]:
    """``install()`` for the duration of a simulation, then ``uninstall()`` of what it added
    (libraries imported meanwhile keep the functions, which compute nothing outside simulation).
    ``check``: first make sure the libraries already imported see the flash-attn now in place
    (``check_bindings``; for a method that calls flash-attn through a library)."""
    added = install()
    try:
        if check:
            check_bindings()
        yield added
    finally:
        uninstall(added)
