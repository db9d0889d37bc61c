"""The ring loop: K/V blocks travel around a ring of ranks, each step's attention merged by log-sum-exp.

Any ring method (``ring``, ``usp``'s ring dimension, ``usp-upipe``'s ring kernel, striped attention)
is this loop plus a **schedule**: at each step, which local query rows attend to which rows of the
K/V block the rank holds, and with which mask. The loop owns the rest:

* forward (``ring_forward``): the transfer of the held K/V block to the next rank is posted *before*
  the step's kernel calls (``comm.RingComm``), so the p2p exchange overlaps them; each call's
  ``(out, lse)`` is merged into the rows it covers in fp32 (``kernels.merge_partials``);
* backward (``ring_backward``): dQ accumulates locally; each block's dK/dV accumulator (fp32)
  travels with its K/V and arrives home after the last step, so nothing is recomputed over the
  whole sequence. Every kernel backward gets the final ``out`` and ``lse`` of its rows, which is
  what makes the blocks' gradients add up to the full one;
* ``RingAttention``: the autograd function around both, saving only q, k, v, out and lse;
* ``RingKernel``: a ring presented as a local kernel (``kernels.Kernel``), for a method that calls
  ``kernel.forward/backward`` itself per stage (UPipe's stages over a ring: ``usp-upipe``).

A schedule (``RingSchedule``) is an object with ``blocks(step, rank, size, local_len)``, returning
``RingBlock`` s: query rows, key rows, ``causal`` and the kernel's masking keywords (``q_offset``,
``docs``, ``k_start``; ``kernels.mask_keywords``), and ``may_be_empty``: whether a row may see no key
in a call (then merged as the empty set it is). At step ``i`` rank ``r`` holds the block of rank
``(r - i) mod size``. Schedules here:

* ``ZigzagSchedule``: the zigzag layout without documents (``methods/ring.py`` explains it): one
  call per step, balanced;
* ``RunsSchedule``: any layout given as runs of global positions per ring rank
  (``layouts.LayoutPlan``), with or without documents: one call per pair of a query run and a key
  run that can see one another, each masked by the kernels' one rule (global query/key runs,
  documents, negative offsets). Pairs that cannot see one another (a key run after the query run
  under a causal mask; runs in different documents) make no call. With ``pack`` (the ``doc-zigzag``
  layout, which cuts every document into 2R chunks, so four calls per document per step) and a kernel
  with a variable-length form on the tensors' device (``kernel.packs(device)``), a step's calls are
  packed into a few variable-length calls instead (``ringpack``), as ring-flash-attn's zigzag varlen
  ring makes them; the layout's sections let each call take its rows as a slice and merge in place
  (``_merge_into``) where ring-flash-attn gathers half the rows and scatters the output back.

A new schedule (striped attention's: step ``i`` is causal with offset 0 or -1) is a class with those
two members; docs/adding-a-method.md shows one.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from . import comm, ringpack
from .kernels import mask_keywords, merge_partials

if TYPE_CHECKING:
    from .documents import Documents
    from .layouts import Run

FULL = slice(None)


@dataclass(frozen=True)
class RingBlock:
    """One kernel call of a ring step: local query ``rows`` against ``cols`` of the held K/V block."""

    rows: slice
    cols: slice
    causal: bool
    mask: Mapping = field(default_factory=dict)  # kernel keywords: q_offset, docs, k_start


class RingSchedule(Protocol):
    may_be_empty: bool

    def blocks(self, step: int, rank: int, size: int, local_len: int) -> list[RingBlock]: ...


def _covers(s: slice, n: int) -> bool:
    return range(n)[s] == range(n)


# ----------------------------------------------------------------------- schedules
def zigzag_block(step: int, rank: int, local_len: int, causal: bool):
    """``(q_rows, kv_rows, causal)`` of the zigzag layout's attention at ``step`` (methods/ring.py)."""
    if not causal:
        return FULL, FULL, False
    if step == 0:
        return FULL, FULL, True
    half = local_len // 2
    if step <= rank:  # the block comes from an earlier rank
        return FULL, slice(0, half), False
    return slice(half, None), FULL, False


@dataclass(frozen=True)
class ZigzagSchedule:
    """The zigzag layout without documents: ``zigzag_block`` at every step."""

    causal: bool
    may_be_empty = False

    def blocks(self, step: int, rank: int, size: int, local_len: int) -> list[RingBlock]:
        return [RingBlock(*zigzag_block(step, rank, local_len, self.causal))]


