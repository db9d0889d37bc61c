"""bench.measure.simulate.PeakTracker._track: a fake tensor's storage recorded as MemTracker records it (its
one storage, a view's storage once, a grown storage's new size), and any other tensor left to MemTracker."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from bench.measure.simulate import PeakTracker


def _snapshot(tracker) -> dict:
    return {str(d): dict(s) for d, s in tracker._curr_mem_snap.items()}


def test_a_fake_tensors_storage_is_tracked_as_mem_tracker_tracks_it():
    ours, theirs = PeakTracker(), PeakTracker()
    with FakeTensorMode():
        a = torch.empty(64, 32)
        views = [a, a[1:], a.t()]  # one storage
        b = torch.empty(1000, dtype=torch.bfloat16)
        grown = torch.empty(8)
        for t, kind in [*((v, _MemRefType.ACT) for v in views), (b, _MemRefType.TEMP), (grown, _MemRefType.ACT)]:
            ours._track(kind, t)
            MemTracker._track(theirs, kind, t)
        assert _snapshot(ours) == _snapshot(theirs) and _snapshot(ours)
        grown.untyped_storage().resize_(4096)  # a storage that grew since it was recorded
        ours._track(_MemRefType.ACT, grown)
        MemTracker._track(theirs, _MemRefType.ACT, grown)
    assert _snapshot(ours) == _snapshot(theirs)
    assert len(ours._WINFO) == len(theirs._WINFO) == 3
