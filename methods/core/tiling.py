"""Sequence tiles of a tiled op: their bounds, and the ones a simulation needs to run.

Shared by the step's tiled MLP, norms and loss (``bench.model.decoder``) and by the methods'
own tiled work (``methods.core.normtile``), which cannot import the bench.

A simulation runs a few tiles for all of them (``tiles_to_run``): right for memory, wrong for
what the step *executes*. So a loop iterates ``run_tiles``, which, while a tile's body runs,
says how many tiles it stands for (``counted_as``); the step's counters
(``bench.measure.stepcount``: FLOPs, memory traffic, host copies) multiply what they count by it.
FPDT's chunk-pair loops do the same with ``items_to_run`` and ``counting_as`` (at the paper's
64K-token chunks a 4M-token step has 2080 pairs per block and pass, which made its simulation
the longest of ``python -m bench fidelity``); the collectives, which ``CommCounter`` does not
weigh, stay outside the skipped items.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_local = threading.local()


def counted_as() -> int:
    """How many tiles the work now running stands for (1 outside a skipped-tile loop; nested loops multiply)."""
    return getattr(_local, "weight", 1)


def tiles_to_run(sizes: list[int], fake: bool) -> list[int]:
    """Indices of the tiles/chunks a loop must process.

    Real tensors: all. Fake tensors (simulation): the first tile creates the gradient
    accumulators, and from the second on every tile of the same size allocates and frees
    exactly the same bytes next to them, so the first two tiles and the last (when its size
    differs) give the same peak as all of them, for a fraction of the simulation time.
    """
    if not fake or len(sizes) <= 3:
        return list(range(len(sizes)))
    return [0, 1] if sizes[-1] == sizes[1] else [0, 1, len(sizes) - 1]


def tile_weights(sizes: list[int], fake: bool) -> list[int]:
    """For each tile of ``tiles_to_run``, how many tiles it stands for: the second stands for every
    tile up to the last (or up to the shorter last one, which runs itself); they sum to ``len(sizes)``."""
    run = tiles_to_run(sizes, fake)
    if len(run) == len(sizes):
        return [1] * len(run)
    return [1, len(sizes) - 1] if len(run) == 2 else [1, len(sizes) - 2, 1]


@contextlib.contextmanager
def counting_as(weight: int) -> Iterator[None]:
    """Within the block, the work stands for ``weight`` items (times the enclosing loop's; ``counted_as``)."""
    outer = counted_as()
    _local.weight = outer * weight
    try:
        yield
    finally:
        _local.weight = outer


def run_tiles(sizes: list[int], fake: bool) -> Iterator[int]:
    """``tiles_to_run``'s indices, each yielded with ``counted_as`` set to its ``tile_weights``
    (times the enclosing loop's) while the caller's loop body runs."""
    for i, weight in zip(tiles_to_run(sizes, fake), tile_weights(sizes, fake), strict=False):
        with counting_as(weight):
            yield i


def items_to_run(n: int, fake: bool, tail: int = 1) -> list[tuple[int, int]]:
    """``(index, weight)`` of the items of a loop of ``n`` identical-shaped items that a simulation runs.

    For loops whose first item differs (it creates an accumulator), whose middle items each allocate
    and free the same bytes, and whose last ``tail`` items differ again (no prefetch of a next item,
    a causal diagonal block): the first, the second standing for every middle item (its weight), and
    the last ``tail``. Real tensors: every item, weight 1. The weights sum to ``n``.
    """
    if not fake or n <= 2 + tail:
        return [(i, 1) for i in range(n)]
    return [(0, 1), (1, n - 1 - tail)] + [(i, 1) for i in range(n - tail, n)]


def tile_bounds(n: int, tiles: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``tiles`` near-equal tiles of ``n`` (``tensor_split``'s sizes)."""
    base, extra = divmod(n, tiles)
    out, start = [], 0
    for i in range(tiles):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out
