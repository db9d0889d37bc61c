"""Max-context search: exact to the stated step, every trial a row, OOMs included; the secant on the
load (the default) gives doubling and bisection's answer in fewer probes, and falls back on them where
a probe has no load or the load is far from linear; errors stop the search with a lower bound; trials
isolated so a dying trial is a row."""
from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from bench.measure.config import StepConfig
from bench.measure.result import Measurement, failed
from bench.measure.run import build_row
from bench.measure.trial import Search, Trial
from bench.search.maxctx import doubling, run_isolated, search
from records import human

K = 1024


def fake_runner(limit: int, error_at: int | None = None, seen: list | None = None):
    """A runner whose trials fit up to ``limit`` tokens (no computation)."""

    def run(trial: Trial):
        if seen is not None:
            seen.append(trial.seq_len)
        if error_at is not None and trial.seq_len >= error_at:
            return build_row(trial, failed("error", "boom"), 0.0)
        if trial.seq_len <= limit:
            return build_row(trial, Measurement(peak_bytes=trial.seq_len), 0.0)
        return build_row(trial, failed("oom", "too long"), 0.0)

    return run


def trial(method="upipe", ws=8):
    return Trial.make(method, "llama3-8b", 1, ws, mode="simulated")


def searching(t: Trial, granularity: int, max_seq_len: int, start: int | None = None) -> Trial:
    """``t`` as a max-context search with these parameters."""
    return dataclasses.replace(t, kind="max_context", search=Search(granularity, max_seq_len, start),
                               seq_len=granularity)


def test_doubling_then_bisection_is_exact_to_the_step():
    seen, rows = [], []
    final = search(searching(trial(), 128 * K, 16 << 20), runner=fake_runner(5_000_000, seen=seen),
                   on_row=rows.append, progress=None, propose=doubling)
    assert final.kind == "max_context" and final.status == "ok"
    assert final.figures.max_context == 5_000_000 // (128 * K) * 128 * K  # 4.75M
    assert seen[:7] == [128 * K * 2**i for i in range(7)]  # 128K ... 8M, the first failure
    assert all(s % (128 * K) == 0 for s in seen)
    assert len(rows) == len(seen) == final.figures.trials
    assert sum(r.status == "oom" for r in rows) >= 1  # OOMs are rows too
    assert final.figures.peak_bytes == final.figures.max_context  # figures of the longest fit
    assert any("exact to 131072 tokens" in n for n in final.notes)
    assert final.search == {"granularity": 128 * K, "step": 128 * K, "max_seq_len": 16 << 20, "start": None}


GIB = 1 << 30


def memory_runner(peak_of, seen: list):
    """A runner whose peak is ``peak_of(seq_len)`` bytes, judged against the device's usable memory by
    ``build_row`` (rows past it are ``oom`` with their peak, as simulated ones are)."""

    def run(t: Trial):
        seen.append(t.seq_len)
        return build_row(t, Measurement(peak_bytes=int(peak_of(t.seq_len))), 0.0)

    return run


