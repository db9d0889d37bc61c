"""bench.stackmodel.allocator: the caching-allocator model on hand-made traces with known answers,
the trace recorder on fake and real tensors, and its use in simulated mode."""
from __future__ import annotations

import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.measure.simulate import track_peaks
from bench.stackmodel.allocator import (
    ALLOC,
    FREE,
    AllocatorOOM,
    CachingAllocatorModel,
    Event,
    Trace,
    TraceRecorder,
    allocation_size,
    allocator_peaks,
    record_step,
    replay,
    round_size,
)
from records.identity import V1_OMITTED_LEVERS

MiB = 1 << 20
MODES = [False, True]  # classic segments, expandable segments


def model(expandable: bool, capacity: int | None = None) -> CachingAllocatorModel:
    return CachingAllocatorModel(expandable_segments=expandable, capacity=capacity)


# ------------------------------------------------------------------ sizes and segments


def test_round_size_and_allocation_size():
    assert [round_size(n) for n in (1, 511, 512, 513, 1000, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1024, 1536]
    assert allocation_size(512) == allocation_size(MiB) == 2 * MiB  # kSmallBuffer
    assert allocation_size(MiB + 512) == allocation_size(10 * MiB - 512) == 20 * MiB  # kLargeBuffer
    assert allocation_size(10 * MiB) == 10 * MiB  # kMinLargeAlloc and up: rounded to kRoundLarge
    assert allocation_size(50 * MiB + 1) == 52 * MiB


@pytest.mark.parametrize("expandable", MODES)
def test_small_sizes_round_to_512_in_one_2mib_segment(expandable):
    m = model(expandable)
    m.malloc(1)
    m.malloc(513)
    assert m.allocated == 512 + 1024
    assert m.reserved == 2 * MiB  # kSmallBuffer segment (or one 2 MiB page)


@pytest.mark.parametrize("expandable", MODES)
def test_a_1mib_ish_small_allocation_reserves_a_2mib_segment(expandable):
    m = model(expandable)
    m.malloc(MiB - 1000)
    assert m.reserved == 2 * MiB
    m.malloc(MiB - 1000)  # the segment's remainder fits a second one
    assert m.reserved == 2 * MiB
    m.malloc(MiB - 1000)
    assert m.reserved == 4 * MiB


@pytest.mark.parametrize("expandable", MODES)
def test_a_5mib_allocation_reserves_20mib(expandable):
    m = model(expandable)
    m.malloc(5 * MiB)
    assert (m.allocated, m.reserved) == (5 * MiB, 20 * MiB)
    m.malloc(5 * MiB)  # split from the cached remainder
    m.malloc(10 * MiB)
    assert (m.allocated, m.reserved) == (20 * MiB, 20 * MiB)


def test_a_50mib_allocation_reserves_its_size_rounded_to_2mib_classic_and_20mib_pages_expandable():
    classic, expandable = model(False), model(True)
    for m in (classic, expandable):
        m.malloc(50 * MiB)
    assert classic.reserved == 50 * MiB
    assert expandable.reserved == 60 * MiB  # three kLargeBuffer pages
    classic.malloc(51 * MiB + 1)
    assert classic.reserved == 50 * MiB + 52 * MiB


@pytest.mark.parametrize("expandable", MODES)
def test_free_then_smaller_reuses_the_cached_block(expandable):
    m = model(expandable)
    a = m.malloc(30 * MiB)
    reserved, addr = m.reserved, a.addr
    m.free(a, 30 * MiB)
    assert m.allocated == 0 and m.reserved == reserved  # cached, not returned
    b = m.malloc(25 * MiB)
    assert b.addr == addr
    assert m.reserved == reserved and m.allocated == 25 * MiB


def test_classic_hands_out_a_large_block_unsplit_when_the_rest_is_at_most_1mib():
    """should_split (large pool, classic): remaining > kSmallSize; else the whole block is
    allocated and allocated_bytes counts it, while the live bytes do not."""
    m = model(False)
    a = m.malloc(12 * MiB)
    m.free(a, 12 * MiB)
    m.malloc(11 * MiB)  # 1 MiB left over: not split
    assert m.allocated == 12 * MiB and m.live_rounded == 11 * MiB
    e = model(True)
    a = e.malloc(12 * MiB)
    e.free(a, 12 * MiB)
    e.malloc(11 * MiB)  # expandable: split whenever >= kMinBlockSize remains
    assert e.allocated == e.live_rounded == 11 * MiB


def test_best_fit_takes_the_smallest_free_block_that_fits():
    m = model(False)
    big, small = m.malloc(40 * MiB), m.malloc(24 * MiB)
    where = small.addr
    m.free(big, 40 * MiB)
    m.free(small, 24 * MiB)
    assert m.malloc(20 * MiB).addr == where


def test_fragmentation_classic_reserves_more_than_expandable():
    """Four 12 MiB tensors, all freed, then one of 24 MiB. Classic: four separate 12 MiB
    segments that cannot merge, so a new 24 MiB segment; expandable: the four lay side by
    side in one segment, merge when freed, and the 24 MiB fits in them."""
    events = [Event(ALLOC, i, 12 * MiB, "cuda:0") for i in range(4)]
    events += [Event(FREE, i, 12 * MiB, "cuda:0") for i in range(4)]
    events += [Event(ALLOC, 9, 24 * MiB, "cuda:0")]
    classic = replay(Trace(events), "cuda:0", expandable_segments=False)
    expandable = replay(Trace(events), "cuda:0", expandable_segments=True)
    assert classic.peak_reserved == 4 * 12 * MiB + 24 * MiB
    assert expandable.peak_reserved == 60 * MiB  # 48 MiB in three 20 MiB pages
    assert classic.peak_reserved > expandable.peak_reserved
    assert classic.peak_allocated == expandable.peak_allocated == 48 * MiB


def test_expandable_prefers_a_hole_to_the_growable_tail():
    """get_free_block's expandable_size: a free hole of the right size is taken before the
    free end of the segment, which could grow."""
    m = model(True)
    a = m.malloc(10 * MiB)
    hole = a.addr
    m.malloc(10 * MiB)
    m.malloc(15 * MiB)  # leaves 5 MiB free at the mapped end (40 MiB mapped)
    m.free(a, 10 * MiB)
    # the 5 MiB tail is the smallest fit by size, but it could grow: the 10 MiB hole is taken
    assert m.malloc(4 * MiB).addr == hole
    assert m.reserved == 40 * MiB
    classic = model(False)
    a = classic.malloc(10 * MiB)
    hole = a.addr
    tail = classic.malloc(15 * MiB)
    classic.free(a, 10 * MiB)
    classic.free(tail, 15 * MiB)
    assert classic.malloc(4 * MiB).addr == hole  # classic: plain best fit (10 < 15)


# ------------------------------------------------------------------ capacity


def test_capacity_pressure_releases_the_cache_classic():
    m = model(False, capacity=100 * MiB)
    blocks = [m.malloc(12 * MiB) for _ in range(4)]
    for b in blocks:
        m.free(b, 12 * MiB)
    m.malloc(60 * MiB)  # 48 cached + 60 > 100: release_cached_blocks, then cudaMalloc
    assert m.cache_releases == 1
    assert m.reserved == 60 * MiB and m.peak_reserved == 60 * MiB <= 100 * MiB


def test_capacity_pressure_unmaps_free_pages_expandable():
    m = model(True, capacity=100 * MiB)
    s = m.malloc(MiB)  # a 2 MiB page of the small pool
    m.free(s, MiB)
    a = m.malloc(30 * MiB)  # 40 MiB of large pages
    m.free(a, 30 * MiB)
    m.malloc(90 * MiB)  # 2 + 40 + 60 > 100: unmap the free pages, then map 100 MiB
    assert m.cache_releases == 1
    assert m.reserved == m.peak_reserved == 100 * MiB


def test_an_expandable_segment_spans_the_device_not_the_capacity_left():
    """The virtual range of an expandable segment is 1 1/8 of the device's total memory
    (find_expandable_block: prop.totalGlobalMem), whatever part of it the allocator may map. A
    40/20/40 MiB layout in a 100 MiB capacity, the 40s freed and unmapped by a release: the
    80 MiB that then fit physically (20 + 80) extend the segment past the live block on a
    device-sized range; a range sized on the capacity (120 MiB of pages) has no room there, and
    a second segment is opened (as find_expandable_block does when no range has room)."""
    for device_bytes, same_segment in ((None, False), (1000 * MiB, True)):
        m = CachingAllocatorModel(expandable_segments=True, capacity=100 * MiB, device_bytes=device_bytes)
        a, b, c = m.malloc(40 * MiB), m.malloc(20 * MiB), m.malloc(40 * MiB)
        m.free(a, 40 * MiB)
        m.free(c, 40 * MiB)
        d = m.malloc(80 * MiB)
        assert m.cache_releases == 1 and m.reserved == 100 * MiB
        assert (d.segment is b.segment) is same_segment
        assert (d.addr == b.addr + 20 * MiB) is same_segment


@pytest.mark.parametrize("expandable", MODES)
def test_oom_when_even_the_released_cache_is_not_enough(expandable):
    m = model(expandable, capacity=100 * MiB)
    m.malloc(60 * MiB)
    with pytest.raises(AllocatorOOM, match="out of memory"):
        m.malloc(60 * MiB)
    assert m.cache_releases == 1
    events = [Event(ALLOC, 0, 60 * MiB, "cuda:0"), Event(ALLOC, 1, 60 * MiB, "cuda:0")]
    result = replay(Trace(events), "cuda:0", expandable, capacity=100 * MiB)
    assert result.oom and result.peak_reserved <= 100 * MiB


@pytest.mark.parametrize("expandable", MODES)
def test_random_traces_keep_the_books(expandable):
    """Random allocations and frees of all sizes: reserved covers allocated at every step,
    the rounded live peak is the trace's, and once everything is freed and the cache released
    nothing stays reserved (the block lists are consistent)."""
    rng = random.Random(0)
    m = model(expandable)
    live: dict[int, tuple] = {}
    events = []
    for i in range(3000):
        if live and rng.random() < 0.45:
            eid = rng.choice(list(live))
            block, n = live.pop(eid)
            m.free(block, n)
            events.append(Event(FREE, eid, n, "cuda:0"))
        else:
            n = rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * MiB), rng.randint(MiB, 64 * MiB)])
            live[i] = (m.malloc(n), n)
            events.append(Event(ALLOC, i, n, "cuda:0"))
        assert m.reserved >= m.allocated >= m.live_rounded
    assert m.peak_live_rounded == Trace(events).peak_live("cuda:0", rounded=True)
    if expandable:
        assert m.peak_allocated == m.peak_live_rounded
    for block, n in live.values():
        m.free(block, n)
    m.release_cached_blocks()
    assert m.allocated == 0 and m.reserved == 0
    assert all(not p.keys and not p.unmapped for p in m._pools.values())


