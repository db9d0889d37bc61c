"""Simulated mode: per-rank memory of any shape and world size, allocating nothing.

``FakeTensorMode`` makes every tensor a shape-and-dtype-only fake; a ``fake`` process group
answers every collective instantly with correctly shaped (meaningless) outputs; torch's
``MemTracker`` records the bytes each live tensor would occupy, by category. Together they give
one rank's peak memory for any model, length and world size on a CPU (how long that takes:
docs/modes.md, section "Simulated"). What it measures is exactly what the code allocates:
kernels are called through their fake implementations (the flash kernels' fakes allocate ``out``
and ``lse`` only; on the GPU code path, fake CUDA tensors, ``bench.stackmodel.simcuda``, the CUDA
flash op's fake also allocates its two small philox tensors), and the CUDA caching allocator
(fragmentation, workspaces) is not modelled, so figures are lower bounds on
``torch.cuda.max_memory_reserved`` (``bench.stackmodel.allocator`` replays a step's allocations
through a model of that allocator).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.init as init
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _UpdateType, _WeakRefInfo
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the fake backend

from methods.core.hostmem import simulated_host
from methods.core.tiling import compressing_repeats

from ..stackmodel.simmode import SimulationMode, tensor_leaves
from . import fakeroute, tape
from .fakeroute import active_fake_mode

_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_ADD, _DEL, _REF, _SIZE = _UpdateType.ADD, _UpdateType.DEL, _UpdateType.REF, _UpdateType.SIZE
# output types tracked without flattening (MemTracker flattens every output with tree_map_only)
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter, FakeTensor})


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """A ``fake``-backend default process group of ``world_size`` ranks (this process is ``rank``)."""

    if dist.is_initialized():
        raise RuntimeError(
            "a default process group already exists in this process; simulation needs its own "
            "(run it in a fresh process, e.g. through `python -m bench run --mode simulated`)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensors(dtype: torch.dtype = torch.bfloat16, meta_host: bool = True) -> Iterator[None]:
    """Fake-tensor mode with ``dtype`` as the default dtype (modules are created in it:
    ``.to(dtype)`` after construction fails under fake mode).

    ``meta_host``: the CPU code path of a GPU simulation, where the accelerator is a fake CPU
    device. Methods that offload to host memory then offload to the ``meta`` device
    (``methods.core.hostmem``), so the tracker counts those bytes apart from the simulated
    device's. On the GPU code path (fake CUDA tensors, ``bench.stackmodel.simcuda``) host memory
    is the fake CPU device itself and the methods take their CUDA branches.

    Tensors without values make identical loop iterations interchangeable, so the tiled ops'
    and the methods' loops run one for all their middle iterations, counted for all of them
    (``methods.core.tiling.compressing_repeats``): the same peak, in a fraction of the time."""

    previous = torch.get_default_dtype()
    host = simulated_host("meta") if meta_host else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=False), host, compressing_repeats():
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


@dataclass(frozen=True)
class MemoryPeak:
    """Peak bytes by MemTracker category (parameter, gradient, activation, temp, optstate, other)."""

    total: int
    by_category: dict[str, int]

    def gib(self, category: str | None = None) -> float:
        return (self.total if category is None else self.by_category.get(category, 0)) / 2**30


def track_peak(step: Callable[[], None], *external) -> MemoryPeak:
    """Run ``step`` under torch's ``MemTracker`` and return the peak of the current device.

    ``external`` are modules, optimizers and tensors that exist before ``step`` (their
    memory counts toward the peak from the start).
    """

    tracker = MemTracker()
    if external:
        tracker.track_external(*external)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak")
    (device_stats,) = snapshot.values() if len(snapshot) == 1 else (max(snapshot.values(), key=lambda c: c["Total"]),)
    categories = {str(k.value).lower(): int(v) for k, v in device_stats.items() if k != "Total"}
    return MemoryPeak(int(device_stats["Total"]), categories)


@contextlib.contextmanager
def no_param_init() -> Iterator[None]:
    """Make ``torch.nn.init``'s initialisers no-ops while modules are built.

    Random initialisation cannot run on fake tensors of every device, and simulation needs
    shapes only. Modules call ``nn.init.<fn>`` through the module attribute, so replacing the
    attributes is enough; they are restored on exit.
    """

    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    saved = {n: getattr(init, n) for n in names}
    for n in names:
        setattr(init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(init, n, fn)


class PeakTracker(SimulationMode, MemTracker):
    """A ``MemTracker`` that keeps the per-device peak only, and the ``SimulationMode`` of the counters
    entered inside it.

    ``MemTracker`` also keeps every module's own peak, scanning all tracked modules after every
    operator: on a deep model that scan dominates the run time
    (docs/modes.md, section "Simulated"). Only the global per-device peak and its category split
    are needed here, so the scan is replaced by the global update (the same code as MemTracker's
    last loop).

    While a ``tape.recording`` block runs (``_tape`` set), every update of the current snapshot and
    every peak check is also noted, so that identical loop iterations can be replayed on it without
    running (``bench.measure.tape``).

    The counters of a simulated step (``bench.stackmodel.simmode``) entered inside the tracker join it
    (not while it is entered more than once: they would run once per push): every operator goes through
    one Python dispatch for them and the tracker, which tracks inside every counter, as a tracker pushed
    below them all did.
    """

    _tape = None  # the recording tape (bench.measure.tape), if any
    declines_dtensor = True  # DTensor runs its local ops, which come through again (as MemTracker)

    def joinable(self) -> bool:
        return self._depth == 1

    def __enter__(self) -> PeakTracker:
        if self._depth and self.counters:
            raise RuntimeError("a PeakTracker with counters joined is entered again: they would count twice")
        super().__enter__()
        if self._depth == 1:
            tape.register(self)
        return self

    def __exit__(self, *args) -> None:
        if self._depth == 1:
            tape.unregister(self)
        super().__exit__(*args)

    def _track(self, reftype, t: torch.Tensor) -> None:
        """``MemTracker._track`` for a fake tensor, whose one storage is its own (``get_untyped_storages`` looks
        through wrapper subclasses, building a set, for every output): a storage seen before has its size
        checked, a new one is recorded in ``reftype``. Any other tensor as ``MemTracker`` tracks it."""
        if type(t) is not FakeTensor:
            return super()._track(reftype, t)
        storage = t.untyped_storage()
        seen = self._WINFO.get(storage)
        if seen is not None:
            winfo = seen[0]
            if winfo.size != storage.size():
                old = winfo.mem_consumed
                winfo.update_mem_consumed(storage)
                self._update_snap(_SIZE, winfo, old_mem_consumed=old)
            return None
        winfo, ref = _WeakRefInfo.create_winfo(storage, t.device, reftype, self._delete_callback)
        self._WINFO[storage] = (winfo, ref)
        if winfo.mem_consumed > 0:
            self._update_snap(_ADD, winfo)
        return None

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        """``MemTracker._update_snap``'s accounting, with a device's snapshot created only when it is missing
        (``MemTracker`` builds the default, a dict over every category, on every update): an added storage
        counts its bytes to its category and the total, a freed one takes them off (and a device whose
        total falls to zero leaves the snapshot), a category change moves them, a resize changes them."""
        if self._tape is not None:
            self._tape.note_update(u_type, winfo, old_mem_consumed, old_reftype)
        snap = self._curr_mem_snap
        device = winfo.device
        dev_snap = snap.get(device)
        if dev_snap is None:
            dev_snap = snap[device] = dict.fromkeys(self._ref_class, 0)
            dev_snap[_TOTAL_KEY] = 0
        elif _TOTAL_KEY not in dev_snap:
            dev_snap[_TOTAL_KEY] = 0
        mem = winfo.mem_consumed
        if u_type is _ADD:
            dev_snap[winfo.reftype] += mem
            dev_snap[_TOTAL_KEY] += mem
            return
        if u_type is _DEL:
            dev_snap[winfo.reftype] -= mem
            dev_snap[_TOTAL_KEY] -= mem
        elif u_type is _REF:
            if old_reftype is None:
                raise AssertionError("a category change without the old category")
            dev_snap[old_reftype] -= mem
            dev_snap[winfo.reftype] += mem
            return
        elif u_type is _SIZE:
            if old_mem_consumed is None:
                raise AssertionError("a resize without the old size")
            dev_snap[winfo.reftype] += mem - old_mem_consumed
            dev_snap[_TOTAL_KEY] += mem - old_mem_consumed
        else:
            raise ValueError(f"Invalid update type: {u_type}")
        if dev_snap[_TOTAL_KEY] == 0:
            del snap[device]

    def _update_peak_stats(self, peak_state) -> None:  # noqa: ARG002 - same signature
        if self._tape is not None:
            self._tape.note_peak()
        # a device's snapshot maps categories to ints: a shallow copy is a deep one
        peak = self._peak_mem
        for dev, dev_snap in self._curr_mem_snap.items():
            total = dev_snap[_TOTAL_KEY]
            if peak.get(dev, 0) < total:
                peak[dev] = total
                self._peak_mem_snap[dev] = dict(dev_snap)

    def _call(self, func, args: tuple, kwargs: dict):
        """``MemTracker.__torch_dispatch__`` with less work per operator, inside the joined counters (an op
        on DTensors never reaches here, ``declines_dtensor``): the outputs are tracked in the order
        ``tree_map_only`` visits them, a single tensor without flattening, and the peak is updated after
        every operator as there."""
        fake_mode = active_fake_mode()
        if func is _WAIT_TENSOR and fake_mode:
            res = args[0]  # as MemTracker: a wait returns its input, not the fake kernel's new tensor
        else:
            res = fakeroute.call(func, args, kwargs, fake_mode)  # what FakeTensorMode itself returns
        if fake_mode is self._fake_mode_on_entry:
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            if type(res) in _PLAIN_TENSORS:
                self._track(reftype, res)
            else:
                for leaf in tensor_leaves(res, []):
                    self._track(reftype, leaf)
            self._update_peak_stats(None)
        return res


def _peak_tracker() -> PeakTracker:
    return PeakTracker()


def peaks_by_device(tracker: MemTracker) -> dict[str, MemoryPeak]:
    """A tracker's peak per device (``"cpu"``, ``"meta"``, ``"cuda:0"``) with its categories."""
    out = {}
    for device, stats in tracker.get_tracker_snapshot("peak").items():
        categories = {str(k.value).lower(): int(v) for k, v in stats.items() if k != "Total"}
        out[str(device)] = MemoryPeak(int(stats["Total"]), categories)
    return out


def track_peaks(step: Callable[[], None], *external) -> dict[str, MemoryPeak]:
    """Like ``track_peak`` but one ``MemoryPeak`` per device (``"cpu"``, ``"meta"``, ``"cuda:0"``).

    Each device's peak is its own maximum over the step (they need not coincide in time).
    Per-module peaks are not kept (see ``_peak_tracker``), which makes it fast on deep models.
    """
    tracker = _peak_tracker()
    if external:
        tracker.track_external(*external)
    with tracker:
        step()
    return peaks_by_device(tracker)
