"""The single-device attention block: the ground truth every method is checked against.

Plain autograd, whole sequence on one device, RoPE with the given positions, GQA through
the kernel's native head mapping (query head ``i`` uses KV head ``i // (H/G)``). With packed
documents (``docs=``), attention stays within each document (causal inside it when the spec
is), and without ``positions`` RoPE takes each token's position inside its document.
"""
from __future__ import annotations

import torch

from .base import AttentionParams
from .documents import Documents
from .kernels import Kernel, attention, get_kernel
from .spec import AttnSpec


class AttentionBlock(AttentionParams):
    """Reference attention block, ``[B, S, dim] -> [B, S, dim]``."""

    def __init__(self, spec: AttnSpec, kernel: str | None = "math") -> None:
        super().__init__(spec)
        self.kernel: Kernel = get_kernel(kernel)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, docs: Documents | None = None
    ) -> torch.Tensor:
        if docs is not None:
            if not isinstance(docs, Documents):
                raise ValueError(f"docs must be a methods.Documents (Documents.from_lengths([...])), got {docs!r}")
            docs.check_seq_len(x.shape[1], "the reference block's input")
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device) if docs is None else docs.positions(x.device)
        cos, sin = self.rope(positions, x.dtype)
        q, k, v = self.project_qkv(x, cos, sin)
        out = attention(q, k, v, self.spec.causal, self.kernel, docs=docs)
        return self.wo(out.flatten(2))
