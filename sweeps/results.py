"""Which trials of a sweep already have a row, and the error row of a failed job.

A sweep trial is done when a row with the same ``records.trial_key`` exists: the trial's
``key()`` is the key of the row it writes, so no other matching is needed.
"""
from __future__ import annotations

from pathlib import Path

from bench.measure.trial import Trial
from records import Figures, Kind, Row, append_rows, cpu_name, environment, key_string, read_rows, trial_key


def trial_id(trial: Trial) -> str:
    """A trial's key as one string (the key of the sweep's jobs file)."""
    return key_string(trial.key())


def finished(rows_path: Path, trials: list[Trial] | None = None) -> dict[str, str]:
    """``trial_id -> status`` of every given trial that has a row (the newest row wins)."""
    wanted = {trial.key(): trial_id(trial) for trial in trials or []}
    out: dict[str, str] = {}
    for row in read_rows(rows_path, on_error="warn"):
        tid = wanted.get(trial_key(row))
        if tid is not None:
            out[tid] = row.status
    return out


def error_row_for(trial: Trial, sweep: str, rows_path: Path, message: str, log_path: str) -> None:
    """Append an ``error`` row for a trial whose job failed before writing its own row."""
    row = Row(
        **trial.row_fields(), status="error", message=f"job failed: {message}\nlog: {log_path}",
        figures=Figures(max_context=0 if trial.kind == Kind.MAX_CONTEXT else None),
        env=environment(trial.kernel_name(), cpu_name()), model_arch=trial.config().to_dict(),
        notes=[f"sweep {sweep}: recorded by the sweep runner, not by the trial", f"log {log_path}"],
    )
    append_rows(rows_path, [row])
