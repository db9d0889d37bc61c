"""A user's runs never touch committed data, and bad input is one line before any work.

Each test is one defect a new user met (the issue's list): where outputs go by default, output
paths that cannot be written, sweep specs with unknown names or invalid options, malformed
YAML, bad flags; and the demo's machinery on a clean checkout leaving ``git status`` clean.

Where a test checks several inputs of one command, one of them goes through a subprocess (the
command's wiring: exit status, stderr, working directory) and the others through the command's
``main`` in this process (``in_process``), which prints and returns the same: a Python start-up
per input would cost seconds each.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from analysis.load import load_rows
from bench.cli import main as bench_main
from records import append_rows, read_rows
from records.outputs import OutputError, check_dir, check_file
from sweeps.__main__ import main as sweeps_main
from tests.rowfactory import make_row

REPO = Path(__file__).resolve().parents[1]
READ_ONLY_FILE = Path("/sys/kernel/uevent_seqnum")  # read-only even for root (sysfs)


def cli(module: str, *args: str, cwd: Path = REPO, env: dict | None = None, timeout: float = 300):
    env = dict(os.environ, PYTHONPATH=str(REPO), MPLBACKEND="Agg", **(env or {}))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def in_process(capsys, module: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` through its ``main`` in this process: what it returned (or exited
    with: argparse exits) and printed, as ``cli`` reports a subprocess."""
    capsys.readouterr()  # drop what came before
    main = {"bench": bench_main, "sweeps": sweeps_main}[module]
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([module, *args], code, out, err)


def one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "error" in line]) >= 1


TINY_RUN = ("run", "--method", "ulysses", "--model", "tiny-llama", "--seq-len", "4K", "--world-size", "2",
            "--scope", "attention")


# ----------------------------------------------------------------------------- output paths

def test_check_file_and_dir_refuse_what_cannot_be_written(tmp_path):
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    with pytest.raises(OutputError, match="is a directory"):
        check_file(tmp_path)
    with pytest.raises(OutputError, match="is a file, not a directory"):
        check_file(a_file / "rows.jsonl")
    with pytest.raises(OutputError, match="is a file, not a directory"):
        check_dir(a_file)
    assert check_file(tmp_path / "new" / "rows.jsonl") == tmp_path / "new" / "rows.jsonl"
    assert not (tmp_path / "new").exists(), "checking must not create anything"
    if READ_ONLY_FILE.exists():
        with pytest.raises(OutputError, match="not writable"):
            check_file(READ_ONLY_FILE)


def test_bench_out_problems_are_one_line_before_the_trial(tmp_path, capsys):
    """The first through ``python -m bench`` (a subprocess), the others through its ``main``."""
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    one_line_error(cli("bench", *TINY_RUN, "--out", str(tmp_path)), "is a directory")
    one_line_error(in_process(capsys, "bench", *TINY_RUN, "--out", str(a_file / "rows.jsonl")),
                   "is a file, not a directory")
    if READ_ONLY_FILE.exists():
        one_line_error(in_process(capsys, "bench", *TINY_RUN, "--out", str(READ_ONLY_FILE)), "not writable")
    one_line_error(in_process(capsys, "bench", "plan", "--model", "tiny-llama", "--gpus", "2", "--out-dir",
                              str(a_file)), "is a file, not a directory")


def test_bench_refuses_a_fractional_integer_option(capsys):
    one_line_error(in_process(capsys, "bench", *TINY_RUN, "--opt", "kernel=math", "--method", "upipe", "--opt",
                              "chunk_heads=2.5", "--no-save"), "must be an int")


def test_bench_writes_under_runs_of_the_working_directory(tmp_path, capsys, monkeypatch):
    """``bench``'s ``main`` in this process, from ``tmp_path`` (the subprocess with its defaults, in a
    checkout of its own, is test_a_user_session_on_a_clean_checkout_leaves_git_status_clean's)."""
    committed = REPO / "results" / "bench" / "simulated.jsonl"
    before = committed.read_bytes() if committed.exists() else None
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CPAB_RUNS", "")
    proc = in_process(capsys, "bench", *TINY_RUN)
    assert proc.returncode == 0, proc.stderr
    (row,) = read_rows(tmp_path / "runs" / "bench" / "simulated.jsonl", on_error="raise")
    assert row.method == "ulysses"
    assert (committed.read_bytes() if committed.exists() else None) == before


