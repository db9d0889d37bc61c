"""Sequence layouts: which tokens of the global sequence each rank holds, and in which order.

Every layout is written once, here, as a pair with one argument order:

* ``<layout>_shard(x, dim, rank, world_size, <layout parameter>)``: this rank's part of a
  full-sequence tensor (a new contiguous tensor);
* ``<layout>_unshard(x, dim, group, <layout parameter>)``: every rank's part gathered in
  rank order and put back in global order (all-gather, no autograd).

Methods call them from their ``shard``/``unshard``. Tokens carry their global positions
(RoPE uses them), so a layout never changes a method's result, only which rank computes
what; it exists for the attention schedule (causal load balance, a pipeline of chunks).
The sequence length must be a multiple of the layout's granularity: the method's
``check_seq_len`` says so before any of these is called.

Layouts (C ranks, sequence length S):

* contiguous: rank r holds tokens ``[r*S/C, (r+1)*S/C)``. Ulysses, UPipe, offload and the
  default of ``AttentionMethod``.
* zigzag over a ring of R ranks: the sequence is cut into 2R chunks and ring rank j holds
  chunks j and 2R-1-j, in that order, which balances causal work around the ring; that
  order is then split contiguously into the C ranks. Ring and ring-flash-attn use R = C;
  USP uses its ring degree (C = R * ulysses_degree, see ``methods/usp.py``).
* cyclic (FPDT's): C*K chunks, global chunk c on rank c % C, so rank r holds chunks
  ``r, r+C, ..., r+(K-1)C`` in that order (K = ``num_chunks``; K = 1 is contiguous).
"""
from __future__ import annotations

import torch

from . import comm


# ----------------------------------------------------------------------- contiguous
def contiguous_shard(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous ``1/world_size`` of ``x`` along ``dim``."""
    return x.chunk(world_size, dim=dim)[rank].contiguous()


def contiguous_unshard(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Inverse of ``contiguous_shard``: every rank's part concatenated in rank order."""
    return comm.all_gather_cat(x, group, dim)


# ----------------------------------------------------------------------- zigzag
def zigzag_multiple(ring_size: int) -> int:
    """The sequence length must be a multiple of this for the zigzag layout (2R chunks)."""
    return 2 * ring_size if ring_size > 1 else 1


def zigzag_index(seq_len: int, ring_size: int, device=None) -> torch.Tensor:
    """Global token order of the layout: ring rank j's part is chunk j then chunk 2R-1-j."""
    if ring_size == 1:
        return torch.arange(seq_len, device=device)
    chunks = torch.arange(seq_len, device=device).chunk(2 * ring_size)
    return torch.cat([chunks[i] for j in range(ring_size) for i in (j, 2 * ring_size - 1 - j)])


def zigzag_shard(
    x: torch.Tensor, dim: int, rank: int, world_size: int, ring_size: int | None = None
) -> torch.Tensor:
    """This rank's tokens: the zigzag order over ``ring_size`` ranks (None: ``world_size``),
    split contiguously into ``world_size`` parts."""
    ring = world_size if ring_size is None else ring_size
    index = zigzag_index(x.shape[dim], ring, x.device).chunk(world_size)[rank]
    return x.index_select(dim, index)


def zigzag_unshard(x: torch.Tensor, dim: int, group, ring_size: int | None = None) -> torch.Tensor:
    """Inverse of ``zigzag_shard``: gather in rank order, then undo the zigzag order."""
    ring = comm.world(group)[0] if ring_size is None else ring_size
    full = comm.all_gather_cat(x, group, dim)
    return full.index_select(dim, torch.argsort(zigzag_index(full.shape[dim], ring, full.device)))


# ----------------------------------------------------------------------- cyclic chunks
def cyclic_shard(x: torch.Tensor, dim: int, rank: int, world_size: int, num_chunks: int) -> torch.Tensor:
    """Rank ``rank``'s chunks ``rank, rank+C, ...`` of ``x`` along ``dim``, in that order."""
    cs = x.shape[dim] // (world_size * num_chunks)
    parts = x.unflatten(dim, (num_chunks, world_size, cs)).select(dim + 1, rank)
    return parts.flatten(dim, dim + 1).contiguous()


def cyclic_unshard(x: torch.Tensor, dim: int, group, num_chunks: int) -> torch.Tensor:
    """Inverse of ``cyclic_shard``: gather in rank order, then interleave the ranks' chunks."""
    world_size = comm.world(group)[0]
    full = comm.all_gather_cat(x, group, dim)
    cs = full.shape[dim] // (world_size * num_chunks)
    return full.unflatten(dim, (world_size, num_chunks, cs)).transpose(dim, dim + 1).flatten(dim, dim + 2)
