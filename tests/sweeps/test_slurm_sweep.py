"""Sweeps through the real Slurm brought up by scripts/slurm-up.sh (see conftest.py).

A 2-task gloo trial (one task per rank, torch.distributed initialised from the Slurm job
environment), a failing trial's error row, and cancel + resume (trials held back at a known
point by ``$CPAB_SWEEP_HOLD``, so the cancel never races the trials).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from records import read_rows
from sweeps.__main__ import main as sweeps_main
from sweeps.jobs import HOLD_ENV, hold_path
from sweeps.spec import load_spec

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]


def spec_file(tmp_path: Path, name: str, **changes) -> Path:
    spec = dict(name=name, kind="trial", mode="real", scope="attention", dtype="fp32", device="cpu",
                models=["tiny-llama"], seq_lens=["512"], world_sizes=[2], methods=["upipe"],
                step={"warmup": 1, "iters": 1, "smoke": True}, out=str(tmp_path / "rows.jsonl"),
                slurm={"partition": "debug", "time_min": 10, "cpus_per_task": 1, "max_parallel": 1})
    spec.update(changes)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def sweeps(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sweeps", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def sweeps_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``python -m sweeps`` through its ``main`` in this process (the same submissions to Slurm,
    without a Python start-up), reported as ``sweeps`` reports the subprocess. The subprocess runs
    where its process is the point: the first sweep of test_two_task_gloo_trial_through_slurm, and
    the sweep test_cancel_then_resume_submits_only_missing_trials interrupts."""
    capsys.readouterr()  # drop what came before
    code = sweeps_main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["sweeps", *args], code, out, err)


@pytest.fixture
def cancel_after(slurm_cluster):
    names: list[str] = []
    yield names.append
    for name in names:
        subprocess.run(["scancel", "-n", f"sweep-{name}"], capture_output=True)


def sacct_state(job_id: str) -> str:
    for _ in range(30):
        out = subprocess.run(["sacct", "-n", "-X", "-j", job_id, "-o", "State"], capture_output=True, text=True)
        state = out.stdout.strip().split()[0] if out.stdout.strip() else ""
        if state and state not in ("PENDING", "RUNNING"):
            return state
        time.sleep(1)
    return state


def test_two_task_gloo_trial_through_slurm(tmp_path, cancel_after, capsys):
    name = f"slurm-ok-{tmp_path.name[-12:]}"
    cancel_after(name)
    path = spec_file(tmp_path, name)
    out = sweeps("run", str(path), "--executor", "slurm")
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = read_rows(tmp_path / "rows.jsonl", on_error="raise")
    assert (row.status, row.mode, row.world_size, row.method) == ("ok", "real", 2, "upipe"), row.message
    assert row.figures.step_time_s and row.figures.step_time_s > 0
    jobs = json.loads((tmp_path / "rows.jobs.json").read_text())
    (info,) = jobs.values()
    assert info["executor"] == "slurm" and sacct_state(info["job_id"]) == "COMPLETED"
    assert sweeps_main(["run", str(path), "--executor", "slurm"]) == 0  # again, in this process: nothing to submit
    assert "1 skipped" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA: the job must fail there")
def test_failing_trial_on_slurm_is_an_error_row(tmp_path, cancel_after, capsys):
    """A trial the spec check lets through (it cannot know the node has no CUDA) fails in its job;
    the runner records an error row with the job's log. (Invalid options are refused before
    submitting now: tests/test_user_runs.py.) A one-rank trial: a one-task job fails as a job of
    several does, with fewer processes to start."""
    name = f"slurm-bad-{tmp_path.name[-12:]}"
    cancel_after(name)
    path = spec_file(tmp_path, name, device="h100-80g", world_sizes=[1])
    out = sweeps_in_process(capsys, "run", str(path), "--executor", "slurm")
    assert out.returncode == 1, out.stdout + out.stderr
    (row,) = read_rows(tmp_path / "rows.jsonl", on_error="raise")
    assert row.status == "error" and "needs CUDA, which this machine lacks" in row.message
    assert Path(row.message.rsplit("log: ", 1)[1].strip()).is_file()


def _wait_for(condition, what: str, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.5)


def _interruptible() -> None:
    """In the sweep's process before it starts: SIGINT back to its default disposition. A test
    run started as a background job of a non-interactive shell (how CI may run it) inherits
    SIGINT *ignored*, Python then installs no KeyboardInterrupt handler, and the user's Ctrl-C
    this test stands for would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_cancel_then_resume_submits_only_missing_trials(tmp_path, cancel_after, capsys):
    """The user stops a sweep (SIGINT) with one trial done, one in its job and one not yet
    submitted, and cancels its jobs; the same command again submits only the two without a row.
    The 512 and 1K trials are held back ($CPAB_SWEEP_HOLD, sweeps.jobs) until the stop, so it
    always finds them unfinished, however fast the trials run. One-rank simulated trials: what is
    checked is which trials the runner submits, skips and records, which does not depend on the
    mode, and a simulated trial runs in its bench process (no rank to spawn, no step to time). A
    real trial through Slurm is test_two_task_gloo_trial_through_slurm's."""
    name = f"slurm-cancel-{tmp_path.name[-12:]}"
    cancel_after(name)
    path = spec_file(tmp_path, name, seq_lens=["256", "512", "1K"], world_sizes=[1], mode="simulated")
    rows_path, jobs_path = tmp_path / "rows.jsonl", tmp_path / "rows.jobs.json"
    hold = tmp_path / "hold"
    hold.mkdir()
    first, *held = load_spec(path).trials()
    for trial in held:
        hold_path(hold, trial).touch()
    proc = subprocess.Popen([sys.executable, "-m", "sweeps", "run", str(path), "--executor", "slurm"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, **{HOLD_ENV: str(hold)}), preexec_fn=_interruptible)

    def first_done_second_held() -> bool:
        if proc.poll() is not None:
            return True  # it ended by itself: the assertions below say how
        jobs = json.loads(jobs_path.read_text()) if jobs_path.exists() else {}  # written atomically
        if not read_rows(rows_path, on_error="skip") or len(jobs) != 2:
            return False
        second = next(j["job_id"] for j in jobs.values() if j["label"] == held[0].label)
        state = subprocess.run(["squeue", "-h", "-j", second, "-o", "%T"], capture_output=True, text=True)
        return state.stdout.strip() == "RUNNING"  # started, and held: it cannot finish

    try:
        _wait_for(first_done_second_held, "the first trial's row and the second trial's job running")
    finally:
        proc.send_signal(signal.SIGINT)  # the user stops the sweep ...
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "run the same command again to resume" in out, out
    subprocess.run(["scancel", "-n", f"sweep-{name}"], check=True)  # ... and cancels its jobs
    _wait_for(lambda: not subprocess.run(["squeue", "-h", "-n", f"sweep-{name}"], capture_output=True,
                                         text=True).stdout.strip(), "the cancelled job to leave the queue", 60)
    assert [r.seq_len for r in read_rows(rows_path, on_error="raise")] == [first.seq_len]
    again = sweeps_in_process(capsys, "run", str(path), "--executor", "slurm")  # nothing held now
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1 skipped" in again.stdout
    submitted = [line.split(" as job")[0].split("submitted ", 1)[1] for line in again.stderr.splitlines()
                 if "submitted " in line]
    assert submitted == [t.label for t in held], again.stderr
    rows = read_rows(rows_path, on_error="raise")
    assert sorted((r.seq_len, r.status) for r in rows) == [(256, "ok"), (512, "ok"), (1024, "ok")], \
        [(r.seq_len, r.status, r.message) for r in rows]
