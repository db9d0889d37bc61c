"""Each rank's measured attention time in real CPU trials (``bench.measure.attntime``).

On the session's gloo rank pool (tests/bench/conftest.py): a real 2-rank trial whose documents put
the attention work on one rank measures that rank as the slowest, as ``doc_work`` models it; the
kernels' call timer sees every attention call (an exact count for ``ulysses``, and for every method
of ours no torch attention op outside a timed kernel call); a wrapper whose library calls its own
kernels records no time (None), never 0. Trials are small (tiny-llama, 512 tokens to 2K, a smoke
run's timed steps): what they check is where the time is taken, not how long it is.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.measure.attntime import (
    CLOCKS,
    MIXED_CLOCKS,
    NONE_SEEN,
    NOT_ON_CUDA,
    THREAD,
    WALL,
    AttentionTimer,
    StepAttention,
    attention_clock,
    imbalance,
    timed_device,
)
from bench.measure.config import StepConfig
from bench.measure.result import Measurement
from bench.measure.run import _combine_ranks, build_row, guarded, measure_on_device, real_rank
from bench.measure.trial import Trial
from bench.stackmodel import docwork
from methods.core import kernels
from records.schema import ATTENTION_CLOCKS, RowError, validate_row
from records.workloads.spec import DocsSpec
from tests.flash_attn_standin import installed_for_the_call

aten = torch.ops.aten
# the torch kernel's CPU attention ops (methods.core.kernels.TorchKernel): what an attention computed
# outside the kernel interface would also call
SDPA_CPU = {aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
# 2K tokens: 16 short documents, then one of 1K (ring, contiguous: rank 1 holds the long one). Long enough that
# the long document's work stands out of the ranks' fixed costs per step (the measurements: commit 43b8e5a)
SKEWED = DocsSpec(lengths=(64,) * 16 + (1024,))
# 512 tokens of documents for the calls' checks: short ones, then a long one
MIXED = DocsSpec(lengths=(16,) * 16 + (256,))


class AttentionOps(TorchDispatchMode):
    """Counts the torch CPU attention ops run while a call timer is installed (the timed steps), inside a
    timed kernel call and outside one."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = self.outside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SDPA_CPU and kernels._timer is not None:
            if kernels._timing_depth:
                self.inside += 1
            else:
                self.outside += 1
        return func(*args, **(kwargs or {}))


def rank_with_op_count(group, trial: Trial):
    """A real rank (``real_rank``'s measurement) with its attention ops counted (module level: the ranks run it)."""
    ops = AttentionOps()
    result = guarded(measure_on_device, trial, group, torch.device("cpu"), ops, True)
    return result, ops.inside, ops.outside


def rank_with_flash_standin(group, trial: Trial):
    """``real_rank`` with the flash-attn stand-in on the rank for the call (the library wrappers need it)."""
    with installed_for_the_call():
        return real_rank(group, trial)


def real_trial(method: str, seq_len: int, world_size: int, docs: DocsSpec | None = None, options=None,
               iters: int = 1, model: str = "tiny-llama", **step) -> Trial:
    return Trial.make(method, model, seq_len, world_size, mode="real", device="cpu", warmup=1, iters=iters,
                      smoke=True, options=options, docs=docs, step=StepConfig(**step))


def row_of(pool, trial: Trial, fn=real_rank):
    results = pool.run(fn, trial, world_size=trial.world_size)
    assert all(r.status == "ok" for r in results), next(r.traceback for r in results if r.status != "ok")
    return build_row(trial, _combine_ranks(results), 1.0), results


# --------------------------------------------------------------------------- without ranks


def test_timer_sums_each_step_and_restores_the_previous_timer():
    before = kernels.set_call_timer(None)
    try:
        timer = AttentionTimer()
        q = torch.randn(1, 8, 2, 4, requires_grad=True)
        for _ in range(2):
            with timer.step():
                kernels.attention(q, q, q, causal=True, kernel=kernels.get_kernel("torch")).sum().backward()
        assert kernels._timer is None
        assert [(s.forward_calls, s.backward_calls) for s in timer.steps] == [(1, 1), (1, 1)]
        assert all(t > 0 for t in timer.seconds()) and timer.calls() == {"forward": 1, "backward": 1}
        with timer.step():
            pass  # no call: a step without attention
        assert timer.seconds()[-1] == 0.0
        assert AttentionTimer().seconds() is None and AttentionTimer().calls() is None
        with pytest.raises(ValueError, match="'forward' or 'backward'"):
            StepAttention().record("sideways", 1.0)
    finally:
        kernels.set_call_timer(before)


