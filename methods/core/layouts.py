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
* cyclic: C*K chunks, global chunk c on rank c % C, so rank r holds chunks
  ``r, r+C, ..., r+(K-1)C`` in that order (K = ``num_chunks``; K = 1 is contiguous). FPDT's
  chunk order, and with one-token chunks the strided layout below.
* strided: rank r holds tokens ``r, r+C, r+2C, ...`` (striped attention's layout: every rank's
  tokens are spread evenly over the sequence, so causal work is balanced token by token).

Layouts as runs. For a method that masks by global position (a ring step with documents, a
layout chosen by option) every layout is also a list of runs: ``(first global position, length)``
in the order the tokens sit, over the whole sequence (``global_runs``), split into the ranks'
parts by ``split_runs``. ``plan_layout`` builds such a plan for a layout named by option
(``SEQUENCE_LAYOUTS``), including the per-document head-tail layout, which cuts every document
into 2R chunks (R ring ranks, ring rank j holding chunks j and 2R-1-j of each document) and may
pad documents to a multiple of 2R: padding tokens are zero inputs in documents of their own
(``LayoutPlan.docs``), so no real token sees them, and ``LayoutPlan.unshard`` drops them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import comm
from .documents import Documents


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


# ----------------------------------------------------------------------- strided
def strided_shard(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s tokens ``rank, rank+C, rank+2C, ...`` of ``x`` along ``dim`` (one-token cyclic chunks)."""
    return cyclic_shard(x, dim, rank, world_size, x.shape[dim] // world_size)


def strided_unshard(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Inverse of ``strided_shard``: gather in rank order, then interleave the ranks' tokens."""
    return cyclic_unshard(x, dim, group, x.shape[dim])


# ----------------------------------------------------------------------- runs and plans
Run = tuple[int, int]  # (first global position, length)
SEQUENCE_LAYOUTS = ("contiguous", "zigzag", "doc-zigzag")


def split_runs(runs: list[Run], parts: int) -> list[list[Run]]:
    """The concatenation of ``runs`` cut into ``parts`` equal contiguous pieces, each as runs."""
    total = sum(n for _, n in runs)
    size = total // parts
    out: list[list[Run]] = [[] for _ in range(parts)]
    at = 0  # position in the concatenation
    for start, n in runs:
        while n:
            part = at // size
            take = min(n, (part + 1) * size - at)
            out[part].append((start, take))
            start, n, at = start + take, n - take, at + take
    return out


def merge_runs(runs: list[Run]) -> list[Run]:
    """Adjacent runs that continue one another joined into one."""
    out: list[Run] = []
    for start, n in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((start, n))
    return out


def zigzag_runs(seq_len: int, ring_size: int, start: int = 0) -> list[Run]:
    """The zigzag order of ``seq_len`` tokens from ``start`` over ``ring_size`` ring ranks, as runs."""
    if ring_size == 1:
        return [(start, seq_len)]
    c = seq_len // (2 * ring_size)
    return [(start + i * c, c) for j in range(ring_size) for i in (j, 2 * ring_size - 1 - j)]


@dataclass(frozen=True)
class LayoutPlan:
    """Where every token sits under one layout: the sequence (padded, when the layout pads) in the
    order of the ranks' parts.

    * ``order``: runs of positions of the padded sequence, rank 0's tokens first; the first
      ``len / world_size`` tokens of the concatenation are rank 0's, and so on;
    * ``docs``: the documents of the padded sequence (padding in documents of its own), or None;
    * ``real``: per padded document, the position of its first token in the given sequence, or
      -1 for a padding document (None without documents: no padding);
    * ``padding``: how many padding tokens the layout adds (0 but for ``doc-zigzag`` with padding).
    """

    order: tuple[Run, ...]
    world_size: int
    docs: Documents | None = None
    real: tuple[int, ...] | None = None
    padding: int = 0

    @property
    def padded_len(self) -> int:
        return sum(n for _, n in self.order)

    @property
    def local_len(self) -> int:
        return self.padded_len // self.world_size

    def rank_runs(self, rank: int, parts: int | None = None) -> list[Run]:
        """Runs of the padded positions held by part ``rank`` of ``parts`` (None: the world size)."""
        return merge_runs(split_runs(list(self.order), parts or self.world_size)[rank])

    def source_index(self, device=None) -> torch.Tensor:
        """Per token in the ranks' order, its index in the given sequence (padding: that sequence's length)."""
        padded = torch.cat([torch.arange(s, s + n) for s, n in self.order])
        if not self.padding:
            return padded.to(device)
        ids = self.docs.doc_ids()[padded]
        real, starts = torch.tensor(self.real)[ids], torch.tensor(self.docs.starts)[ids]
        return torch.where(real >= 0, padded - starts + real, self.padded_len - self.padding).to(device)

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s tokens of the full sequence ``x``; padding tokens are zeros."""
        index = self.source_index(x.device).chunk(self.world_size)[rank]
        if self.padding:
            x = torch.cat([x, torch.zeros_like(x.narrow(dim, 0, 1))], dim=dim)
        return x.index_select(dim, index)

    def unshard(self, x: torch.Tensor, dim: int, group) -> torch.Tensor:
        """Inverse of ``shard``: every rank's part gathered, padding dropped, in global order."""
        full = comm.all_gather_cat(x, group, dim)
        source = self.source_index(full.device)
        keep = torch.nonzero(source < full.shape[dim] - self.padding).flatten() if self.padding else None
        if keep is not None:
            full, source = full.index_select(dim, keep), source[keep]
        return full.index_select(dim, torch.argsort(source))


def layout_multiple(layout: str, ring_size: int, world_size: int) -> int:
    """The sequence length must be a multiple of this under ``layout`` without padding."""
    if layout == "contiguous" or ring_size == 1:
        return world_size
    return math.lcm(2 * ring_size, world_size)


def check_layout(layout: str, who: str) -> None:
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(f"{who}: unknown sequence layout {layout!r}; choose one of {list(SEQUENCE_LAYOUTS)}")


@functools.lru_cache(maxsize=64)
def check_local_share(who: str, layout: str, plan: LayoutPlan, docs: Documents, local_len: int) -> None:
    """A block call's check that ``local_len`` tokens on this rank are ``plan``'s share of ``docs``
    (``layout``: how the message names the layout); one line that says how to shard."""
    if plan.local_len != local_len:
        raise ValueError(
            f"{who}: the input has {local_len} tokens on this rank, but the {layout} of these {docs.seq_len} "
            f"tokens puts {plan.local_len} on each rank ({plan.padding} padding tokens); shard it with the "
            f"method's shard(x, dim, docs=docs)"
        )


def plan_layout(
    layout: str, seq_len: int, ring_size: int, world_size: int, docs: Documents | None = None, pad: bool = True,
    who: str = "this method", interleaved: bool = False,
) -> LayoutPlan:
    """The plan of ``layout`` for a sequence of ``seq_len`` tokens (with ``docs``, its documents)
    over a ring of ``ring_size`` ranks whose parts are split contiguously into ``world_size`` ranks.

    ``contiguous`` and ``zigzag`` need ``seq_len`` a multiple of ``layout_multiple``; so does
    ``doc-zigzag`` without documents (it is then ``zigzag``). With documents ``doc-zigzag`` cuts each
    document into 2R chunks; with ``pad`` it pads each to a multiple of 2R (and the whole to a
    multiple of ``layout_multiple`` with a trailing padding document), without ``pad`` it refuses
    lengths that would need padding. Every refusal is one line naming the fix.

    ``doc-zigzag``'s order within a ring rank's part (``_sectioned_order``): the real tokens of its head
    chunks, those of its tail chunks, then the padding, so that a ring step's packed calls take their rows
    and keys as slices (``ringpack``: no gather of rows and no scatter of results); with ``interleaved``,
    each document's head and tail side by side with its padding, the order ring-flash-attn's varlen zigzag
    expects. Either order gives every rank the same tokens.
    """
    check_layout(layout, who)
    multiple = layout_multiple(layout, ring_size, world_size)
    if layout != "doc-zigzag" or docs is None or ring_size == 1 and seq_len % world_size == 0:
        if seq_len % multiple:
            fix = ("pad or trim the sequence" if layout != "doc-zigzag" or docs is None
                   else "give documents with pad=True")
            raise ValueError(
                f"{who}: sequence length {seq_len} is not divisible by {multiple}, which the {layout!r} layout needs "
                f"at world size {world_size}; {fix} to a multiple of {multiple}"
            )
        order = [(0, seq_len)] if layout == "contiguous" else zigzag_runs(seq_len, ring_size)
        return LayoutPlan(tuple(order), world_size, docs)
    docs.check_seq_len(seq_len)
    two_r = 2 * ring_size
    short = [n for n in docs.lengths if n % two_r]
    if short and not pad:
        raise ValueError(
            f"{who}: the 'doc-zigzag' layout cuts every document into {two_r} chunks, but {len(short)} document "
            f"length(s) are not divisible by {two_r} (e.g. {short[0]}); allow padding (pad=True) or give lengths "
            f"that are multiples of {two_r}"
        )
    groups: list[tuple[int, int, int]] = []  # each document with its padding: (padded start, padded length, real)
    lengths: list[int] = []
    real: list[int] = []  # per padded document: its first token in the given sequence, -1 for padding
    for n, start in zip(docs.lengths, docs.starts, strict=True):
        groups.append((sum(lengths), n + -n % two_r, n))
        lengths.append(n)
        real.append(start)
        if n % two_r:
            lengths.append(-n % two_r)
            real.append(-1)
    tail = -sum(lengths) % multiple
    if tail and not pad:
        raise ValueError(
            f"{who}: the 'doc-zigzag' layout needs the sequence length ({seq_len}) to be a multiple of {multiple} "
            f"at world size {world_size}; allow padding (pad=True) or pad the sequence"
        )
    if tail:
        groups.append((sum(lengths), tail, 0))
        lengths.append(tail)
        real.append(-1)
    padded = Documents.from_lengths(lengths)
    order = (_interleaved_order if interleaved else _sectioned_order)(groups, ring_size)
    return LayoutPlan(tuple(merge_runs(order)), world_size, padded, tuple(real), padded.seq_len - seq_len)


def _interleaved_order(groups: list[tuple[int, int, int]], ring_size: int) -> list[Run]:
    """Ring rank j takes chunks j and 2R-1-j of every document with its padding, side by side, documents in
    order (``zigzag_runs`` lists the chunks ring rank by ring rank)."""
    return [run for j in range(ring_size) for start, n, _ in groups
            for run in zigzag_runs(n, ring_size, start)[2 * j: 2 * j + 2]]


def _sectioned_order(groups: list[tuple[int, int, int]], ring_size: int) -> list[Run]:
    """Ring rank j's chunks j and 2R-1-j of every document in three sections: the real tokens of its head
    chunks, those of its tail chunks, then the padding of both. Documents go in the same order in every
    section and on every rank: by how many of their 2R chunks hold a real token, most first (then in order),
    so that for every chunk the documents whose chunk holds real tokens come first. A ring step's rows then
    meet their held keys in one piece per section (``ringpack``)."""
    def cut(start: int, n: int, real_n: int) -> list[tuple[Run, Run]]:
        """Each chunk's (real part, padding part)."""
        parts = []
        for first, c in zigzag_runs(n, ring_size, start):
            keep = min(max(start + real_n - first, 0), c)
            parts.append(((first, keep), (first + keep, c - keep)))
        return parts

    chunks = [cut(*g) for g in groups]
    ranked = sorted(range(len(groups)), key=lambda g: -sum(1 for part, _ in chunks[g] if part[1]))
    order: list[Run] = []
    for j in range(ring_size):
        mine = [2 * j, 2 * j + 1] if ring_size > 1 else [0]
        order += [chunks[g][i][0] for i in mine for g in ranked]
        order += [chunks[g][i][1] for i in mine for g in ranked]
    return [run for run in order if run[1]]
