"""A ring step's kernel calls packed into variable-length calls, for layouts that cut documents into chunks.

``doc-zigzag`` cuts every document into 2R chunks and gives ring rank r chunks r and 2R-1-r of each, so a
rank holds two runs per document and a ring step pairs them with the two runs of the held K/V block: up to
four kernel calls per document per step (``ringloop.RunsSchedule.blocks``), thousands at a million tokens of
short documents. A kernel with a variable-length form (flash-attn's ``varlen`` functions; torch's flash op
on CUDA) takes them as one call instead, each pair a sequence of its own, which is what ring-flash-attn's
zigzag varlen ring does. ``pack`` turns a step's calls into such calls:

1. each call is cut into its blocks by the kernels' masking rule (``kernels.mask_blocks``): each block is
   unmasked or causal on a square, where every kernel's causal flag means the same;
2. unmasked blocks that continue one another are joined: the same query rows over adjacent keys, or the same
   keys under adjacent query rows (under a causal mask a chunk's rows see the earlier chunk's keys whole);
3. the blocks are dealt into rounds, each of one kind (causal or not) and holding every query row at most
   once (interval colouring: blocks in order of their first row, each into the first round that ended
   before it), so the rows of a round merge into the output without overlapping.

A round is one ``PackedCall``: the query rows and key rows it gathers, in block order, and the cumulative
lengths of its sequences. A round whose rows are the whole local block in order gathers nothing (``index``
says None), as step 0 of ``doc-zigzag`` is (its causal round); the others gather their rows and scatter the
result back, which is the memory and traffic a packed call costs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kernels import mask_blocks

Span = tuple[int, int]  # (first local row, length)


@dataclass(frozen=True)
class PackedCall:
    """One variable-length kernel call of a ring step: sequence ``i`` is query rows ``rows[i]`` of the local
    block against key rows ``cols[i]`` of the held K/V block, causal (on squares) or not."""

    rows: tuple[Span, ...]
    cols: tuple[Span, ...]
    causal: bool

    @property
    def cu_q(self) -> list[int]:
        return _cumulative(self.rows)

    @property
    def cu_k(self) -> list[int]:
        return _cumulative(self.cols)


def _cumulative(spans: tuple[Span, ...]) -> list[int]:
    out = [0]
    for _, n in spans:
        out.append(out[-1] + n)
    return out


def index(spans: tuple[Span, ...], total: int, device) -> torch.Tensor | None:
    """The rows ``spans`` gather, as an int64 index on ``device``; None when they are ``[0, total)`` in
    order (nothing to gather)."""
    if _whole(spans, total):
        return None
    rows = np.concatenate([np.arange(start, start + n, dtype=np.int64) for start, n in spans])
    return torch.from_numpy(rows).to(device)


def _whole(spans: tuple[Span, ...], total: int) -> bool:
    at = 0
    for start, n in spans:
        if start != at:
            return False
        at += n
    return at == total


Block = tuple[int, int, int, int, bool]  # (row start, row stop, col start, col stop, causal)


def pack(calls) -> list[PackedCall]:
    """The rounds of ``calls`` (``ringloop.RingBlock`` s of one step: rows and cols slices with bounds, the
    causal flag and the kernels' masking keywords), as described in the module docstring."""
    blocks: list[Block] = []
    for call in calls:
        r0, c0 = call.rows.start, call.cols.start
        sq, sk = call.rows.stop - r0, call.cols.stop - c0
        for rows, parts in mask_blocks(sq, sk, call.causal, **call.mask):
            for cols, square in parts:
                blocks.append((r0 + rows.start, r0 + rows.stop, c0 + cols.start, c0 + cols.stop, square))
    blocks = _join(sorted(blocks, key=lambda b: (b[4], b[0], b[1], b[2])), rows_fixed=True)
    blocks = _join(sorted(blocks, key=lambda b: (b[4], b[2], b[3], b[0])), rows_fixed=False)
    rounds: list[tuple[bool, list[Block]]] = []
    ends: list[int] = []
    for block in sorted(blocks, key=lambda b: (b[4], b[0], b[2])):
        for i, (kind, members) in enumerate(rounds):
            if kind == block[4] and ends[i] <= block[0]:
                members.append(block)
                ends[i] = block[1]
                break
        else:
            rounds.append((block[4], [block]))
            ends.append(block[1])
    return [PackedCall(tuple((r0, r1 - r0) for r0, r1, _, _, _ in members),
                       tuple((c0, c1 - c0) for _, _, c0, c1, _ in members), kind)
            for kind, members in rounds]


def _join(blocks: list[Block], rows_fixed: bool) -> list[Block]:
    """Unmasked neighbours joined: with ``rows_fixed``, the same rows over adjacent keys (``blocks`` sorted by
    kind, rows, keys); else the same keys under adjacent rows (sorted by kind, keys, rows)."""
    out: list[Block] = []
    for b in blocks:
        if out and not b[4] and not out[-1][4]:
            r0, r1, c0, c1, _ = out[-1]
            if rows_fixed and (r0, r1) == (b[0], b[1]) and c1 == b[2]:
                out[-1] = (r0, r1, c0, b[3], False)
                continue
            if not rows_fixed and (c0, c1) == (b[2], b[3]) and r1 == b[0]:
                out[-1] = (r0, b[1], c0, c1, False)
                continue
        out.append(b)
    return out
