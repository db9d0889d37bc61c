"""Step-time spread and host load: a real trial times at least five steps and reports their
median, minimum and maximum (each step as long as its slowest rank's); fewer steps are refused
unless the trial is a smoke run, whose row says so; the host's load is recorded with a
``host_shared`` verdict that follows the trial's own thread count."""
from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.measure import run as run_mod
from bench.measure.result import LoadAround, Measurement
from bench.measure.timing import MIN_TIMED_STEPS, StepStats, host_shared, slowest_rank_steps
from bench.measure.trial import Trial
from records import validate_row

REPO = Path(__file__).resolve().parents[3]


def test_stats_are_the_median_and_extremes_of_the_steps():
    s = StepStats((3.0, 1.0, 10.0, 2.0, 4.0))
    assert (s.median, s.min, s.max) == (3.0, 1.0, 10.0)  # one slow step does not move the median
    assert s.plus(0.5).times == (3.5, 1.5, 10.5, 2.5, 4.5)
    with pytest.raises(ValueError, match="no timed steps"):
        StepStats(())


def test_a_job_step_lasts_as_long_as_its_slowest_rank():
    assert slowest_rank_steps([[1.0, 5.0, 2.0], [2.0, 1.0, 2.5]]) == [2.0, 5.0, 2.5]
    with pytest.raises(ValueError, match="different numbers of steps"):
        slowest_rank_steps([[1.0, 2.0], [1.0]])


@pytest.mark.parametrize("before,after,own,shared", [
    (0.5, 1.9, 2, False),   # the trial's own two threads explain the load
    (2.6, 1.0, 2, True),    # someone else's work was running before the timing
    (1.0, 4.4, 4, True),    # four own threads, more load than that
    (3.9, 3.9, 4, False),
])
def test_host_shared_means_load_above_the_trials_own_threads(before, after, own, shared):
    assert host_shared(before, after, own) is shared


def _real(**kw) -> Trial:
    return Trial.make("ulysses", "tiny-mha", 512, 2, mode="real", device="cpu", warmup=1, **kw)


def test_fewer_than_five_timed_steps_are_refused_without_smoke():
    with pytest.raises(ValueError, match=r"iters=2: a real trial times at least 5 steps.*--smoke"):
        _real(iters=2).validate()
    with pytest.raises(ValueError, match="emulated trial times at least 5"):
        Trial.make("ulysses", "tiny-mha", 512, 2, mode="emulated", device="cpu", iters=4).validate()
    _real(iters=2, smoke=True).validate()
    _real().validate()  # the default times MIN_TIMED_STEPS steps
    assert _real().iters == MIN_TIMED_STEPS == 5
    # simulated trials time nothing: iters does not matter there
    Trial.make("ulysses", "tiny-mha", 512, 2, mode="simulated", device="cpu", iters=1).validate()


def test_smoke_survives_the_trip_to_a_sweep_job():
    assert Trial.from_json(_real(iters=1, smoke=True).to_json()).smoke is True


@pytest.mark.slow  # a subprocess
def test_cli_refuses_few_steps_in_one_line_before_running():
    p = subprocess.run([sys.executable, "-m", "bench", "run", "--method", "ulysses", "--model", "tiny-mha",
                        "--seq-len", "512", "--world-size", "2", "--mode", "real", "--device", "cpu",
                        "--iters", "3", "--no-save"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "--smoke" in lines[0] and "at least 5" in lines[0], p.stderr
    assert "[real on" not in p.stderr  # refused before any rank was spawned


def _rank(times, threads=1, host="h", before=0.2, after=0.4) -> Measurement:
    return Measurement(compute_time_s=sum(times) / len(times), step_times_s=times, threads=threads, host=host,
                       host_load=LoadAround(before, after, 2), peak_bytes=10)


def test_row_from_ranks_reports_median_min_max_of_the_slowest_rank_steps():
    trial = _real()
    ranks = [_rank([1.0, 1.2, 0.9, 3.0, 1.1]), _rank([1.1, 1.0, 1.0, 1.0, 5.0])]
    row = run_mod.build_row(trial, run_mod._combine_ranks(ranks), wall_s=10.0)
    f = row.figures
    assert f.step_times_s == [1.1, 1.2, 1.0, 3.0, 5.0]
    assert (f.step_time_s, f.step_time_min_s, f.step_time_max_s) == (1.2, 1.0, 5.0)
    assert f.tokens_per_s_per_device == pytest.approx(256 / 1.2)  # throughput from the median
    assert f.trial_threads == 2 and f.host_cpus == 2 and f.host_shared is False
    assert any(n.startswith("host load: 1-min load average 0.20 before / 0.40 after") for n in row.notes)
    validate_row(row)


def test_row_says_when_the_host_was_shared_and_when_it_is_a_smoke_run():
    trial = _real(iters=2, smoke=True)
    ranks = [_rank([1.0, 2.0], before=3.5, after=3.1), _rank([1.0, 2.0], before=3.5, after=3.1)]
    row = run_mod.build_row(trial, run_mod._combine_ranks(ranks), wall_s=1.0)
    assert row.figures.host_shared is True
    assert any(n.startswith("host shared: 1-min load average 3.50 before / 3.10 after") for n in row.notes)
    assert any(n.startswith("smoke run: 2 timed step(s), fewer than 5") for n in row.notes)


def test_emulated_steps_include_the_modelled_communication():
    trial = Trial.make("ulysses", "tiny-mha", 512, 2, mode="emulated", device="cpu")
    result = dataclasses.replace(_rank([1.0, 2.0, 3.0, 4.0, 5.0]), comm_time_s=0.5)
    f = run_mod.build_row(trial, result, wall_s=1.0).figures
    assert f.step_times_s == [1.5, 2.5, 3.5, 4.5, 5.5]
    assert f.step_time_s == pytest.approx(f.compute_time_s + f.comm_time_s) == 3.5


@pytest.mark.slow  # spawns two gloo ranks
def test_a_tiny_real_trial_records_five_steps_and_the_host_load():
    """Two spawned gloo ranks, tiny model, 512 tokens: the figures, not the speed."""
    row = run_mod.run_trial(_real(threads=1))
    assert row.status == "ok", row.message
    f = row.figures
    assert len(f.step_times_s) >= MIN_TIMED_STEPS
    assert f.step_time_s == statistics.median(f.step_times_s)
    assert f.step_time_min_s == min(f.step_times_s) <= f.step_time_s <= f.step_time_max_s == max(f.step_times_s)
    assert f.compute_time_s == f.step_time_s
    assert f.host_load_before is not None and f.host_load_after is not None
    assert f.host_cpus >= 1 and f.trial_threads == 2 and isinstance(f.host_shared, bool)
    assert any(n.startswith(("host load:", "host shared:")) for n in row.notes)
    assert not any(n.startswith("smoke run") for n in row.notes)
