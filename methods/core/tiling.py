"""Sequence tiles of a tiled op: their bounds, and the ones a simulation needs to run.

Shared by the step's tiled MLP, norms and loss (``bench.model.decoder``) and by the methods'
own tiled work (``methods.core.normtile``), which cannot import the bench.
"""
from __future__ import annotations


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


def tile_bounds(n: int, tiles: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``tiles`` near-equal tiles of ``n`` (``tensor_split``'s sizes)."""
    base, extra = divmod(n, tiles)
    out, start = [], 0
    for i in range(tiles):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out
