"""Run a sweep: expand, skip finished trials, submit the rest with submitit, watch, record.

Resumable by construction: a trial is finished exactly when its row is in the sweep's rows
file (bench appends it atomically at the end of the trial), so running a sweep again after
a kill, a preemption or a cancel submits only the trials without a row. A job that fails
or times out becomes an ``error`` row carrying its log path and the last lines of its
error, so failures are visible in every table and are not retried unless asked
(``--retry-errors``). Submitted jobs are remembered in ``<rows>.jobs.json`` so that
``status`` can tell running from pending.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import submitit

import methods
from bench.measure.trial import Trial
from records import GiB, human

from .jobs import BenchJob, bench_argv
from .results import error_row_for, finished, trial_id
from .spec import SweepSpec

EXECUTORS = ("local", "slurm", "debug")
LOCAL_EXECUTORS = ("local", "debug")  # they run the trials on this machine: it is the compute node


@dataclass
class SweepSummary:
    total: int
    skipped: int
    submitted: int
    ok: int
    failed: int


def _jobs_file(spec: SweepSpec) -> Path:
    return spec.rows_path.with_suffix(".jobs.json")


def _load_jobs(spec: SweepSpec) -> dict[str, dict]:
    path = _jobs_file(spec)
    return json.loads(path.read_text()) if path.exists() else {}


def _save_jobs(spec: SweepSpec, jobs: dict[str, dict]) -> None:
    path = _jobs_file(spec)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(jobs, indent=1))
    tmp.replace(path)  # atomic: a kill never leaves a half-written job list


def make_executor(spec: SweepSpec, kind: str, folder: Path, trial: Trial | None = None):
    """A submitit executor for ``kind``; Slurm resources from the spec's ``slurm:`` block."""
    if kind not in EXECUTORS:
        raise ValueError(f"executor {kind!r} is not one of {list(EXECUTORS)}")
    if kind == "slurm":
        if shutil.which("sbatch") is None:
            raise ValueError(
                "executor 'slurm' needs Slurm's sbatch on PATH; on this machine run "
                "scripts/slurm-up.sh, or use --executor local"
            )
    executor = submitit.AutoExecutor(folder=str(folder), cluster=kind)
    sl = spec.slurm
    params: dict[str, Any] = {"timeout_min": int(sl.get("time_min", 60)), "name": f"sweep-{spec.name}"}
    if kind == "slurm":
        ws = trial.world_size if trial else 1
        per_node = int(sl.get("gpus_per_node") or sl.get("tasks_per_node") or ws) or ws
        params.update(
            nodes=math.ceil(ws / per_node), tasks_per_node=min(ws, per_node),
            slurm_partition=sl.get("partition"), cpus_per_task=int(sl.get("cpus_per_task", 1)),
        )
        if sl.get("gpus_per_node"):
            params["gpus_per_node"] = int(sl["gpus_per_node"])
        if sl.get("mem_gb"):
            params["mem_gb"] = int(sl["mem_gb"])
        extra = {k: sl[k] for k in ("account", "constraint", "qos") if sl.get(k)}
        if extra:
            params["slurm_additional_parameters"] = extra
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor, (params.get("nodes", 1) * params.get("tasks_per_node", 1))