def test_replay_keeps_to_its_device():
    events = [Event(ALLOC, 0, 5 * MiB, "cuda:0"), Event(ALLOC, 1, 5 * MiB, "meta"), Event(FREE, 0, 5 * MiB, "cuda:0")]
    result = replay(Trace(events), "cuda:0")
    assert result.events == 2 and result.peak_allocated == 5 * MiB


# ------------------------------------------------------------------ the recorder


def test_recorder_on_fake_tensors_counts_storages_once_and_sees_frees():
    with FakeTensorMode():
        w = torch.empty(256, 256)

        def step():
            x = torch.empty(64, 256)  # 64 KiB
            views = [x.view(-1), x.t(), x[1:3], x.reshape(256, 64)]  # no new storage
            y = x @ w  # 64 KiB
            del x, views
            y.add_(1)  # in place: nothing
            del y

        recorder = TraceRecorder()
        recorder.track_external(w)
        with recorder:
            step()
    trace = recorder.trace
    initial = trace.events[:trace.step_start]
    assert [(e.action, e.nbytes) for e in initial] == [(ALLOC, 256 * 256 * 4)]
    step_events = trace.events[trace.step_start:]
    assert [(e.action, e.nbytes) for e in step_events] == [
        (ALLOC, 64 * 256 * 4), (ALLOC, 64 * 256 * 4), (FREE, 64 * 256 * 4), (FREE, 64 * 256 * 4)]
    assert step_events[0].id == step_events[2].id  # x dies first, with its views
    assert step_events[1].op == "mm.default"
    assert {e.device for e in trace.events} == {"cpu"}
    assert trace.peak_live("cpu") == 256 * 256 * 4 + 2 * 64 * 256 * 4