class RunsSchedule:
    """Any layout as runs of global positions per ring rank (``runs[j]``: ring rank j's tokens, in
    local order), with the kernels' masking rule per pair of runs; ``docs``: the documents of
    those positions (a padded layout's, ``LayoutPlan.docs``), or None. With ``keys`` (runs of the
    K/V rows, e.g. an all-gathered sequence in layout order) it is a one-step schedule on one device:
    ``runs[0]`` (the queries) against ``keys``, for ``ring_attention(..., group=None)``. With ``pack``
    the ring loop runs each step as ``packed`` variable-length calls where the kernel can
    (``ringpack``; the ``doc-zigzag`` layout's schedules)."""

    may_be_empty = True

    def __init__(self, runs: list[list[Run]], causal: bool, docs: Documents | None = None,
                 keys: list[Run] | None = None, pack: bool = False) -> None:
        self.causal, self.docs, self.pack = causal, docs, pack
        starts = docs.starts if docs is not None else None
        self.runs = []
        for rank_runs in runs if keys is None else [*runs, keys]:
            local, at = [], 0
            for start, n in rank_runs:
                # documents of the run's first and last token (a run meets a contiguous range of them)
                first = last = 0
                if starts is not None:
                    first = bisect.bisect_right(starts, start) - 1
                    last = bisect.bisect_right(starts, start + n - 1) - 1
                local.append((at, start, n, first, last))
                at += n
            self.runs.append(local)
        self.keys = None if keys is None else self.runs.pop()
        self._cache: dict[tuple[int, int], list[RingBlock]] = {}
        self._packed: dict[tuple[int, int], list[ringpack.PackedCall]] = {}

    def blocks(self, step: int, rank: int, size: int, local_len: int) -> list[RingBlock]:
        if self.keys is not None:  # one step: this rank's queries against every key (an all-gather)
            if step not in self._cache:
                self._cache[step] = self._pairs(self.runs[0], self.keys)
            return self._cache[step]
        source = (rank - step) % size
        if (rank, source) not in self._cache:
            self._cache[rank, source] = self._pairs(self.runs[rank], self.runs[source])
        return self._cache[rank, source]

    def packed(self, step: int, rank: int, size: int, local_len: int) -> list[ringpack.PackedCall]:
        """``blocks`` of the same step packed into variable-length calls (``ringpack.pack``)."""
        key = (rank, step) if self.keys is not None else (rank, (rank - step) % size)
        if key not in self._packed:
            self._packed[key] = ringpack.pack(self.blocks(step, rank, size, local_len), local_len)
        return self._packed[key]

    def _pairs(self, queries, keys) -> list[RingBlock]:
        """Every pair of a query run and a key run that can see one another, queries in order, then keys
        in order. The key runs are disjoint, so in order of position their documents never go back:
        the keys a query run may meet are found by bisection there, then taken in their own order."""
        by_start = sorted(range(len(keys)), key=lambda j: keys[j][1])
        firsts = [keys[j][3] for j in by_start]  # each key run's first document, in order of position
        lasts = [keys[j][4] for j in by_start]
        out = []
        for qo, qs, nq, q0, q1 in queries:
            if self.docs is None:
                candidates = range(len(keys))
            else:  # key runs ending in document q0 or later and starting in document q1 or earlier
                lo, hi = bisect.bisect_left(lasts, q0), bisect.bisect_right(firsts, q1)
                candidates = sorted(by_start[lo:hi])
            for j in candidates:
                ko, ks, nk, k0, k1 = keys[j]
                if self.causal and ks > qs + nq - 1:
                    continue  # every key follows every query
                if self.docs is not None and (k1 < q0 or k0 > q1):
                    continue  # no document in common
                if self.docs is not None:
                    mask = mask_keywords(qs - ks, self.docs, ks)
                else:
                    mask = mask_keywords(qs - ks if self.causal else 0)
                out.append(RingBlock(slice(qo, qo + nq), slice(ko, ko + nk), self.causal, mask))
        return out


def _packs(schedule: RingSchedule, kernel, q: torch.Tensor) -> bool:
    """Whether this ring's steps run as packed variable-length calls: the schedule packs and the kernel has
    a variable-length form on ``q``'s device."""
    packs = getattr(kernel, "packs", None)
    return bool(getattr(schedule, "pack", False)) and packs is not None and packs(q.device)


def _gather(t: torch.Tensor, rows: ringpack.Rows, dim: int = 1) -> torch.Tensor:
    """The ``rows`` of ``t`` along ``dim``: all of it, a view of a slice, or a gathered copy."""
    if rows is None:
        return t
    if isinstance(rows, slice):
        return t.narrow(dim, rows.start, rows.stop - rows.start)
    return t.index_select(dim, rows)


def _merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """``merge_partials`` (with ``may_be_empty``) written into ``out`` and ``lse`` in place (views of a packed
    call's slice of the step's accumulators): the old part rescaled in place and the block's added with its
    weight, instead of three new fp32 temporaries and a copy back."""
    new_lse = torch.logaddexp(lse, block_lse)
    ref = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    out.mul_(torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1))
    out.addcmul_(block_out, torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1))
    lse.copy_(new_lse)


