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

The loop itself (exchange, kernel calls, merge, the backward's travelling dK/dV) is
``methods.core.ringloop``; this method is that loop with its layout's schedule. The layout is an
option (``methods.core.seqlayout``): ``zigzag`` (above, the default), ``contiguous`` or
``doc-zigzag`` (every document cut into 2C chunks, padded where needed).

Packed documents (``docs=``): each ring step's calls get the documents with the global positions
of the query and key runs they cover (``ringloop.RunsSchedule``), so a step attends only within
documents and skips pairs of runs that share none. Under the global zigzag the work per rank then
depends on where the documents fall; ``doc-zigzag`` gives every rank a head and a tail of every
document. Under ``doc-zigzag``, with a kernel that has a variable-length form on the device (CUDA), a
step's calls (four per document) are packed into one or two variable-length calls, each document's
pair of chunks a sequence (``methods.core.ringpack``), as ring-flash-attn's zigzag varlen ring does.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .core.documents import Documents
from .core.registry import MethodFacts, register
from .core.ringloop import FULL, RingKernel, ring_attention, ring_backward, ring_forward, zigzag_block
from .core.seqlayout import SequenceLayoutMethod

__all__ = ["FULL", "Ring", "RingKernel", "ring_attention", "ring_backward", "ring_forward", "zigzag_block"]


@register("ring", "Ring Attention: K/V blocks passed around the ring (p2p overlapped), LSE merge, zigzag",
          facts=MethodFacts(column="ring", reference=True))
class Ring(SequenceLayoutMethod):
    honours_documents: ClassVar[bool] = True

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions, docs)
        q, k, v = self.project_qkv(x, cos, sin)
        schedule = self.ring_schedule(self.spec.causal, docs, x.shape[1] * self.world_size)
        out = ring_attention(q, k, v, self.spec.causal, self.kernel, self.scale, self.group, schedule)
        return self.wo(out.flatten(2))