def test_recorder_logs_storage_resize_as_new_allocation_then_free():
    def step():
        t = torch.empty(1000)
        st = t.untyped_storage()
        st.resize_(0)  # what FSDP does to free an unsharded parameter
        st.resize_(8000)
        del t, st

    _, trace = record_step(step)
    assert [(e.action, e.nbytes) for e in trace.events] == [(ALLOC, 4000), (FREE, 4000), (ALLOC, 8000), (FREE, 8000)]


def _cpu_training_step():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.Adam(net.parameters())
    x = torch.randn(32, 64)

    def step():
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # optimizer state exists before the measured step
    return step, net, opt


def test_recorder_peak_equals_memtracker_peak_on_a_real_cpu_step():
    step, net, opt = _cpu_training_step()
    tracked = track_peaks(step, net, opt)["cpu"].total
    peaks, trace = record_step(step, net, opt)
    assert peaks["cpu"].total == tracked
    assert trace.peak_live("cpu") == tracked
    assert trace.step_start > 0  # parameters and Adam state enter first
    # and the replay's rounded live peak is the trace's
    result = replay(trace, "cpu")
    assert result.peak_live_rounded == trace.peak_live("cpu", rounded=True)
    assert result.peak_reserved >= result.peak_allocated >= result.peak_live_rounded


