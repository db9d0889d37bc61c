"""An input RMSNorm folded into a method's projections, tile by tile over the sequence.

A pre-norm block computes ``a = rms_norm(x)`` and hands ``a`` to the attention, which saves it
for backward: a full-length ``[B, S/C, D]`` tensor besides the block input ``x`` (which the
checkpoint keeps anyway). Folding the norm into the method (``fused_attn_norm``, used by
``upipe``) lets the method save ``x`` alone and rebuild ``rms_norm(x)`` one sequence tile at a
time wherever it reads ``a``: each projection ``a @ w.T``, each weight gradient ``dt.T @ a``,
and finally the norm's own backward, which turns the accumulated ``da`` into ``dx`` in place.
Only one tile of ``a`` (``tile`` tokens x D) exists at a time. Cost: the norm (elementwise,
cheap next to the GEMMs) is recomputed once per projection.

Tiles follow the paper's (ALST) tiled-MLP rule, ``ceil(local tokens / D)`` tiles of about D
tokens, iterated by ``methods.core.tiling.run_tiles`` (every tile, unless a simulation has
switched on its compression of identical tiles).
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .tiling import run_tiles, tile_bounds


def _bounds(n: int, dim: int) -> Iterator[tuple[int, int]]:
    bounds = tile_bounds(n, max(1, math.ceil(n / dim)))
    for i in run_tiles([length for _, length in bounds]):
        yield bounds[i]


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """``rms_norm(x) @ weight.T`` for ``x`` of shape ``[B, n, D]``, one sequence tile at a time."""
    b, n, dim = x.shape
    out = x.new_empty(b, n, weight.shape[0])
    for start, length in _bounds(n, dim):
        out.narrow(1, start, length).copy_(F.linear(_norm(x.narrow(1, start, length), norm_weight, eps), weight))
    return out


def norm_weight_grad(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, dt: torch.Tensor) -> torch.Tensor:
    """``dt.T @ rms_norm(x)`` (the gradient of ``weight`` in ``norm_linear``), ``dt``: ``[B*n, rows]``."""
    b, n, dim = x.shape
    dt3 = dt.view(b, n, -1)
    acc = x.new_zeros(dt.shape[1], dim)
    for start, length in _bounds(n, dim):
        a = _norm(x.narrow(1, start, length), norm_weight, eps).reshape(-1, dim)
        acc.addmm_(dt3.narrow(1, start, length).reshape(-1, dt.shape[1]).t(), a)
    return acc


def norm_backward_(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, da: torch.Tensor) -> torch.Tensor:
    """Turn ``da`` (the gradient of ``rms_norm(x)``) into ``dx`` in place, tile by tile, and return
    the norm weight's gradient."""
    dim = x.shape[-1]
    dw = torch.zeros_like(norm_weight)
    for start, length in _bounds(x.shape[1], dim):
        leaf = x.narrow(1, start, length).detach().requires_grad_()
        w = norm_weight.detach().requires_grad_()
        with torch.enable_grad():
            y = _norm(leaf, w, eps)
        gx, gw = torch.autograd.grad(y, [leaf, w], da.narrow(1, start, length))
        da.narrow(1, start, length).copy_(gx)
        dw.add_(gw)
        del y, gx, gw, leaf, w
    return dw
