"""What a simulated step executed, counted, as typed records (``StepCounts``), and their flat form on disk.

``bench.stackmodel.stepcount`` counts the FLOPs by kernel class, the host copies by issuer and
direction, the memory-bound kernels' traffic and the methods' noted events; ``comm_counts``
(``bench.stackmodel.steptime``) the collectives by kind (``Collective``: operation, group size,
members in the counted rank's node), each kind with its calls and bytes (``Traffic``). The
step-time model (``bench.stackmodel.steptime``) and NCCL's buffers
(``bench.stackmodel.stack.nccl_buffer_bytes``) read these records.

Rows store the counts flat, in ``figures.step_time_model["counts"]``, and the planner's
simulation cache in ``step_counts`` (``bench.search.plan.SimCache``), with string keys:

* ``flops.matmul``, ``flops.attention``, ``flops.other``; ``flops.attention_varlen_excess`` only where
  it is not 0 (the dense-rate FLOPs the flash op's varlen calls cost beyond their counted ones,
  ``bench.stackmodel.varlenrate``: a step with documents), so counts without it keep their form
* ``host.<method|offload>.<d2h|h2d>_bytes`` and ``..._calls``
* ``bytes.memory_bound`` and ``bytes.memory_bound_calls`` (absent from counts of version 2)
* ``comm.<op>.<group size>.<members in the rank's node>.bytes`` and ``.calls``; the same under
  ``comm_attn.`` for the attention's own calls of a kind it waits on (``Collective.attention``)
* ``counts_version``: the version of the counting (``COUNTS_VERSION``), written from version 4 on; counts
  without it are of version 3 where they have ``bytes.memory_bound``, else of version 2
* any other key: an event noted by a method (``methods.core.events``: ``pipeline.chunk_passes``)

:meth:`StepCounts.from_flat` and :meth:`StepCounts.to_flat` are the one place that form is read
and written; ``to_flat(from_flat(d)) == d`` for every form ``from_flat`` accepts, values (ints
stay ints) and, for sorted input as rows store it, key order included.

The collectives keep the order they were first seen in (the calls of the step, or the keys of the
flat form); the step-time model sums their times in the order of their flat keys (``flat_name``), so
a figure computed from a step's counts, or from the same counts read back from a row, is the same to
the bit whatever order a rank issued them in.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

# what ``bench.stackmodel.stepcount`` counts: 2 the FLOPs, host copies and collectives; 3 the memory-bound kernels'
# bytes, the skipped tiles weighed; 4 the indexing kernels' bytes as the rows they index, not the whole tensors
COUNTS_VERSION = 4
VERSION_KEY = "counts_version"  # the flat key of StepCounts.version
KERNEL_CLASSES = ("matmul", "attention", "other")
VARLEN_EXCESS = "attention_varlen_excess"  # flops.<this>: the varlen calls' excess (module docstring)
ISSUERS = ("method", "offload")
DIRECTIONS = ("d2h", "h2d")
_COMM_PREFIXES = {"comm": False, "comm_attn": True}  # flat prefix -> Collective.attention


@dataclass(frozen=True)
class Traffic:
    """Calls of one kind in a step and the bytes they move."""

    calls: float = 0  # calls in the step (a simulated tile's weighted by the tiles it stands for)
    bytes: float = 0  # bytes over those calls (a collective's: per rank; a kernel's: read plus written)

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.calls + other.calls, self.bytes + other.bytes)


@dataclass(frozen=True)
class Collective:
    """A kind of collective call: calls of one kind are timed (``bench.stackmodel.steptime``) and
    connected (``bench.stackmodel.stack.nccl_buffer_bytes``) alike."""

    op: str  # the c10d operation: all_to_all, all_gather, reduce_scatter, all_reduce, send, broadcast, barrier
    size: int  # ranks in the call's group
    in_node: int  # members of the group in the counted rank's node (the others are reached over the network)
    attention: bool = False  # the attention's own calls that it waits on; the kind without this flag counts them too

    def __post_init__(self) -> None:
        if not self.op or "." in self.op:
            raise ValueError(f"a collective's op must be a name without dots, got {self.op!r}")
        if self.size < 1 or not 0 <= self.in_node <= self.size:
            raise ValueError(f"a collective needs size >= 1 and 0 <= in_node <= size, got size {self.size}, "
                             f"in_node {self.in_node} ({self.op})")


@dataclass(frozen=True)
class HostCopy:
    """A kind of copy between the simulated accelerator and the host (``bench.stackmodel.stepcount.HostCopies``)."""

    issuer: str  # "method": the attention methods' code (FPDT's chunk store); "offload": the step's checkpoint offload
    direction: str  # "d2h": device to host; "h2d": host to device

    def __post_init__(self) -> None:
        if self.issuer not in ISSUERS or self.direction not in DIRECTIONS:
            raise ValueError(f"a host copy's issuer must be one of {ISSUERS} and its direction one of {DIRECTIONS}, "
                             f"got {self.issuer!r}, {self.direction!r}")


@dataclass(frozen=True)
class StepCounts:
    """Everything one rank's step executed that the step-time model turns into seconds (module docstring)."""

    flops_matmul: float = 0  # FLOPs of the GEMMs (mm, addmm, bmm, ...), recompute included
    flops_attention: float = 0  # FLOPs of the attention kernels, causal masking counted
    flops_other: float = 0  # FLOPs of the other ops torch's counter has a formula for
    # dense-rate FLOPs the flash op's varlen calls cost beyond flops_attention (short documents, few heads per
    # call run below the dense rate: bench.stackmodel.varlenrate); timed with the attention; 0 without documents
    flops_attention_varlen_excess: float = 0.0
    host_copies: dict[HostCopy, Traffic] = field(default_factory=dict)  # accelerator <-> host copies, bytes moved
    memory_bound: Traffic | None = None  # the memory-bound kernels' calls and HBM bytes; None: counts of version 2
    events: dict[str, float] = field(default_factory=dict)  # events the methods noted, by name (count)
    collectives: dict[Collective, Traffic] = field(default_factory=dict)  # collective calls by kind, first seen first
    version: int | None = None  # the counting's version (COUNTS_VERSION); None: counts from before it was written

    def known_version(self) -> int | None:
        """``version``, or for counts from before it was written 3 (with the memory-bound bytes) or 2; None for
        empty counts (``StepCounts()``), which any version can join."""
        if self.version is not None:
            return self.version
        if self == StepCounts():
            return None
        return 3 if self.memory_bound is not None else 2

    def host_bytes(self, issuer: str) -> float:
        """Bytes ``issuer``'s copies moved, device to host plus host to device."""
        return (self.host_copies.get(HostCopy(issuer, "d2h"), Traffic()).bytes
                + self.host_copies.get(HostCopy(issuer, "h2d"), Traffic()).bytes)

    # ----------------------------------------------------------------------- arithmetic

    @classmethod
    def combine(cls, parts: Sequence[StepCounts], fn: Callable[..., float]) -> StepCounts:
        """Counts whose every figure is ``fn`` of that figure in each of ``parts`` (a figure a part
        lacks is 0): extrapolation over layers, per-layer increments, interpolation over lengths.
        An entry of any part is an entry of the result; ``memory_bound`` is None only where it is
        None in every part. Counts of different versions (``known_version``: a planner's cached simulation
        beside a new one) make counts of the oldest, which do not write their version, so that whoever reads
        them takes them as old (the planner simulates them again before it times them)."""
        versions = {v for p in parts if (v := p.known_version()) is not None}
        version = min(versions) if versions else None
        if version is not None and version < 4:
            version = None  # the versions before 4 are known by their content
        def entries(get: Callable[[StepCounts], dict]) -> dict:
            keys = dict.fromkeys(k for p in parts for k in get(p))
            return {k: Traffic(fn(*(get(p).get(k, Traffic()).calls for p in parts)),
                               fn(*(get(p).get(k, Traffic()).bytes for p in parts))) for k in keys}

        bound = [p.memory_bound for p in parts]
        names = dict.fromkeys(name for p in parts for name in p.events)
        return cls(
            flops_matmul=fn(*(p.flops_matmul for p in parts)),
            flops_attention=fn(*(p.flops_attention for p in parts)),
            flops_other=fn(*(p.flops_other for p in parts)),
            flops_attention_varlen_excess=fn(*(p.flops_attention_varlen_excess for p in parts)),
            host_copies=entries(lambda p: p.host_copies),
            memory_bound=None if all(b is None for b in bound) else Traffic(
                fn(*((b or Traffic()).calls for b in bound)), fn(*((b or Traffic()).bytes for b in bound))),
            events={name: fn(*(p.events.get(name, 0) for p in parts)) for name in names},
            collectives=entries(lambda p: p.collectives),
            version=version,
        )

    # ----------------------------------------------------------------------- the flat form (module docstring)

    @classmethod
    def from_flat(cls, flat: Mapping[str, float]) -> StepCounts:
        """The counts of a row's flat ``counts`` (or a cached ``step_counts``); a malformed key, a
        value that is not a number, or half of a calls/bytes pair raises a ``ValueError`` naming it."""
        flops: dict[str, float] = {}
        pairs: dict[object, dict[str, float]] = {}  # Traffic entries (in order first seen) -> {"calls", "bytes"}
        events: dict[str, float] = {}
        version = None
        for key, value in flat.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"step count {key!r} must be a number, got {value!r}")
            head, _, rest = key.partition(".")
            if key == VERSION_KEY:
                if not isinstance(value, int) or not 4 <= value <= COUNTS_VERSION:
                    raise ValueError(f"step count {key!r} must be an integer from 4 to {COUNTS_VERSION} (earlier "
                                     f"counts do not write it), got {value!r}")
                version = value
            elif head == "flops":
                if rest not in (*KERNEL_CLASSES, VARLEN_EXCESS):
                    raise ValueError(f"step count {key!r}: the FLOPs classes are {', '.join(KERNEL_CLASSES)} "
                                     f"(and {VARLEN_EXCESS})")
                if rest == VARLEN_EXCESS and value == 0:
                    raise ValueError(f"step count {key!r} is 0: the flat form leaves it out when it is 0")
                flops[rest] = value
            elif head == "host":
                issuer, _, what = rest.partition(".")
                direction, _, unit = what.partition("_")
                if issuer not in ISSUERS or direction not in DIRECTIONS or unit not in ("bytes", "calls"):
                    raise ValueError(f"step count {key!r} is not host.<{'|'.join(ISSUERS)}>."
                                     f"<{'|'.join(DIRECTIONS)}>_<bytes|calls>")
                pairs.setdefault(HostCopy(issuer, direction), {})[unit] = value
            elif head == "bytes":
                if rest not in ("memory_bound", "memory_bound_calls"):
                    raise ValueError(f"step count {key!r} is not bytes.memory_bound or bytes.memory_bound_calls")
                pairs.setdefault("memory_bound", {})["calls" if rest.endswith("_calls") else "bytes"] = value
            elif head in _COMM_PREFIXES:
                parts = rest.split(".")
                if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit() \
                        or parts[3] not in ("bytes", "calls"):
                    raise ValueError(f"step count {key!r} is not {head}.<op>.<group size>.<members in the rank's "
                                     "node>.<bytes|calls>")
                try:
                    kind = Collective(parts[0], int(parts[1]), int(parts[2]), _COMM_PREFIXES[head])
                except ValueError as err:
                    raise ValueError(f"step count {key!r}: {err}") from None
                if f"{flat_name(kind)}.{parts[3]}" != key:
                    raise ValueError(f"step count {key!r} is not written as {flat_name(kind)}.{parts[3]}")
                pairs.setdefault(kind, {})[parts[3]] = value
            else:
                events[key] = value
        missing = [c for c in KERNEL_CLASSES if c not in flops]
        if missing:
            raise ValueError(f"step counts lack flops.{', flops.'.join(missing)} (every count of "
                             "bench.stackmodel.stepcount has flops.matmul, flops.attention and flops.other)")
        for entry, pair in pairs.items():
            if len(pair) != 2:
                have = next(iter(pair))
                raise ValueError(f"step counts have the {have} of {flat_name(entry)} but not its "
                                 f"{'calls' if have == 'bytes' else 'bytes'}: each comes with the other")
        traffic = {entry: Traffic(pair["calls"], pair["bytes"]) for entry, pair in pairs.items()}
        return cls(flops_matmul=flops["matmul"], flops_attention=flops["attention"], flops_other=flops["other"],
                   flops_attention_varlen_excess=flops.get(VARLEN_EXCESS, 0.0),
                   host_copies={k: v for k, v in traffic.items() if isinstance(k, HostCopy)},
                   memory_bound=traffic.get("memory_bound"), events=events,
                   collectives={k: v for k, v in traffic.items() if isinstance(k, Collective)}, version=version)

    def to_flat(self) -> dict[str, float]:
        """The flat form (module docstring), keys sorted as rows store them."""
        out: dict[str, float] = {"flops.matmul": self.flops_matmul, "flops.attention": self.flops_attention,
                                 "flops.other": self.flops_other}
        if self.flops_attention_varlen_excess:
            out[f"flops.{VARLEN_EXCESS}"] = self.flops_attention_varlen_excess
        for copy, t in self.host_copies.items():
            out[f"host.{copy.issuer}.{copy.direction}_bytes"] = t.bytes
            out[f"host.{copy.issuer}.{copy.direction}_calls"] = t.calls
        if self.memory_bound is not None:
            out["bytes.memory_bound"] = self.memory_bound.bytes
            out["bytes.memory_bound_calls"] = self.memory_bound.calls
        for kind, t in self.collectives.items():
            out[f"{flat_name(kind)}.bytes"] = t.bytes
            out[f"{flat_name(kind)}.calls"] = t.calls
        if self.version is not None:
            out[VERSION_KEY] = self.version
        for name, n in self.events.items():
            if name in out or name == VERSION_KEY or name.partition(".")[0] in ("flops", "host", "bytes",
                                                                                 *_COMM_PREFIXES):
                raise ValueError(f"event name {name!r} collides with the counts' own keys: name it otherwise")
            out[name] = n
        return dict(sorted(out.items()))


def flat_name(entry: object) -> str:
    """The flat key of a Traffic entry, less its ``.bytes``/``.calls`` (``_bytes``/``_calls``) ending."""
    if isinstance(entry, Collective):
        prefix = next(p for p, attention in _COMM_PREFIXES.items() if attention == entry.attention)
        return f"{prefix}.{entry.op}.{entry.size}.{entry.in_node}"
    if isinstance(entry, HostCopy):
        return f"host.{entry.issuer}.{entry.direction}"
    return "bytes.memory_bound"

