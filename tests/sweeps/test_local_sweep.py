"""Local sweeps end to end: rows land, reruns skip, failures become error rows, kills resume.

``python -m sweeps`` runs as a subprocess where its process is the point (the first run of
test_run_resume_and_status, and the run SIGKILLed midway); the other tests call its ``main`` in
this process, which submits the same local jobs (each trial still runs in a ``python -m bench``
process of its own), without a Python start-up per command.
"""
from __future__ import annotations

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
from sweeps.runner import run_sweep, status_counts
from sweeps.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


def write_spec(tmp_path: Path, **changes) -> Path:
    spec = dict(name="t", kind="trial", mode="simulated", scope="attention", dtype="bf16", device="h100-80g",
                models=["tiny-llama"], seq_lens=["4K"], world_sizes=[2], methods=["ulysses"],
                out=str(tmp_path / "rows.jsonl"))
    spec.update(changes)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def sweep_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sweeps", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def sweep_main(capsys, *args: str) -> tuple[int, str]:
    """``python -m sweeps`` in this process: its exit status and what it printed to stdout."""
    code = sweeps_main(list(args))
    return code, capsys.readouterr().out


def sweep_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``python -m sweeps`` through its ``main`` in this process, reported as ``sweep_cli`` reports
    the subprocess: exit status, stdout and stderr (where the runner reports each trial)."""
    capsys.readouterr()  # drop what came before
    code = sweeps_main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["sweeps", *args], code, out, err)


def test_run_resume_and_status(tmp_path, capsys):
    """Rows land, a rerun skips them, status counts them; and a job's process unpickles what the
    runner submitted without importing torch (it only starts ``python -m bench``)."""
    path = write_spec(tmp_path, methods=["ulysses", "upipe"])
    first = sweep_cli("run", str(path), "--executor", "local", "--max-parallel", "2")
    assert first.returncode == 0, first.stderr
    rows = read_rows(tmp_path / "rows.jsonl", on_error="raise")
    assert sorted(r.method for r in rows) == ["ulysses", "upipe"]
    assert all(r.status == "ok" and r.mode == "simulated" and r.seq_len == 4096 for r in rows)
    code, out = sweep_main(capsys, "run", str(path), "--executor", "local")
    assert code == 0 and "0 run" in out and "2 skipped" in out
    assert len(read_rows(tmp_path / "rows.jsonl")) == 2
    code, out = sweep_main(capsys, "status", str(path))
    assert code == 0 and "done 2" in out and "pending 0" in out
    submitted = sorted((tmp_path / "logs" / "t").glob("*_submitted.pkl"))
    assert len(submitted) == 2, sorted((tmp_path / "logs" / "t").iterdir())
    probe = subprocess.run([sys.executable, "-c", "import sys; from submitit.core.utils import DelayedSubmission; "
                            "DelayedSubmission.load(sys.argv[1]); print(sorted({'torch', 'bench'} & set(sys.modules)))",
                            str(submitted[0])], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", \
        f"a job's process imports torch or bench to unpickle its job: {probe.stdout}{probe.stderr}"


def test_dry_run_prints_bench_commands_and_submits_nothing(tmp_path, capsys):
    path = write_spec(tmp_path, step={"tiled_mlp": False, "iters": 3})
    out = sweep_in_process(capsys, "run", str(path), "--dry-run")
    assert out.returncode == 0
    assert "python -m bench trial " in out.stderr  # the trial itself, as JSON (Trial.to_json)
    assert '"method": "ulysses"' in out.stderr and '"model": "tiny-llama"' in out.stderr
    assert '"world_size": 2' in out.stderr
    assert '"tiled_mlp": false' in out.stderr and '"iters": 3' in out.stderr
    assert not (tmp_path / "rows.jsonl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA: the job must fail there")
def test_failed_trial_becomes_an_error_row_with_its_log(tmp_path, capsys):
    """A trial the spec check lets through (it cannot know the compute node has no CUDA) fails in
    its job; the runner records the failure as an error row with the job's log. (Invalid options
    no longer get this far: tests/test_user_runs.py checks they are refused before submitting.)"""
    path = write_spec(tmp_path, mode="emulated")
    out = sweep_in_process(capsys, "run", str(path), "--executor", "local")
    assert out.returncode == 1, out.stdout + out.stderr
    (row,) = read_rows(tmp_path / "rows.jsonl", on_error="raise")
    assert row.status == "error" and "needs CUDA, which this machine lacks" in row.message
    log = row.message.rsplit("log: ", 1)[1].strip()
    assert Path(log).is_file(), log
    counts = status_counts(load_spec(path))
    assert counts["failed"] == 1


def test_bad_spec_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    path = write_spec(tmp_path, mode="fast")
    out = sweep_in_process(capsys, "run", str(path))
    assert out.returncode == 2 and "mode: 'fast' is not allowed" in out.stderr and "Traceback" not in out.stderr


def test_sigkill_midway_then_rerun_gives_exactly_one_row_per_trial(tmp_path):
    """Three trials (one method: what resuming keys on is the trial, whichever method it runs): the
    runner is killed once two have rows, the third's job started or about to; the rerun runs only it."""
    path = write_spec(tmp_path, seq_lens=["1K", "2K", "4K"], methods=["ulysses"])
    rows_path = tmp_path / "rows.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "sweeps", "run", str(path), "--executor", "local"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(read_rows(rows_path, on_error="skip")) < 2:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and every job it started, mid-sweep
    proc.wait()
    done_before = len(read_rows(rows_path, on_error="raise"))
    assert 2 <= done_before < 3, done_before
    summary = run_sweep(load_spec(path), "local")
    assert summary.skipped == done_before and summary.failed == 0
    rows = read_rows(rows_path, on_error="raise")  # raises on any corrupt line
    keys = sorted((r.method, r.seq_len) for r in rows)
    assert keys == [("ulysses", s) for s in (1024, 2048, 4096)], keys


def test_local_real_trial_spawns_its_own_gloo_ranks(tmp_path, capsys):
    """A local job is one task: bench must spawn the trial's ranks itself, not take the
    submitit job (1 task) for the launched world."""
    path = write_spec(tmp_path, mode="real", dtype="fp32", device="cpu", seq_lens=["512"],
                      step={"warmup": 1, "iters": 1, "smoke": True})
    out = sweep_in_process(capsys, "run", str(path), "--executor", "local")
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = read_rows(tmp_path / "rows.jsonl", on_error="raise")
    assert (row.status, row.mode, row.world_size) == ("ok", "real", 2), row.message


def test_upipe_best_runs_through_a_sweep_and_resumes(tmp_path, capsys):
    """The named configuration end to end: expanded in the spec, run by bench with its levers,
    its row records the U that auto chose and why, and a rerun recognises the row as done."""
    path = write_spec(tmp_path, scope="model", seq_lens=["16K"], world_sizes=[2], methods=["upipe-best"])
    first = sweep_in_process(capsys, "run", str(path), "--executor", "local")
    assert first.returncode == 0, first.stderr
    (row,) = read_rows(tmp_path / "rows.jsonl", on_error="raise")
    assert row.status == "ok" and row.method == "upipe"
    assert row.options["chunk_heads_requested"] == "auto" and isinstance(row.options["chunk_heads"], int)
    assert row.notes and row.notes[0].startswith(f"chunk_heads=auto -> {row.options['chunk_heads']}")
    assert all(row.levers[k] for k in ("ac", "ac_offload", "tiled_mlp", "tiled_norm", "chunked_loss"))
    code, out = sweep_main(capsys, "run", str(path), "--executor", "local")
    assert code == 0 and "0 run" in out and "1 skipped" in out, out
