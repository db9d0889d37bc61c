"""Which trials of a sweep already have a row, and the error row of a failed job.

A sweep trial matches a row when every input the sweep specified agrees: kind, method,
options (as given), model, scope, sequence length (``run``) , world size, mode, dtype and
device, and each training-step lever the spec set (rows record every lever, defaults
included, so the sweep's levers are compared as a subset).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.rows import (Environment, Figures, Row, append_rows, cpu_name, environment, read_rows,
                        requested_options)

from .spec import Trial

ROW_KIND = {"run": "trial", "max-context": "max_context"}
DTYPE = {"bf16": "bf16", "fp32": "fp32"}


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def trial_id(trial: Trial) -> str:
    """A stable string identity of a sweep trial (also the key of the jobs file)."""
    seq = trial.seq_len if trial.kind == "run" else "max"
    return "|".join(str(x) for x in (
        trial.kind, trial.method, _canon(dict(trial.options)), trial.model, trial.scope, seq,
        trial.world_size, trial.mode, trial.dtype, trial.device, _canon(dict(trial.step)),
    ))


def row_matches(trial: Trial, row: Row) -> bool:
    if row.kind != ROW_KIND[trial.kind] or row.method != trial.method:
        return False
    if _canon(requested_options(row.options)) != _canon(dict(trial.options)):
        return False
    if (row.model, row.scope, row.world_size, row.mode, row.dtype, row.device) != (
        trial.model, trial.scope, trial.world_size, trial.mode, trial.dtype, trial.device
    ):
        return False
    if trial.kind == "run" and row.seq_len != trial.seq_len:
        return False
    for key, value in trial.step:
        if key == "batch":
            if row.batch != value:
                return False
        elif key not in ("warmup", "iters") and row.levers.get(key) != value:
            return False
    return True


def finished(rows_path: Path, trials: list[Trial] | None = None) -> dict[str, str]:
    """``trial_id -> status`` of every trial with a row (the newest row wins)."""
    rows = read_rows(rows_path, on_error="warn")
    out: dict[str, str] = {}
    for trial in trials or []:
        for row in rows:
            if row_matches(trial, row):
                out[trial_id(trial)] = row.status
    return out


def error_row_for(trial: Trial, rows_path: Path, message: str, log_path: str) -> None:
    """Append an ``error`` row for a trial whose job failed before writing its own row."""
    from methods.core.kernels import default_kernel_name

    levers = dict(trial.step)
    row = Row(
        kind=ROW_KIND[trial.kind], method=trial.method, options=dict(trial.options), model=trial.model,
        scope=trial.scope, seq_len=trial.seq_len, batch=1, world_size=trial.world_size, mode=trial.mode,
        dtype=DTYPE[trial.dtype], device=trial.device, levers=levers,
        link={"name": "unknown (job failed)"} if trial.mode == "emulated" else None,
        search=dict(trial.max_context) if trial.kind == "max-context" else None,
        status="error", message=f"job failed: {message}\nlog: {log_path}",
        figures=Figures(max_context=0 if trial.kind == "max-context" else None),
        env=environment(default_kernel_name(), cpu_name()),
        notes=[f"sweep {trial.sweep}: recorded by the sweep runner, not by the trial", f"log {log_path}"],
    )
    append_rows(rows_path, [row])
