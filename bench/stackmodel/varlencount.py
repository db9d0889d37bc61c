"""FLOPs of the flash op's variable-length form under simulation: each sequence's own area.

``methods.core.kernels`` runs a call with documents on CUDA as one call of
``aten._flash_attention_forward/backward`` with cumulative sequence lengths (``cu_seqlens``: the
documents). torch's FLOP formula for it reads the lengths from the tensor, but under FakeTensorMode
the tensor has no values, and it then counts every sequence at the longest one's length with no
causal mask (``torch.utils.flop_counter._offsets_to_lengths``): a packed sequence of many short
documents comes out many times too costly.

The lengths are known where the tensor is made: the kernels build it on the host from Python ints
(``torch.tensor(list)``, which FakeTensorMode receives as ``aten.lift_fresh`` of a real tensor) and
copy it to the device (``aten._to_copy``). ``CuSeqlensValues`` is a dispatch mode that remembers the
values of every small integer tensor made so, and follows them through copies; the formulas here
(``varlen_formulas``, for ``bench.stackmodel.stepcount``'s counter) then count each sequence as a
flash kernel computes it: ``4·sq·sk·d`` forward and ``10·sq·sk·d`` backward per head, times the
sequence's unmasked share (causal: bottom-right aligned, as flash-attn's varlen kernels; the suite
makes causal varlen calls on square blocks only, where alignment does not matter). A tensor whose
values were not seen falls back to torch's formula.

The op runs short sequences, and calls with few heads, below its dense rate (``varlenrate``): beside
the FLOPs, ``excess_flops`` gives the dense-rate FLOPs a call costs beyond them, which the counter
carries to ``StepCounts.flops_attention_varlen_excess`` and the step-time model times with the
attention.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.weak import WeakIdKeyDictionary

from . import varlenrate
from .simmode import Counter

aten = torch.ops.aten
MAX_TRACKED = 1 << 16  # integer tensors up to this many elements are remembered (cu_seqlens are small)


class CuSeqlensValues(Counter):
    """Remembers the values of small integer tensors made from Python data, through copies (docstring).
    A counter (``bench.stackmodel.simmode``): inside a ``SimulationMode`` one of its hooks."""

    declines_dtensor = False

    def __init__(self) -> None:
        super().__init__()
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def after(self, func, args: tuple, kwargs: dict, out) -> None:
        if func in (aten.lift_fresh.default, aten.lift_fresh_copy.default):
            src = args[0]
            if _small_int(src) and type(src) is torch.Tensor:
                with _disable_current_modes():  # a real tensor: read it with no mode (FakeTensorMode) active
                    self.values[out] = src.tolist()
        elif func in (aten._to_copy.default, aten.clone.default) and isinstance(args[0], torch.Tensor):
            known = self.values.get(args[0])
            if known is not None and isinstance(out, torch.Tensor):
                self.values[out] = known


def _small_int(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() <= MAX_TRACKED and \
        t.dtype in (torch.int32, torch.int64)


_ACTIVE: list[CuSeqlensValues] = []


def lengths(t) -> list[int] | None:
    """The sequence lengths of a cumulative-lengths tensor whose values were seen, else None."""
    for mode in reversed(_ACTIVE):
        cu = mode.values.get(t)
        if cu is not None:
            return [b - a for a, b in zip(cu, cu[1:], strict=False)]
    return None


class tracking:  # noqa: N801 (a context manager used like a function)
    """Enter a ``CuSeqlensValues`` mode and make it the one the formulas read."""

    def __init__(self) -> None:
        self.mode = CuSeqlensValues()

    def __enter__(self) -> CuSeqlensValues:
        _ACTIVE.append(self.mode)
        self.mode.__enter__()
        return self.mode

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        _ACTIVE.remove(self.mode)


def _share(sq: int, sk: int, causal: bool) -> float:
    """The unmasked share of a causal call aligned bottom-right (row ``i`` sees keys ``j <= sk - sq + i``)."""
    if not causal or not sq or not sk:
        return 1.0
    pairs = sq * (sk - sq) + sq * (sq + 1) // 2 if sq <= sk else sk * (sk + 1) // 2
    return pairs / (sq * sk)


def _per_sequence(q, k, v, cu_q, cu_k, causal: bool, backward: bool) -> tuple[int, float] | None:
    """(FLOPs, excess) of a varlen call: each sequence counted at its own length and mask, and the dense-rate
    FLOPs the call costs beyond them (``varlenrate.relative_rate`` of the sequence's length and the call's
    query heads); None when the lengths were not seen."""
    lq, lk = lengths(cu_q), lengths(cu_k)
    if lq is None or lk is None or len(lq) != len(lk):
        return None
    _, h_q, d_q = q.shape
    _, h_k, d_k = k.shape
    _, h_v, d_v = v.shape
    pass_ = "bwd" if backward else "fwd"
    heads = (h_q, d_q, h_k, d_k, h_v, d_v)
    total = excess = 0.0
    for sq, sk in zip(lq, lk, strict=True):
        flops = _dense(backward, heads, sq, sk) * _share(sq, sk, causal)
        total += flops
        if flops:  # the measured calls are square: a sequence's rate goes by its query length
            excess += flops * (1.0 / varlenrate.relative_rate(sq, h_q, pass_) - 1.0)
    return int(total), excess


@functools.lru_cache(maxsize=1 << 16)
def _dense(backward: bool, heads: tuple[int, ...], sq: int, sk: int) -> int:
    """torch's FLOP formula of one unmasked sequence of a varlen call (``heads``: query, key and value heads and
    head sizes), kept per shape: a packed call of a million tokens has a thousand sequences, and the same calls
    recur in every layer, stage and pass, while the formula goes through pytree for each (its ``shape_wrapper``)."""
    h_q, d_q, h_k, d_k, h_v, d_v = heads
    qs, ks, vs = (1, h_q, sq, d_q), (1, h_k, sk, d_k), (1, h_v, sk, d_v)
    return sdpa_backward_flop_count((1, h_q, sq, d_v), qs, ks, vs) if backward else sdpa_flop_count(qs, ks, vs)


def _varlen_fwd(query, key, value, cum_seq_q=None, cum_seq_k=None, max_q=0, max_k=0, dropout_p=0.0,
                is_causal=False, *args, out_val=None, **kwargs) -> int:
    if cum_seq_q is not None:
        counted = _per_sequence(query, key, value, cum_seq_q, cum_seq_k, bool(is_causal), False)
        if counted is not None:
            return counted[0]
    from torch.utils.flop_counter import _flash_attention_forward_flop
    return _flash_attention_forward_flop(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                         *args, out_val=out_val, **kwargs)


def _varlen_bwd(grad_out, query, key, value, out, logsumexp, cum_seq_q=None, cum_seq_k=None, max_q=0, max_k=0,
                dropout_p=0.0, is_causal=False, *args, out_val=None, **kwargs) -> int:
    if cum_seq_q is not None:
        counted = _per_sequence(query, key, value, cum_seq_q, cum_seq_k, bool(is_causal), True)
        if counted is not None:
            return counted[0]
    from torch.utils.flop_counter import _flash_attention_backward_flop
    return _flash_attention_backward_flop(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                                          max_k, dropout_p, is_causal, *args, out_val=out_val, **kwargs)


def _excess_fwd(query, key, value, cum_seq_q=None, cum_seq_k=None, max_q=0, max_k=0, dropout_p=0.0,
                is_causal=False, *args, **kwargs) -> float:
    counted = None if cum_seq_q is None else _per_sequence(query, key, value, cum_seq_q, cum_seq_k,
                                                           bool(is_causal), False)
    return counted[1] if counted is not None else 0.0


def _excess_bwd(grad_out, query, key, value, out, logsumexp, cum_seq_q=None, cum_seq_k=None, max_q=0, max_k=0,
                dropout_p=0.0, is_causal=False, *args, **kwargs) -> float:
    counted = None if cum_seq_q is None else _per_sequence(query, key, value, cum_seq_q, cum_seq_k,
                                                           bool(is_causal), True)
    return counted[1] if counted is not None else 0.0


_varlen_fwd._get_raw = True
_varlen_bwd._get_raw = True


def varlen_formulas() -> dict:
    """Op -> formula for ``FlopCounterMode(custom_mapping=...)``: the flash op's forward and backward, each
    sequence of a variable-length call counted at its own length and mask (module docstring)."""
    return {aten._flash_attention_forward: _varlen_fwd, aten._flash_attention_backward: _varlen_bwd}


def excess_flops(packet, args: tuple, kwargs: dict) -> float:
    """The dense-rate FLOPs a call of ``packet`` (an op's overload packet) costs beyond the FLOPs its formula
    counts: for the flash op's variable-length form, ``sum flops_seq * (1 / relative_rate - 1)`` over its
    sequences (``bench.stackmodel.varlenrate``); 0 for any other op, a dense call, or lengths not seen. Read
    by ``bench.stackmodel.stepcount``'s counter beside the formula, which must return plain FLOPs."""
    fn = _EXCESS.get(packet)
    return fn(*args, **kwargs) if fn is not None else 0.0


_EXCESS = {aten._flash_attention_forward: _excess_fwd, aten._flash_attention_backward: _excess_bwd}
