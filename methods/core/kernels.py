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

The masking rule (one rule, every kernel). A call's queries and keys are two runs of global
positions: keys ``[k_start, k_start + Sk)`` and queries ``[k_start + q_offset, ... + Sq)``. Query
``i`` sees key ``j`` when (with ``causal``) ``j <= i + q_offset`` and (with ``docs``, a
``methods.core.documents.Documents`` of the global sequence) both lie in the same document. So
``q_offset`` may be negative: ``q_offset = -1`` on equal lengths is the strictly causal block
(key ``j <`` query ``i``) a strided ring step needs. A row that sees no key (the first
``-q_offset`` rows; a query whose document has no key in the call) gets a zero output and an
LSE of ``-inf``, which ``merge_partials(..., may_be_empty=True)`` merges as the empty set it
is. ``k_start`` only means something with ``docs`` (it places the call in the documents).
``mask_blocks`` turns any call into blocks that are each unmasked or causal on a square (per
document, then ``offset_blocks`` within it). With documents:

* ``torch``: on CPU the blocks through ``blockwise_forward/backward`` (no ``Sq x Sk`` mask). On
  CUDA, a call whose blocks tile its rows and columns in order with one kind of block
  (``varlen_layout``; every full-sequence call, as the head-parallel methods make) is one call
  of the flash op's variable-length form (cumulative lengths); any other goes blockwise.
* ``flash-attn``: the same, through ``_flash_attn_varlen_forward/_backward``.
* ``math``: the explicit boolean mask of the rule (``visible``).

``docs=None`` with ``q_offset >= 0`` is exactly the behaviour described above it.