def status_counts(spec: SweepSpec) -> Counter:
    """done / failed / running / pending counts over the spec's trials."""
    rows = finished(spec.rows_path, spec.trials())
    jobs = _load_jobs(spec)
    counts: Counter = Counter()
    for trial in spec.trials():
        tid = trial_id(trial)
        row = rows.get(tid)
        if row is not None:
            counts["failed" if row == "error" else "done"] += 1
        elif tid in jobs and _job_alive(jobs[tid]):
            counts["running"] += 1
        else:
            counts["pending"] += 1
    return counts


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] not in "ZX"  # a zombie has finished
    except (OSError, IndexError):
        return False


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (children first found through /proc)."""
    def children(p: int) -> list[int]:
        out = []
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    out += [int(c) for c in f.read().split()]
        except OSError:
            pass
        return out

    stack, seen = [pid], []
    while stack:
        p = stack.pop()
        seen.append(p)
        stack += children(p)
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _job_alive(info: dict) -> bool:
    if info.get("executor") != "slurm":
        return bool(info.get("alive_hint")) and _pid_alive(int(info["job_id"]))
    res = subprocess.run(["squeue", "-h", "-j", str(info["job_id"]), "-o", "%T"], capture_output=True, text=True)
    return res.returncode == 0 and bool(res.stdout.strip())


def unchecked_needs(trials: list[Trial]) -> list[str]:
    """One line per method whose trials need optional modules that this machine cannot import
    (``MethodInfo.missing``), for a sweep submitted elsewhere: the compute node checks them
    when the trial runs (``Trial.validate``), as it checks CUDA."""
    needs: dict[str, list[str]] = {}
    for trial in trials:
        for module in methods.get_info(trial.method).missing(trial.supplies()):
            if module not in needs.setdefault(trial.method, []):
                needs[trial.method].append(module)
    return [f"{name} needs {', '.join(mods)} (checked on the compute node)" for name, mods in needs.items() if mods]


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = int(width * done / total) if total else width
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


def run_sweep(
    spec: SweepSpec, executor: str = "local", dry_run: bool = False, max_parallel: int | None = None,
    retry_errors: bool = False, poll_s: float = 1.0, stream: TextIO | None = None, rerun: bool = False,
) -> SweepSummary:
    stream = stream or sys.stderr  # looked up per call: whatever stderr is now (redirected, captured)
    if max_parallel is not None and max_parallel < 1:
        raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
    trials = spec.trials()
    rows = finished(spec.rows_path, trials)
    todo = [t for t in trials
            if rerun or trial_id(t) not in rows or (retry_errors and rows[trial_id(t)] == "error")]
    skipped = len(trials) - len(todo)
    print(f"sweep {spec.name}: {len(trials)} trials, {skipped} already have rows in {spec.rows_path}, "
          f"{len(todo)} to run ({executor})", file=stream)
    if executor not in LOCAL_EXECUTORS:
        for line in unchecked_needs(todo):
            print("  " + line, file=stream)
    if dry_run:
        for t in todo:
            print("  python -m bench " + " ".join(shlex.quote(a) for a in bench_argv(t, spec.rows_path,
                                                                                     spec.extrapolates(t))),
                  file=stream)
        return SweepSummary(len(trials), skipped, 0, 0, 0)
    spec.rows_path.parent.mkdir(parents=True, exist_ok=True)
    folder = spec.rows_path.parent / "logs" / spec.name
    limit = max_parallel or int(spec.slurm.get("max_parallel", 0)) or (1 if executor != "slurm" else len(todo) or 1)
    if limit < 1:
        raise ValueError(f"slurm.max_parallel must be >= 1, got {spec.slurm.get('max_parallel')}")
    tail = RowTail(spec.rows_path)
    jobs_state = _load_jobs(spec)
    pending, running = [], []
    for trial in todo:  # jobs left behind by a killed `run`: adopt them on Slurm, kill them locally
        info = jobs_state.get(trial_id(trial))
        if info and _job_alive(info):
            if info["executor"] == "slurm":
                running.append((trial, submitit.SlurmJob(folder=str(folder), job_id=info["job_id"])))
                print(f"  adopted running job {info['job_id']} for {trial.label}", file=stream)
                continue
            _kill_tree(int(info["job_id"]))
            print(f"  killed orphaned job {info['job_id']} of an interrupted run ({trial.label})", file=stream)
        pending.append(trial)
    ok = failed = 0
    last_line = ""
    while pending or running:
        while pending and len(running) < limit:
            trial = pending.pop(0)
            ex, tasks = make_executor(spec, executor, folder, trial)
            job = ex.submit(BenchJob(), trial.to_json(), trial.label, str(spec.rows_path.resolve()), tasks,
                            extrapolate_layers=spec.extrapolates(trial))
            jobs_state[trial_id(trial)] = {"job_id": str(job.job_id), "executor": executor, "alive_hint": True,
                                           "label": trial.label}
            _save_jobs(spec, jobs_state)
            running.append((trial, job))
            print(f"{chr(10) if stream.isatty() else ''}  submitted {trial.label} as job {job.job_id}", file=stream)
        still = []
        for trial, job in running:
            if not job.done():
                still.append((trial, job))
                continue
            try:
                job.results()
                ok += 1
            except Exception as err:  # noqa: BLE001 - any failure becomes an error row
                failed += 1
                _record_failure(spec, trial, job, err, stream)
            jobs_state[trial_id(trial)]["alive_hint"] = False
            _save_jobs(spec, jobs_state)
        running = still
        for row in tail.new_rows():  # each trial and each max-context probe, as it ends
            print(("\n" if stream.isatty() else "") + "    " + describe(row), file=stream, flush=True)
            last_line = ""
        line = f"  {_bar(ok + failed, len(todo))} ok {ok} failed {failed} running {len(running)}"
        if line != last_line:  # redraw in place on a terminal, one line per change otherwise
            print(("\r" if stream.isatty() else "") + line, end="" if stream.isatty() else "\n",
                  file=stream, flush=True)
            last_line = line
        if running:
            time.sleep(poll_s)
    print(file=stream)
    return SweepSummary(len(trials), skipped, len(todo), ok, failed)


class RowTail:
    """The rows appended to a file since this object was made (complete lines only), so the
    runner can report each trial, and each probe of a max-context search, as it ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new_rows(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a foreign line: read_rows reports it where rows are read
        return rows


def peak_text(figures: dict) -> str:
    """The row's peak memory, saying which peak it is: the reserved peak where the row has one
    (CUDA, or the paper stack's allocator model), as the comparison tables' ``mem_gib`` shows
    it (``analysis.load``), with the allocated peak beside it; else the allocated peak."""
    allocated, reserved = figures.get("peak_bytes"), figures.get("peak_reserved_bytes")
    if reserved is not None:
        beside = f" (allocated {allocated / GiB:.2f})" if allocated is not None else ""
        return f"reserved peak {reserved / GiB:.2f} GiB{beside}"
    return f"allocated peak {allocated / GiB:.2f} GiB" if allocated is not None else ""


def describe(row: dict) -> str:
    """One line for a finished row: what ran, how it ended, the figure that matters."""
    figures = row.get("figures") or {}
    if row.get("kind") == "max_context":
        what = f"max context {human(figures.get('max_context') or 0)}"
        return (f"{row['method']} {row['model']} x{row['world_size']} {row['mode']}: search done, {what} "
                f"({row['status']})")
    step = f"step {figures['step_time_s']:.3f} s" if figures.get("step_time_s") else ""
    detail = ", ".join(part for part in (peak_text(figures), step) if part)
    if row.get("status") != "ok":
        detail = (row.get("message") or "").splitlines()[0][:100] if row.get("message") else detail
    return f"{row['method']} {row['model']} {human(row['seq_len'])} x{row['world_size']} {row['mode']}: " \
           f"{row['status']} {detail}".rstrip()


def _record_failure(spec: SweepSpec, trial: Trial, job, err: Exception, stream: TextIO) -> None:
    """An ``error`` row for a failed job, unless the trial managed to write its own row."""
    if trial_id(trial) in finished(spec.rows_path, [trial]):
        return
    log = str(getattr(job.paths, "stderr", ""))
    lines = [line for line in str(err).strip().splitlines() if line.strip()][-10:]
    error_row_for(trial, spec.name, spec.rows_path, message="\n".join(lines), log_path=log)
    print(f"\n  FAILED {trial.label} (job {job.job_id}); log: {log}", file=stream)