def test_allocator_peaks_of_a_step():
    step, net, opt = _cpu_training_step()
    allocated, reserved = allocator_peaks(step, net, opt, device="cpu", expandable_segments=True)
    assert allocated == record_step(step, net, opt)[1].peak_live("cpu", rounded=True)
    assert reserved % (2 * MiB) == 0 and reserved >= allocated
    with pytest.raises(AllocatorOOM):
        allocator_peaks(step, net, opt, device="cpu", capacity=MiB)


# ------------------------------------------------------------------ simulated mode


def test_simulated_mode_records_the_reserved_peak_without_changing_the_fit():
    from bench.measure.config import StepConfig
    from bench.measure.run import build_row, measure_simulated
    from bench.measure.trial import Trial

    base = Trial.make("ulysses", "tiny-llama", 1024, 2, device="cpu")
    plain = measure_simulated(base)
    assert plain.peak_reserved_bytes is None
    for allocator in ("classic", "expandable"):
        trial = Trial.make("ulysses", "tiny-llama", 1024, 2, device="cpu", step=StepConfig(allocator_model=allocator))
        out = measure_simulated(trial)
        assert out.peak_bytes == plain.peak_bytes
        assert out.peak_reserved_bytes >= out.allocator.peak_allocated_bytes >= out.peak_bytes
        row = build_row(trial, out, 1.0)
        assert row.figures.peak_reserved_bytes == out.peak_reserved_bytes
        assert row.levers["allocator_model"] == allocator
        assert any("caching allocator" in n for n in row.notes)
    assert StepConfig().levers()["allocator_model"] == V1_OMITTED_LEVERS["allocator_model"]  # earlier rows' keys
    with pytest.raises(ValueError, match="allocator_model must be one of"):
        StepConfig(allocator_model="cuda")
    with pytest.raises(ValueError, match="in emulated mode the real allocator"):
        Trial.make("ulysses", "tiny-llama", 1024, 2, mode="emulated", device="cpu",
                   step=StepConfig(allocator_model="classic")).validate()