# ----------------------------------------------------------------------- the loop
def ring_forward(q, k, v, scale: float, kernel, group, schedule: RingSchedule):
    """Ring attention forward on BSHD tensors: ``(out, lse)``, out in q's dtype, lse fp32 ``[B, H, n]``."""
    size, rank = comm.world(group)
    ring = comm.RingComm(group)
    n = q.shape[1]
    out = lse = None
    kb, vb = k, v
    packing = _packs(schedule, kernel, q)
    for step in range(size):
        if step + 1 < size:
            next_kv = ring.exchange([kb, vb])  # posted before this step's attention
        if packing:
            out, lse = _packed_forward(q, kb, vb, out, lse, schedule.packed(step, rank, size, n), kernel, scale)
        for blk in () if packing else schedule.blocks(step, rank, size, n):
            rows, cols = blk.rows, blk.cols
            blk_out, blk_lse = kernel.forward(q[:, rows], kb[:, cols], vb[:, cols], blk.causal, scale, **blk.mask)
            if out is None and _covers(rows, n):
                out, lse = merge_partials(None, None, blk_out, blk_lse)
                continue
            if out is None:
                out, lse = _empty(q, v)
            merged = merge_partials(out[:, rows], lse[:, :, rows], blk_out, blk_lse, schedule.may_be_empty)
            out[:, rows], lse[:, :, rows] = merged
        if step + 1 < size:
            ring.wait()
            kb, vb = next_kv
    if out is None:  # no call at all: every row saw nothing
        out, lse = _empty(q, v)
    return out.to(q.dtype), lse


def _packed_forward(q, kb, vb, out, lse, calls: list[ringpack.PackedCall], kernel, scale: float):
    """One ring step as packed calls: each takes its query and key rows (a view where they are one piece,
    else a gather), and its output is merged into those rows (``may_be_empty``: a row of the local block
    may have seen no key yet), in place where they are a slice, else gathered and scattered back."""
    n = q.shape[1]
    for call in calls:
        qi = ringpack.index(call.rows, n, q.device)
        ki = ringpack.index(call.cols, kb.shape[1], q.device)
        blk_out, blk_lse = kernel.varlen_forward(_gather(q, qi), _gather(kb, ki), _gather(vb, ki), call.cu_q,
                                                 call.cu_k, call.causal, scale)
        if qi is None:
            out, lse = merge_partials(out, lse, blk_out, blk_lse, True)
            continue
        if out is None:
            out, lse = _empty(q, vb)
        if isinstance(qi, slice):
            _merge_into(_gather(out, qi), _gather(lse, qi, 2), blk_out, blk_lse)
            continue
        merged_out, merged_lse = merge_partials(out.index_select(1, qi), lse.index_select(2, qi), blk_out, blk_lse,
                                                True)
        out.index_copy_(1, qi, merged_out)
        lse.index_copy_(2, qi, merged_lse)
    return out, lse


def _empty(q, v):
    b, n, h = q.shape[:3]
    return (torch.zeros(b, n, h, v.shape[-1], dtype=torch.float32, device=q.device),
            torch.full((b, h, n), float("-inf"), dtype=torch.float32, device=q.device))


