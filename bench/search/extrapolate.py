"""Simulated trials of deep models from 3- and 4-layer simulations, extrapolated over layers.

A full simulation of a 32-64 layer model at millions of tokens takes minutes on one core
under the paper stack (the allocator trace grows with the layers), and a max-context search
runs many. The layers of a decoder are identical, so what one more layer adds to rank 0's
peak is a constant: its sharded parameters, gradients and optimizer state, and its offloaded
checkpoint (host). With 3 or more layers the step is in one regime (the first block keeps its
checkpoint on the device, and under ``offload_keep="first_last"`` the last too; the others
are offloaded; under ``offload_keep="none"`` all are, and under ``fsdp_offload`` each layer's
sharded state adds to the host instead of the device), so

    figure(L) = figure(3) + (figure(4) - figure(3)) * (L - 3)

for the peak, each tracker category, the host peak, the modelled communication and the
step-time counts (FLOPs, collectives, host copies: ``bench.stackmodel.stepcount``). The
reserved peak (paper stack) is not linear in the layers: the allocator's slack above the live
bytes is what its cache holds around the peak moment, inside one block's backward, so it is
taken from the 4-layer simulation and added to the extrapolated peak,
``reserved(L) = peak(L) + (reserved(4) - peak(4))``. The same rule as ``bench.search.plan``
(``tests/bench/search/test_extrapolate.py`` checks it against a full simulation). A row made this way
says so in its notes.

Ranks. A method whose ranks differ (``AttentionMethod.deciding_ranks``: the ring family) is
extrapolated rank by rank, each from its own 3- and 4-layer simulations (and replayed under
pressure from its own trace), and the worst extrapolated rank decides (``bench.measure.run.worst_of``),
as a full simulation of every rank would: what a layer adds is each rank's own sharded state, but
the allocator's slack and the moment of the peak are per rank, so extrapolating one rank (the worst
of the shallow simulations) could pick a rank that is not the worst at the full depth.

That rule ignores what the allocator does at its capacity. The real one, when an allocation
does not fit, releases its cached blocks (with expandable segments: unmaps every free page of
every stream's segment) and tries again (``malloc`` in ``c10/cuda/CUDACachingAllocator.cpp``;
``bench.stackmodel.allocator`` models it); its reserved peak never passes the capacity, and a step
fails only if what is live, page-rounded, does not fit. The slack above the live bytes is
cached memory, so ``peak(L) + slack`` past the capacity does not make an OOM. So the runner
(``under_pressure``) replays the 4-layer simulation's allocation trace again against the
capacity less ``reserve = peak(L) - peak(4)``, the bytes the further layers add (their sharded
parameters, gradients and optimizer state, which the deeper model holds throughout the
backward where the peak lies): the model fits if that replay does, with its reserved peak
plus ``reserve``. Below the capacity that is the rule above to the byte. Holding ``reserve``
for the whole step is conservative (the gradients of blocks not yet reached do not exist yet).
Checked against full simulations (Llama3-8B torch-cp at 1M on 8 ranks: the slack rule says 76.93
GiB, over the 75.65 usable; the whole 32-layer step fits after 2 cache releases; the test
``test_extrapolation_under_pressure_agrees_with_full_simulation``). The planner
(``bench.search.plan``) keeps the slack rule for its cached simulations, which hold no trace, and
replays under pressure only where the slack alone takes a length past the capacity.

Group extrapolation (two-level checkpoints, ``StepConfig.ac_group = K > 1``;
``bench.training.nested``): the rule above does not hold over layers, because the forward
stores one input per *group* and the backward re-creates one group's ``K`` block inputs on the
host: adding a layer changes the group structure (a new group, or a longer last one). But when
``K`` divides ``L`` the model is ``n = L / K`` identical groups, and adding a group adds a
constant: its ``K`` layers' sharded state (device, or host under ``fsdp_offload``), its stored
group input (host), its ``K`` blocks' FLOPs, collectives and host copies; the ``K``
re-created block inputs are held for one group at a time, a constant. ``offload_keep``
applies to the group inputs as it does to block inputs at ``K = 1``
(``bench.training.step.kept_on_device``): under ``"first_last"`` and ``"first"`` groups 0 and
``n - 1`` (resp. 0) keep their inputs on the device only once ``n > 2``, so ``n >= 3`` is one
regime (``n = 2 -> 3`` moves a group input from the host to the device); under ``"none"``
every group input is on the host at any ``n``, and ``n >= 2`` is one regime (one group is a
case of its own: measured, the increment from 1 to 2 groups differs from the later ones).
So, with ``g = GROUP_LOW[offload_keep]``,

    figure(n) = figure(g) + (figure(g + 1) - figure(g)) * (n - g)

from simulations of ``g * K`` and ``(g + 1) * K`` layers, for every figure the layer rule
carries, the reserved peak again taking the larger simulation's slack (``scheme`` picks the
rule; ``tests/bench/search/test_plan.py`` checks it against a full simulation). When ``K`` does not
divide ``L`` (the last group is shorter: not identical groups) or the model has too few groups
to gain anything (``n <= g + 1``), the model is simulated whole.

Limits. Both rules extrapolate the peak of the two simulations, i.e. the step's heaviest moment
at that depth. The rules are exact while that moment stays the heaviest at the full depth. Each
moment grows linearly, but not all at the same rate: without ``fsdp_offload`` the sharded
gradients of the blocks already done accumulate on the device over the backward, so a moment
late in the backward grows faster with depth than one early in it, and where the shallow
simulations peak early and the two moments are close the full model peaks late, above the
extrapolation. Measured on a tiny model where gradients are large next to activations
(``test_group_extrapolation_matches_full_simulation``: 10 layers, ``first_last``, 32768 tokens):
0.8% under. At the lengths the searches reach, the activations of one block's backward are tens
of GiB against a few GiB of gradients, and the planner's two-level rungs run with
``fsdp_offload`` (gradients on the host).
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from records import GiB, Row

from ..measure.result import Measurement
from ..measure.run import (
    build_row,
    deciding_ranks,
    guarded,
    measure_simulated,
    measure_worst_rank,
    replay_with_reserve,
    worst_of,
)
from ..measure.trial import Trial
from ..stackmodel.counts import StepCounts

LOW = 3  # layer counts simulated: 3 and 4 (step.py keeps the first and last block's checkpoints on
# the device and offloads the others only when there are more than 2 blocks, so L >= 3 is one regime)


def layer_variant(cfg, n_layers: int, directory: str) -> str:
    """A JSON config file of ``cfg`` with ``n_layers`` layers (same name)."""
    path = Path(directory) / f"{cfg.name.replace('/', '_')}_L{n_layers}.json"
    if not path.exists():
        path.write_text(json.dumps({**cfg.to_dict(), "n_layers": n_layers}))
    return str(path)


# group counts simulated under two-level checkpoints, by offload_keep: g and g + 1 groups (module docstring)
GROUP_LOW = {"first_last": 3, "first": 3, "none": 2}


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How a model is simulated: ``units`` identical units of ``size`` layers (a layer, or a
    two-level checkpoint group), extrapolated from ``low`` and ``low + 1`` units; ``whole``:
    simulated whole, for the reason ``why``."""
    size: int = 1
    low: int = LOW
    units: int = 0
    why: str = ""

    @property
    def whole(self) -> bool:
        return bool(self.why)

    @property
    def layers(self) -> tuple[int, int]:
        """The layer counts simulated."""
        return self.low * self.size, (self.low + 1) * self.size

    def describe(self) -> str:
        if self.whole:
            return f"whole model simulated: {self.why}"
        if self.size == 1:
            return f"from {self.layers[0]}- and {self.layers[1]}-layer simulations"
        return (f"from {self.low} and {self.low + 1} groups of {self.size} ({self.layers[0]} and {self.layers[1]} "
                f"layers) to {self.units} groups")


