"""Where a user's runs write, and the checks that an output path can be written before any work.

``results/`` and ``paper_figs/`` are the project's reference data, regenerated on purpose by
the maintainers (``--out results/...``, ``make figs``). Everything a user runs writes under
the **runs directory** instead: ``runs/`` relative to the working directory (gitignored), or
``$CPAB_RUNS`` when set. ``check_file``/``check_dir`` answer "can this be written?" before
anything is written (leaving nothing behind), so a bad ``--out`` is one line of error before
a trial runs, never a traceback after it.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

RUNS_ENV = "CPAB_RUNS"


def runs_dir() -> Path:
    """The user's output directory: ``$CPAB_RUNS``, else ``runs/`` under the working directory."""
    return Path(os.environ.get(RUNS_ENV) or "runs")


class OutputError(ValueError):
    """An output path that cannot be written; the message names the path and the fix."""


def _existing_ancestor(path: Path) -> Path:
    for parent in path.parents:
        if parent.exists():
            return parent
    return Path(".")


def _probe_dir(directory: Path, path: Path, what: str) -> None:
    """Create and remove a temporary file in ``directory``: the one honest test of writability
    (permission bits do not stop root, and a read-only file system shows only on a write)."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".cpab-write-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise OutputError(f"{what} {path}: directory {directory} is not writable ({err.strerror}); "
                          f"choose another path") from None


def _check_creatable(path: Path, what: str) -> None:
    """``path`` does not exist: its nearest existing ancestor must be a writable directory."""
    ancestor = _existing_ancestor(path)
    if not ancestor.is_dir():
        raise OutputError(f"{what} {path}: {ancestor} is a file, not a directory; choose another path")
    _probe_dir(ancestor, path, what)


def check_file(path: str | os.PathLike, what: str = "output file") -> Path:
    """``path`` can be appended to (an existing writable file, or creatable); returns it."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a directory; give a file path, e.g. {path / 'rows.jsonl'}")
    if path.exists():
        try:  # opening for append writes nothing; it fails as the real append would
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        except OSError as err:
            raise OutputError(f"{what} {path} is not writable ({err.strerror}); choose another path") from None
        return path
    _check_creatable(path, what)
    return path


def check_dir(path: str | os.PathLike, what: str = "output directory") -> Path:
    """``path`` is, or can become, a writable directory; returns it."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise OutputError(f"{what} {path} is a file, not a directory; choose another path")
        _probe_dir(path, path, what)
        return path
    _check_creatable(path, what)
    return path
