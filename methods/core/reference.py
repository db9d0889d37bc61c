"""The single-device attention block: the ground truth every method is checked against.

Plain autograd, whole sequence on one device, RoPE with the given positions, GQA through
the kernel's native head mapping (query head ``i`` uses KV head ``i // (H/G)``).
"""
from __future__ import annotations

import torch

from .base import AttentionParams
from .kernels import Kernel, attention, get_kernel
from .spec import AttnSpec


class AttentionBlock(AttentionParams):
    """Reference attention block, ``[B, S, dim] -> [B, S, dim]``."""

    def __init__(self, spec: AttnSpec, kernel: str | None = "math") -> None:
        super().__init__(spec)
        self.kernel: Kernel = get_kernel(kernel)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = self.rope(positions, x.dtype)
        q, k, v = self.project_qkv(x, cos, sin)
        out = attention(q, k, v, self.spec.causal, self.kernel)
        return self.wo(out.flatten(2))