# ------------------------------------------------------------------ streams


@pytest.mark.parametrize("expandable", MODES)
def test_a_block_cached_by_one_stream_is_not_reused_by_another(expandable):
    a = model(expandable)
    b = a.malloc(50 * MiB, stream=1)
    a.free(b, 50 * MiB)
    reserved = a.reserved
    again = a.malloc(50 * MiB, stream=1)  # the same stream takes its cached block back
    assert a.reserved == reserved
    a.free(again, 50 * MiB)
    a.malloc(50 * MiB, stream=0)  # another stream cannot: its pool grows
    assert a.reserved >= reserved + 50 * MiB



def test_replay_shares_one_pool_unless_per_stream():
    size = 50 * MiB
    events = [Event(ALLOC, 0, size, "cuda:0", 1), Event(FREE, 0, size, "cuda:0", 1),
              Event(ALLOC, 1, size, "cuda:0", 0), Event(FREE, 1, size, "cuda:0", 0)]
    shared = replay(Trace(events), "cuda:0", per_stream=False)
    per_stream = replay(Trace(events), "cuda:0", per_stream=True)
    assert per_stream.peak_reserved >= shared.peak_reserved + size


def test_recorder_tags_device_storage_with_the_simulated_current_stream():
    from bench.measure.simulate import fake_tensors
    from bench.stackmodel import simcuda

    simcuda.require()
    with simcuda.runtime(), fake_tensors(torch.float32, meta_host=False):
        side = torch.cuda.Stream()
        other = torch.cuda.Stream()

        def step():
            x = torch.empty(1024, device="cuda")
            with torch.cuda.stream(side):
                y = torch.empty(2048, device="cuda")
                assert torch.cuda.current_stream() is side
                with torch.cuda.stream(other):
                    z = torch.empty(4096, device="cuda")
                w = torch.empty(8192, device="cuda")
            h = torch.empty(16, device="cpu")
            del x, y, z, w, h

        _, trace = record_step(step)
    streams = {(e.action, e.nbytes, e.device): e.stream for e in trace.events}
    assert streams[(ALLOC, 4096, "cuda:0")] == 0
    assert streams[(ALLOC, 8192, "cuda:0")] == streams[(ALLOC, 32768, "cuda:0")] == 1  # back on side
    assert streams[(ALLOC, 16384, "cuda:0")] == 2
    assert streams[(ALLOC, 64, "cpu")] == 0
    assert all(e.stream == streams[(ALLOC, e.nbytes, e.device)] for e in trace.events if e.action == FREE)
    assert simcuda.stream_id() == 0  # the runtime's streams are gone with it


def test_fsdp2_all_gather_buffers_are_made_on_its_copy_in_stream():
    """A simulated model step: FSDP2's all-gather outputs (the unsharded parameters, flat)
    come from a side stream, so the replay keeps them in a pool of their own."""
    from bench.measure import run
    from bench.measure.config import StepConfig
    from bench.measure.trial import Trial

    seen = {}
    real = run.replay

    def keep(trace, device, **kw):
        seen["events"] = [e for e in trace.events[trace.step_start:] if e.device == device]
        return real(trace, device, **kw)

    trial = Trial.make("ulysses", "tiny-llama", 1024, 2, mode="simulated", device="h100-80g",
                       step=StepConfig(scope="model", allocator_model="expandable"))
    run.replay = keep
    try:
        out = run.measure_simulated(trial)
    finally:
        run.replay = real
    side = [e for e in seen["events"] if e.action == ALLOC and e.stream != 0]
    assert side, "no allocation on a side stream"
    assert {e.op for e in side} >= {"empty.memory_format"}
    assert out.peak_reserved_bytes >= out.allocator.peak_allocated_bytes
