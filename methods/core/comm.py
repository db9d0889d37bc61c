"""Collectives with autograd, written against plain ``torch.distributed``.

Plain ``torch.distributed`` calls (``all_to_all_single``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``batch_isend_irecv``) so the same code runs on NCCL, gloo and
the ``fake`` backend used for simulation, and every call passes through the dispatcher as a
``c10d::*`` op, which is where the benchmark's ``CommCounter`` counts it.
``group=None`` means "one device": every helper is then the identity, which is how a
method runs at world size 1 with the same code path.

Head-parallel methods (Ulysses and its kin) move tokens between the two layouts below
with all-to-alls; a method that keeps every head on every rank (Llama-3-style context
parallelism: gather K/V along the sequence, attend the local queries to all of it) uses
``all_gather_seq`` and its transpose ``reduce_scatter_seq``.

Layouts: activations are ``[batch, seq, heads, head_dim]``. "seq" layout: each rank holds
``S/C`` tokens and all heads; "head" layout: each rank holds all ``S`` tokens of ``h/C``
heads. Tokens are concatenated in rank order, so the global order is whatever order the
method's ``shard`` put them in (positions travel separately, see ``rope.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import ringsync

Group = "dist.ProcessGroup | None"


def world(group) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group``; ``(1, 0)`` for ``None``."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


# ----------------------------------------------------------------------- all-to-all
def seq_to_head_(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, S/C, h, d]`` on each rank -> ``[B, S, h/C, d]`` (no autograd)."""
    size, _ = world(group)
    if size == 1:
        return x
    b, sl, h, d = x.shape
    send = x.reshape(b, sl, size, h // size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    del send
    return recv.permute(1, 0, 2, 3, 4).reshape(b, size * sl, h // size, d)


def head_to_seq_(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, S, h/C, d]`` on each rank -> ``[B, S/C, h, d]`` (no autograd)."""
    size, _ = world(group)
    if size == 1:
        return x
    b, s, hc, d = x.shape
    send = x.reshape(b, size, s // size, hc, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    del send
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * hc, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_head_(x, group)

    @staticmethod
    def backward(ctx, grad):
        return head_to_seq_(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return head_to_seq_(x, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_head_(grad, ctx.group), None


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable sequence->head all-to-all (Ulysses' first exchange)."""
    if world(group)[0] == 1:
        return x
    return _SeqToHead.apply(x, group)


def head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable head->sequence all-to-all (Ulysses' second exchange)."""
    if world(group)[0] == 1:
        return x
    return _HeadToSeq.apply(x, group)


# ----------------------------------------------------------------------- gathers and reduce-scatters
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (deprecated there) to
# *_single; older releases lack the new names. Both dispatch to the same c10d ops.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_cat(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no autograd)."""
    size, _ = world(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return torch.cat(out.chunk(size, dim=0), dim=dim)


def reduce_scatter_cat(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Sum every rank's ``x`` and keep this rank's chunk along ``dim`` (no autograd).

    The backward of ``all_gather_seq`` and the forward of ``reduce_scatter_seq``. Inverse in
    shape of ``all_gather_cat``: ``x.shape[dim]`` must be a multiple of the group size, and
    rank ``r`` gets chunk ``r`` of the sum. Along any dimension but the first, the chunks are
    copied one after the other into one send buffer (a copy of ``x``: a chunk along a later
    dimension is not contiguous). The sum runs in ``x``'s dtype (the backend's reduction); a
    caller that wants an fp32 sum of bf16 values passes them in fp32.
    """
    size, _ = world(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % size:
        raise ValueError(
            f"reduce-scatter along dim {dim}: length {x.shape[dim]} is not a multiple of the group size {size}"
        )
    chunks = x.chunk(size, dim=dim)
    # the chunks one after the other along dim 0 (gloo takes only this form): rank r gets the r-th's sum
    send = torch.cat(chunks, dim=0) if dim else x.contiguous()
    out = torch.empty(chunks[0].shape, dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, send, group=group)
    return out


class _AllGatherSeq(torch.autograd.Function):
    """All-gather forward, reduce-scatter backward (see ``all_gather_seq``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather_cat(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_cat(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """Reduce-scatter forward, all-gather backward (see ``reduce_scatter_seq``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_cat(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_cat(grad, ctx.group, ctx.dim), None, None


def all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Differentiable all-gather: every rank's ``x`` concatenated along ``dim`` in rank order.

    For methods that are not head-parallel (Llama-3-style context parallelism gathers the
    whole K/V on every rank). The backward is a reduce-scatter: every rank's copy of the
    gathered tensor feeds its own part of the loss, so the gradient of this rank's ``x`` is
    the sum over ranks of their gradients for this rank's slice. The result is the global
    sequence only if the layout is contiguous (rank r holds chunk r); with another layout
    it is in the layout's order, and the caller masks accordingly.
    """
    if world(group)[0] == 1:
        return x
    return _AllGatherSeq.apply(x, group, dim)


def reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Differentiable reduce-scatter: the sum over ranks of ``x``, this rank's chunk along ``dim``.

    The transpose of ``all_gather_seq``: for a method that computes a full-length partial
    result on every rank (e.g. each rank's contribution to every token) and keeps its own
    tokens of the total. The backward all-gathers the gradient (this rank's chunk of the
    sum is used by this rank only, and every rank's ``x`` contributed to it).
    """
    if world(group)[0] == 1:
        return x
    return _ReduceScatterSeq.apply(x, group, dim)


def all_reduce_sum_(x: torch.Tensor, group) -> torch.Tensor:
    """In-place sum over the group (identity for one device)."""
    if world(group)[0] > 1:
        dist.all_reduce(x, group=group)
    return x


# ----------------------------------------------------------------------- ring p2p
class RingComm:
    """Pass tensors to the next rank and receive from the previous one.

    ``exchange`` posts all sends and receives at once with ``batch_isend_irecv`` and
    returns immediately, so the caller can compute on the current block while the next
    one travels; ``wait`` completes them. Peers are global ranks, as P2P ops require.

    The tensors being sent are held here until ``wait``: a real backend's work object keeps a
    send's buffer alive until the transfer completes (gloo's send work holds the tensor, NCCL
    stashes it for the caching allocator), whereas the ``fake`` backend's work holds nothing. A
    caller may drop its own reference to a tensor it sent before waiting (the ring backward's
    travelling dK/dV accumulators); without this hold the simulation would free that memory
    earlier than any real run does.
    """

    def __init__(self, group) -> None:
        self.group = group
        self.size, self.rank = world(group)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self._reqs: list = []
        self._in_flight: list[torch.Tensor] = []  # the tensors being sent, held until wait()

    def exchange(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``tensors`` to the next rank; return buffers that will hold the previous rank's."""
        if self._reqs:
            raise RuntimeError("RingComm.exchange called again before wait()")
        recv = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        sends = [t.contiguous() for t in tensors]
        ops = []
        for send_t, recv_t in zip(sends, recv, strict=True):
            ops.append(dist.P2POp(dist.isend, send_t, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, recv_t, self.prev, self.group))
        self._reqs = dist.batch_isend_irecv(ops)
        self._in_flight = sends
        return recv

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs, self._in_flight = [], []
        if ringsync.enabled() and self.size > 1:  # the paper's ring code synchronises every step
            ringsync.barrier(self.group)
