"""What one iteration of a loop did to the memory tracker, recorded once and replayed for identical ones.

A simulated loop whose middle iterations allocate and free the same bytes in the same order can run
one of them and stand for the rest (``methods.core.tiling``). Its peak is then the same only when
the state each iteration starts from does not change from one to the next. Where it does (a loop
that keeps every iteration's output until after the loop, as DeepSpeed's ``TiledMLP`` does), or
where the allocation trace must hold every iteration's allocations (the caching allocator's replay,
``bench.stackmodel.allocator``, whose reserved peak depends on the order of every allocation and
free), the skipped iterations must still reach the tracker. ``recording`` does that without running
their operators: while an iteration runs it notes, in order, every update the active tracker
(``bench.measure.simulate.PeakTracker`` and its subclass ``TraceRecorder``) makes to its current
snapshot (a storage added, freed, moved to another category or resized) and every point where it
checks its peak (after each operator); ``Tape.replay`` then makes the same updates and checks again
through the tracker's own methods, on stand-in storages (``Storage``), so that the peaks, their
categories and the trace's events (fresh ids, the same sizes, devices, streams and operators) are
those of running the iteration again.

An iteration may free storages that an earlier one left alive (the previous tile's output, freed
when the next one replaces it) and leave its own alive: its ``escapes``. ``replay(carried)`` frees,
at each of the tape's frees of an earlier storage, the next of ``carried`` (the previous iteration's
escapes: stand-ins, or a real tensor's release as a callable), and returns its own escapes for the
next. Updates of a storage that existed before the tape and that the tape does not free (a
category change of a pre-existing gradient) are not repeatable: such a tape refuses to replay.

Only values change between identical iterations; a simulation has none. The operators' counts
(FLOPs, traffic) are not the tracker's: the recorded iteration runs under ``counting_as``, as every
compressed loop does.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_TRACKERS: list[Any] = []  # trackers inside their outermost ``with`` (registered by PeakTracker)

_PEAK = "peak"


def register(tracker: Any) -> None:
    """``tracker`` is active: ``recording`` records its updates (``PeakTracker.__enter__``)."""
    _TRACKERS.append(tracker)


def unregister(tracker: Any) -> None:
    """``tracker`` is no longer active (``PeakTracker.__exit__``)."""
    _TRACKERS.remove(tracker)


class Storage:
    """A stand-in for a storage that a replayed iteration allocates: the attributes the tracker
    reads from its ``_WeakRefInfo`` (and ``TraceRecorder`` its trace event), no tensor behind it."""

    __slots__ = ("size", "element_size", "device", "reftype", "mem_consumed", "_trace_event", "owner")

    def __init__(self, size: int, element_size: int, device, reftype, mem_consumed: int, owner: Any) -> None:
        self.size, self.element_size, self.device = size, element_size, device
        self.reftype, self.mem_consumed = reftype, mem_consumed
        self._trace_event = None
        self.owner = owner  # the tracker that counts it

    def free(self) -> None:
        """The stand-in's storage dies: the tracker counts its free (where the real one's would be)."""
        self.owner._update_snap(_UpdateType.DEL, self)


Carried = Storage | Callable[[], None]


class _TrackerTape:
    """One tracker's entries: ``(kind, winfo, reftype, old, mem_consumed, size, op)``, or ``(_PEAK,)``."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.entries: list[tuple] = []

    def note_update(self, u_type, winfo, old_mem_consumed, old_reftype) -> None:
        old = old_reftype if u_type == _UpdateType.REF else old_mem_consumed
        self.entries.append((u_type, winfo, winfo.reftype, old, winfo.mem_consumed, winfo.size,
                             getattr(self.tracker, "_op", None)))

    def note_peak(self) -> None:
        self.entries.append((_PEAK,))

    def check(self) -> tuple[int, int]:
        """(frees of earlier storages, escapes); raises where the tape cannot be replayed."""
        born: dict[int, bool] = {}  # id(winfo) -> still alive at the end
        external = 0
        for entry in self.entries:
            if entry[0] == _PEAK:
                continue
            u_type, winfo = entry[0], entry[1]
            key = id(winfo)
            if u_type == _UpdateType.ADD:
                born[key] = True
            elif key in born and born[key]:
                if u_type == _UpdateType.DEL:
                    born[key] = False
            elif u_type == _UpdateType.DEL:
                external += 1
            else:
                raise RuntimeError(f"a recorded iteration changed a storage it did not allocate ({u_type.name}): "
                                   "its effect does not repeat, so the iteration cannot be replayed; run it instead")
        return external, sum(born.values())

    def replay(self, carried: list[Carried]) -> list[Storage]:
        tracker = self.tracker
        update, peak = tracker._update_snap, tracker._update_peak_stats
        has_op = hasattr(tracker, "_op")
        outer_op = tracker._op if has_op else None
        live: dict[int, Storage] = {}
        pending = iter(carried)
        try:
            for entry in self.entries:
                if entry[0] == _PEAK:
                    peak(None)
                    continue
                u_type, winfo, reftype, old, mem, size, op = entry
                if has_op:
                    tracker._op = op
                key = id(winfo)
                if u_type == _UpdateType.ADD:
                    live[key] = stand_in = Storage(size, winfo.element_size, winfo.device, reftype, mem, tracker)
                    update(u_type, stand_in)
                elif key in live:
                    stand_in = live[key]
                    if u_type == _UpdateType.DEL:
                        del live[key]
                        update(u_type, stand_in)
                    elif u_type == _UpdateType.REF:
                        stand_in.reftype = reftype
                        update(u_type, stand_in, old_reftype=old)
                    else:  # SIZE
                        stand_in.size, stand_in.mem_consumed = size, mem
                        update(u_type, stand_in, old_mem_consumed=old)
                else:  # the free of an earlier iteration's storage
                    earlier = next(pending)
                    if isinstance(earlier, Storage):
                        earlier.free()
                    else:
                        earlier()  # a real tensor's last reference dropped: the tracker sees its free
        finally:
            if has_op:
                tracker._op = outer_op
        return list(live.values())


