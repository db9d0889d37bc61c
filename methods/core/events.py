"""Counts of method-level events that a step's counters read (``bench.stackmodel.stepcount``).

Some costs of a method are neither FLOPs, bytes nor collectives, but a number of times a
piece of its schedule runs: a chunk pipeline such as DeepSpeed's FPDT synchronises the host
with the device at every chunk it processes, whatever the chunk's size. The method says so
with ``note`` where that piece runs; ``counting`` collects the notes of the code under it. The
methods cannot import the bench, so the counter lives here and the bench reads it.

The counter is the process's, not the thread's: autograd runs a device's backward (and the
checkpoint recompute inside it) on its own worker thread, whose notes must count too.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .tiling import counted_as

_lock = threading.Lock()
_active: list[dict[str, float]] = []  # the counters on, innermost last

CHUNK_PASSES = "pipeline.chunk_passes"  # one chunk of a chunk pipeline, forward or backward


def note(name: str, n: int = 1) -> None:
    """Count ``n`` events ``name`` (times the tiles the running code stands for) if a counter is on."""
    with _lock:
        if _active:
            counts = _active[-1]
            counts[name] = counts.get(name, 0) + n * counted_as()


@contextlib.contextmanager
def counting() -> Iterator[dict[str, float]]:
    """Collect the events noted under this context into the dict it yields (nested: the inner one)."""
    counts: dict[str, float] = {}
    with _lock:
        _active.append(counts)
    try:
        yield counts
    finally:
        with _lock:
            del _active[next(i for i, c in enumerate(_active) if c is counts)]  # by identity: {} == {}
            if _active:
                for key, value in counts.items():
                    _active[-1][key] = _active[-1].get(key, 0) + value
