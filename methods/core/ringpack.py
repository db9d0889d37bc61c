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
3. the blocks are dealt into rounds, each of one kind (causal or not), holding every query row at most
   once and its key rows in order (interval colouring: blocks in order of their first row, each into the
   first round whose rows and keys both ended before its own), so the rows of a round merge into the
   output without overlapping, and rows and keys that lie in one piece are one slice;
4. a round whose rows are the whole local block goes first (the step's output is then its output, with
   nothing to merge).

A round is one ``PackedCall``: the query rows and key rows it takes, in block order, and the cumulative
lengths of its sequences. Rows in one piece in order are taken as a slice (``index`` gives None for the
whole block, a ``slice`` for a part), others are gathered and their result scattered back, which is memory
and traffic. ``doc-zigzag`` holds a rank's part in sections, the real tokens of its head chunks, those of
its tail chunks, then the padding (``layouts.plan_layout``), so the rounds of its ring steps are slices: at
step 0, the causal chunks (the whole block) and the tails against the heads; from an earlier rank, the heads
and then the tails against the held heads; from a later one, the tails against the held heads and then the
held tails; a padding document's blocks, which break those pieces, go to small calls of their own.
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


Rows = torch.Tensor | slice | None  # what a call takes of a block: None (all of it), a slice, or an index


def index(spans: tuple[Span, ...], total: int, device) -> Rows:
    """The rows ``spans`` take of a block of ``total`` rows: None when they are ``[0, total)`` in order, a
    ``slice`` when they are one piece in order (nothing to gather either way), else an int64 index on
    ``device``."""
    piece = _piece(spans)
    if piece is not None:
        return None if piece == (0, total) else slice(*piece)
    rows = np.concatenate([np.arange(start, start + n, dtype=np.int64) for start, n in spans])
    return torch.from_numpy(rows).to(device)


def _piece(spans: tuple[Span, ...]) -> tuple[int, int] | None:
    """``(start, stop)`` when ``spans`` continue one another in order, else None."""
    start = at = spans[0][0]
    for first, n in spans:
        if first != at:
            return None
        at += n
    return start, at


Block = tuple[int, int, int, int, bool]  # (row start, row stop, col start, col stop, causal)


def pack(calls, local_len: int) -> list[PackedCall]:
    """The rounds of ``calls`` (``ringloop.RingBlock`` s of one step over ``local_len`` query rows: rows and
    cols slices with bounds, the causal flag and the kernels' masking keywords), as described in the module
    docstring."""
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
    ends: list[tuple[int, int]] = []  # per round: where its rows and its keys end
    for block in sorted(blocks, key=lambda b: (b[4], b[0], b[2])):
        for i, (kind, members) in enumerate(rounds):
            if kind == block[4] and ends[i][0] <= block[0] and ends[i][1] <= block[2]:
                members.append(block)
                ends[i] = (block[1], block[3])
                break
        else:
            rounds.append((block[4], [block]))
            ends.append((block[1], block[3]))
    packed = [PackedCall(tuple((r0, r1 - r0) for r0, r1, _, _, _ in part),
                         tuple((c0, c1 - c0) for _, _, c0, c1, _ in part), kind)
              for kind, members in rounds for part in _one_piece_apart(members)]
    return sorted(packed, key=lambda call: _piece(call.rows) != (0, local_len))


def _one_piece_apart(members: list[Block]) -> list[list[Block]]:
    """A round cut into its stretches of blocks whose rows and keys both continue one another (one slice
    each): each stretch with at least an eighth of the round's rows is a call of its own, the stray rest
    one more call (gathered), so that a few stray blocks (a padding document's) cost a small gathered call
    instead of gathering the whole round. A round of small pieces stays one gathered call. The eighth bounds
    a round at nine calls."""
    stretches: list[list[Block]] = []
    for b in members:
        if stretches and stretches[-1][-1][1] == b[0] and stretches[-1][-1][3] == b[2]:
            stretches[-1].append(b)
        else:
            stretches.append([b])
    rows = [sum(b[1] - b[0] for b in stretch) for stretch in stretches]
    big = [8 * n >= sum(rows) for n in rows]
    if len(stretches) == 1 or not any(big):
        return [members]
    stray = [b for stretch, keep in zip(stretches, big, strict=True) if not keep for b in stretch]
    return [stretch for stretch, keep in zip(stretches, big, strict=True) if keep] + ([stray] if stray else [])


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