Timing hook. ``set_call_timer`` installs a ``CallTimer`` that receives the time, on the timer's own
``clock`` (the wall clock, or the calling thread's CPU clock: ``bench.measure.attntime`` says which and
why), of every public ``forward``/``backward`` call of the kernels above, whoever makes it (a method's
autograd function, ``_Attention``, a ring loop, a wrapper's interface). A measurement turns it on
around the steps it times and off after: the methods do not know they are timed. A call made inside a
timed call is not timed again. With no timer installed a call costs one global read. The time is the
host's: exact for synchronous (CPU) kernels; on CUDA it would be the launch only, which is why the
measurement turns it on for CPU ranks alone.
"""
from __future__ import annotations

import functools
import importlib
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .documents import Documents

ENV_VAR = "CPBENCH_KERNEL"


class Kernel(Protocol):
    """What a method calls: BSHD in, ``(out, lse)`` out, and the matching backward.

    ``q_offset``, ``docs`` and ``k_start`` (the masking rule of the module docstring) are keywords
    with defaults, passed only when not at their default, so a kernel wrapper that does not take
    them still serves every call made without them.
    """

    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, q_offset: int = 0,
        docs: Documents | None = None, k_start: int = 0,
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
        docs: Documents | None = None,
        k_start: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class CallTimer(Protocol):
    """What ``set_call_timer`` installs: told the time of each timed kernel call on its own clock."""

    def clock(self) -> float:
        """Seconds on the timer's clock (``time.perf_counter``, ``time.thread_time``, ...)."""
        ...

    def record(self, direction: str, seconds: float) -> None:
        """One call: ``direction`` is ``"forward"`` or ``"backward"``, ``seconds`` its time on ``clock``."""
        ...


_timer: CallTimer | None = None
_timing_depth = 0  # > 0 while a timed call runs: a kernel call inside it is not timed again


def set_call_timer(timer: CallTimer | None) -> CallTimer | None:
    """Install ``timer`` (None: none) for every kernel call from now on; returns the one it replaces."""
    global _timer
    previous, _timer = _timer, timer
    return previous


def _timed(direction: str):
    """Decorate a kernel's public ``forward``/``backward`` so the installed ``CallTimer`` sees it."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            global _timing_depth
            timer = _timer
            if timer is None or _timing_depth:
                return fn(self, *args, **kwargs)
            _timing_depth += 1
            t0 = timer.clock()
            try:
                result = fn(self, *args, **kwargs)
            finally:
                _timing_depth -= 1
            timer.record(direction, timer.clock() - t0)
            return result

        return call

    return wrap


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, q_offset: int = 0,
    docs: Documents | None = None, k_start: int = 0,
) -> None:
    """Refuse shapes, offsets and document windows the kernels would misread, before any kernel runs."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention kernels take [batch, seq, heads, head_dim] tensors")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})"
        )
    if not _is_int(q_offset):
        raise ValueError(
            f"q_offset must be an int (the position of the first query relative to the first key; "
            f"negative: the first -q_offset queries see no key), got {q_offset!r}"
        )
    if docs is None:
        if k_start != 0:
            raise ValueError(f"k_start={k_start!r} places keys in documents: give docs= with it, or leave it 0")
        return
    if not _is_int(k_start) or k_start < 0:
        raise ValueError(f"k_start must be an int >= 0 (global position of the first key), got {k_start!r}")
    q_start, n = k_start + q_offset, docs.seq_len
    if q_start < 0 or q_start + q.shape[1] > n or k_start + k.shape[1] > n:
        raise ValueError(
            f"queries [{q_start}, {q_start + q.shape[1]}) and keys [{k_start}, {k_start + k.shape[1]}) must lie in "
            f"the {n} tokens of the documents; pass the global position of the first key as k_start and the "
            f"queries' offset from it as q_offset"
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

    A negative offset hides key 0 from the first ``-q_offset`` rows: they come first, as a row
    range with no blocks (they see nothing), and the rest is the split above from that row on.
    """
    if q_offset < 0:
        first = min(sq, -q_offset)
        rest = offset_blocks(sq - first, sk, 0)
        return [(slice(0, first), [])] + [(slice(rows.start + first, rows.stop + first), parts) for rows, parts in rest]
    m = max(0, min(sq, sk - q_offset))
    groups: list[tuple[slice, list[tuple[slice, bool]]]] = []
    if m:
        parts = [(slice(0, q_offset), False)] if q_offset else []
        groups.append((slice(0, m), parts + [(slice(q_offset, q_offset + m), True)]))
    if m < sq:
        groups.append((slice(m, sq), [(slice(0, sk), False)]))
    return groups


Blocks = list[tuple[slice, list[tuple[slice, bool]]]]


def mask_blocks(
    sq: int, sk: int, causal: bool, q_offset: int = 0, docs: Documents | None = None, k_start: int = 0
) -> Blocks:
    """The masking rule of the module docstring as blocks, in ``offset_blocks``' form.

    Row ranges are disjoint, in order, and cover ``[0, sq)``; a row range with no blocks sees no
    key. Without ``docs`` this is ``offset_blocks`` (causal) or one unmasked block. With ``docs``
    each document met by the queries gets its rows, and the keys of the same document inside the
    call are split by ``offset_blocks`` at that document's own offset (or one unmasked block).
    """
    if docs is None:
        if causal:
            return offset_blocks(sq, sk, q_offset)
        return [(slice(0, sq), [(slice(0, sk), False)])]
    q_start = k_start + q_offset
    keys = {d: (lo - k_start, hi - k_start) for d, lo, hi in docs.spans(k_start, k_start + sk)}
    groups: Blocks = []
    for d, lo, hi in docs.spans(q_start, q_start + sq):
        r0, r1 = lo - q_start, hi - q_start
        if d not in keys:
            groups.append((slice(r0, r1), []))
            continue
        c0, c1 = keys[d]
        if not causal:
            groups.append((slice(r0, r1), [(slice(c0, c1), False)]))
            continue
        # this document's rows [r0, r1) against its keys [c0, c1): query r0 sits at offset lo - (k_start + c0)
        for rows, parts in offset_blocks(r1 - r0, c1 - c0, lo - (k_start + c0)):
            groups.append((slice(rows.start + r0, rows.stop + r0),
                           [(slice(cols.start + c0, cols.stop + c0), sq_causal) for cols, sq_causal in parts]))
    return groups


def varlen_layout(blocks: Blocks, sq: int, sk: int) -> tuple[list[int], list[int], bool] | None:
    """``(cu_q, cu_k, causal)`` when ``blocks`` are one variable-length kernel call, else None.

    That is when every row range has exactly one block, all of one kind (causal ones are square,
    where every kernel's causal flag means the same), and the blocks' rows and columns each tile
    ``[0, sq)`` and ``[0, sk)`` in order: the tensors themselves are then the packed sequences and
    the cumulative lengths are the blocks' bounds. A full-sequence call with documents (every
    head-parallel method's) is such a call; a call with empty rows or two blocks per row is not.
    """
    if not blocks or any(len(parts) != 1 for _, parts in blocks):
        return None
    kinds = {parts[0][1] for _, parts in blocks}
    cu_q, cu_k = [0], [0]
    for rows, [(cols, _)] in blocks:
        if rows.start != cu_q[-1] or cols.start != cu_k[-1]:
            return None
        cu_q.append(rows.stop)
        cu_k.append(cols.stop)
    if len(kinds) != 1 or cu_q[-1] != sq or cu_k[-1] != sk:
        return None
    return cu_q, cu_k, kinds.pop()


@functools.lru_cache(maxsize=256)
def document_call(
    sq: int, sk: int, causal: bool, q_offset: int, docs: Documents, k_start: int
) -> tuple[Blocks, tuple[list[int], list[int], bool] | None]:
    """``mask_blocks`` of one call with documents and its ``varlen_layout`` (None: blockwise).

    Cached: a step makes the same call in every layer, in the forward, its recomputation and the
    backward (and per stage for a staged method), and the rule is pure Python over every document,
    so computing it once keeps the host ahead of the GPU. The blocks are shared between calls and
    must not be changed.
    """
    blocks = mask_blocks(sq, sk, causal, q_offset, docs, k_start)
    return blocks, varlen_layout(blocks, sq, sk)


def visible(
    sq: int, sk: int, causal: bool, q_offset: int = 0, docs: Documents | None = None, k_start: int = 0,
    device=None,
) -> Tensor:
    """The masking rule as an explicit boolean ``[sq, sk]`` tensor (True: query ``i`` sees key ``j``).
    Quadratic: for the ``math`` kernel and tests only."""
    rows = torch.arange(sq, device=device)[:, None]
    cols = torch.arange(sk, device=device)[None, :]
    mask = cols <= rows + q_offset if causal else torch.ones(sq, sk, dtype=torch.bool, device=device)
    if docs is not None:
        ids = docs.doc_ids(device)
        q_start = k_start + q_offset
        mask = mask & (ids[q_start : q_start + sq, None] == ids[None, k_start : k_start + sk])
    return mask


def _batched_cu(cu: list[int], batch: int, device) -> Tensor:
    """Cumulative lengths of ``cu``'s sequences repeated over the batch (each batch row's tokens
    follow the previous row's), int32 on ``device``; made on the host and copied."""
    per = cu[-1]
    full = [b * per + c for b in range(batch) for c in cu[:-1]] + [batch * per]
    return torch.tensor(full, dtype=torch.int32).to(device)


def _max_len(cu: list[int]) -> int:
    return max(b - a for a, b in zip(cu, cu[1:], strict=False))


NativeForward = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
NativeBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Tensor]]