def test_a_kernel_call_inside_a_timed_one_is_not_timed_again():
    class Outer:
        name = "outer"

        @kernels._timed("forward")
        def forward(self, q, k, v, causal, scale):
            return kernels.get_kernel("torch").forward(q, k, v, causal, scale)

    step = StepAttention()
    before = kernels.set_call_timer(step)
    try:
        q = torch.randn(1, 8, 2, 4)
        Outer().forward(q, q, q, True, 0.5)
    finally:
        kernels.set_call_timer(before)
    assert step.forward_calls == 1


def test_imbalance_is_the_slowest_over_the_mean():
    assert imbalance([1.0, 3.0]) == pytest.approx(1.5)
    assert imbalance([0.0, 0.0]) == 1.0


def test_a_cuda_row_says_its_attention_is_not_timed():
    assert timed_device(torch.device("cpu")) and not timed_device(torch.device("cuda", 0))
    trial = Trial.make("ulysses", "tiny-llama", 1024, 2, mode="real", device="h100-80g", warmup=1, iters=1,
                       smoke=True)
    row = build_row(trial, Measurement(compute_time_s=1.0, step_times_s=[1.0]), 1.0)
    assert NOT_ON_CUDA in row.notes and NONE_SEEN not in row.notes
    assert row.figures.rank_attention_s is None and row.figures.attention_imbalance is None


def test_ranks_timed_on_different_clocks_report_no_times_and_say_why():
    trial = Trial.make("ulysses", "tiny-llama", 1024, 2, mode="real", device="cpu", warmup=1, iters=1, smoke=True)

    def rank(clock: str) -> Measurement:
        return Measurement(compute_time_s=1.0, step_times_s=[1.0], attention_times_s=[0.5],
                           attention_calls={"forward": 1, "backward": 1}, attention_clock=clock)

    row = build_row(trial, _combine_ranks([rank(THREAD), rank(WALL)]), 1.0)
    assert MIXED_CLOCKS in row.notes and NONE_SEEN not in row.notes
    assert row.figures.rank_attention_s is None and row.figures.attention_clock is None
    same = build_row(trial, _combine_ranks([rank(THREAD), rank(THREAD)]), 1.0)
    assert same.figures.rank_attention_s == [0.5, 0.5] and same.figures.attention_clock == THREAD


def test_a_row_refuses_attention_times_that_do_not_match_its_ranks():
    row = dataclasses.replace(_plain_row(), figures=dataclasses.replace(
        _plain_row().figures, rank_attention_s=[1.0, 3.0], attention_imbalance=1.5, attention_clock="thread"))
    validate_row(row)
    validate_row(dataclasses.replace(row, figures=dataclasses.replace(row.figures, attention_clock=None)))  # older
    for times, ratio, clock, said in (([1.0], 1.0, "wall", "one time"), ([1.0, 3.0], 1.2, "wall", "max over the mean"),
                                      (None, 1.5, None, "need the times"), (None, None, "wall", "need the times"),
                                      ([1.0, -1.0], 1.0, "wall", "one time"),
                                      ([1.0, 3.0], 1.5, "cpu", "'cpu' is not one of wall, thread")):
        bad = dataclasses.replace(row, figures=dataclasses.replace(
            row.figures, rank_attention_s=times, attention_imbalance=ratio, attention_clock=clock))
        with pytest.raises(RowError, match=said):
            validate_row(bad)


def test_the_clock_is_the_threads_cpu_time_where_a_rank_has_one_intra_op_thread():
    """One intra-op thread: a kernel call's CPU time on its thread is its work, not the waits for a core (a
    sleep inside a timed call adds wall time, no thread time); several: the wall clock."""
    assert attention_clock(1) == THREAD and attention_clock(2) == WALL and attention_clock(16) == WALL
    assert set(CLOCKS) == set(ATTENTION_CLOCKS)
    with pytest.raises(ValueError, match="one of"):
        AttentionTimer(clock="cpu")

    class Sleeping:
        name = "sleeping"

        @kernels._timed("forward")
        def forward(self):
            time.sleep(0.05)

    took = {}
    for clock in CLOCKS:
        timer = AttentionTimer(clock=clock)
        before = kernels.set_call_timer(None)
        try:
            with timer.step():
                Sleeping().forward()
        finally:
            kernels.set_call_timer(before)
        took[clock] = timer.seconds()[0]
    assert took[WALL] >= 0.05 and took[THREAD] < 0.01, took
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert AttentionTimer().clock == THREAD
        torch.set_num_threads(2)
        assert AttentionTimer().clock == WALL
    finally:
        torch.set_num_threads(threads)