def ring_backward(dout, q, k, v, out, lse, scale: float, kernel, group, schedule: RingSchedule):
    """Ring attention backward: ``(dq, dk, dv)``; dK/dV travel with their blocks."""
    size, rank = comm.world(group)
    kv_ring, dkv_ring = comm.RingComm(group), comm.RingComm(group)
    dq = torch.zeros_like(q, dtype=torch.float32)
    kb, vb = k, v
    next_dkv = None

    def accumulators(step: int):
        """The dK/dV accumulators of the block held at ``step``: fresh at step 0, else they arrive
        from the previous rank (posted at the end of the previous step)."""
        if step == 0:
            return torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        dkv_ring.wait()
        return next_dkv

    packing = _packs(schedule, kernel, q)
    for step in range(size):
        if step + 1 < size:
            next_kv = kv_ring.exchange([kb, vb])
        dk = dv = None
        for call in schedule.packed(step, rank, size, q.shape[1]) if packing else ():
            qi = ringpack.index(call.rows, q.shape[1], q.device)
            ki = ringpack.index(call.cols, kb.shape[1], q.device)
            dq_b, dk_b, dv_b = kernel.varlen_backward(
                _gather(dout, qi), _gather(q, qi), _gather(kb, ki), _gather(vb, ki), _gather(out, qi),
                _gather(lse, qi, 2).contiguous(), call.cu_q, call.cu_k, call.causal, scale,
            )
            if dk is None:
                dk, dv = accumulators(step)
            for acc, grad, at in ((dq, dq_b, qi), (dk, dk_b, ki), (dv, dv_b, ki)):
                if at is None or isinstance(at, slice):
                    _gather(acc, at).add_(grad)
                else:
                    acc.index_add_(1, at, grad.float())
            del dq_b, dk_b, dv_b
        for blk in () if packing else schedule.blocks(step, rank, size, q.shape[1]):
            rows, cols = blk.rows, blk.cols
            dq_b, dk_b, dv_b = kernel.backward(
                dout[:, rows], q[:, rows], kb[:, cols], vb[:, cols], out[:, rows],
                lse[:, :, rows].contiguous(), blk.causal, scale, **blk.mask,
            )
            dq[:, rows] += dq_b
            if dk is None and step == 0 and _covers(cols, kb.shape[1]):
                dk, dv = dk_b.float().contiguous(), dv_b.float().contiguous()  # p2p needs contiguous
            else:
                if dk is None:
                    dk, dv = accumulators(step)
                dk[:, cols] += dk_b
                dv[:, cols] += dv_b
            del dq_b, dk_b, dv_b
        if dk is None:  # this step made no call: pass the accumulators on untouched
            dk, dv = accumulators(step)
        if size > 1:  # after the last step this send brings each block's grads home
            next_dkv = dkv_ring.exchange([dk, dv])
        if step + 1 < size:
            kv_ring.wait()
            kb, vb = next_kv
    if size > 1:
        dkv_ring.wait()
        dk, dv = next_dkv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """``ring_forward`` / ``ring_backward`` as one autograd function (saves q, k, v, out, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, kernel, group, schedule):
        out, lse = ring_forward(q, k, v, scale, kernel, group, schedule)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.kernel, ctx.group, ctx.schedule = scale, kernel, group, schedule
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ring_backward(dout, q, k, v, out, lse, ctx.scale, ctx.kernel, ctx.group, ctx.schedule)
        return (*grads, None, None, None, None)


def ring_attention(q, k, v, causal: bool, kernel, scale: float, group,
                   schedule: RingSchedule | None = None) -> torch.Tensor:
    """Differentiable ring attention over ``group`` on BSHD tensors; ``schedule`` None: the zigzag
    layout's (``ZigzagSchedule``), which needs an even number of local tokens."""
    if schedule is None:
        size, _ = comm.world(group)
        if causal and size > 1 and q.shape[1] % 2:
            raise ValueError(
                f"ring attention: {q.shape[1]} local tokens cannot form the two zigzag chunks; "
                f"shard the input with the method's shard() (sequence a multiple of {2 * size})"
            )
        schedule = ZigzagSchedule(causal)
    return RingAttention.apply(q, k, v, scale, kernel, group, schedule)


ScheduleFor = Callable[[bool, "Documents | None", int], RingSchedule]


class RingKernel:
    """A ring over ``group`` presented as a local attention kernel (``kernels.Kernel``).

    Lets a method that calls ``kernel.forward/backward`` per stage (UPipe) attend across a ring
    dimension: the paper's multi-node UPipe is exactly this, Ulysses stages in the node and a ring
    across nodes (``usp-upipe``). ``schedule_for(causal, docs, local_len)`` picks the schedule of a
    call (the method's layout, with the call's documents); None: the zigzag layout, no documents.
    Calls are whole-sequence calls: a query offset or key start is refused.
    """

    def __init__(self, inner, group, schedule_for: ScheduleFor | None = None) -> None:
        self.inner, self.group, self.schedule_for = inner, group, schedule_for
        self.name = inner.name if comm.world(group)[0] == 1 else f"ring/{inner.name}"

    def _schedule(self, q, causal, q_offset, docs, k_start) -> RingSchedule:
        if q_offset or k_start:
            raise ValueError("a ring kernel attends whole ring-sharded sequences: call it without q_offset/k_start")
        if self.schedule_for is not None:
            return self.schedule_for(causal, docs, q.shape[1])
        if docs is not None:
            raise ValueError("this ring kernel has no layout to place documents in: build it with schedule_for")
        return ZigzagSchedule(causal)

    def forward(self, q, k, v, causal, scale, q_offset=0, docs=None, k_start=0):
        schedule = self._schedule(q, causal, q_offset, docs, k_start)
        return ring_forward(q, k, v, scale, self.inner, self.group, schedule)

    def backward(self, dout, q, k, v, out, lse, causal, scale, q_offset=0, docs=None, k_start=0):
        schedule = self._schedule(q, causal, q_offset, docs, k_start)
        return ring_backward(dout, q, k, v, out, lse, scale, self.inner, self.group, schedule)
