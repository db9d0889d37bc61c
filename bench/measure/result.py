"""What one measurement of a trial returns: ``Measurement``, the figures ``bench.measure.run.build_row`` makes a row of.

Every measuring path returns one: a simulation (``measure_simulated``), an emulated rank
(``_emulated``), one real rank (``real_rank``) and the real ranks combined (``_combine_ranks``),
the layer-extrapolated model and its allocator replay (``bench.search.extrapolate``), and a
failure (``guarded``: ``status`` and ``message`` only). A figure a path does not measure is
``None``. Bytes are one rank's.

The planner caches simulated measurements as JSON (``bench.search.plan.SimCache``):
:meth:`Measurement.to_dict` and :meth:`Measurement.from_dict` are that form, the keys of the
fields below and the counts flat (``bench.stackmodel.counts``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..stackmodel.counts import StepCounts

if TYPE_CHECKING:
    from ..stackmodel.allocator import Trace
    from .trial import Trial


@dataclass(frozen=True)
class AllocatorReplay:
    """A step's device allocations and frees replayed through the model of the CUDA caching allocator
    (``bench.stackmodel.allocator``)."""

    model: str  # its segments: "classic" or "expandable" (StepConfig.allocator_model)
    pools: str | None  # "shared" or "per-stream" (StepConfig.allocator_pools); None in caches made before pools
    peak_allocated_bytes: int  # the replay's allocated peak, reserve included (bytes)
    events: int  # allocations and frees replayed (count)
    replay_s: float  # wall time of the replay (s)
    cache_releases: int  # times the allocator released its cached blocks and retried (count)
    oom: str | None  # why the replay ran out of the memory it may map; None: it did not
    reserve_bytes: int | None = None  # bytes held besides the trace (a deeper model's further layers); None: none

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None or k not in ("pools", "reserve_bytes")}


@dataclass(frozen=True)
class LoadAround:
    """The host's load around the timed steps (``bench.measure.timing.HostLoad``)."""

    before: float  # 1-minute load average before the timed steps
    after: float  # 1-minute load average after them
    cpus: int  # logical CPUs of the host (count)


@dataclass(frozen=True)
class KeptTrace:
    """A simulation's allocation trace, kept to replay it again (``bench.measure.run.replay_with_reserve``)."""

    trace: Trace  # the step's allocations and frees (bench.stackmodel.allocator.record_step)
    device_key: str  # the simulated accelerator's device in the trace ("cuda:0")
    trial: Trial  # the trial as the accounting stack ran it


@dataclass
class Measurement:
    """The figures of one measurement (module docstring); the field order is ``to_dict``'s."""

    status: str = "ok"  # ok, oom or error
    message: str | None = None  # why the status is not ok (one line)
    traceback: str | None = None  # the failing measurement's traceback (guarded)
    peak_reserved_bytes: int | None = None  # reserved peak: CUDA's, or the modelled allocator's (bytes)
    allocator: AllocatorReplay | None = None  # simulated with allocator_model: the replay behind peak_reserved_bytes
    peak_bytes: int | None = None  # allocated peak of live tensors on the device (bytes)
    peak_by_category: dict[str, int] | None = None  # that peak by MemTracker category: parameter, temp, ... (bytes)
    host_peak_bytes: int | None = None  # simulated: peak of host memory (offloads) (bytes)
    comm_bytes: int | None = None  # bytes the rank's collectives send in a step (bytes)
    comm_bytes_by_op: dict[str, int] | None = None  # those bytes by collective operation (bytes)
    comm_time_s: float | None = None  # simulated: the collectives' time through the link model (s)
    step_counts: StepCounts | None = None  # simulated: what the step executed, for the step-time model
    sim_device: str | None = None  # simulated: the fake device the step ran on ("cuda:0", "cpu")
    flash_attn_simulated: bool | None = None  # bench.stackmodel.fake_flash_attn stood in for flash-attn
    stack_notes: list[str] | None = None  # what the accounting stack and the extrapolation did (row notes)
    comm_calls: list[tuple[str, int, int]] | None = None  # emulated, real: first step's collectives (op, bytes, ranks)
    compute_time_s: float | None = None  # median of the timed steps (s); real, combined: the slowest rank's
    step_times_s: list[float] | None = None  # every timed step, in order (s)
    host: str | None = None  # the host the rank ran on
    host_load: LoadAround | None = None  # the host's load around the timed steps
    loss: float | None = None  # the step's loss; combined: the mean over ranks
    device_name: str | None = None  # the device the rank ran on (CUDA's name, or the CPU's)
    threads: int | None = None  # torch's intra-op threads of the rank (count)
    own_threads: int | None = None  # combined: the threads of the trial's ranks on rank 0's host (count)
    skipped_calls: dict[str, int] | None = None  # emulated with attention_math=skip: attention calls answered (count)
    attention_times_s: list[float] | None = None  # real, CPU: each timed step's attention kernel seconds (attntime)
    attention_calls: dict[str, int] | None = None  # real, CPU: attention kernel calls per step, forward and backward
    attention_clock: str | None = None  # real, CPU: the clock the attention was timed on (attntime); combined: ranks'
    rank_attention_s: list[float] | None = None  # real, combined: each rank's median attention seconds, rank order
    rank_attention_calls: list[list[int]] | None = None  # real, combined: [forward, backward] calls per step, by rank
    rank: int | None = None  # simulated, emulated: the rank measured; of several (worst_of), the worst
    rank_peaks: list[list[int]] | None = None  # several ranks simulated or emulated: [rank, judged peak (bytes)]
    # simulated with documents, several ranks: a simulated rank with the most counted attention pairs, where ``rank``
    # has fewer: ``step_counts`` are then its own, the whole step's (worst_of)
    attention_rank: int | None = None
    rank_reserved_peaks: list[list[int]] | None = None  # several ranks emulated on CUDA: [rank, reserved peak]
    trace: KeptTrace | None = field(default=None, compare=False, repr=False)  # keep_trace: to replay (not in to_dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (module docstring): the fields that are not None, the trace left out."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "trace":
                continue
            if isinstance(value, StepCounts):
                value = value.to_flat()
            elif isinstance(value, AllocatorReplay):
                value = value.to_dict()
            elif isinstance(value, LoadAround):
                value = dataclasses.asdict(value)
            elif f.name == "comm_calls":
                value = [list(c) for c in value]
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        """The measurement of ``to_dict``'s form; an unknown key raises a ``ValueError`` naming it."""
        names = {f.name for f in dataclasses.fields(cls)} - {"trace"}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"a measurement has no field {', '.join(map(repr, unknown))} "
                             f"(fields: {', '.join(sorted(names))})")
        values = dict(d)
        if values.get("step_counts") is not None:
            values["step_counts"] = StepCounts.from_flat(values["step_counts"])
        if values.get("allocator") is not None:
            values["allocator"] = AllocatorReplay(**{"pools": None, **values["allocator"]})
        if values.get("host_load") is not None:
            values["host_load"] = LoadAround(**values["host_load"])
        if values.get("comm_calls") is not None:
            values["comm_calls"] = [tuple(c) for c in values["comm_calls"]]
        return cls(**values)


def failed(status: str, message: str, traceback: str | None = None) -> Measurement:
    """A measurement that did not finish: ``status`` (oom or error) and why."""
    return Measurement(status=status, message=message, traceback=traceback)