@pytest.mark.parametrize("shape", ["linear", "steps"])
def test_the_secant_on_the_load_finds_doublings_answer(shape):
    """Same answers as doubling and bisection, for fits anywhere in the range. On memory linear in the
    length (a fixed part plus bytes per token): never more probes, and half of them over the four cases.
    On a load with a step in it (flat, then a jump: the secant alone would creep along one end): at most
    twice its probes."""
    usable = build_row(trial().probe(1 << 20), Measurement(peak_bytes=1), 0.0).figures.usable_bytes
    total = {"doubling": 0, "secant": 0}
    for per_token in (3_000, 7_777, 20_000, 61_000):
        if shape == "linear":
            peak_of = lambda s, b=per_token: 9 * GIB + b * s  # noqa: E731
        else:
            peak_of = lambda s, b=per_token: (usable // 2 if s * b < usable - 9 * GIB else usable + 1)  # noqa: E731
        answers, probes = {}, {}
        for name, propose in (("doubling", doubling), ("secant", None)):
            seen: list[int] = []
            final = search(searching(trial(), 128 * K, 64 << 20, 2 << 20), runner=memory_runner(peak_of, seen),
                           progress=None, propose=propose)
            answers[name], probes[name] = final.figures.max_context, len(seen)
            assert final.figures.trials == len(seen) and len(set(seen)) == len(seen)
        assert answers["secant"] == answers["doubling"] > 0, (per_token, answers)
        assert probes["secant"] <= (probes["doubling"] if shape == "linear" else 2 * probes["doubling"]), probes
        for name in total:
            total[name] += probes[name]
    if shape == "linear":
        assert total["secant"] <= total["doubling"] / 2, total


def test_rows_without_a_load_fall_back_on_doubling_and_bisection():
    """A real out-of-memory row records no peak: the search bisects past it, to the same exact answer."""
    final = search(searching(trial(), 128 * K, 16 << 20), runner=fake_runner(5_000_000), progress=None)
    assert final.figures.max_context == 5_000_000 // (128 * K) * 128 * K


def test_step_respects_the_methods_sequence_multiple():
    # ring's zigzag layout needs multiples of 2*C = 16 at C = 8; 1000 is not one
    final = search(searching(trial("ring"), 1000, 64_000), runner=fake_runner(50_000), progress=None)
    assert final.search["step"] == 2000
    assert final.figures.max_context == 50_000 // 2000 * 2000


def test_limit_reached_is_a_lower_bound_and_nothing_fitting_is_zero():
    final = search(searching(trial(), 128 * K, 1 << 20), runner=fake_runner(10 << 20), progress=None)
    assert final.figures.max_context == 1 << 20
    assert any("lower bound" in n for n in final.notes)
    none = search(searching(trial(), 128 * K, 1 << 20), runner=fake_runner(1000), progress=None)
    assert none.figures.max_context == 0 and any("nothing fits" in n for n in none.notes)


def test_an_error_stops_the_search_and_says_so():
    final = search(searching(trial(), 128 * K, 16 << 20), runner=fake_runner(10 << 20, error_at=2 << 20), progress=None,
                   propose=doubling)
    assert final.status == "error" and "boom" in final.message
    assert final.figures.max_context == 1 << 20


def test_start_and_progress(capsys):
    import sys

    seen = []
    search(searching(trial(), 128 * K, 4 << 20, 1 << 20), runner=fake_runner(3 << 20, seen=seen), progress=sys.stderr)
    assert seen[0] == 1 << 20
    err = capsys.readouterr().err
    assert "[max-context simulated 8xh100-80g upipe llama3-8b] trial 1: 1M -> ok" in err


def test_simulated_search_end_to_end():
    """A real simulated search (one attention block, fast) finds a length that fits followed by
    one that does not."""
    t = Trial.make("ulysses", "llama3-8b", 1, 8, mode="simulated", step=StepConfig(scope="attention"))
    rows = []
    final = search(searching(t, 1 << 20, 64 << 20, 4 << 20), on_row=rows.append, progress=None)
    best = final.figures.max_context
    assert final.status == "ok" and best >= 4 << 20
    statuses = {r.seq_len: r.status for r in rows}
    assert statuses[best] == "ok" and statuses[best + (1 << 20)] == "oom"


def _die(trial, conn):  # runs in the spawned child
    os.kill(os.getpid(), signal.SIGKILL)


def _exit(trial, conn):
    os._exit(3)


def _say_environment(trial, conn):  # runs in the isolated child
    conn.send(("raise", f"{os.environ.get('CPAB_TEST_ISOLATED')} in {os.getcwd()}"))
    conn.close()


def test_an_isolated_trial_runs_in_the_callers_environment_as_it_is_at_the_call(monkeypatch, tmp_path):
    """A simulated trial's process comes from a fork server started once; it still sees the environment
    and working directory of the call, not those of when the server started (as a spawned one would)."""
    t = Trial.make("upipe", "llama3-8b", 1024, 8, mode="simulated")
    with pytest.raises(ValueError, match=r"^None in "):
        run_isolated(t, target=_say_environment)  # the server is running from here on
    monkeypatch.setenv("CPAB_TEST_ISOLATED", "set-after")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"^set-after in {tmp_path}$"):
        run_isolated(t, target=_say_environment)


def test_isolated_trial_that_dies_is_a_row():
    t = Trial.make("upipe", "tiny-llama", 1024, 2, mode="emulated", device="cpu")
    killed = run_isolated(t, target=_die)
    assert killed.status == "oom" and "SIGKILL" in killed.message
    crashed = run_isolated(t, target=_exit)
    assert crashed.status == "error" and "exit code 3" in crashed.message


def test_isolated_emulated_search():
    """Each emulated trial in its own process (one here); the CPU preset's budget is the host's
    memory, so the search reaches its limit."""
    t = Trial.make("upipe", "tiny-mha", 1, 2, mode="emulated", device="cpu", iters=1, smoke=True)
    rows = []
    final = search(searching(t, 256, 256), on_row=rows.append, progress=None)
    assert [(r.seq_len, r.status, r.mode) for r in rows] == [(256, "ok", "emulated")]
    assert final.figures.max_context == 256 and any("lower bound" in n for n in final.notes)


def test_human_sizes():
    assert [human(n) for n in (131072, 1 << 20, 3 << 19, 5 << 20, 1000, 6272 << 10)] == [
        "128K", "1M", "1.5M", "5M", "1000", "6.125M"]
