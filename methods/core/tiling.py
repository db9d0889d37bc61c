"""Loops over identical tiles or chunk pairs: which iterations run, and how many each stands for.

Shared by the step's tiled MLP, norms and loss (``bench.model.decoder``), by the methods' own
tiled work (``methods.core.normtile``) and by FPDT's chunk-pair loops (``methods.fpdt``), which
cannot import the bench.

One mechanism, one policy. Such a loop always iterates a helper of this module: ``run_tiles``
(tiles of a sequence, by their sizes) or ``repeated`` (items of which the loop says which are
alike). By default the helpers yield every iteration with weight 1, so a loop runs exactly as
written. A simulation, whose tensors carry shapes but no values, switches the policy on
(``compressing_repeats``, entered by ``bench.measure.simulate.fake_tensors``): the identical
middle iterations then run once, standing for all of them, which gives the same peak memory
(they allocate and free the same bytes) for a fraction of the time. The loops themselves never
ask whether they are simulated.

What a compressed loop executes is then short of the full loop's, so while an iteration's body
runs, ``counted_as`` says how many iterations it stands for (``counting_as``; nested loops
multiply), and the step's counters (``bench.stackmodel.stepcount``: FLOPs, memory traffic, host
copies) multiply what they count by it. The weight is per thread: the body and the counters
that see its operators run on the same thread (an autograd engine thread, in a backward), so a
loop on one thread never weighs another's counts. The policy is per process, as the simulated
host (``methods.core.hostmem``): it must hold on the autograd engine's threads as well.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_local = threading.local()
_COMPRESS = False  # the policy: compress identical middle iterations (a simulation) or run them all


def compressing() -> bool:
    """Whether the loop helpers compress identical iterations now (``compressing_repeats``)."""
    return _COMPRESS


@contextlib.contextmanager
def compressing_repeats() -> Iterator[None]:
    """Within the block, ``run_tiles`` and ``repeated`` run one iteration for the identical middle
    ones and weigh it by their count. Only for tensors without values (a simulation): real tensors
    would compute wrong results."""
    global _COMPRESS
    previous, _COMPRESS = _COMPRESS, True
    try:
        yield
    finally:
        _COMPRESS = previous


def counted_as() -> int:
    """How many iterations the work now running stands for (1 outside a compressed loop; nested loops multiply)."""
    return getattr(_local, "weight", 1)


@contextlib.contextmanager
def counting_as(weight: int) -> Iterator[None]:
    """Within the block, the work stands for ``weight`` items (times the enclosing loop's; ``counted_as``)."""
    outer = counted_as()
    _local.weight = outer * weight
    try:
        yield
    finally:
        _local.weight = outer


def items_to_run(n: int, compress: bool, tail: int = 1) -> list[tuple[int, int]]:
    """``(index, weight)`` of the items of a loop of ``n`` identical-shaped items that run.

    For loops whose first item differs (it creates an accumulator), whose middle items each allocate
    and free the same bytes, and whose last ``tail`` items differ again (no prefetch of a next item,
    a causal diagonal block). ``compress``: the first, the second standing for every middle item (its
    weight), and the last ``tail``. Otherwise (or when there is no middle to compress): every item,
    weight 1. The weights sum to ``n``.
    """
    if not compress or n <= 2 + tail:
        return [(i, 1) for i in range(n)]
    return [(0, 1), (1, n - 1 - tail)] + [(i, 1) for i in range(n - tail, n)]


def tile_items(sizes: list[int], compress: bool) -> list[tuple[int, int]]:
    """``(index, weight)`` of the tiles of sizes ``sizes`` that run.

    ``compress``: the first tile creates the gradient accumulators, and from the second on every
    tile of the same size allocates and frees exactly the same bytes next to them, so the first two
    tiles (the second standing for every tile up to the last) and the last, when its size differs,
    give the same peak as all of them. Up to 3 tiles, or without ``compress``: every tile, weight 1.
    """
    if not compress or len(sizes) <= 3:
        return [(i, 1) for i in range(len(sizes))]
    return items_to_run(len(sizes), True, tail=0 if sizes[-1] == sizes[1] else 1)


def tiles_to_run(sizes: list[int], compress: bool) -> list[int]:
    """Indices of ``tile_items``."""
    return [i for i, _ in tile_items(sizes, compress)]


def tile_weights(sizes: list[int], compress: bool) -> list[int]:
    """Weights of ``tile_items``: how many tiles each tile that runs stands for; they sum to ``len(sizes)``."""
    return [w for _, w in tile_items(sizes, compress)]


def run_tiles(sizes: list[int], compress: bool | None = None) -> Iterator[int]:
    """The indices of ``tile_items`` under the policy (``compress=None``; a bool overrides it),
    each yielded with ``counted_as`` set to its weight (times the enclosing loop's) while the
    caller's loop body runs."""
    for i, weight in tile_items(sizes, compressing() if compress is None else compress):
        with counting_as(weight):
            yield i


def repeated(n: int, tail: int = 1, alike: bool = True) -> list[tuple[int, int]]:
    """``(index, weight)`` of the items of a loop of ``n`` that run under the policy (``items_to_run``).

    ``tail``: how many last items differ from the middle ones; ``alike=False``: the loop's middle
    items are not interchangeable here (they run whatever the policy). A list, so that a loop can
    look ahead (prefetch the next item under its weight); the caller runs each item's work under
    ``counting_as(weight)``.
    """
    return items_to_run(n, alike and compressing(), tail)


def tile_bounds(n: int, tiles: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``tiles`` near-equal tiles of ``n`` (``tensor_split``'s sizes)."""
    base, extra = divmod(n, tiles)
    out, start = [], 0
    for i in range(tiles):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out
