"""The result row: one schema, validated on write and on read, stored as JSON Lines.

A row is a ``Row`` (trial keys, outcome, ``Figures``, ``Environment``). ``validate_row``
checks every field's type and allowed values and names the bad field; ``append_rows``
refuses invalid rows before touching the file and ``read_rows`` re-validates every line.

Appending is atomic per row: the file is opened ``O_APPEND``, locked with
``fcntl.flock(LOCK_EX)`` and each row goes out as **one** ``os.write`` of one complete
line, so a writer killed at any instant leaves whole lines only, and concurrent writers
(processes or threads) never interleave or lose rows. If the file does not end with a
newline (written by something else and cut short), a newline is written first so the new
row starts on its own line. ``read_rows`` skips lines that do not parse or do not validate,
reporting each with its line number (or raises, with ``on_error="raise"``).

``trial_key(row)`` is a row's identity as a trial: every field that decides what was run
(not what came out). The sweeps use it to skip trials that already have a row.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Union

SCHEMA_VERSION = 1
MODES = ("real", "emulated", "simulated")
STATUSES = ("ok", "oom", "error")
KINDS = ("trial", "max_context")
SCOPES = ("model", "attention")
DTYPES = ("bf16", "fp32")


class RowError(ValueError):
    """A row that does not follow the schema; the message names the field."""


@dataclass
class Figures:
    """What was measured. Every field is optional (``None``: not measured in this mode).

    Bytes are per rank. ``peak_bytes`` is the allocated peak (MemTracker's live tensors in
    simulated and CPU runs, ``torch.cuda.max_memory_allocated`` on CUDA), the max over ranks
    in real mode; ``peak_reserved_bytes`` is ``max_memory_reserved`` (CUDA only).
    ``step_time_s`` is seconds per step (mean of the timed steps; emulated: measured compute
    plus modelled communication). Tokens per device count every token once:
    ``batch * seq_len / world_size``.
    """

    peak_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_by_category: dict | None = None
    host_peak_bytes: int | None = None  # offloaded (host) memory of one rank
    capacity_bytes: int | None = None
    usable_bytes: int | None = None
    host_usable_bytes: int | None = None  # simulated: host memory one rank's offloads may fill
    step_time_s: float | None = None
    compute_time_s: float | None = None
    comm_time_s: float | None = None  # modelled (emulated, simulated) with the row's link
    comm_bytes: int | None = None  # bytes one rank sends per step (sum over collectives)
    comm_bytes_by_op: dict | None = None
    tokens_per_device: int | None = None
    tokens_per_s_per_device: float | None = None
    flops_per_device: float | None = None
    tflops_per_device: float | None = None
    loss: float | None = None
    max_context: int | None = None  # max_context rows: longest fitting length (0: none)
    trials: int | None = None  # max_context rows: trials run
    wall_s: float | None = None  # wall time of the whole trial, set-up included


@dataclass
class Environment:
    git_commit: str
    git_dirty: bool
    torch: str
    cuda: str | None
    python: str
    libraries: dict
    device_name: str
    kernel: str
    host: str
    time: str  # ISO 8601, UTC
    argv: list = field(default_factory=list)


@dataclass
class Row:
    # ---- trial keys
    kind: str
    method: str
    options: dict
    model: str
    scope: str
    seq_len: int
    batch: int
    world_size: int
    mode: str
    dtype: str
    device: str
    levers: dict
    link: dict | None
    search: dict | None
    # ---- outcome
    status: str
    message: str
    figures: Figures
    env: Environment
    model_arch: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- validation

def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation in (dict, list, str):
        return isinstance(value, annotation)
    return True


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_fields(data: Any, cls, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise RowError(f"{where} must be an object, got {type(data).__name__}")
    hints = _hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise RowError(f"{where}: unknown field(s) {unknown}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for name, annotation in hints.items():
        f = fields[name]
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RowError(f"{where}.{name} is missing")
            continue
        value = data[name]
        if annotation in (Figures, Environment):
            out[name] = annotation(**_check_fields(value, annotation, f"{where}.{name}"))
            continue
        if not _type_ok(value, annotation):
            raise RowError(
                f"{where}.{name} = {value!r} has the wrong type (expected {_type_name(annotation)})"
            )
        if isinstance(value, float) and value != value:
            raise RowError(f"{where}.{name} is NaN")
        out[name] = value
    return out


def _type_name(annotation) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _json_safe(value: Any, where: str) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise RowError(f"{where} is not JSON-serialisable: {err}") from None


def validate_row(row: Row | dict) -> Row:
    """Return ``row`` as a ``Row`` if it follows the schema, else raise ``RowError``
    naming the field."""
    data = row.to_dict() if isinstance(row, Row) else row
    values = _check_fields(data, Row, "row")
    r = Row(**values)
    if r.schema != SCHEMA_VERSION:
        raise RowError(f"row.schema = {r.schema} is not the supported version {SCHEMA_VERSION}")
    for name, allowed in (("kind", KINDS), ("mode", MODES), ("status", STATUSES),
                          ("scope", SCOPES), ("dtype", DTYPES)):
        if getattr(r, name) not in allowed:
            raise RowError(f"row.{name} = {getattr(r, name)!r} is not one of {list(allowed)}")
    for name in ("method", "model", "device"):
        if not getattr(r, name):
            raise RowError(f"row.{name} must be a non-empty string")
    if r.seq_len < 0 or (r.kind == "trial" and r.seq_len == 0):
        raise RowError(f"row.seq_len = {r.seq_len} must be a positive number of tokens")
    if r.batch < 1:
        raise RowError(f"row.batch = {r.batch} must be >= 1")
    if r.world_size < 1:
        raise RowError(f"row.world_size = {r.world_size} must be >= 1")
    if r.status != "ok" and not r.message:
        raise RowError(f"row.message must say why a row has status {r.status!r}")
    if r.mode == "emulated" and r.link is None:
        raise RowError("row.link must name the bandwidth model of an emulated row")
    if r.kind == "max_context":
        if r.search is None:
            raise RowError("row.search must hold the search parameters of a max_context row")
        if r.figures.max_context is None:
            raise RowError("row.figures.max_context is missing from a max_context row")
    for name in ("peak_bytes", "peak_reserved_bytes", "host_peak_bytes", "comm_bytes", "max_context"):
        v = getattr(r.figures, name)
        if v is not None and v < 0:
            raise RowError(f"row.figures.{name} = {v} must not be negative")
    for name in ("step_time_s", "tokens_per_s_per_device", "tflops_per_device"):
        v = getattr(r.figures, name)
        if v is not None and v < 0:
            raise RowError(f"row.figures.{name} = {v} must not be negative")
    _json_safe(data, "row")
    return r


# ----------------------------------------------------------------------------- identity

def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def requested_options(options: dict) -> dict:
    """The method options as the user asked for them: a row of a trial run with
    ``chunk_heads="auto"`` records the U it resolved to in ``chunk_heads`` and the request in
    ``chunk_heads_requested`` (``bench.autochunk``); the trial asked for ``auto``."""
    out = dict(options)
    if "chunk_heads_requested" in out:
        out["chunk_heads"] = out.pop("chunk_heads_requested")
    return out


def trial_key(row: Row | dict) -> tuple:
    """Hashable identity of the trial a row reports (inputs only, never outcomes)."""
    d = row.to_dict() if isinstance(row, Row) else row
    link = d.get("link")
    return (
        d["kind"], d["method"], _canon(requested_options(d.get("options") or {})), d["model"], d["scope"],
        int(d["seq_len"]), int(d.get("batch", 1)), int(d["world_size"]), d["mode"], d["dtype"],
        d["device"], _canon(d.get("levers") or {}), link["name"] if link else None,
        _canon(d.get("search")),
    )


# ----------------------------------------------------------------------------- file I/O

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


# ----------------------------------------------------------------------------- provenance

_GIT_CACHE: dict[str, Any] = {}


def _git_info() -> tuple[str, bool]:
    if "info" not in _GIT_CACHE:
        import subprocess

        root = Path(__file__).resolve().parents[1]
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or "unknown"
            dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                        capture_output=True, text=True, timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            commit, dirty = "unknown", False
        _GIT_CACHE["info"] = (commit, dirty)
    return _GIT_CACHE["info"]


def _library_versions() -> dict[str, str | None]:
    from importlib import metadata

    out = {}
    for dist_name in ("numpy", "deepspeed", "flash-attn", "ring-flash-attn", "submitit"):
        try:
            out[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            out[dist_name] = None
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def environment(kernel: str, device_name: str) -> Environment:
    """Where and with what a row was produced."""
    import datetime
    import platform
    import socket

    import torch

    commit, dirty = _git_info()
    return Environment(
        git_commit=commit,
        git_dirty=dirty,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        libraries=_library_versions(),
        device_name=device_name,
        kernel=kernel,
        host=socket.gethostname(),
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        argv=list(sys.argv),
    )
