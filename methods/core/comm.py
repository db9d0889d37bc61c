"""Collectives with autograd, written against plain ``torch.distributed``.

Plain ``torch.distributed`` calls (``all_to_all_single``, ``all_gather_into_tensor``,
``batch_isend_irecv``) so the same code runs on NCCL, gloo and the ``fake`` backend used
for simulation. ``group=None`` means "one device": every helper is then the identity,
which is how a method runs at world size 1 with the same code path.

Layouts: activations are ``[batch, seq, heads, head_dim]``. "seq" layout: each rank holds
``S/C`` tokens and all heads; "head" layout: each rank holds all ``S`` tokens of ``h/C``
heads. Tokens are concatenated in rank order, so the global order is whatever order the
method's ``shard`` put them in (positions travel separately, see ``rope.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

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


# ----------------------------------------------------------------------- gathers
# torch 2.13 renamed all_gather_into_tensor (deprecated there); older releases lack the new name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_cat(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (no autograd)."""
    size, _ = world(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return torch.cat(out.chunk(size, dim=0), dim=dim)


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
    """

    def __init__(self, group) -> None:
        self.group = group
        self.size, self.rank = world(group)
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self._reqs: list = []

    def exchange(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``tensors`` to the next rank; return buffers that will hold the previous rank's."""
        if self._reqs:
            raise RuntimeError("RingComm.exchange called again before wait()")
        recv = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = []
        for send_t, recv_t in zip(tensors, recv):
            ops.append(dist.P2POp(dist.isend, send_t.contiguous(), self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, recv_t, self.prev, self.group))
        self._reqs = dist.batch_isend_irecv(ops)
        return recv

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs = []
