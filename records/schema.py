"""The result row: one schema, validated on write (``records.store``) and on read.

A row is a ``Row``: the trial's keys (what was run), its outcome (status, message),
``Figures`` (what was measured) and ``Environment`` (where and with what); ``docs`` (packed
documents, ``records.workloads``) is a trial key too, absent from a row of one sequence.
``validate_row`` checks every field's type and allowed values (``records.vocab``) and names
the bad field.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

from .vocab import DType, Kind, Mode, Scope, Status
from .workloads import check_fields as check_docs

# 2: ``levers`` holds every lever (schema 1 left out those at their default that were added
# late, records.identity.V1_OMITTED_LEVERS), and ``ran``/``presets`` say what ran
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
# the fewest timed steps whose median and range a row reports as a spread (bench.measure.timing)
MIN_TIMED_STEPS = 5


class RowError(ValueError):
    """A row that does not follow the schema; the message names the field."""


@dataclass
class Figures:
    """What was measured. Every field is optional (``None``: not measured in this mode).

    Bytes are per rank. ``peak_bytes`` is the allocated peak (MemTracker's live tensors in
    simulated and CPU runs, ``torch.cuda.max_memory_allocated`` on CUDA), the max over ranks
    in real mode; ``peak_reserved_bytes`` is ``max_memory_reserved`` (CUDA only; in simulated
    mode with ``allocator_model``, the reserved peak of ``bench.stackmodel.allocator``'s model).
    ``step_time_s`` is seconds per step: the median of the timed steps (``step_times_s``, each
    the slowest rank's in real mode; emulated: measured compute plus modelled communication),
    with ``step_time_min_s``/``step_time_max_s`` their extremes (a real or emulated row without
    ``step_times_s`` has the mean of two steps and no spread); simulated: the step-time model of
    ``bench.stackmodel.steptime``, its terms, constants and the counts it used in
    ``step_time_model``. Tokens per device count every token once: ``batch * seq_len /
    world_size``; throughput is from the median.
    ``host_load_before``/``_after`` are the host's 1-minute load average around the timed steps
    (rank 0's host), ``host_cpus`` its logical CPUs, ``trial_threads`` the threads the trial's
    own processes run there, and ``host_shared`` whether the load exceeded them
    (``bench.measure.timing.host_shared``).
    """

    peak_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_by_category: dict | None = None
    host_peak_bytes: int | None = None  # offloaded (host) memory of one rank
    capacity_bytes: int | None = None
    usable_bytes: int | None = None
    host_usable_bytes: int | None = None  # simulated: host memory one rank's offloads may fill
    step_time_s: float | None = None
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    step_times_s: list | None = None  # every timed step, in order
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
    host_load_before: float | None = None  # 1-minute load average before the timed steps
    host_load_after: float | None = None  # ... and after them
    host_cpus: int | None = None  # logical CPUs of the host (os.cpu_count)
    trial_threads: int | None = None  # threads the trial's own processes run on that host
    host_shared: bool | None = None  # the load exceeded trial_threads: others' work ran too
    step_time_model: dict | None = None  # simulated: terms, constants, counts (bench.stackmodel.steptime)
    # packed documents: each rank's attention work and the imbalance (bench.stackmodel.docwork.RankWork.to_dict);
    # absent from a row of one sequence
    doc_work: dict | None = None
    # simulated, emulated: the rank whose figures these are (the worst of those measured: bench.measure.run.worst_of),
    # and, where several were measured, each one's judged peak as [rank, bytes] (emulated: its allocated peak);
    # absent from rows before ranks
    worst_rank: int | None = None
    rank_peaks: list | None = None
    # emulated on CUDA, several ranks: each one's reserved peak as [rank, bytes], the ranks of rank_peaks
    rank_reserved_peaks: list | None = None
    # real, CPU ranks: each rank's time in attention kernel calls per step (the median over the timed steps,
    # rank order; bench.measure.attntime), the slowest rank's over the mean, and the clock they were timed on
    # (ATTENTION_CLOCKS; absent from rows made before it was recorded, which timed on the wall clock); absent
    # where not measured
    rank_attention_s: list | None = None
    attention_imbalance: float | None = None
    attention_clock: str | None = None


# figures written only when measured, so that a row without them is written as it was before they existed
OMITTED_WHEN_NONE = ("doc_work", "worst_rank", "rank_peaks", "rank_reserved_peaks", "rank_attention_s",
                     "attention_imbalance", "attention_clock")
# the clocks a rank's attention time is taken on (bench.measure.attntime.CLOCKS): the wall clock, or the calling
# thread's CPU time
ATTENTION_CLOCKS = ("wall", "thread")


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
    # ---- resolution (bench.resolve): every lever as it ran, after the presets named in `presets`
    # filled in what the request left open (``levers`` is the request, the trial's identity)
    ran: dict | None = None
    presets: list = field(default_factory=list)
    schema: int = SCHEMA_VERSION
    # ---- packed documents (a trial key when present; records.workloads.DocsSpec.fields): the
    # distribution and seed, or the explicit lengths, and the lengths' count/min/max/mean.
    # None: one sequence (every row before documents existed)
    docs: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-ready data; ``docs`` and ``figures.doc_work`` only when the row has documents,
        so that a row of one sequence is written as it was before documents existed, and the figures of
        ``OMITTED_WHEN_NONE`` only when measured."""
        d = dataclasses.asdict(self)
        if d["docs"] is None:
            del d["docs"]
        for late in OMITTED_WHEN_NONE:
            if d["figures"].get(late) is None:
                d["figures"].pop(late, None)
        return d


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


@functools.cache
def _hints(cls) -> dict[str, Any]:
    """The resolved field types of a row dataclass, once per class: resolving them is most of the
    cost of validating a row, and a reader validates every row it reads. Callers do not mutate it."""
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


def _check_spread(f: Figures) -> None:
    """The recorded steps and their summary agree (a hand-edited or mis-combined row is refused)."""
    if f.step_times_s is None:
        if f.step_time_min_s is not None or f.step_time_max_s is not None:
            raise RowError("row.figures.step_time_min_s/max_s need the steps they summarise (step_times_s)")
        return
    times = f.step_times_s
    if not times or not all(_type_ok(t, float) and t >= 0 for t in times):
        raise RowError(f"row.figures.step_times_s = {times!r} must be a non-empty list of seconds")
    if f.step_time_min_s is None or f.step_time_max_s is None or f.step_time_s is None:
        raise RowError("row.figures.step_times_s needs step_time_s (median), step_time_min_s and step_time_max_s")
    tol = 1e-9 * max(times)
    if abs(f.step_time_min_s - min(times)) > tol or abs(f.step_time_max_s - max(times)) > tol \
            or abs(f.step_time_s - statistics.median(times)) > tol:
        raise RowError(f"row.figures.step_time_s/min/max ({f.step_time_s}, {f.step_time_min_s}, "
                       f"{f.step_time_max_s}) are not the median/min/max of step_times_s {times}")


def _rank_pairs(pairs) -> bool:
    """Whether ``pairs`` is a non-empty list of ``[rank, bytes]`` integer pairs."""
    return bool(pairs) and isinstance(pairs, list) and all(
        isinstance(p, list) and len(p) == 2 and all(_type_ok(v, int) for v in p) for p in pairs)


def _check_ranks(f: Figures, world_size: int) -> None:
    """``worst_rank`` is a rank of the job, ``rank_peaks`` (``[rank, bytes]`` pairs, one per rank
    measured) holds it, and ``rank_reserved_peaks`` (emulated on CUDA) names the same ranks."""
    if f.worst_rank is not None and not 0 <= f.worst_rank < world_size:
        raise RowError(f"row.figures.worst_rank = {f.worst_rank} is not a rank of world size {world_size}")
    pairs, reserved = f.rank_peaks, f.rank_reserved_peaks
    if pairs is not None:
        if not _rank_pairs(pairs):
            raise RowError(f"row.figures.rank_peaks = {pairs!r} must be a non-empty list of [rank, bytes] pairs")
        if f.worst_rank not in [p[0] for p in pairs]:
            raise RowError(f"row.figures.rank_peaks = {pairs!r} must hold worst_rank ({f.worst_rank}), the rank "
                           "whose figures the row has")
    if reserved is not None and (pairs is None or not _rank_pairs(reserved)
                                 or [p[0] for p in reserved] != [p[0] for p in pairs]):
        raise RowError(f"row.figures.rank_reserved_peaks = {reserved!r} must be [rank, bytes] pairs of the ranks "
                       f"of rank_peaks ({pairs!r})")


def _check_attention(f: Figures, world_size: int) -> None:
    """``rank_attention_s`` holds one time per rank, ``attention_imbalance`` is its max over its mean, and
    ``attention_clock`` (where recorded) names one of ``ATTENTION_CLOCKS``."""
    times, ratio, clock = f.rank_attention_s, f.attention_imbalance, f.attention_clock
    if times is None:
        if ratio is not None or clock is not None:
            raise RowError("row.figures.attention_imbalance and attention_clock need the times they describe "
                           "(rank_attention_s)")
        return
    if clock is not None and clock not in ATTENTION_CLOCKS:
        raise RowError(f"row.figures.attention_clock = {clock!r} is not one of {', '.join(ATTENTION_CLOCKS)}")
    if len(times) != world_size or not all(_type_ok(t, float) and t >= 0 for t in times):
        raise RowError(f"row.figures.rank_attention_s = {times!r} must hold one time (seconds, >= 0) per rank of "
                       f"world size {world_size}")
    mean = sum(times) / len(times)
    expected = max(times) / mean if mean else 1.0
    if ratio is None or abs(ratio - expected) > 1e-5 * expected:
        raise RowError(f"row.figures.attention_imbalance = {ratio!r} is not the max over the mean of "
                       f"rank_attention_s ({expected:.6f})")


def validate_row(row: Row | dict) -> Row:
    """Return ``row`` as a ``Row`` if it follows the schema, else raise ``RowError``
    naming the field."""
    data = row.to_dict() if isinstance(row, Row) else row
    values = _check_fields(data, Row, "row")
    r = Row(**values)
    if r.schema not in READABLE_VERSIONS:
        raise RowError(f"row.schema = {r.schema} is not a readable version {list(READABLE_VERSIONS)}")
    if r.schema < 2 and (r.ran is not None or r.presets):
        raise RowError(f"row.ran and row.presets came with schema 2; this row says schema {r.schema}")
    for name, vocab in (("kind", Kind), ("mode", Mode), ("status", Status), ("scope", Scope),
                        ("dtype", DType)):
        if getattr(r, name) not in vocab.values():
            raise RowError(f"row.{name} = {getattr(r, name)!r} is not one of {list(vocab.values())}")
    for name in ("method", "model", "device"):
        if not getattr(r, name):
            raise RowError(f"row.{name} must be a non-empty string")
    if r.seq_len < 0 or (r.kind == Kind.TRIAL and r.seq_len == 0):
        raise RowError(f"row.seq_len = {r.seq_len} must be a positive number of tokens")
    if r.batch < 1:
        raise RowError(f"row.batch = {r.batch} must be >= 1")
    if r.world_size < 1:
        raise RowError(f"row.world_size = {r.world_size} must be >= 1")
    if r.status != Status.OK and not r.message:
        raise RowError(f"row.message must say why a row has status {r.status!r}")
    if r.mode == Mode.EMULATED and r.link is None:
        raise RowError("row.link must name the bandwidth model of an emulated row")
    if r.kind == Kind.MAX_CONTEXT:
        if r.search is None:
            raise RowError("row.search must hold the search parameters of a max_context row")
        if r.figures.max_context is None:
            raise RowError("row.figures.max_context is missing from a max_context row")
    for name in ("peak_bytes", "peak_reserved_bytes", "host_peak_bytes", "comm_bytes", "max_context"):
        v = getattr(r.figures, name)
        if v is not None and v < 0:
            raise RowError(f"row.figures.{name} = {v} must not be negative")
    for name in ("step_time_s", "step_time_min_s", "step_time_max_s", "tokens_per_s_per_device",
                 "tflops_per_device", "host_load_before", "host_load_after"):
        v = getattr(r.figures, name)
        if v is not None and v < 0:
            raise RowError(f"row.figures.{name} = {v} must not be negative")
    if r.docs is not None:
        try:
            check_docs(r.docs)
        except ValueError as err:
            said = str(err)
            raise RowError(f"row.{said}" if said.startswith("docs") else f"row.docs: {said}") from None
    _check_spread(r.figures)
    _check_ranks(r.figures, r.world_size)
    _check_attention(r.figures, r.world_size)
    _json_safe(data, "row")
    return r


