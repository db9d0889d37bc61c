"""What runs inside a submitted job: one trial, as a ``python -m bench`` subprocess.

A subprocess (not an in-process call) so that a crash, an OOM kill or a hung collective
ends the trial and leaves the job able to report it. On Slurm a trial of C ranks is one
job with C tasks (one per GPU); each task exports the torchrun-style environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) from
submitit's ``JobEnvironment`` and the bench process initialises ``torch.distributed``
from it (NCCL on GPU, gloo on CPU). Locally a trial is one task and bench spawns its own
ranks. Rows are appended to the sweep's rows file by bench itself (atomically), so a row
exists exactly when a trial finished.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import submitit

from .spec import Trial

REPO = Path(__file__).resolve().parents[1]


# spec `step:` keys -> bench CLI flags; the levers are on by default, so only "off" has a flag
_OFF_FLAGS = {
    "fsdp": "--no-fsdp", "ac": "--no-ac", "ac_offload": "--no-offload", "tiled_mlp": "--no-tiled-mlp",
    "tiled_norm": "--no-tiled-norm", "chunked_loss": "--no-chunked-loss",
}
_VALUE_FLAGS = {"mlp_tiles": "--tiles", "loss_chunk": "--loss-chunk", "batch": "--batch",
                "warmup": "--warmup", "iters": "--iters"}
STEP_KEYS = set(_OFF_FLAGS) | set(_VALUE_FLAGS)


def step_flags(step: dict[str, Any]) -> list[str]:
    """``bench`` flags for a spec's training-step levers (unknown keys are refused)."""
    flags: list[str] = []
    for key, value in sorted(step.items()):
        if key in _OFF_FLAGS:
            if not isinstance(value, bool):
                raise ValueError(f"step.{key}: expected true or false, got {value!r}")
            flags += [] if value else [_OFF_FLAGS[key]]
        elif key in _VALUE_FLAGS:
            flags += [_VALUE_FLAGS[key], str(value)]
        else:
            raise ValueError(f"step.{key}: unknown training-step lever; allowed: {sorted(STEP_KEYS)}")
    return flags


def bench_argv(trial: Trial, rows_path: Path) -> list[str]:
    """The ``python -m bench`` command line of a trial."""
    argv = [
        "run" if trial.kind == "run" else "max-context",
        "--method", trial.method, "--model", trial.model, "--world-size", str(trial.world_size),
        "--mode", trial.mode, "--scope", trial.scope, "--dtype", trial.dtype, "--device", trial.device,
        "--out", str(rows_path), "--json",
    ]
    if trial.kind == "run":
        argv += ["--seq-len", str(trial.seq_len)]
    for key, value in trial.options:
        argv += ["--opt", f"{key}={value}"]
    argv += step_flags(dict(trial.step))
    for key, value in trial.max_context:
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


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


class TrialJob(submitit.helpers.Checkpointable):
    """A submitit callable running one trial; requeued as-is on preemption (trials are atomic)."""

    def __call__(self, trial: Trial, rows_path: str, tasks: int, timeout_s: float | None = None) -> dict[str, Any]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **_distributed_env(tasks))
        if tasks <= 1:  # one task runs every rank itself: hide the job so bench spawns its own ranks
            env = {k: v for k, v in env.items() if not k.startswith(("SUBMITIT_", "SLURM_"))}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "bench", *bench_argv(trial, Path(rows_path))]
        print("trial:", trial.label, "\ncommand:", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=timeout_s)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"bench exited with status {proc.returncode} for {trial.label}:\n{tail}")
        return {"trial": trial.label, "stdout_tail": proc.stdout.strip().splitlines()[-3:]}
