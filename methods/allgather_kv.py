"""All-gather K/V context parallelism (Llama 3's): every rank attends its own queries to the whole K/V.

Each rank projects Q, K and V for its tokens (every head), all-gathers K and V along the sequence
(``comm.all_gather_seq``; its backward is a reduce-scatter, which sums every rank's dK/dV for this
rank's tokens into its own projections) and attends its queries to all of it. The gathered K/V is
in the layout's order (rank 0's tokens, then rank 1's, ...), so the attention is masked by global
position: one kernel call per pair of a local query run and a gathered key run that can see one
another (``ringloop.RunsSchedule`` with ``keys``, run as a one-step ring on one device, so the calls
merge in fp32 and the backward gets each row's final LSE). Under ``doc-zigzag`` on a kernel with a
variable-length form (CUDA) those calls are packed into a few variable-length ones (``methods.core.ringpack``).

Layout (``methods.core.seqlayout``, an option): ``zigzag`` by default, the head-tail layout Llama 3
uses to balance causal work (rank r holds chunks r and 2C-1-r); ``contiguous``; ``doc-zigzag``.

Packed documents (``docs=``): Llama 3 chose this method for document masks. Every rank holds the
whole sequence's K/V, so each query attends within its own document with the same kernels' rule;
nothing travels per step. What it pays: every rank holds and saves ``2 * S * G * d`` K/V values per
block (cheap with few KV heads), and the work per rank follows where the documents fall.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .core import comm
from .core.documents import Documents
from .core.registry import MethodFacts, register
from .core.ringloop import ring_attention
from .core.seqlayout import SequenceLayoutMethod


# facts: ours, outside the paper's columns (the defaults, stated)
@register("allgather-kv", "Llama 3 CP: all-gather K/V along the sequence, local queries attend to all of it",
          facts=MethodFacts(column=None, library="ours"))
class AllGatherKV(SequenceLayoutMethod):
    honours_documents: ClassVar[bool] = True
    passes_kv_by_steps: ClassVar[bool] = False

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions, docs)
        q, k, v = self.project_qkv(x, cos, sin)  # [B, n, heads, d]: this rank's tokens, every head
        k = comm.all_gather_seq(k, self.group, dim=1)  # [B, S, G, d] on every rank, in layout order
        v = comm.all_gather_seq(v, self.group, dim=1)
        schedule = self.gathered_schedule(self.spec.causal, docs, x.shape[1] * self.world_size)
        out = ring_attention(q, k, v, self.spec.causal, self.kernel, self.scale, None, schedule)
        return self.wo(out.flatten(2))