def scheme(n_layers: int, ac_group: int = 1, offload_keep: str = "first_last") -> Scheme:
    """The extrapolation rule for a model of ``n_layers`` under ``ac_group`` and ``offload_keep``
    (module docstring: over layers at ``ac_group = 1``, over groups when ``ac_group`` divides
    the layers, else the whole model)."""
    if ac_group <= 1:
        if n_layers <= LOW + 1:
            return Scheme(units=n_layers, why=f"{n_layers} layers, no more than the {LOW + 1} it would simulate")
        return Scheme(units=n_layers)
    if n_layers % ac_group:
        return Scheme(ac_group, units=n_layers, why=(
            f"{n_layers} layers are not a multiple of ac_group={ac_group} (a shorter last group: "
            "the groups are not identical)"))
    low, groups = GROUP_LOW[offload_keep], n_layers // ac_group
    if groups <= low + 1:
        return Scheme(ac_group, low, groups, f"{groups} groups of {ac_group}, no more than the {low + 1} "
                      "it would simulate")
    return Scheme(ac_group, low, groups)


LINEAR = ("peak_bytes", "host_peak_bytes", "comm_bytes", "comm_time_s")  # Measurement fields linear in the layers


def extrapolate(r3: Measurement, r4: Measurement, layers: int, low: int = LOW) -> Measurement:
    """The full model's simulated result from the ``low``- and ``low + 1``-unit ones: by default
    the 3- and 4-layer ones for ``layers`` > 4 layers; for two-level checkpoints, ``layers``
    and ``low`` count groups (``scheme``)."""
    n = layers - low
    linear = {}
    for key in LINEAR:
        a, b = getattr(r3, key), getattr(r4, key)
        if a is not None and b is not None:
            value = a + (b - a) * n
            linear[key] = value if isinstance(a, float) else int(value)
    out = dataclasses.replace(r4, **linear)
    if r4.peak_reserved_bytes is not None:
        out.peak_reserved_bytes = out.peak_bytes + max(0, r4.peak_reserved_bytes - r4.peak_bytes)
    if r3.step_counts is not None or r4.step_counts is not None:  # FLOPs, collectives and host copies per
        # layer are identical: linear too
        out.step_counts = StepCounts.combine([r3.step_counts or StepCounts(), r4.step_counts or StepCounts()],
                                             lambda a, b: a + (b - a) * n)
    cat3, cat4 = r3.peak_by_category or {}, r4.peak_by_category or {}
    out.peak_by_category = {c: int(cat3.get(c, 0) + (cat4.get(c, 0) - cat3.get(c, 0)) * n)
                            for c in dict.fromkeys([*cat3, *cat4])}
    alloc3, alloc4 = r3.allocator, r4.allocator
    if alloc4:
        out.allocator = dataclasses.replace(
            alloc4, oom=alloc4.oom or (alloc3.oom if alloc3 else None),
            peak_allocated_bytes=out.peak_bytes if out.peak_bytes is not None else alloc4.peak_allocated_bytes)
    return out