# ----------------------------------------------------------------------------- sweeps

def write_spec(tmp_path: Path, **changes) -> Path:
    spec = dict(name="t", kind="trial", mode="simulated", scope="attention", device="h100-80g",
                models=["tiny-llama"], seq_lens=["4K"], world_sizes=[2], methods=["ulysses"])
    spec.update(changes)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("changes,needle", [
    ({"methods": ["ulysess"]}, "unknown method 'ulysess'"),
    ({"models": ["llama9"]}, "unknown model 'llama9'"),
    ({"device": "h900"}, "unknown device preset 'h900'"),
    ({"methods": [{"name": "upipe", "options": {"chunk_heads": 3}}]}, "chunk_heads=3 is not a multiple"),
    ({"methods": [{"name": "upipe", "options": {"chunk_heads": 2.5}}]}, "must be an int"),
    ({"methods": [{"name": "ulysses", "options": {"colour": 1}}]}, "unknown option(s) ['colour']"),
])
def test_bad_specs_are_refused_before_submitting_dry_run_included(tmp_path, capsys, changes, needle):
    """Through ``sweeps``' ``main`` in this process (test_sweep_flags_and_files_are_one_line_errors
    runs a refused spec through ``python -m sweeps``)."""
    out = tmp_path / "rows.jsonl"
    path = write_spec(tmp_path, out=str(out), **changes)
    for extra in ((), ("--dry-run",)):
        proc = in_process(capsys, "sweeps", "run", str(path), *extra)
        one_line_error(proc, needle)
        assert " as job " not in proc.stderr
    assert not out.exists() and not (tmp_path / "logs").exists(), "nothing may be written"


def test_every_problem_of_a_spec_is_its_own_line(tmp_path, capsys):
    path = write_spec(tmp_path, out=str(tmp_path / "rows.jsonl"), world_sizes=[2, 3],
                      methods=["ulysses", {"name": "upipe", "options": {"chunk_heads": 2}}])
    proc = in_process(capsys, "sweeps", "run", str(path), "--dry-run")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert any("ulysses on tiny-llama x3" in line for line in lines), proc.stderr
    assert any("upipe[chunk_heads=2] on tiny-llama x3" in line for line in lines), proc.stderr
    assert "2 problem(s); nothing was submitted" in proc.stderr or "problem(s)" in lines[-1]


