"""Ring Attention: K/V blocks travel around a ring of C ranks, merged by log-sum-exp.

Each rank projects Q/K/V for its own tokens (RoPE with their global positions) and keeps
its Q. For C steps it attends its Q to the K/V block it holds while posting the transfer
of that block to the next rank *before* the attention call, so the p2p exchange overlaps
the kernel; partial results are merged in fp32 by log-sum-exp (``kernels.merge_partials``).
Only the real KV heads travel (GQA is native in the kernels). The backward is a ring as
well: dQ accumulates locally, each block's dK/dV accumulator (fp32) travels with its K/V
and arrives home after C steps, so nothing is recomputed over the whole sequence.

Zigzag layout (causal load balance). The sequence is cut into 2C chunks; ring rank j holds
chunks j and 2C-1-j, in that order (``layouts.zigzag_index``). With local halves A (chunk r) and
B (chunk 2C-1-r), and the block held at step i coming from rank s = (r - i) mod C:

* step 0 (s = r): plain causal attention on the local tokens. A sees A causally; B sees
  all of A and B causally; A does not see B. That is exactly the lower triangle of
  [A; B] x [A; B], because chunk r precedes chunk 2C-1-r.
* s < r (i <= r): remote chunk s precedes both local chunks and remote chunk 2C-1-s follows
  both, so the full local Q attends the first half of the remote K/V, no mask.
* s > r (i > r): remote chunks s and 2C-1-s both lie strictly between chunk r and chunk
  2C-1-r, so only B attends, to the full remote K/V, no mask.

Every step costs the same (one causal n x n block counts as half), which is the point.
Non-causal attention is the plain ring: every block in full.
"""
from __future__ import annotations

import torch

from .core import comm
from .core.base import ZigzagLayoutMethod
from .core.kernels import merge_partials
from .core.registry import MethodFacts, register

FULL = slice(None)


# ----------------------------------------------------------------------- zigzag schedule
def zigzag_block(step: int, rank: int, local_len: int, causal: bool):
    """``(q_rows, kv_rows, causal)`` of the attention at ``step`` (see the module docstring)."""
    if not causal:
        return FULL, FULL, False
    if step == 0:
        return FULL, FULL, True
    half = local_len // 2
    if step <= rank:  # the block comes from an earlier rank
        return FULL, slice(0, half), False
    return slice(half, None), FULL, False


# ----------------------------------------------------------------------- the ring
def ring_forward(q, k, v, causal: bool, scale: float, kernel, group):
    """Ring attention forward on BSHD tensors in the zigzag layout: ``(out, lse)``."""
    size, rank = comm.world(group)
    ring = comm.RingComm(group)
    out = lse = None
    kb, vb = k, v
    for step in range(size):
        if step + 1 < size:
            next_kv = ring.exchange([kb, vb])  # posted before this block's attention
        rows, cols, blk_causal = zigzag_block(step, rank, q.shape[1], causal)
        blk_out, blk_lse = kernel.forward(q[:, rows], kb[:, cols], vb[:, cols], blk_causal, scale)
        if out is None:  # step 0 covers every local query
            out, lse = merge_partials(None, None, blk_out, blk_lse)
        else:
            merged = merge_partials(out[:, rows], lse[:, :, rows], blk_out, blk_lse)
            out[:, rows], lse[:, :, rows] = merged
        if step + 1 < size:
            ring.wait()
            kb, vb = next_kv
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, causal: bool, scale: float, kernel, group):
    """Ring attention backward: ``(dq, dk, dv)``; dK/dV travel with their blocks."""
    size, rank = comm.world(group)
    kv_ring, dkv_ring = comm.RingComm(group), comm.RingComm(group)
    dq = torch.zeros_like(q, dtype=torch.float32)
    kb, vb = k, v
    for step in range(size):
        if step + 1 < size:
            next_kv = kv_ring.exchange([kb, vb])
        rows, cols, blk_causal = zigzag_block(step, rank, q.shape[1], causal)
        dq_b, dk_b, dv_b = kernel.backward(
            dout[:, rows], q[:, rows], kb[:, cols], vb[:, cols], out[:, rows],
            lse[:, :, rows].contiguous(), blk_causal, scale,
        )
        dq[:, rows] += dq_b
        if step == 0:
            dk, dv = dk_b.float().contiguous(), dv_b.float().contiguous()  # p2p needs contiguous
        else:  # the accumulators of the block we hold arrive from the previous rank
            dkv_ring.wait()
            dk, dv = next_dkv  # noqa: F821 - bound by the previous step's exchange (step > 0)
            dk[:, cols] += dk_b
            dv[:, cols] += dv_b
        del dq_b, dk_b, dv_b
        if size > 1:  # after the last step this send brings each block's grads home
            next_dkv = dkv_ring.exchange([dk, dv])
        if step + 1 < size:
            kv_ring.wait()
            kb, vb = next_kv
    if size > 1:
        dkv_ring.wait()
        dk, dv = next_dkv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel, group):
        out, lse = ring_forward(q, k, v, causal, scale, kernel, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.kernel, ctx.group = causal, scale, kernel, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ring_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.kernel, ctx.group)
        return (*grads, None, None, None, None)


class RingKernel:
    """A ring over ``group`` presented as a local attention kernel (``kernels.Kernel``).

    Lets a method that calls ``kernel.forward/backward`` per stage (UPipe) attend across a
    ring dimension: the paper's multi-node UPipe is exactly this, Ulysses stages in the
    node and a zigzag ring across nodes (``usp-upipe``).
    """

    def __init__(self, inner, group) -> None:
        self.inner, self.group = inner, group
        self.name = inner.name if comm.world(group)[0] == 1 else f"ring/{inner.name}"

    def forward(self, q, k, v, causal, scale):
        return ring_forward(q, k, v, causal, scale, self.inner, self.group)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return ring_backward(dout, q, k, v, out, lse, causal, scale, self.inner, self.group)


def ring_attention(q, k, v, causal: bool, kernel, scale: float, group) -> torch.Tensor:
    """Differentiable ring attention over ``group`` on BSHD tensors in the zigzag layout."""
    size, _ = comm.world(group)
    if causal and size > 1 and q.shape[1] % 2:
        raise ValueError(
            f"ring attention: {q.shape[1]} local tokens cannot form the two zigzag chunks; "
            f"shard the input with the method's shard() (sequence a multiple of {2 * size})"
        )
    return _RingAttention.apply(q, k, v, causal, scale, kernel, group)


@register("ring", "Ring Attention: K/V blocks passed around the ring (p2p overlapped), LSE merge, zigzag",
          facts=MethodFacts(column="ring", reference=True))
class Ring(ZigzagLayoutMethod):
    documents_refusal = "not yet: its ring steps take no document mask"

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions)
        q, k, v = self.project_qkv(x, cos, sin)
        out = ring_attention(q, k, v, self.spec.causal, self.kernel, self.scale, self.group)
        return self.wo(out.flatten(2))
