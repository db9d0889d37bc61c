"""A simulated DeepSpeed TiledMLP that replays its middle tiles is, to the tracker, the counters and the
allocation trace, the TiledMLP that runs them all (bench.measure.tape, bench.model.dstiled)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _MemRefType
from torch.utils.checkpoint import checkpoint

from bench.measure import tape
from bench.measure.simulate import no_param_init, peaks_by_device
from bench.model import dstiled
from bench.model.decoder import FeedForward
from bench.stackmodel.allocator import TraceRecorder, replay
from bench.stackmodel.stepcount import StepCounter
from methods.core.tiling import compressing_repeats

pytest.importorskip("deepspeed", reason="DeepSpeed's TiledMLP is what the stand-in reproduces")

DIM, FFN = 64, 160


def _step(tokens: int, compress: bool, ac: bool) -> tuple[list[tuple], dict, object, object]:
    """Forward and backward of a DeepSpeed-tiled MLP (``ceil(tokens / DIM)`` tiles) under fake tensors:
    the trace's events with their ids renumbered in order, the peaks, the counts and the replay."""
    calls = {"stand-in": 0}
    with FakeTensorMode(), no_param_init(), (compressing_repeats() if compress else contextlib.nullcontext()):
        mlp = FeedForward(DIM, FFN, 1e-5)
        mlp.tiles, mlp.impl = 0, "deepspeed"
        x = torch.empty(1, tokens, DIM, requires_grad=True)
        recorder, steps = TraceRecorder(), StepCounter("cpu", "meta")
        recorder.track_external(mlp)
        forward = dstiled.TiledMLPStandIn.forward

        def counted(*args):
            calls["stand-in"] += 1
            return forward(*args)

        dstiled.TiledMLPStandIn.forward = staticmethod(counted)
        try:
            with recorder, steps.counting():
                y = checkpoint(mlp, x, use_reentrant=False) if ac else mlp(x)
                y.sum().backward()
                del y
        finally:
            dstiled.TiledMLPStandIn.forward = staticmethod(forward)
    assert calls["stand-in"] == ((2 if ac else 1) if compress else 0), "the wrong TiledMLP ran"
    ids: dict[int, int] = {}
    events = [(e.action, ids.setdefault(e.id, len(ids)), e.nbytes, e.device, e.stream, e.op)
              for e in recorder.trace.events]
    return events, peaks_by_device(recorder), steps.counts(), replay(recorder.trace, "cpu")


@pytest.mark.parametrize("tokens", [DIM * 12, DIM * 9 + 5, DIM * 3])
@pytest.mark.parametrize("ac", [False, True], ids=["plain", "checkpointed"])
def test_the_stand_in_replays_what_deepspeeds_tiles_do(tokens, ac):
    """Tiles of one size (12), a shorter last one (10 tiles of 59, the last 54) and too few to compress (3)."""
    want = _step(tokens, compress=False, ac=ac)
    have = _step(tokens, compress=True, ac=ac)
    assert have[0] == want[0], "the allocation trace differs"
    assert have[1] == want[1], "the peaks differ"
    assert have[2] == want[2], "the step's counts differ"
    assert have[3] == want[3], "the caching allocator's replay differs"


def test_a_tape_refuses_an_iteration_that_changes_an_earlier_storage():
    with FakeTensorMode():
        recorder = TraceRecorder()
        earlier = torch.empty(1024)
        recorder.track_external(earlier)
        with recorder, pytest.raises(RuntimeError, match="cannot be replayed"), tape.recording():
            recorder._update_and_maybe_create_winfos(earlier, _MemRefType.GRAD)  # a category change: not repeatable


def test_a_tape_frees_what_it_is_given_for_an_earlier_iteration():
    with FakeTensorMode():
        recorder = TraceRecorder()
        with recorder:
            held = [torch.empty(256)]
            with tape.recording() as rec:
                held.append(torch.empty(256))
                del held[0]
            assert (rec.external, rec.escapes) == (1, 1)
            escaped = rec.replay([lambda: held.clear()])
            assert not held and len(escaped) == 1
            escaped = rec.replay(escaped)
            escaped[0].free()
    sizes = [(e.action, e.nbytes) for e in recorder.trace.events]
    assert sizes == [("alloc", 1024), ("alloc", 1024), ("free", 1024), ("alloc", 1024), ("free", 1024),
                     ("alloc", 1024), ("free", 1024), ("free", 1024)]
    with pytest.raises(ValueError, match="carried"):
        rec.replay([])


def test_a_tape_refuses_a_tracker_that_cannot_replay():
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode(), MemTracker(), pytest.raises(RuntimeError, match="PeakTracker"), tape.recording():
        pass
