"""Rows on disk: JSON Lines, appended atomically, re-validated on read.

Appending: the file is opened ``O_APPEND``, locked with ``fcntl.flock(LOCK_EX)`` and each row
goes out as **one** ``os.write`` of one complete line ending in a newline, so concurrent writers
(processes or threads) never interleave or lose rows. A writer killed during its write can leave a
prefix of its line (Linux checks for a fatal signal between the pages of one write, so a row longer
than a page can be cut), never a line that looks whole: a row is complete only with its newline, and
that is its last byte. So a file's lines are whole rows except, at most, an unterminated last line,
which ``read_rows`` reports but never counts (a write in progress, or a writer killed mid-write, even
with ``on_error="raise"``), and which the next ``append_rows`` removes under its lock, where no live
writer can be in the middle of a write. ``read_rows`` skips lines that do not parse or do not
validate, reporting each with its line number (or raises, with ``on_error="raise"``).
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
            _drop_unterminated_tail(fd)  # a killed writer's part of a row must not swallow ours
            for line in lines:
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    return len(lines)


def _drop_unterminated_tail(fd: int, block: int = 1 << 16) -> None:
    """Truncate what follows the last newline of the open file ``fd`` (a part of a row, whose writer
    was killed: ``append_rows``'s caller holds the lock, so no writer is in the middle of a write)."""
    size = end = os.fstat(fd).st_size
    if not size or os.pread(fd, 1, size - 1) == b"\n":
        return
    while end > 0:
        start = max(0, end - block)
        found = os.pread(fd, end - start, start).rfind(b"\n")
        if found >= 0:
            os.ftruncate(fd, start + found + 1)
            return
        end = start
    os.ftruncate(fd, 0)  # no newline at all: the file is one cut-off row


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
    ``"raise"`` raises ``RowError`` naming the file, line and field. An unterminated last line is
    never a row and never raises: a write in progress, or a writer killed mid-write (the module's
    docstring); it is reported as the other bad lines are under ``"warn"`` and ``"skip"``.
    """
    if on_error not in ("warn", "skip", "raise"):
        raise ValueError(f"on_error must be 'warn', 'skip' or 'raise', got {on_error!r}")
    path = Path(path)
    if not path.exists():
        return []
    rows: list[Row] = []

    def report(issue: BadLine) -> None:
        if bad is not None:
            bad.append(issue)
        if on_error == "warn":
            print(f"warning: skipping corrupt row {issue}", file=sys.stderr)

    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if not raw.endswith(b"\n"):  # the last line: a row's write in progress or cut off; never raised
                report(BadLine(str(path), no, "RowError: incomplete last line (no newline): a write in progress "
                                              "or a writer killed mid-write; the next append removes it"))
                continue
            try:
                rows.append(validate_row(json.loads(raw.decode())))
            except (UnicodeDecodeError, json.JSONDecodeError, RowError, TypeError) as err:
                issue = BadLine(str(path), no, f"{type(err).__name__}: {err}")
                if on_error == "raise":
                    raise RowError(str(issue)) from None
                report(issue)
    return rows


def finished_keys(path: str | os.PathLike, statuses: tuple[str, ...] = ("ok", "oom")) -> set[tuple]:
    """Trial keys of rows with one of ``statuses`` (what a resumed sweep can skip)."""
    return {trial_key(r) for r in read_rows(path, on_error="skip") if r.status in statuses}