def blockwise_forward(
    native: NativeForward, q: Tensor, k: Tensor, v: Tensor, scale: float, q_offset: int,
    blocks: Blocks | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal attention with a query offset from ``native(q, k, v, causal, scale)`` calls.

    ``native`` only ever sees unmasked blocks or causal square blocks (``blocks``, by default
    ``offset_blocks``; ``mask_blocks`` for documents). Rows covered by two blocks are merged by
    log-sum-exp in fp32 (``merge_partials``) and cast back to the input dtype; rows with one
    block keep the kernel's output as is; rows with none get zeros and an LSE of ``-inf``.
    """
    if blocks is None:
        blocks = offset_blocks(q.shape[1], k.shape[1], q_offset)
    outs, lses = [], []
    for rows, parts in blocks:
        if not parts:
            b, n, h = q.shape[0], len(range(q.shape[1])[rows]), q.shape[2]
            outs.append(q.new_zeros(b, n, h, v.shape[-1]))
            lses.append(torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device))
            continue
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
    scale: float, q_offset: int, blocks: Blocks | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``blockwise_forward`` from ``native(dout, q, k, v, out, lse, causal, scale)`` calls.

    Each block's backward gets the final ``out`` and ``lse`` of its rows: with them a flash
    backward recomputes that block's share of the softmax exactly (as ring attention does), so
    the blocks' gradients add up to the full one. They are summed in fp32 (keys before the
    offset get contributions from two row ranges) and cast to the input dtypes. Rows and keys
    in no block get zero gradients.
    """
    if blocks is None:
        blocks = offset_blocks(q.shape[1], k.shape[1], q_offset)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for rows, parts in blocks:
        for cols, causal in parts:
            dq_b, dk_b, dv_b = native(
                dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows],
                lse[:, :, rows].contiguous(), causal, scale,
            )
            dq[:, rows] += dq_b
            dk[:, cols] += dk_b
            dv[:, cols] += dv_b
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _VarlenCalls:
    """The public variable-length calls of a kernel whose ``_varlen_forward``/``_varlen_backward`` take
    packed sequences (``TorchKernel``, ``FlashAttnKernel``); ``packs(device)`` says where they run. Timed
    like ``forward``/``backward``, as the ring loop calls them instead of those (``ringloop``, packed steps)."""

    @_timed("forward")
    def varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], cu_k: list[int], causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """Packed sequences: sequence ``i`` is rows ``cu_q[i]:cu_q[i+1]`` of ``q`` against rows
        ``cu_k[i]:cu_k[i+1]`` of ``k``/``v``, unmasked or causal (on equal lengths)."""
        return self._varlen_forward(q, k, v, cu_q, cu_k, causal, scale)

    @_timed("backward")
    def varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        cu_q: list[int], cu_k: list[int], causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Backward of ``varlen_forward``."""
        return self._varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)


class TorchKernel(_VarlenCalls):
    """PyTorch's fused flash attention ops (CPU and CUDA variants), GQA native.

    Causal calls other than ``q_offset = 0`` on equal lengths go through ``blockwise_forward``:
    the ops' causal flag has no offset (PyTorch aligns an unequal-length causal mask top-left,
    pytorch/pytorch#108108, which the CPU op does on 2.13, i.e. only ``q_offset = 0``), and
    their ``attn_mask`` would be an ``Sq x Sk`` tensor.
    """

    name = "torch"

    @_timed("forward")
    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, q_offset: int = 0,
        docs: Documents | None = None, k_start: int = 0,
    ) -> tuple[Tensor, Tensor]:
        if docs is not None:
            blocks, layout = document_call(q.shape[1], k.shape[1], causal, q_offset, docs, k_start)
            layout = layout if q.device.type != "cpu" else None
            if layout is not None:
                return self._varlen_forward(q, k, v, *layout, scale)
            return blockwise_forward(self._forward, q, k, v, scale, q_offset, blocks)
        if causal and (q_offset or q.shape[1] != k.shape[1]):
            return blockwise_forward(self._forward, q, k, v, scale, q_offset)
        return self._forward(q, k, v, causal, scale)

    @_timed("backward")
    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        causal: bool, scale: float, q_offset: int = 0, docs: Documents | None = None, k_start: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if docs is not None:
            blocks, layout = document_call(q.shape[1], k.shape[1], causal, q_offset, docs, k_start)
            layout = layout if q.device.type != "cpu" else None
            if layout is not None:
                return self._varlen_backward(dout, q, k, v, out, lse, *layout, scale)
            return blockwise_backward(self._backward, dout, q, k, v, out, lse, scale, q_offset, blocks)
        if causal and (q_offset or q.shape[1] != k.shape[1]):
            return blockwise_backward(self._backward, dout, q, k, v, out, lse, scale, q_offset)
        return self._backward(dout, q, k, v, out, lse, causal, scale)

    @staticmethod
    def packs(device: torch.device) -> bool:
        """Whether ``varlen_forward``/``varlen_backward`` run natively on ``device``: the flash op's
        variable-length form exists on CUDA only."""
        return device.type != "cpu"

    @staticmethod
    def _varlen_forward(
        q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], cu_k: list[int], causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """The CUDA flash op's variable-length form: the batch's rows packed one after another
        (``[B * S, H, d]``, a view), one sequence per block of ``varlen_layout``; its LSE
        ``[H, B * Sq]`` returned as ``[B, H, Sq]``."""
        b, sq, h, d = q.shape
        out, lse = torch.ops.aten._flash_attention_forward(
            q.reshape(b * sq, h, d), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
            _batched_cu(cu_q, b, q.device), _batched_cu(cu_k, b, q.device), _max_len(cu_q), _max_len(cu_k),
            0.0, causal, False, scale=scale,
        )[:2]
        return out.view(b, sq, h, out.shape[-1]), lse.view(h, b, sq).transpose(0, 1).contiguous()

    @staticmethod
    def _varlen_backward(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        cu_q: list[int], cu_k: list[int], causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Backward of ``_varlen_forward`` (defined cumulative lengths select the varlen backward)."""
        b, sq, h, d = q.shape
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.reshape(b * sq, h, -1).contiguous(), q.reshape(b * sq, h, d), k.reshape(-1, *k.shape[2:]),
            v.reshape(-1, *v.shape[2:]), out.reshape(b * sq, h, -1), lse.transpose(0, 1).reshape(h, b * sq),
            _batched_cu(cu_q, b, q.device), _batched_cu(cu_k, b, q.device), _max_len(cu_q), _max_len(cu_k),
            0.0, causal, seed, seed, scale=scale,
        )
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)

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
    next to the ``[B, H, Sq, Sk]`` fp32 scores this kernel materialises anyway; with documents,
    the whole rule's mask (``visible``). A row that sees no key has an LSE of ``-inf``; its
    probabilities are taken against 0 instead, so they are 0 (not NaN) and so is its output.
    """

    name = "math"

    @staticmethod
    def _scores(
        q: Tensor, k: Tensor, causal: bool, scale: float, q_offset: int = 0,
        docs: Documents | None = None, k_start: int = 0,
    ) -> tuple[Tensor, int]:
        groups = q.shape[2] // k.shape[2]
        qf = q.float().transpose(1, 2)
        kf = k.float().transpose(1, 2).repeat_interleave(groups, dim=1)
        s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
        if docs is not None:
            seen = visible(q.shape[1], k.shape[1], causal, q_offset, docs, k_start, s.device)
            s = s.masked_fill(~seen, float("-inf"))
        elif causal:  # key j is hidden from query i when j > i + q_offset
            mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1 + q_offset)
            s = s.masked_fill(mask, float("-inf"))
        return s, groups

    @staticmethod
    def _probs(s: Tensor, lse: Tensor) -> Tensor:
        return torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))

    @_timed("forward")
    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, q_offset: int = 0,
        docs: Documents | None = None, k_start: int = 0,
    ) -> tuple[Tensor, Tensor]:
        s, groups = self._scores(q, k, causal, scale, q_offset, docs, k_start)
        lse = torch.logsumexp(s, dim=-1)
        p = self._probs(s, lse)
        vf = v.float().transpose(1, 2).repeat_interleave(groups, dim=1)
        out = torch.matmul(p, vf).transpose(1, 2).to(q.dtype)
        return out, lse

    @_timed("backward")
    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        causal: bool, scale: float, q_offset: int = 0, docs: Documents | None = None, k_start: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        s, groups = self._scores(q, k, causal, scale, q_offset, docs, k_start)
        p = self._probs(s, lse)
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


class FlashAttnKernel(_VarlenCalls):
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

    @_timed("forward")
    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, q_offset: int = 0,
        docs: Documents | None = None, k_start: int = 0,
    ) -> tuple[Tensor, Tensor]:
        if docs is not None:
            blocks, layout = document_call(q.shape[1], k.shape[1], causal, q_offset, docs, k_start)
            if layout is not None:
                return self._varlen_forward(q, k, v, *layout, scale)
            return blockwise_forward(self._forward, q, k, v, scale, q_offset, blocks)
        if causal and q_offset != k.shape[1] - q.shape[1]:
            return blockwise_forward(self._forward, q, k, v, scale, q_offset)
        return self._forward(q, k, v, causal, scale)

    @_timed("backward")
    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        causal: bool, scale: float, q_offset: int = 0, docs: Documents | None = None, k_start: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if docs is not None:
            blocks, layout = document_call(q.shape[1], k.shape[1], causal, q_offset, docs, k_start)
            if layout is not None:
                return self._varlen_backward(dout, q, k, v, out, lse, *layout, scale)
            return blockwise_backward(self._backward, dout, q, k, v, out, lse, scale, q_offset, blocks)
        if causal and q_offset != k.shape[1] - q.shape[1]:
            return blockwise_backward(self._backward, dout, q, k, v, out, lse, scale, q_offset)
        return self._backward(dout, q, k, v, out, lse, causal, scale)

    @staticmethod
    def packs(device: torch.device) -> bool:
        """Its variable-length functions take any device flash-attn runs on."""
        return True

    def _varlen_forward(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: list[int], cu_k: list[int], causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """``_flash_attn_varlen_forward`` on the batch packed row after row (``[B * S, H, d]``);
        its LSE ``[H, B * Sq]`` returned as ``[B, H, Sq]``."""
        b, sq, h, d = q.shape
        out, lse, *_ = self._fa._flash_attn_varlen_forward(
            q.reshape(b * sq, h, d), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
            _batched_cu(cu_q, b, q.device), _batched_cu(cu_k, b, q.device), _max_len(cu_q), _max_len(cu_k),
            0.0, scale, causal, -1, -1, 0.0, None, False,
        )
        if lse.shape != (h, b * sq):  # older flash-attn padded the varlen LSE per sequence
            raise ValueError(
                f"flash-attn's varlen forward returned an LSE of shape {tuple(lse.shape)}, not [heads, total] "
                f"({h}, {b * sq}); upgrade flash-attn (2.7+) or use kernel='torch' with documents"
            )
        return out.view(b, sq, h, out.shape[-1]), lse.view(h, b, sq).transpose(0, 1).contiguous()

    def _varlen_backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        cu_q: list[int], cu_k: list[int], causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, sq, h, d = q.shape
        q3, k3, v3 = q.reshape(b * sq, h, d), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
        dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
        self._fa._flash_attn_varlen_backward(
            dout.reshape(b * sq, h, -1).contiguous(), q3, k3, v3, out.reshape(b * sq, h, -1),
            lse.transpose(0, 1).reshape(h, b * sq).contiguous(), dq, dk, dv,
            _batched_cu(cu_q, b, q.device), _batched_cu(cu_k, b, q.device), _max_len(cu_q), _max_len(cu_k),
            0.0, scale, causal, -1, -1, 0.0, None, False, None,
        )
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)

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


def mask_keywords(q_offset: int = 0, docs: Documents | None = None, k_start: int = 0) -> dict:
    """The masking keywords of a kernel call that are not at their defaults: a kernel wrapper
    without them (tests' old-signature kernels) serves every call made without them."""
    extra: dict = {"q_offset": q_offset} if q_offset else {}
    if docs is not None:
        extra["docs"] = docs
        if k_start:
            extra["k_start"] = k_start
    return extra


class _Attention(torch.autograd.Function):
    """Plain autograd around one kernel call. The masking keywords reach the kernel only when
    not at their defaults (``mask_keywords``)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel, q_offset, docs=None, k_start=0):
        extra = mask_keywords(q_offset, docs, k_start)
        out, lse = kernel.forward(q, k, v, causal, scale, **extra)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.kernel, ctx.extra = causal, scale, kernel, extra
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale, **ctx.extra)
        return dq, dk, dv, None, None, None, None, None, None


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    kernel: Kernel | None = None,
    scale: float | None = None,
    q_offset: int = 0,
    docs: Documents | None = None,
    k_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable local attention returning ``(out, lse)``; lse is not differentiable.

    With ``causal``, query ``i`` sees keys ``j <= i + q_offset`` (``q_offset``: the global
    position of the first query relative to the first key; see the module docstring for what
    each kernel does with it). ``q_offset`` is ignored without ``causal``. With ``docs``, only
    keys of the query's own document (keys start at global position ``k_start``).
    """
    _check(q, k, v, causal, q_offset, docs, k_start)
    kernel = kernel or get_kernel()
    scale = softmax_scale(q.shape[-1]) if scale is None else scale
    if docs is None:
        return _Attention.apply(q, k, v, causal, scale, kernel, q_offset)
    return _Attention.apply(q, k, v, causal, scale, kernel, q_offset, docs, k_start)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    kernel: Kernel | None = None,
    scale: float | None = None,
    q_offset: int = 0,
    docs: Documents | None = None,
    k_start: int = 0,
) -> torch.Tensor:
    """Differentiable local attention (BSHD in, BSHD out); the mask as in ``attention_with_lse``."""
    return attention_with_lse(q, k, v, causal, kernel, scale, q_offset, docs, k_start)[0]


def merge_partials(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor,
    may_be_empty: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets.

    ``out`` is kept in fp32 (ring/chunked methods accumulate many blocks, and bf16
    accumulation drifts: a common complaint against ring attention implementations).
    ``lse`` is ``[B, H, S]``, outputs are BSHD.

    ``may_be_empty``: some rows may have seen no key on both sides (LSE ``-inf``, with documents
    or a negative offset); their weights are then taken against 0, so they stay an output of 0
    with an LSE of ``-inf`` instead of becoming NaN. Off by default: it costs one more
    LSE-sized temporary, and rows of calls without documents always see a key.
    """
    block_out = block_out.float()
    if out is None:
        return block_out, block_lse.clone()
    new_lse = torch.logaddexp(lse, block_lse)
    ref = new_lse.masked_fill(new_lse == float("-inf"), 0.0) if may_be_empty else new_lse
    w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse
