"""What runs inside a submitted job: one trial, as a ``python -m bench`` subprocess.

A subprocess (not an in-process call) so that a crash, an OOM kill or a hung collective
ends the trial and leaves the job able to report it. On Slurm a trial of C ranks is one
job with C tasks (one per GPU); each task exports the torchrun-style environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) from
submitit's ``JobEnvironment`` and the bench process initialises ``torch.distributed``
from it (NCCL on GPU, gloo on CPU). Locally a trial is one task and bench spawns its own
ranks. The trial crosses the process boundary as JSON (``Trial.to_json``, read back by
``python -m bench trial``). Rows are appended to the sweep's rows file by bench itself
(atomically), so a row exists exactly when a trial finished. The job receives the trial as that
JSON and its label, not as a ``Trial``: unpickling a ``Trial`` in the job's process would import
``bench`` and with it torch, seconds of start-up per job for a process that only starts another.

``$CPAB_SWEEP_HOLD`` (for tests): a directory; while it holds a trial's ``hold_path``, every
task of that trial's job waits before running it, so a test can stop a sweep at a known point
(some trials done, the others held) however fast the trials are.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import submitit

if TYPE_CHECKING:  # only the type: this module is imported by every job's process (see above)
    from bench.measure.trial import Trial

REPO = Path(__file__).resolve().parents[1]
HOLD_ENV = "CPAB_SWEEP_HOLD"


def hold_path(directory: str | Path, trial: Trial | str) -> Path:
    """The file in ``$CPAB_SWEEP_HOLD`` that holds ``trial``'s job back while it exists (``trial``:
    the trial or its label)."""
    label = trial if isinstance(trial, str) else trial.label
    return Path(directory) / re.sub(r"[^A-Za-z0-9.,=-]+", "_", label)


def bench_argv(trial: Trial | str, rows_path: Path, extrapolate_layers: bool = False) -> list[str]:
    """The ``python -m bench`` command line of a trial (``trial``: the trial or its JSON,
    ``Trial.to_json``): the trial itself, as JSON (and, for a simulated trial or search the spec
    extrapolates over layers, ``--extrapolate-layers``)."""
    as_json = trial if isinstance(trial, str) else trial.to_json()
    return ["trial", as_json, "--out", str(rows_path), "--json"] + (
        ["--extrapolate-layers"] if extrapolate_layers else [])


def _distributed_env(tasks: int) -> dict[str, str]:
    """torchrun-style variables for this Slurm task (empty for a single-task job)."""
    if tasks <= 1:
        return {}
    job = submitit.JobEnvironment()
    port = 20000 + int(str(job.job_id).split("_")[0]) % 20000
    return {
        "RANK": str(job.global_rank), "WORLD_SIZE": str(job.num_tasks), "LOCAL_RANK": str(job.local_rank),
        "MASTER_ADDR": job.hostnames[0], "MASTER_PORT": str(port),
    }


class BenchJob(submitit.helpers.Checkpointable):
    """A submitit callable running one trial, given as its JSON (``Trial.to_json``) and its label;
    requeued as-is on preemption (trials are atomic)."""

    def __call__(self, trial_json: str, label: str, rows_path: str, tasks: int, timeout_s: float | None = None,
                 extrapolate_layers: bool = False) -> dict[str, Any]:
        held = hold_path(os.environ[HOLD_ENV], label) if os.environ.get(HOLD_ENV) else None
        if held is not None and held.exists():
            print(f"trial: {label} held until {held} is removed", flush=True)
            while held.exists():
                time.sleep(0.2)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **_distributed_env(tasks))
        if tasks <= 1:  # one task runs every rank itself: hide the job so bench spawns its own ranks
            env = {k: v for k, v in env.items() if not k.startswith(("SUBMITIT_", "SLURM_"))}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "bench", *bench_argv(trial_json, Path(rows_path), extrapolate_layers)]
        print("trial:", label, "\ncommand:", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=timeout_s)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"bench exited with status {proc.returncode} for {label}:\n{tail}")
        return {"trial": label, "stdout_tail": proc.stdout.strip().splitlines()[-3:]}