def unit_increments(r3: Measurement, r4: Measurement) -> dict:
    """Per-unit (layer or group) increments of everything ``extrapolate`` carries, from the two simulations
    of one length: with ``with_increments`` they stand in for the larger simulation at another length
    (the planner's approximation, which its search re-checks exactly at its answer)."""
    cat3, cat4 = r3.peak_by_category or {}, r4.peak_by_category or {}
    out = {k: (getattr(r4, k) or 0) - (getattr(r3, k) or 0) for k in LINEAR}
    out["peak_by_category"] = {c: cat4.get(c, 0) - cat3.get(c, 0) for c in dict.fromkeys([*cat3, *cat4])}
    if r3.step_counts is not None or r4.step_counts is not None:
        out["step_counts"] = StepCounts.combine([r3.step_counts or StepCounts(), r4.step_counts or StepCounts()],
                                                lambda a, b: b - a)
    if r4.peak_reserved_bytes is not None:
        out["reserved_slack"] = r4.peak_reserved_bytes - r4.peak_bytes
    return out


def with_increments(r3: Measurement, slope: dict) -> Measurement:
    """The larger simulation's result (4 layers, or ``g + 1`` groups) from the smaller one and
    increments measured at another length."""
    r4 = dataclasses.replace(r3, **{k: getattr(r3, k) + slope.get(k, 0) for k in LINEAR if getattr(r3, k) is not None})
    cat3 = r3.peak_by_category or {}
    r4.peak_by_category = {c: cat3.get(c, 0) + d for c, d in slope.get("peak_by_category", {}).items()}
    if r3.step_counts is not None or "step_counts" in slope:
        r4.step_counts = StepCounts.combine([r3.step_counts or StepCounts(), slope.get("step_counts", StepCounts())],
                                            lambda a, d: a + d)
    if r3.peak_reserved_bytes is not None:
        r4.peak_reserved_bytes = r4.peak_bytes + slope.get(
            "reserved_slack", r3.peak_reserved_bytes - r3.peak_bytes)
    return r4