def test_sweep_flags_and_files_are_one_line_errors(tmp_path, capsys):
    """The flag and the empty file through ``sweeps``' ``main`` in this process, the broken YAML
    and a spec naming an unknown method through ``python -m sweeps`` (a subprocess)."""
    path = write_spec(tmp_path, out=str(tmp_path / "rows.jsonl"))
    one_line_error(in_process(capsys, "sweeps", "run", str(path), "--max-parallel", "-1"), "must be >= 1")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    one_line_error(in_process(capsys, "sweeps", "run", str(empty), "--set", "slurm.partition=gpu"), "name:")
    unknown = write_spec(tmp_path, out=str(tmp_path / "rows.jsonl"), methods=["ulysess"])
    proc = cli("sweeps", "run", str(unknown))
    one_line_error(proc, "unknown method 'ulysess'")
    assert " as job " not in proc.stderr and not (tmp_path / "rows.jsonl").exists(), "nothing may be submitted"
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: t\nmethods: [ulysses\nmodels: [x]\n")
    proc = cli("sweeps", "run", str(broken))
    one_line_error(proc, f"{broken}:")
    assert len(proc.stderr.strip().splitlines()) == 1 and "not valid YAML" in proc.stderr
    assert ":3:" in proc.stderr or ":4:" in proc.stderr  # line (and column) of the problem


def test_help_examples_exist(capsys):
    proc = in_process(capsys, "sweeps", "--help")
    assert proc.returncode == 0 and "sweeps/configs/" in proc.stdout, proc.stdout
    for word in proc.stdout.split():
        if word.startswith("sweeps/configs/"):
            assert (REPO / word).is_file(), word


def test_sweep_defaults_to_runs_and_status_finds_its_rows(tmp_path, capsys, monkeypatch):
    """The first run through ``python -m sweeps`` from ``tmp_path``; status and the rerun through its
    ``main`` in this process, from the same directory."""
    path = write_spec(tmp_path)
    run = cli("sweeps", "run", str(path), "--executor", "local", cwd=tmp_path, env={"CPAB_RUNS": ""})
    assert run.returncode == 0, run.stderr
    assert "ulysses tiny-llama 4K x2 simulated: ok" in run.stderr  # each trial reported as it ends
    rows = read_rows(tmp_path / "runs" / "sweeps" / "t.jsonl", on_error="raise")
    assert [r.method for r in rows] == ["ulysses"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CPAB_RUNS", "")
    assert sweeps_main(["status", str(path)]) == 0
    status = capsys.readouterr().out
    assert "done 1" in status and "pending 0" in status, status
    again = in_process(capsys, "sweeps", "run", str(path), "--executor", "local", "--rerun")
    assert again.returncode == 0 and "1 run" in again.stdout, again.stdout + again.stderr
    assert len(read_rows(tmp_path / "runs" / "sweeps" / "t.jsonl")) == 2  # re-measured; the newest wins


# ----------------------------------------------------------------------------- analysis

def test_a_coarse_search_never_replaces_a_finer_one(tmp_path):
    def search_row(step: int, found: int, time: str):
        return make_row(kind="max_context", seq_len=16 << 20, max_context=found, time=time, mode="simulated",
                        search={"granularity": step, "step": step, "max_seq_len": 16 << 20, "start": None})

    append_rows(tmp_path / "a.jsonl", [search_row(128 << 10, 5767168, "2026-01-01T00:00:00+00:00"),
                                       search_row(1 << 20, 5 << 20, "2026-02-01T00:00:00+00:00")])
    df = load_rows(tmp_path)
    assert sorted(df["max_context"]) == [5 << 20, 5767168]


def test_analysis_labels_your_rows_apart_and_refuses_a_file_as_out(tmp_path):
    committed, mine = tmp_path / "committed", tmp_path / "mine"
    row = make_row(method="ulysses", peak_gib=10.0)
    append_rows(committed / "r.jsonl", [row])
    append_rows(mine / "r.jsonl", [row])
    df = load_rows(committed, user_dirs=[mine])
    assert sorted(df["origin"]) == ["committed", "yours"]
    assert any(label.endswith(", yours") for label in df["mode_label"])
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    one_line_error(cli("analysis", "figs", "--out", str(a_file)), "is a file, not a directory")


# ----------------------------------------------------------------------------- the demo's machinery

def test_a_user_session_on_a_clean_checkout_leaves_git_status_clean(tmp_path):
    """Copy the tracked tree into a fresh repository, run a sweep, a bench trial and the figures
    with their defaults, as the demo does, and check that git sees no change."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout
    clone = tmp_path / "clone"
    for name in filter(None, files.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / name)
    git = dict(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    env = dict(os.environ, **git)
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "clean checkout"]):
        subprocess.run(cmd, cwd=clone, check=True, env=env, capture_output=True)

    def run(module: str, *args: str) -> None:
        proc = subprocess.run([sys.executable, "-m", module, *args], cwd=clone, capture_output=True, text=True,
                              timeout=600, env=dict(env, PYTHONPATH=str(clone), MPLBACKEND="Agg", CPAB_RUNS=""))
        assert proc.returncode == 0, proc.stderr[-2000:]

    spec = write_spec(tmp_path)
    run("sweeps", "run", str(spec), "--executor", "local")
    run("bench", *TINY_RUN)
    run("analysis", "figs", "--mine", "runs", "--quiet")
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert status == "", f"the user's session changed the checkout:\n{status}"
    assert (clone / "runs" / "figs" / "README.md").is_file() and (clone / "runs" / "sweeps" / "t.jsonl").is_file()
