"""Rotary position embedding (rotate-half form) applied with explicit global positions.

Every method applies RoPE to the tokens it holds using their *global* positions, so a
method's sequence layout (contiguous, zigzag, ...) never changes the result. Angles are
computed in fp32 and the rotation is applied in the input dtype.
"""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """``cos, sin`` of shape ``[S, 1, head_dim // 2]`` for BSHD broadcasting."""
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def rope_table(seq_len: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """A precomputed table of every position's rotation, ``complex64 [seq_len, head_dim // 2]``
    (``cos + i sin``), as TorchTitan's Llama keeps it: its ``freqs_cis`` buffer covers the
    whole training sequence (``training.seq_len``) on every rank, unsharded. Angles as
    ``rope_cos_sin`` computes them, so the values agree with it."""
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.polar(torch.ones_like(angles), angles)


def rope_cos_sin_from_table(table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """``cos, sin`` (``[S, 1, head_dim // 2]``) of ``positions`` looked up in a ``rope_table``."""
    rows = table[positions]
    return rows.real.to(dtype)[:, None, :], rows.imag.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[B, S, h, d]``) by the given angles; differentiable."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