def under_pressure(high: Measurement, out: Measurement) -> Measurement:
    """``out`` (the model extrapolated from ``high``, the larger simulation, run with
    ``keep_trace``) with its reserved peak replayed rather than added: ``high``'s allocation
    trace through the allocator model again, against the capacity less the bytes the extra
    layers add to the peak (``reserve``; module docstring). Where the extrapolated reserved peak
    would pass the capacity, the modelled allocator meets it, releases its cached blocks and
    retries, as the real one does, so the model fits unless what is live (page-rounded) does
    not. Without a trace (lean stack), ``out`` unchanged."""
    out = dataclasses.replace(out, trace=None)  # extrapolate() copied the larger result's
    if high.trace is None or not out.allocator:
        return out
    reserve = max(0, out.peak_bytes - high.peak_bytes)
    reserved, alloc = replay_with_reserve(high, reserve)
    if alloc.oom:  # keep the slack rule's figure: what the model would need, not where the replay stopped
        oom = f"{alloc.oom} (with {reserve / GiB:.2f} GiB of the further layers held; bench.search.extrapolate)"
        return dataclasses.replace(out, allocator=dataclasses.replace(
            out.allocator, oom=oom, reserve_bytes=reserve, cache_releases=alloc.cache_releases))
    return dataclasses.replace(out, peak_reserved_bytes=max(reserved, out.peak_bytes), allocator=dataclasses.replace(
        out.allocator, reserve_bytes=reserve, cache_releases=alloc.cache_releases))


def simulated_pair(trial: Trial, how: Scheme, directory: str,
                   rank: int = 0) -> tuple[list[Measurement], Measurement | None]:
    """The two shallow simulations ``how`` names, of rank ``rank`` (the larger one keeping its trace),
    and the model extrapolated from them and replayed under pressure (``under_pressure``); ``None``
    for the latter if either simulation failed with an error."""
    cfg = trial.config()
    shallow = [dataclasses.replace(trial, model=layer_variant(cfg, n, directory)) for n in how.layers]
    results = [guarded(measure_simulated, t, i == 1, rank) for i, t in enumerate(shallow)]
    out = None
    if not any(r.status == "error" for r in results):
        out = under_pressure(results[1], extrapolate(results[0], results[1], how.units, how.low))
    results[1].trace = None
    return results, out


def layer_extrapolated_runner(workdir: str | None = None) -> Callable[[Trial], Row]:
    """A runner for ``bench.search.maxctx.search``: simulated trials of models deeper than 4
    layers are extrapolated from 3- and 4-layer simulations (under two-level checkpoints, from
    ``g`` and ``g + 1`` groups: ``scheme``, the planner's rule); others are simulated whole."""
    directory = workdir or tempfile.mkdtemp(prefix="cpab-layers-")

    def runner(trial: Trial) -> Row:
        if trial.mode != "simulated":
            raise ValueError("layer extrapolation is for simulated trials only")
        cfg = trial.config()
        t0 = time.perf_counter()
        how = scheme(cfg.n_layers, trial.step.ac_group, trial.step.offload_keep)
        if how.whole:
            result = guarded(measure_worst_rank, trial)
            if how.size > 1 and result.status != "error":
                result.stack_notes = list(result.stack_notes or []) + [how.describe()]
            return build_row(trial, result, time.perf_counter() - t0)
        by_rank: dict[int, Measurement] = {}
        for rank in deciding_ranks(trial):  # each rank extrapolated on its own, then the worst (module docstring)
            results, extrapolated = simulated_pair(trial, how, directory, rank)
            failed = next((r for r in results if r.status == "error"), None)
            by_rank[rank] = failed or extrapolated
            if failed:
                break
            extrapolated.status = "ok"  # the budget is judged on the extrapolated figures (build_row)
        result = worst_of(trial, by_rank)
        if result.status == "ok":
            rule = (f"figure({cfg.n_layers}) = figure(3) + (figure(4) - figure(3)) x {cfg.n_layers - LOW}, "
                    "from 3- and 4-layer simulations" if how.size == 1 else how.describe())
            result.stack_notes = list(result.stack_notes or []) + [
                f"extrapolated over {'layers' if how.size == 1 else 'two-level checkpoint groups'}: {rule} "
                "(bench.search.extrapolate)"]
        return build_row(trial, result, time.perf_counter() - t0)

    return runner
