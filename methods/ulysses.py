"""DeepSpeed-Ulysses: sequence parallelism by two all-to-alls around full-sequence attention.

Each of C ranks projects Q/K/V for its S/C tokens and all heads, the sequence->head
all-to-all gives every rank all S tokens of H/C query heads (and G/C KV heads, or one
replica when G < C), local attention runs there, and the head->sequence all-to-all
brings the output back before the output projection. Plain autograd throughout.

Packed documents (``docs=``): after the all-to-all every rank holds whole documents (all S
tokens, in order) for its heads, so the kernel's document mask over the full sequence is all it
takes; the work stays balanced across ranks whatever the document lengths.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from .core import comm
from .core.base import AttentionMethod, MethodOptions
from .core.documents import Documents
from .core.kernels import attention
from .core.registry import MethodFacts, register
from .core.spec import AttnSpec


def replicated_kv_heads(spec: AttnSpec, replication: int) -> list[int]:
    """KV head index of each effective head when every KV head is replicated ``replication`` times."""
    return [j // replication for j in range(spec.n_kv_heads * replication)]


@register("ulysses", "DeepSpeed-Ulysses: all-to-all seq->heads, attention on H/C heads, all-to-all back",
          facts=MethodFacts(column="ulysses", reference=True))
class Ulysses(AttentionMethod):
    honours_documents: ClassVar[bool] = True
    rank_symmetric_reason = ("its all-to-all gives every rank the whole sequence on H/C heads, so every rank "
                             "allocates the same shapes in the same order")

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: MethodOptions) -> None:
        super().validate(spec, world_size, options)
        cls.check_head_split(spec, world_size, "ulysses")

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        self.kv_heads = replicated_kv_heads(spec, self.check_head_split(spec, self.world_size, "ulysses"))

    @classmethod
    def activation_bytes(
        cls, spec: AttnSpec, seq_len: int, world_size: int, options: MethodOptions,
        batch: int = 1, dtype_bytes: int = 2,
    ) -> int:
        """Peak activation bytes per rank, ``M_ulysses = (5H/C + 2G_e/C) * b*B*S*d``.

        Derivation in methods/upipe.py's docstring (peak while exchanging dout: saved q, k, v,
        out in head layout plus dout with its send and receive buffers).
        """
        c = world_size
        g_eff = spec.n_kv_heads * cls.check_head_split(spec, c, "ulysses")
        unit = dtype_bytes * batch * seq_len * spec.head_dim
        return (5 * spec.n_heads // c + 2 * g_eff // c) * unit

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions, docs)
        q, k, v = self.project_qkv(x, cos, sin, self.kv_heads)
        q, k, v = (comm.seq_to_head(t, self.group) for t in (q, k, v))
        out = attention(q, k, v, self.spec.causal, self.kernel, self.scale, docs=docs)
        out = comm.head_to_seq(out, self.group)
        return self.wo(out.flatten(2))
