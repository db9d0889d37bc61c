"""No context parallelism: every rank attends over the whole sequence on its own.

The baseline of the paper's Fig. 1 ladder (docs/paper.md, "Fig. 1: memory breakdown"): its
"FSDP" bar shards the model over the 8 GPUs with FSDP but splits no sequence, so each GPU holds
all 3M tokens' activations. This method is that attention: the single-device block
(``methods.core.reference.AttentionBlock``'s computation, through the chosen kernel) built on a
group of one whatever group it is given. The group a training step passes still serves FSDP
(``bench.training.step`` shards parameters over the trial's group, not the method's), so a
trial of ``no-cp`` on 8 ranks with ``fsdp=True`` is FSDP over 8 ranks with the full sequence
on each: data parallelism over identical inputs.

Because the method's own world is one rank, ``shard``/``unshard`` are the identity and the
sequence length needs no multiple; ``splits_sequence`` is False so that callers comparing
weight gradients do not sum them over the group (each rank already has the full gradient).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .core.base import AttentionMethod, MethodOptions
from .core.documents import Documents
from .core.kernels import attention
from .core.registry import MethodFacts, PaperRun, register
from .core.spec import AttnSpec


@register("no-cp", "No context parallelism: each rank attends over the whole sequence (the paper's Fig. 1 "
          "'FSDP' bar: FSDP over the group, no sequence split)",
          facts=MethodFacts(column="fsdp", reference=True, paper_code=True, simulates=(PaperRun("fsdp"),)))
class NoCP(AttentionMethod):
    splits_sequence: ClassVar[bool] = False
    honours_documents: ClassVar[bool] = True  # the kernel's document mask over the whole sequence
    rank_symmetric_reason = "every rank attends the whole sequence: the same work and shapes on every rank"

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        # a world of one: the group (if any) is the training step's, for FSDP, never this method's
        super().__init__(spec, None, **options)

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: MethodOptions) -> None:
        super().validate(spec, 1, options)

    @classmethod
    def seq_multiple(cls, world_size: int, options: MethodOptions) -> int:
        return 1

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions, docs)
        q, k, v = self.project_qkv(x, cos, sin)
        out = attention(q, k, v, self.spec.causal, self.kernel, self.scale, docs=docs)
        return self.wo(out.flatten(2))