class Tape:
    """The updates of the active tracker while ``recording`` ran (nothing when none was active).

    ``external``: how many storages of earlier iterations the recorded one freed; ``escapes``: how
    many of its own it left alive."""

    def __init__(self, tracker: Any | None) -> None:
        self._tape = _TrackerTape(tracker) if tracker is not None else None
        self.external = self.escapes = 0

    def replay(self, carried: list[Carried] | None = None) -> list[Storage]:
        """The recorded updates again, on fresh stand-ins; ``carried``: what the tape's frees of
        earlier storages free now, in order (``self.external`` of them). Returns the stand-ins left
        alive (``self.escapes`` of them), in the order they were allocated."""
        carried = list(carried or ())
        if len(carried) != self.external:
            raise ValueError(f"this tape frees {self.external} earlier storages, {len(carried)} carried")
        return self._tape.replay(carried) if self._tape is not None else []


@contextlib.contextmanager
def recording() -> Iterator[Tape]:
    """Within the block, the active tracker notes its updates; the ``Tape`` replays them after.

    The cyclic garbage collector is held off meanwhile: a storage it happened to free inside the
    block would be taken for the iteration's own free of an earlier storage."""
    if len(_TRACKERS) > 1:
        raise RuntimeError(f"{len(_TRACKERS)} memory trackers are active: a tape records one")
    if not _TRACKERS and any(isinstance(m, MemTracker) for m in _get_current_dispatch_mode_stack()):
        raise RuntimeError("a MemTracker that cannot replay iterations is active: it would miss the skipped ones; "
                           "track with bench.measure.simulate.PeakTracker (track_peaks) instead")
    tape = Tape(_TRACKERS[0] if _TRACKERS else None)
    recorder = tape._tape
    if recorder is not None:
        if recorder.tracker._tape is not None:
            raise RuntimeError("a tape is already recording: nested recordings are not supported")
        recorder.tracker._tape = recorder
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield tape
    finally:
        if collecting:
            gc.enable()
        if recorder is not None:
            recorder.tracker._tape = None
    if recorder is not None:
        tape.external, tape.escapes = recorder.check()