def _plain_row():
    from tests.rowfactory import make_row

    return make_row(world_size=2)


# --------------------------------------------------------------------------- real ranks


def test_measured_imbalance_agrees_with_the_modelled_one(pool):
    """Ring, contiguous layout: rank 0 holds 16 short documents, rank 1 one long one, ~16x the pairs (the
    measured ratio is smaller: per-call overhead and the kernels' causal blocks are not free). Timed on the ranks'
    CPU clocks, the ratio does not depend on what else runs on the host."""
    trial = real_trial("ring", 2048, 2, SKEWED, options={"layout": "contiguous"}, iters=3)
    work = docwork.trial_work(trial)
    assert work.slowest_rank == 1 and work.imbalance > 1.5  # the set-up is what the test means it to be
    row, _ = row_of(pool, trial)
    f = row.figures
    assert len(f.rank_attention_s) == 2 and all(t > 0 for t in f.rank_attention_s)
    assert f.attention_imbalance > 1.1, f.rank_attention_s
    assert f.attention_clock == THREAD  # the pool's ranks run one intra-op thread each: their CPU time, not the waits
    assert max(range(2), key=f.rank_attention_s.__getitem__) == f.doc_work["slowest_rank"] == 1
    assert f.doc_work["imbalance"] == pytest.approx(work.imbalance, abs=1e-6)
    assert any(n.startswith("rank_attention_s:") and "doc_work.imbalance" in n for n in row.notes)
    validate_row(row)
    assert {"rank_attention_s", "attention_imbalance"} <= set(row.to_dict()["figures"])


@pytest.mark.parametrize("ac", [False, True])
def test_the_timer_sees_every_attention_call_of_ulysses(pool, ac):
    """One kernel forward and one backward per layer and step (with checkpoints, the forward again in the
    backward's recomputation), and no attention op of the timed steps outside a timed call."""
    trial = real_trial("ulysses", 512, 2, MIXED, ac=ac, ac_offload=ac)
    layers = trial.config().n_layers
    results = pool.run(rank_with_op_count, trial, world_size=2)
    for result, inside, outside in results:
        assert result.status == "ok", result.traceback
        assert result.attention_calls == {"forward": layers * (2 if ac else 1), "backward": layers}
        assert inside > 0 and outside == 0
    combined = _combine_ranks([r for r, _, _ in results])
    assert combined.rank_attention_calls == [[layers * (2 if ac else 1), layers]] * 2


OURS = [("ulysses", None, 2), ("upipe", None, 2), ("ring", {"layout": "contiguous"}, 2),
        ("ring", {"layout": "zigzag"}, 2), ("ring", {"layout": "doc-zigzag"}, 2),
        ("usp-upipe", {"ulysses_degree": 2}, 4), ("usp", {"ulysses_degree": 2}, 4), ("allgather-kv", None, 2),
        ("fpdt", None, 2), ("offload", None, 2), ("no-cp", None, 2), ("ds-ulysses", None, 2),
        ("ds-ulysses-hf", None, 2)]


@pytest.mark.parametrize("method,options,ws", OURS, ids=lambda v: v if isinstance(v, str) else None)
def test_every_attention_of_our_methods_goes_through_the_timer(pool, method, options, ws):
    """Every torch attention op a method runs in the timed steps runs inside a timed kernel call."""
    docs = None if method == "ds-ulysses" else MIXED  # DistributedAttention takes no documents
    # two layers (tiny-mha): whether an op runs inside a timed call does not depend on the layer count
    trial = real_trial(method, 512, ws, docs, options=options, model="tiny-mha")
    results = pool.run(rank_with_op_count, trial, world_size=ws)
    for result, inside, outside in results:
        assert result.status == "ok", result.traceback
        assert result.attention_times_s and all(t > 0 for t in result.attention_times_s)
        assert inside > 0 and outside == 0, (inside, outside)
    row = build_row(trial, _combine_ranks([r for r, _, _ in results]), 1.0)
    assert len(row.figures.rank_attention_s) == ws


def test_a_wrapper_without_our_kernels_records_none(pool):
    """ring-flash-attention's zigzag ring calls flash-attn itself (here the stand-in): nothing is timed."""
    trial = real_trial("rfa-zigzag", 512, 2)
    row, results = row_of(pool, trial, rank_with_flash_standin)
    assert all(r.attention_times_s is None and r.attention_calls is None for r in results)
    assert row.figures.rank_attention_s is None and row.figures.attention_imbalance is None
    assert NONE_SEEN in row.notes
    assert "rank_attention_s" not in row.to_dict()["figures"]
