"""Rows on disk: JSON Lines, appended atomically, re-validated on read.

Appending is atomic per row: the file is opened ``O_APPEND``, locked with
``fcntl.flock(LOCK_EX)`` and each row goes out as **one** ``os.write`` of one complete
line, so a writer killed at any instant leaves whole lines only, and concurrent writers
(processes or threads) never interleave or lose rows. If the file does not end with a
newline (written by something else and cut short), a newline is written first so the new
row starts on its own line. ``read_rows`` skips lines that do not parse or do not validate,
reporting each with its line number (or raises, with ``on_error="raise"``).
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .identity import trial_key
from .schema import Row, RowError, validate_row


def encode(row: Row | dict) -> bytes:
    """One validated row as one JSON line (UTF-8, ending in a newline)."""
    r = validate_row(row)
    return (json.dumps(r.to_dict(), sort_keys=True, allow_nan=False) + "\n").encode()


def append_rows(path: str | os.PathLike, rows: Iterable[Row | dict]) -> int:
    """Validate all rows, then append them; each row is a single ``os.write`` under an
    exclusive ``flock``. Returns the number of rows written."""
    lines = [encode(r) for r in rows]  # refuse before writing anything
    if not lines:
        return 0
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                os.write(fd, b"\n")  # a foreign partial line must not swallow ours
            for line in lines:
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    return len(lines)


@dataclass
class BadLine:
    path: str
    line_no: int
    error: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line_no}: {self.error}"


def read_rows(path: str | os.PathLike, on_error: str = "warn", bad: list | None = None) -> list[Row]:
    """All valid rows of a JSON Lines file (missing file: none).

    A line that is not JSON or not a valid row is skipped and reported: ``on_error="warn"``
    prints it to stderr, ``"skip"`` only appends a ``BadLine`` to ``bad`` (when given),
    ``"raise"`` raises ``RowError`` naming the file, line and field.
    """
    if on_error not in ("warn", "skip", "raise"):
        raise ValueError(f"on_error must be 'warn', 'skip' or 'raise', got {on_error!r}")
    path = Path(path)
    if not path.exists():
        return []
    rows: list[Row] = []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                text = raw.decode()
                if not text.endswith("\n"):
                    raise RowError("incomplete last line (no newline): a writer was cut off")
                rows.append(validate_row(json.loads(text)))
            except (UnicodeDecodeError, json.JSONDecodeError, RowError, TypeError) as err:
                issue = BadLine(str(path), no, f"{type(err).__name__}: {err}")
                if on_error == "raise":
                    raise RowError(str(issue)) from None
                if bad is not None:
                    bad.append(issue)
                if on_error == "warn":
                    print(f"warning: skipping corrupt row {issue}", file=sys.stderr)
    return rows


def finished_keys(path: str | os.PathLike, statuses: tuple[str, ...] = ("ok", "oom")) -> set[tuple]:
    """Trial keys of rows with one of ``statuses`` (what a resumed sweep can skip)."""
    return {trial_key(r) for r in read_rows(path, on_error="skip") if r.status in statuses}


