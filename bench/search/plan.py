"""``python -m bench plan``: which configuration, and how long a context, for a model on N GPUs.

    python -m bench plan --model llama3-8b --gpus 8 --device h100-80g
    python -m bench plan --model qwen3-32b --gpus 16 --device h100-80g --nodes 2
    python -m bench plan --model my_model.yaml --gpus 8 --device h200-141g [--max-seq-len 32M]

Configurations: the suite's own methods in the paper's record setup (``StepConfig()``
defaults: FSDP2, AC offloaded to host, tiled MLP/norm, chunked loss): upipe with U = C and
U = auto, ulysses, ring, fpdt, offload; with ``--nodes K > 1`` also usp and usp-upipe with
ulysses_degree = gpus/nodes. Then, beyond the paper (``LADDER``, off with ``--paper-only``),
the paper's UPipe setup with levers added one at a time, each rung keeping the ones before:
our RoPE instead of TorchTitan's table of the whole sequence, every block's checkpoint on
the host, FSDP2's CPU offload of the sharded model state, the attention norm fused into
UPipe's projections, two-level checkpoints of groups of 4 blocks (what each does:
``bench/training/config.py``); a lever the method refuses (across nodes, usp-upipe has no
fused attention norm) is reported skipped and not carried to the later rungs (``ladder``).
Last, sequence chunks (``sequence_chunked``): FPDT's chunk pipeline (``fpdt`` with
``chunk_tokens`` = the granularity, K/V chunks on the host) with every lever of the ladder it
runs, for where the attention stage is the limit (across nodes, usp-upipe's ring holds the
stage's ring-local K/V, their fp32 gradient sums and the blocks in flight).
For each, the simulated maximum context under the **paper stack** (``--stack``;
``bench.stackmodel.stack``: the allocator's reserved peak against the device less the CUDA
context, offloads against the preset's host memory per GPU) at a coarse granularity
(default 1M), and a modelled step time at a common length.

Result: a table with each configuration's max context, peaks, step time and its ratio to
UPipe's paper setup; ``P`` marks the Pareto front of max context against step time; the
recommendation is the longest context among the configurations at most ``MAX_COST`` (2x)
UPipe's paper setup's step time (a slower one is reported, not recommended).

Simulations are cached (``SimCache``): the committed ``results/plan/sims.ndjson`` holds the
simulations behind the committed plans (``paper_figs/plan_*.md``), so re-running those plans
takes seconds; a user's new simulations go to ``runs/plan/sims.ndjson`` (``--cache``,
``--no-cache``). A plan of an uncached model simulates every probe: minutes to an hour on
2 cores (the paper stack's DeepSpeed TiledMLP and allocator replay are the slow parts;
progress is printed).

Layer extrapolation (exact for identical layers): a full-model simulation of a 32-64 layer
model takes minutes per trial, so every trial here simulates the model with 3 and 4 layers
and extrapolates (``bench.search.extrapolate.extrapolate``: peaks, host peak, categories,
counts; the reserved peak keeps the 4-layer run's slack over the allocated one), then judges
the result as a row is judged (``bench.measure.run.build_row``). Where that slack alone takes
an exactly simulated length past the capacity (the allocated peak fits), the 4-layer step is
simulated again with its allocation trace (and the 3-layer step with it, so the two come from
the same code), which is replayed with the further layers' bytes held
(``bench.search.extrapolate.under_pressure``: the allocator releases its cache before it fails,
as the real one does); the cache keeps no traces, but it keeps the outcome, under the whole
model's key with ``PRESSURE_KEY`` appended. Inside the search, a length
may reuse the per-layer increments measured at another length (one 3-layer simulation); the
longest fitting length is always simulated with both, and the shortest failing one too unless
the increment measured at the longest fitting length equals the one the failing length was judged on
(to 0.1%) and it fails by more than the slack rule (a length out of memory only by the borrowed slack
is simulated with both: its own slack, or the pressure replay, may fit). ``tests/bench/search/test_plan.py``
checks it against a full simulation. Models with 4 layers or fewer are simulated whole.

Ranks: a trial fits when its worst rank fits. Every rank that can decide memory
(``bench.measure.run.deciding_ranks``) is extrapolated from its own simulations and the worst decides
(``extrapolated``), as in a simulated row; once a point has run on every rank, the search probes on its
worst rank alone and makes the bracket's ends exact on every rank (``search_max``). ``$CPAB_SIM_RANKS=0``
simulates rank 0 alone (the plan and its workers read it), and the table's header says so.

Group extrapolation (two-level checkpoints, ``ac_group = K``; exact for identical groups): the
figures are not linear in the layers (the host holds one input per group plus one group's
``K`` re-created block inputs), but when ``K`` divides the layers they are linear in the
number of groups once there are enough for ``offload_keep`` to treat the first and last group
as it does at any larger count (3 groups; 2 under ``offload_keep="none"``), so such a trial simulates
``g`` and ``g + 1`` groups (8 and 12 layers at ``K = 4`` under ``"none"``) and extrapolates to
the model's groups the same way (``bench.search.extrapolate.scheme``, where the argument is;
``tests/bench/search/test_plan.py`` checks it against a full simulation under ``"first_last"``,
``tests/bench/search/test_extrapolate.py`` under ``"none"``). Layers that ``K`` does not
divide, or too few groups, are simulated whole; the row's note says which.

Search: lengths are multiples of ``step = lcm(granularity, layout multiple)``; a secant on
the load (the binding budget's fill, which grows smoothly with the length) proposes the next
multiple inside the bracket [longest fit, shortest failure]; it ends when the two are one
step apart, so the answer is exact to one step as in ``bench.search.maxctx``. A two-level
checkpoint rung's search starts one step past the answer of the rung below it, once that one has ended
(``run_searches``); the others start at ``FIRST``.

Step time: a measured row from ``results/`` (mode real, same method/options/model/world
size/device/length) when one exists; else ``bench.stackmodel.steptime``'s model (its fitted
constants) over the counts the longest fitting trial observed (FLOPs by kernel class,
collectives, host copies; extrapolated over layers like the peaks), carried to the length by
``steptime.scale_counts`` (attention FLOPs ∝ S², the rest ∝ S, calls constant). The source is
printed for every row.

Documents (``--docs NAME[:SEED]``, ``plan(docs=...)``): every simulated trial carries them
(``Trial.docs``), so each probe packs its own draw of the distribution at its length
(``records.workloads.DocsSpec.lengths_for``) and the simulations, their cache keys (the trial's
JSON holds the documents) and the step-time counts are those of the workload; the memory search
is the one above (documents leave a head-parallel method's memory as it is; a padding layout's
extra tokens are simulated). A configuration whose method refuses documents is reported skipped
with its reason. The ring family's sequence layouts (a method whose options have ``layout``:
``DOC_LAYOUTS``) are each a configuration. The step time takes the slowest rank's attention
(``documents_counts``) and each row reports the imbalance of the ranks' attention work
(``bench.stackmodel.docwork``) at the common length. Explicit lengths fix the sequence length,
which the plan varies: they are refused.

``chunk_heads=auto`` resolves to the largest U that fits (``bench.search.autochunk``); at the
maximum context of U = C no larger U fits, so the auto row reports U = C's length and the U
it resolves to at the common comparison length.

The Hugging Face stack (``--stack hf``, ``bench.stackmodel.hfstack``): the configurations are
exactly the methods that stack runs (``HF_ENTRIES``): ALST (``ds-ulysses-hf``, Accelerate's
``sp_size`` path), PyTorch's context parallel as Accelerate's ``cp_size`` path runs it
(``torch-cp``) and UPipe in ALST's recipe (``upipe``, U = C), each with the stack's levers only
(the resolver applies them: ``bench.resolve``); ALST is the baseline of ``rel`` and of the
recommendation. There is no ladder and no ring, USP, FPDT or offload row, and the options that
would have no effect there (``--allocator-pools``, ``--paper-only``, ``--nodes``) are refused
before any simulation (``check_stack_options``). Fit is judged as on the paper stack (the
reserved peak, with the pressure replay); the step time takes the hf stack's attention kernel and
rate (``steptime.stack_constants``), as its simulated rows do. Cache keys hold the trial's stack.
"""
from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
from concurrent import futures
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import methods
from records import GiB, Row, human, read_rows, requested_options
from records.identity import V1_OMITTED_LEVERS
from records.workloads import DocsSpec
from records.workloads.spec import identity as docs_identity

from ..measure.config import StepConfig
from ..measure.result import Measurement
from ..measure.run import (
    SIM_RANKS_ENV,
    budgeted_peak,
    build_row,
    deciding_ranks,
    guarded,
    measure_simulated,
    worst_of,
)
from ..measure.trial import AUTO, AUTO_OPTION, Trial
from ..model.config import get_config
from ..resolve import Request, resolve
from ..stackmodel import hfstack
from ..stackmodel import stack as paper_stack
from ..stackmodel.counts import StepCounts
from ..stackmodel.docwork import RankWork, trial_work
from ..stackmodel.hardware import get_device
from ..stackmodel.steptime import (
    COUNTS_VERSION,
    StepTimeConstants,
    attention_kernel,
    constants_for,
    counts_version,
    scale_counts,
    stack_constants,
    step_time,
)
from .autochunk import candidates, with_chunk
from .extrapolate import (
    Scheme,
    extrapolate,
    layer_variant,
    scheme,
    simulated_pair,
    under_pressure,
    unit_increments,
    with_increments,
)
from .maxctx import bracket, row_load, secant_on_load

RESULTS_DIR = Path(__file__).resolve().parents[2] / "results"


# --------------------------------------------------------------------------- layer extrapolation


@dataclass
class Point:  # (exact, slope attributes are set by extrapolated)
    seq_len: int
    status: str  # ok / oom / error
    peak_bytes: int
    host_peak_bytes: int
    comm_time_s: float
    usable_bytes: int
    message: str = ""



class SimCache:
    """Simulations the planner has run, kept across runs: ``(trial, layers) -> measure_simulated``'s
    result. A plan re-run (or another plan that shares trials) then simulates only what is new.

    Read from the committed reference (``results/plan/sims.ndjson``: the simulations behind the
    committed plans) and from the user's cache (``runs/plan/sims.ndjson`` under the working
    directory, or ``path``; JSON lines named ``.ndjson``, not ``.jsonl``, so that nothing reading
    result rows under ``results/`` takes them for rows); new results are appended to the user's
    file only, so a user's plan
    never touches committed data. A line is ``{"key": ..., "result": ...}``; the key is the
    trial's JSON (``Trial.to_json``) with the model named by its config name and layer count,
    so it does not depend on where the layer variant's file lives. Results depend on the code:
    a change to the simulation makes a stale cache wrong, so ``--no-cache`` ignores both files
    and the committed one is regenerated with the plans (results/plan/README.md)."""

    def __init__(self, path: Path | None, read: tuple[Path, ...] = (), simulate: bool = True) -> None:
        self.path = path
        self.files = tuple(f for f in (*read, path) if f is not None)
        self.simulate = simulate  # False: a simulation not cached is a LookupError (re-rendering committed plans)
        self.entries: dict[str, dict] = {}
        for f in (*read, *([path] if path else [])):
            if f is not None and f.exists():
                self.entries.update(self.read(f))
        self.hits = self.misses = 0

    @staticmethod
    def read(path: Path) -> dict[str, dict]:
        """The entries of one cache file; a line that is not ``{"key": ..., "result": {...}}``
        is a ``ValueError`` naming the file, the line and the fix (before any simulation)."""
        entries: dict[str, dict] = {}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as err:
                problem = f"not JSON: {err.msg.removesuffix(' at')} at column {err.colno}"
            else:
                shaped = isinstance(d, dict) and isinstance(d.get("key"), str) and isinstance(d.get("result"), dict)
                problem = None if shaped else 'not {"key": "...", "result": {...}}'
            if problem:
                raise ValueError(f"simulation cache {path}, line {number}: {problem}; delete that line, or the "
                                 f"whole file (its simulations run again), or use --no-cache")
            entries[SimCache.canonical(d["key"])] = d["result"]
        return entries

    @staticmethod
    def key(trial: Trial, name: str, n_layers: int, rank: int = 0) -> str:
        """The cache key of ``trial`` with ``n_layers`` layers, simulated on ``rank`` (named only when it is not
        rank 0, so that the committed keys, all of rank 0, still name the same simulations), in ``canonical``
        form."""
        d = json.loads(trial.to_json())
        d["model"] = f"{name}:L{n_layers}"
        if rank:
            d["rank"] = rank
        return SimCache._canonical(d)

    @staticmethod
    def canonical(key: str) -> str:
        """``key`` (a trial's JSON, maybe with ``PRESSURE_KEY`` appended) with every step lever that sits at the
        value its absence means dropped: the levers added after the first rows, with their defaults
        (``records.identity.V1_OMITTED_LEVERS``, the one table the rows' identity reads too). A key written
        before a lever existed and one written after then name the same simulation, and a new lever is keyed
        only away from its default. A key that is not a trial's JSON is left as it is."""
        base, suffix = (key[: -len(PRESSURE_KEY)], PRESSURE_KEY) if key.endswith(PRESSURE_KEY) else (key, "")
        try:
            d = json.loads(base)
        except json.JSONDecodeError:
            return key
        if not isinstance(d, dict) or not isinstance(d.get("step"), dict):
            return key
        return SimCache._canonical(d) + suffix

    @staticmethod
    def _canonical(d: dict) -> str:
        d["step"] = {k: v for k, v in d["step"].items() if k not in V1_OMITTED_LEVERS or v != V1_OMITTED_LEVERS[k]}
        return json.dumps(d, sort_keys=True)

    def allow(self, key: str) -> None:
        """Before simulating what ``key`` names: a ``LookupError`` naming it when this cache may not simulate."""
        if not self.simulate:
            d = json.loads(key.removesuffix(PRESSURE_KEY))
            where = f" (rank {d['rank']})" if d.get("rank") else ""
            raise LookupError(f"{d['method']} {d['model']} at {d['seq_len']} tokens on {d['world_size']} ranks{where} "
                              f"is not in {', '.join(map(str, self.files))}: run python -m bench plan to simulate it")

    def get(self, key: str) -> dict | None:
        hit = self.entries.get(key)
        if hit is not None:
            self.hits += 1
        return hit

    def put(self, key: str, result: dict) -> None:
        self.misses += 1
        self.entries[key] = result
        if self.path is not None and result.get("status") != "error":
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:  # one write per line: workers append concurrently
                f.write(json.dumps({"key": key, "result": result}, default=str) + "\n")


_CACHE: SimCache | None = None  # this process's (set by plan(); workers get theirs in _worker_init)


def _sim(trial, n_layers: int, workdir: str, cache: dict, keep_trace: bool = False, rank: int = 0) -> Measurement:
    """``trial`` simulated on ``rank`` with ``n_layers`` layers, from ``cache`` (this search's), the ``SimCache``,
    or anew; ``keep_trace``: a simulation run anew keeps its allocation trace (``measure_simulated``), which a cached
    one never has, so that ``extrapolated`` can replay the pair it has just simulated without simulating it again
    (it drops the traces once it is done)."""
    key = (trial.seq_len, n_layers, rank)
    if key not in cache:
        cfg = trial.config()
        t = trial if n_layers == cfg.n_layers else dataclasses.replace(
            trial, model=layer_variant(cfg, n_layers, workdir))
        t = dataclasses.replace(t, mode="simulated")
        stored = _CACHE.key(t, cfg.name, n_layers, rank) if _CACHE is not None else None
        hit = _CACHE.get(stored) if stored else None
        result = Measurement.from_dict(hit) if hit is not None else None
        if result is None:
            if _CACHE is not None:
                _CACHE.allow(stored)
            result = guarded(measure_simulated, t, keep_trace, rank)
            if _CACHE is not None:
                _CACHE.put(stored, result.to_dict())
        cache[key] = result
    return cache[key]


def fresh_counts(trial, workdir: str, rank: int = 0) -> StepCounts | None:
    """The step counts of ``trial`` simulated anew on ``rank`` (extrapolated as ``sim_scheme`` says), for an entry
    whose cached simulations predate the counts of ``COUNTS_VERSION`` (memory figures do not
    depend on the counting, so the search's answer stands); the new results replace the cached
    ones (the cache file gets the later line, which wins when it is read). Not where the cache may not
    simulate (a committed plan re-rendered): there older counts keep the constants fitted on their
    version (``steptime.constants_of``)."""
    cfg = trial.config()
    trial = dataclasses.replace(trial, mode="simulated")
    how = sim_scheme(trial)
    results = []
    for n_layers in ((cfg.n_layers,) if how.whole else how.layers):
        t = trial if n_layers == cfg.n_layers else dataclasses.replace(
            trial, model=layer_variant(cfg, n_layers, workdir))
        if _CACHE is not None:
            _CACHE.allow(_CACHE.key(t, cfg.name, n_layers, rank))
        result = guarded(measure_simulated, t, False, rank)
        if _CACHE is not None:
            _CACHE.put(_CACHE.key(t, cfg.name, n_layers, rank), result.to_dict())
        results.append(result)
    if any(r.status == "error" for r in results):
        return None
    if how.whole:
        return results[0].step_counts
    return extrapolate(results[0], results[1], how.units, how.low).step_counts


def sim_scheme(trial) -> Scheme:
    """How ``trial``'s model is simulated (``bench.search.extrapolate.scheme``): over layers,
    over two-level checkpoint groups, or whole."""
    return scheme(trial.config().n_layers, trial.step.ac_group, trial.step.offload_keep)


@dataclass
class _RankFigures:
    """One rank's figures for a trial in ``extrapolated``: its (extrapolated or whole) measurement, the row
    judged on it, whether it is exact, its per-unit increments and whether it is out of memory by the slack
    rule alone on borrowed increments; ``error``: the message of a simulation that failed."""

    result: Measurement | None
    row: Row | None
    exact: bool
    slope: dict | None
    by_slack: bool = False
    error: str | None = None


def _rank_figures(trial, how: Scheme, workdir: str, cache: dict, slope: dict | None, rank: int) -> _RankFigures:
    """``rank``'s figures for ``trial`` (``extrapolated``'s rule, for one rank)."""
    cfg = trial.config()
    if how.whole:  # too few layers or groups, or groups that are not identical (cached: SimCache)
        rows, exact = [_sim(trial, cfg.n_layers, workdir, cache, rank=rank)], True
        result = rows[0]
    else:  # over layers, or over two-level checkpoint groups (bench.search.extrapolate.scheme)
        low, high = how.layers
        # a stack judged on the reserved peak may need the pressure replay below: simulations run anew keep
        # their traces for it (dropped before returning), so that it need not simulate the same pair again
        traced = paper_stack.reserved(trial.step.stack)
        r3 = _sim(trial, low, workdir, cache, traced, rank)
        if slope is None or (trial.seq_len, high, rank) in cache:
            r4 = _sim(trial, high, workdir, cache, traced, rank)
            slope = unit_increments(r3, r4) if r4.status == "ok" else {}
            rows, exact = [r3, r4], True
        else:
            r4, rows, exact = with_increments(r3, slope), [r3], False
        result = r4 if any(r.status == "error" for r in rows) else extrapolate(r3, r4, how.units, how.low)
    bad = [r for r in rows if r.status == "error"]
    if bad:
        for r in rows:  # no replay: the traces kept for it go
            r.trace = None
        return _RankFigures(None, None, exact, slope, error=bad[0].message or "")
    row = build_row(trial, dataclasses.replace(result, status="ok"), 0.0)
    by_slack = not how.whole and _past_capacity_by_slack(trial, row, result)
    if exact and by_slack:
        # the slack rule passes the capacity where the live bytes do not: the allocator would release
        # its cache and retry (bench.search.extrapolate.under_pressure), so replay the larger
        # simulation's trace with the further layers held. Both simulations run again unless both
        # were just simulated with their traces (the cache keeps no trace, and a pair from one code
        # version keeps the per-layer increment exact); the same pair either way, as simulations are
        # deterministic
        stored = _CACHE.key(trial, cfg.name, cfg.n_layers, rank) + PRESSURE_KEY if _CACHE is not None else None
        hit = _CACHE.get(stored) if stored else None
        replayed = Measurement.from_dict(hit) if hit is not None else None
        if replayed is None:
            if stored:
                _CACHE.allow(stored)
            if r3.trace is not None and r4.trace is not None:
                pair, replayed = [r3, r4], under_pressure(r4, extrapolate(r3, r4, how.units, how.low))
            else:
                pair, replayed = simulated_pair(trial, how, workdir, rank)
            if any(r.status != "ok" for r in pair):
                replayed = None
            elif stored:
                _CACHE.put(stored, replayed.to_dict())
        if replayed is not None:
            result = replayed
            row = build_row(trial, dataclasses.replace(result, status="ok"), 0.0)
    for r in rows:  # the traces kept for the replay are not kept in this search's cache
        r.trace = None
    result.trace = None
    # out of memory by the slack rule alone on borrowed increments: only an exact point can be replayed
    return _RankFigures(result, row, exact, slope, by_slack and not exact)


def extrapolated(trial, workdir: str, cache: dict | None = None, slope: dict | None = None,
                 ranks: tuple[int, ...] | None = None) -> Point:
    """The worst deciding rank's figures for ``trial`` from 3- and 4-layer simulations extrapolated to the
    model's layers (``bench.search.extrapolate.extrapolate``; under two-level checkpoints, from ``g``
    and ``g + 1`` groups to the model's groups: ``sim_scheme``), judged as a row is
    (``build_row``: the paper stack's reserved peak against the device less the CUDA context and NCCL's buffers,
    the lean stack's allocated peak against 90%, offloads against the preset's host memory).

    Ranks: every rank that can decide memory (``bench.measure.run.deciding_ranks``: every rank of the ring
    family, one per ring position of USP's mesh, rank 0 of a method whose ranks are symmetric), each
    extrapolated from its own simulations, and the worst of them (``worst_of``), as the runner's layer
    extrapolation does. A rank out of memory or failing ends the loop: the trial does not fit whatever the
    others hold. ``slope`` (per-unit increments by rank, measured at another length) saves the larger
    simulation of each rank it holds: an approximation that ``search_max`` re-checks exactly at its answer.
    ``ranks``: the deciding ranks to simulate, in this order (default: every one); a point that fits on some
    of them only is not exact either (``search_max`` probes on the worst rank it has found, and makes the
    bracket's ends exact on every rank). ``measured``: every simulated rank's figures are its own (no borrowed
    increments); ``complete``: every deciding rank was simulated, or one does not fit."""
    cache = {} if cache is None else cache
    trial = dataclasses.replace(trial, mode="simulated")
    how = sim_scheme(trial)
    deciding = deciding_ranks(trial)
    order = tuple(r for r in ranks if r in deciding) if ranks is not None else ()
    by_rank: dict[int, _RankFigures] = {}
    for rank in order or deciding:
        got = by_rank[rank] = _rank_figures(trial, how, workdir, cache, (slope or {}).get(rank), rank)
        if got.error is not None or got.row.status != "ok":
            break
    failed = next((got for got in by_rank.values() if got.error is not None), None)
    if failed is not None:
        p = Point(trial.seq_len, "error", 0, 0, 0.0, 0, failed.error)
        p.load = float("inf")  # type: ignore[attr-defined]
        return p
    worst = worst_of(trial, {rank: dataclasses.replace(got.result, status=got.row.status)
                             for rank, got in by_rank.items()})
    row, result = by_rank[worst.rank].row, by_rank[worst.rank].result
    if trial.documents() is not None:
        # the row as the runner builds it from the worst rank (worst_of): its counts are that rank's, not rank
        # 0's, where the step's attention is carried to the slowest rank's by pairs, or the slowest rank's own
        result = dataclasses.replace(result, rank=worst.rank, rank_peaks=worst.rank_peaks,
                                     step_counts=worst.step_counts, attention_rank=worst.attention_rank)
        row = build_row(trial, dataclasses.replace(result, status="ok"), 0.0)
    f = row.figures
    _, compared = budgeted_peak(trial, f)
    load = row_load(trial, row)  # the binding budget's fill: device memory, or host memory for offloads
    p = Point(trial.seq_len, row.status, int(compared), int(f.host_peak_bytes or 0), float(f.comm_time_s or 0.0),
              int(f.usable_bytes), row.message)
    p.load = load  # type: ignore[attr-defined]
    p.measured = all(got.exact for got in by_rank.values())  # type: ignore[attr-defined]
    p.complete = set(by_rank) == set(deciding) or row.status != "ok"  # type: ignore[attr-defined]
    p.exact = p.measured and p.complete  # type: ignore[attr-defined]
    p.slope = {rank: got.slope for rank, got in by_rank.items()}  # type: ignore[attr-defined]
    p.by_slack = any(got.by_slack for got in by_rank.values())  # type: ignore[attr-defined]
    p.step_counts = result.step_counts  # type: ignore[attr-defined]
    p.row = row  # type: ignore[attr-defined]
    p.rank = worst.rank  # type: ignore[attr-defined]
    return p


PRESSURE_KEY = " under_pressure"  # SimCache key suffix: the whole model's figures from the pressure replay


def _past_capacity_by_slack(trial, row, result: Measurement) -> bool:
    """A row of a stack judged on the reserved peak (paper, hf: ``bench.stackmodel.stack.reserved``) out of
    device memory only because its reserved peak (the slack rule's) passes the capacity: the allocated
    peak fits and the replay itself did not run out."""
    f = row.figures
    return (row.status == "oom" and paper_stack.reserved(trial.step.stack) and f.peak_reserved_bytes is not None
            and f.peak_bytes <= f.usable_bytes < f.peak_reserved_bytes
            and not (result.allocator is not None and result.allocator.oom))


def _same(a: dict | None, b: dict | None, rel: float = 1e-3) -> bool:
    """``b``'s per-layer increments (by rank) are ``a``'s to ``rel`` (peak and host peak) on each of ``b``'s ranks."""
    if not a or not b or not b.keys() <= a.keys():
        return False
    return all(a[rank] and r and abs(a[rank].get(k, 0) - r.get(k, 0)) <= rel * max(1, abs(r.get(k, 0)))
               for rank, r in b.items() for k in ("peak_bytes", "host_peak_bytes"))


FIRST = 4 << 20  # where a search starts without a rung below it (search_max's first probe)


def search_max(trial, granularity: int, max_seq_len: int, workdir: str, first: int = FIRST):
    """(max_context, best Point or None, points tried, step, error Point or None): the max-context
    search (``bench.search.maxctx.bracket``) with the secant on the load, over ``extrapolated``
    points that may reuse another length's per-layer increments; the bracket's ends are made
    exact (module docstring)."""
    step = math.lcm(granularity, trial.seq_multiple())
    k_max = max_seq_len // step
    if k_max < 1:
        raise ValueError(f"--max-seq-len {max_seq_len} is below one step of {step} tokens")
    points: dict[int, Point] = {}
    cache: dict = {}
    slope: dict | None = None  # per-layer increments by rank, the latest measured of each
    deciding = deciding_ranks(trial)
    lead: int | None = None  # the worst rank of the latest point simulated on every rank (or failing)

    def at(k: int, exact: bool = False) -> Point:
        """The point at ``k`` steps: on the lead rank alone while one is known (an approximation where
        the ranks differ), on every rank, the lead first, when ``exact``."""
        nonlocal slope, lead
        if k not in points or (exact and not points[k].exact):
            order = None if lead is None else (lead, *(r for r in deciding if r != lead)) if exact else (lead,)
            p = points[k] = extrapolated(trial.with_seq_len(k * step), workdir, cache, None if exact else slope,
                                         order)
            if p.status != "error":
                if p.measured:
                    slope = {**(slope or {}), **p.slope}
                if p.complete:
                    lead = p.rank
        return points[k]

    def settle(lo: int, hi: int) -> bool:
        """Make the bracket's ends exact; whether either one's status moved."""
        changed = False
        for j in (lo, hi):
            if 1 <= j <= k_max and not points[j].exact:
                if (j == hi and lo >= 1 and points[lo].exact and _same(points[lo].slope, points[j].slope)
                        and not getattr(points[j], "by_slack", False)):
                    # hi failed on the increments lo has just been measured with (each of hi's ranks): hi is exact
                    # too. Not the latest increments of the search: hi may have been probed on older ones
                    continue
                before = points[j].status
                if at(j, exact=True).status != before:
                    changed = True
        return changed

    lo, _, error = bracket(at, points, k_max, min(k_max, max(1, first // step)), secant_on_load, settle)
    return lo * step, points.get(lo), len(cache), step, error


# --------------------------------------------------------------------------- configurations


@dataclass
class Entry:
    label: str
    trial: Trial  # at the search's granularity; an auto-chunk request for the U=auto rows
    max_context: int = 0
    peak_bytes: int | None = None
    host_peak_bytes: int | None = None
    comm_time_s: float | None = None  # at max_context
    step_counts: StepCounts | None = None  # at max_context (bench.stackmodel.stepcount), for the step-time model
    rank: int = 0  # the simulated rank whose figures and counts the entry holds (the worst deciding one)
    points: int = 0
    error: str = ""
    skipped: str = ""
    step_time_s: float | None = None
    time_source: str = ""
    resolved_u: int | None = None
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    work: RankWork | None = None  # documents: each rank's attention work at the common length (docwork)
    after: str | None = None  # the ladder rung below this one (its label): where a costlier search starts

    @property
    def method(self) -> str:
        return self.trial.method

    @property
    def auto(self) -> bool:
        return self.trial.auto_chunk is not None


# Beyond the paper (issue 18): levers added one at a time to the paper's UPipe setup, each rung keeping
# the ones before it, so that each lever's gain in context and cost in step time show. Each lever is a
# StepConfig field (bench/training/config.py, where its mechanism is described).
LADDER: tuple[tuple[str, dict[str, Any]], ...] = (
    ("+our RoPE", {"rope_table": "none"}),  # no TorchTitan table of the whole sequence (nor its offloaded copies)
    ("+offload all", {"offload_keep": "none"}),  # first and last block's checkpoints on the host too
    ("+FSDP offload", {"fsdp_offload": True}),  # fp32 masters, gradients, AdamW state and step on the host
    ("+fused norm", {"fused_attn_norm": True}),  # the attention norm inside UPipe's projections, tiled
    ("+2-level AC", {"ac_group": 4}),  # checkpoints of groups of 4 blocks on the host (host: n/4 + 3 inputs)
    # groups of 2 instead: more host (n/2 + 1 block inputs), less device (one fewer block's FSDP
    # prefetch during a group's recomputation) and less recompute ((K-1)/K = 1/2 more forward per block)
    ("+2-level AC g=2", {"ac_group": 2}),
)
MAX_COST = 2.0  # a configuration slower than this x UPipe's paper setup is reported, not recommended
SEQUENCE_CHUNKED = "fpdt"  # the method whose sequence chunks the last beyond-the-paper entry uses
# with documents, each a configuration of a method with a layout option (methods.core.seqlayout):
# the global head-tail layout, and the per-document one (balanced per document, padding each to 2R)
DOC_LAYOUTS = ("zigzag", "doc-zigzag")


def ladder(accepts=None) -> list[tuple[str, dict[str, Any]]]:
    """The cumulative rungs whose levers this code has (a lever not yet in StepConfig is left out).
    ``accepts(levers)``: whether the method runs with them; a rung it refuses is listed (the plan
    reports it skipped, saying why) but its lever is not carried up, so the later rungs keep the
    levers that run (across nodes: usp-upipe has no fused attention norm, and its two-level
    checkpoint rung goes on without it)."""
    known = {f.name for f in dataclasses.fields(StepConfig)}
    out, levers = [], {}
    for label, lever in LADDER:
        if set(lever) <= known:
            rung = {**levers, **lever}
            out.append((label, rung))
            if accepts is None or accepts(rung):
                levers = rung
    return out


def has_layouts(method: str) -> bool:
    """Whether ``method``'s sequence layout is an option (the ring family: ``methods.core.seqlayout``)."""
    return "layout" in {f.name for f in dataclasses.fields(methods.get_info(method).cls.Options)}


def check_stack_options(stack: str, nodes: int = 1, beyond: bool = True, pools: str | None = None) -> None:
    """Refuse, in one line and before any simulation, a plan option that has no effect under ``stack``:
    under ``hf`` the configurations are the methods the Hugging Face stack runs (``HF_ENTRIES``) with
    its own levers, so the paper stack's allocator pools, the paper-only switch (there is no ladder to
    leave out) and ``--nodes`` (whose only use is the paper stack's USP rows; the hf stack's methods
    take the GPUs as one sequence-parallel group) are conflicts."""
    if stack != hfstack.NAME:
        return
    if pools is not None:
        raise ValueError(f"--allocator-pools {pools} has no effect under --stack hf (its allocator is ALST's / "
                         "Accelerate's, a pool per stream: bench.stackmodel.hfstack term 7); drop it, or use "
                         "--stack paper")
    if not beyond:
        raise ValueError("--paper-only has no effect under --stack hf (its configurations are the methods the hf "
                         "stack runs, with no ladder of levers beyond the paper); drop it, or use --stack paper")
    if nodes > 1:
        raise ValueError(f"--nodes {nodes} has no effect under --stack hf (the hf stack's methods take the --gpus "
                         "as one group; --nodes only adds the paper stack's usp rows); drop it, or use --stack paper")


# Under --stack hf: exactly the methods the Hugging Face stack runs (bench.stackmodel.hfstack.METHODS), ALST
# first (the baseline of the table's rel column and of the recommendation), each with the stack's levers only:
# (method, the name its row goes by; UPipe's gets U = C)
HF_ENTRIES: tuple[tuple[str, str], ...] = (
    ("ds-ulysses-hf", "ALST"),  # DeepSpeed's UlyssesSPAttentionHF, Accelerate's sp_size path
    ("torch-cp", "PyTorch CP"),  # Accelerate's cp_size path
    ("upipe", "UPipe"),  # ALST's recipe with UPipe's attention
)


def entries(model: str, gpus: int, nodes: int, device: str, granularity: int, stack: str = "paper",
            beyond: bool = True, pools: str | None = None, docs: DocsSpec | None = None) -> list[Entry]:
    """The plan's trials; ``pools``: the paper stack's allocator pools (``bench.stackmodel.stack.allocator_pools``;
    None: ``PAPER_POOLS``); ``docs``: the packed documents every trial carries, where the ring family's layouts
    (``DOC_LAYOUTS``) are each a configuration. Under the ``hf`` stack: ``HF_ENTRIES``, each resolved with the
    hf stack's levers (``bench.stackmodel.hfstack``; ``check_stack_options`` refuses what has no effect there)."""
    check_stack_options(stack, nodes, beyond, pools)

    def entry(label: str, method: str, options: dict, **levers) -> Entry:
        levers.update(stack=stack, allocator_pools=paper_stack.allocator_pools(stack, pools or paper_stack.PAPER_POOLS))
        request = Request(method, model, granularity, gpus, options, device=device, levers=levers, docs=docs)
        return Entry(label, resolve(request, validate=False))  # runs() and plan() validate what they keep

    if stack == hfstack.NAME:
        return [entry(f"{name}{f' U={gpus}' if method == 'upipe' else ''} ({method})", method, {})
                for method, name in HF_ENTRIES]

    def laid_out(label: str, method: str, options: dict) -> list[Entry]:
        if docs is None or not has_layouts(method):
            return [entry(label, method, options)]
        return [entry(f"{label} {layout}", method, {**options, "layout": layout}) for layout in DOC_LAYOUTS]

    out = [entry(f"upipe U={gpus}", "upipe", {}), entry("upipe U=auto", "upipe", {AUTO_OPTION: AUTO}),
           entry("ulysses", "ulysses", {}), *laid_out("ring", "ring", {})]
    if nodes > 1:
        u = gpus // nodes
        out += [*laid_out(f"usp u={u}", "usp", {"ulysses_degree": u}),
                *laid_out(f"usp-upipe u={u} U={u}", "usp-upipe", {"ulysses_degree": u}),
                *laid_out(f"usp-upipe u={u} U=auto", "usp-upipe", {"ulysses_degree": u, AUTO_OPTION: AUTO})]
    out += [entry("fpdt", "fpdt", {}), entry("offload", "offload", {})]
    if beyond:  # the paper's UPipe (USP x UPipe across nodes) with the levers of LADDER added one by one
        base, opts = ("upipe", {}) if nodes == 1 else ("usp-upipe", {"ulysses_degree": gpus // nodes})
        name = out[0].label if nodes == 1 else f"usp-upipe u={gpus // nodes} U={gpus // nodes}"
        rungs = ladder(lambda levers: runs(entry("", base, dict(opts), **levers)))
        held: list[tuple[str, dict[str, Any]]] = [(name, {})]  # the entries so far, with their levers
        for label, levers in rungs:
            # the nearest rung below whose levers this one keeps (two-level checkpoints of 2 replace those of 4)
            below = next(n for n, kept in reversed(held) if kept.items() <= levers.items())
            out.append(dataclasses.replace(entry(f"{name} {label}", base, dict(opts), **levers), after=below))
            held.append((out[-1].label, levers))
        out.append(sequence_chunked(entry, granularity))
    return out


def sequence_chunked(entry, granularity: int) -> Entry:
    """Issue 18's last lever, for when the attention stage is the limit: the sequence in chunks of
    ``granularity`` tokens through FPDT's pipeline (``methods.fpdt``: one chunk's Q/K/V/O on the
    device at a time, the others on the host), with the levers of every ``LADDER`` rung it runs
    (``entry``: ``entries``' constructor), UPipe's fused attention norm included (fpdt norms each
    chunk as it projects it). The chunk size is the search's granularity, so every length it probes
    is a whole number of chunks. fpdt's UPipe head stages inside the chunks (``chunk_heads``) are
    not set: at the limits of the committed plans the attention holds none of the peak (a chunk
    of one rank's heads is 1 GiB at 1M tokens), and each stage is another pass over the chunks."""
    opts = {"chunk_tokens": granularity}

    def accepts(levers: dict[str, Any]) -> bool:
        return runs(entry("", SEQUENCE_CHUNKED, dict(opts), **levers))

    # the rungs are cumulative over the levers accepted before them: the last accepted rung holds them all
    levers = next((rung for _, rung in reversed(ladder(accepts)) if accepts(rung)), {})
    held = [label for label, lever in LADDER if lever.items() <= levers.items()]  # g=2 replaced groups of 4
    return entry(f"{SEQUENCE_CHUNKED} chunks={human(granularity)} {' '.join(held)}", SEQUENCE_CHUNKED, opts, **levers)


def runs(e: Entry) -> bool:
    """Whether the entry's method accepts its step (``Trial.validate``, without a length)."""
    try:
        e.trial.validate(check_seq_len=False)
    except ValueError:
        return False
    return True


def search_cost(e: Entry) -> tuple[int, bool]:
    """How long ``e``'s search takes, to order them: the layers one exact point simulates (its two
    shallow models, or the whole model: ``sim_scheme``), then the ring family and FPDT before the rest
    (their attention runs a loop per rank or per chunk)."""
    how = sim_scheme(e.trial)
    layers = e.trial.config().n_layers if how.whole else sum(how.layers)
    return layers, e.method in ("ring", "usp", "usp-upipe", "fpdt")


def run_searches(searched: list[Entry], pool: ProcessPoolExecutor | None, workers: int, common: tuple):
    """Every entry's search (``_search_entry``), yielding each entry as its search ends. A ladder rung whose
    simulations are costlier than those of the rung below it (``Entry.after``; ``search_cost``: the two-level
    checkpoint rungs, 8 to 16 layers a simulation) starts after that one, one step past its answer: a rung adds
    a lever that saves memory, so its answer is that one's or a little longer, and a search that starts there
    needs three or four simulations where one that starts at ``FIRST`` needs about six (the answer is the same:
    the search ends on a bracket one step wide wherever it starts). The other searches start at once, at
    ``FIRST``: waiting would cost more than the simulations it saves them. Among the searches that can start,
    the one with the most work on its chain goes first, so that the longest does not run alone at the end."""
    by_label = {e.label: e for e in searched}
    below = {e.label: e.after for e in searched if e.after in by_label
             and search_cost(e)[0] > search_cost(by_label[e.after])[0]}
    chain: dict[str, int] = {}

    def chain_cost(label: str) -> int:  # this search's cost and that of every rung above it
        if label not in chain:
            chain[label] = search_cost(by_label[label])[0] + sum(
                chain_cost(up) for up, down in below.items() if down == label)
        return chain[label]

    answers: dict[str, int] = {}
    granularity = common[0]

    def start(e: Entry) -> int:
        label = below.get(e.label)
        while label is not None and not answers.get(label):
            label = below.get(label)  # a rung below that found nothing (skipped): the one under it
        return answers[label] + granularity if label is not None else FIRST

    waiting = sorted(searched, key=lambda e: (chain_cost(e.label), search_cost(e)), reverse=True)
    running: list = []  # futures, or the one job this process runs next
    while waiting or running:
        ready = [e for e in waiting if below.get(e.label) is None or below[e.label] in answers]
        while ready and len(running) < (workers if pool else 1):
            e = ready.pop(0)
            waiting.remove(e)
            job = (e, *common, start(e))
            running.append(pool.submit(_search_entry, job) if pool else job)
        if pool:
            done = next(futures.as_completed(running))
            result = done.result()
        else:
            done = running[0]
            result = _search_entry(done)
        running.remove(done)
        answers[result.label] = result.max_context
        yield result


def _search_entry(args) -> Entry:
    entry, granularity, max_seq_len, workdir, first = args
    t0 = time.perf_counter()
    try:
        entry.trial.validate(check_seq_len=False)
        found, best, n, _, err = search_max(entry.trial, granularity, max_seq_len, workdir, first)
    except ValueError as e:
        entry.skipped = str(e).splitlines()[0][:160]
        return entry
    entry.max_context, entry.points = found, n
    how = sim_scheme(entry.trial)
    if how.whole or how.size > 1:  # the plain layer extrapolation is the header's
        entry.extra["sims"] = how.describe()
    if best is not None:
        entry.peak_bytes, entry.host_peak_bytes = best.peak_bytes, best.host_peak_bytes
        entry.comm_time_s = best.comm_time_s
        entry.step_counts, entry.rank = getattr(best, "step_counts", None), getattr(best, "rank", 0)
        if entry.step_counts and counts_version(entry.step_counts) < COUNTS_VERSION \
                and (_CACHE is None or _CACHE.simulate):  # re-rendering (no simulation): the counts' own constants
            entry.step_counts = fresh_counts(dataclasses.replace(entry.trial, seq_len=found), workdir, entry.rank)
        ranks = deciding_ranks(entry.trial)
        if len(ranks) > 1:  # which of the deciding ranks holds the most
            entry.extra["rank"] = f"rank {entry.rank}, the worst of {len(ranks)} deciding"
    if err is not None:
        entry.error = err.message[:160]
    entry.seconds = time.perf_counter() - t0
    return entry


def _worker_init(cache: tuple | None = None) -> None:
    """One intra-op thread per worker: fake tensors compute nothing, and the workers share the cores.
    ``cache``: the ``SimCache`` arguments of the parent (each worker reads the files, appends its own)."""
    global _CACHE
    torch.set_num_threads(1)
    _CACHE = SimCache(*cache) if cache else None


def _resolve_u_job(args):
    return _resolve_u(*args)


def _resolve_u(entry: Entry, seq_len: int, workdir: str) -> int | None:
    """The U ``auto`` picks at ``seq_len`` (largest candidate whose extrapolated peak fits)."""
    trial = entry.trial.with_seq_len(seq_len)
    cands = candidates(trial)
    for u in cands:
        if extrapolated(with_chunk(trial, u), workdir).status == "ok":
            return u
    return cands[-1] if cands else None


# --------------------------------------------------------------------------- step time


def real_rows() -> list[Row]:
    """The rows under results/ that can give a step time: real-mode model-scope trials that ran
    (``measured_time``'s candidates; a plan reads them once, not once per configuration)."""
    return [r for path in sorted(RESULTS_DIR.rglob("*.jsonl")) for r in read_rows(path, on_error="skip")
            if r.kind == "trial" and r.mode == "real" and r.status == "ok" and r.scope == "model"
            and r.figures.step_time_s]


def measured_time(trial: Trial, rows: list[Row] | None = None) -> float | None:
    """A measured step time from results/ (real mode, same method/options/model/size/length and
    documents), or None. ``rows``: ``real_rows()`` read once by the caller (read here when not given)."""
    best = None
    want = trial.requested_opts()
    name = trial.config().name
    docs = trial.docs.identity() if trial.docs is not None else None
    for r in real_rows() if rows is None else rows:
        if (r.method == trial.method and r.model == name and r.world_size == trial.world_size
                and r.device == trial.device and r.seq_len == trial.seq_len
                and (docs_identity(r.docs) if r.docs is not None else None) == docs
                and {k: v for k, v in requested_options(r.options).items() if v is not None} == want):
            best = r.figures.step_time_s if best is None else min(best, r.figures.step_time_s)
    return best


def modelled_time(entry: Entry, device: str, seq_len: int) -> float | None:
    """``bench.stackmodel.steptime`` over the entry's counts at its max context, carried to ``seq_len``
    (with documents, the slowest rank's attention there: ``documents_counts``)."""
    if not entry.step_counts or not entry.max_context:
        return None
    preset = get_device(device)
    counts = scale_counts(entry.step_counts, entry.max_context, seq_len)
    if entry.trial.docs is not None:
        counts = documents_counts(entry, counts, seq_len)
    constants, kernel = step_constants(entry.trial.step.stack, counts)
    return step_time(counts, preset, entry.trial.link_model(), constants, kernel or attention_kernel(entry.method))[
        "step_time_s"]


def step_constants(stack: str, counts: StepCounts) -> tuple[StepTimeConstants, str | None]:
    """(constants, attention kernel or None for the method's own) of the step-time model for ``counts``
    under ``stack``: the hf stack's kernel and rate (``steptime.stack_constants``, as its simulated rows
    take them); else the constants fitted on counts of their version (``constants_for``)."""
    if stack == hfstack.NAME:
        return stack_constants(stack, counts_version(counts))
    return constants_for(counts), None


def documents_counts(entry: Entry, scaled: StepCounts, seq_len: int) -> StepCounts:
    """``scaled`` (the entry's counts carried to ``seq_len`` by ``scale_counts``) with the attention of
    the slowest rank at ``seq_len`` under the entry's documents. The attention of packed documents
    grows with their causal areas, not as S² (documents of bounded length: about S), and the step waits
    for the slowest rank: the simulated rank's counted attention FLOPs at the max context (and their
    varlen excess, whose share of them a draw from the same distribution keeps) are carried by the
    ratio of the slowest rank's counted (query, key) pairs at ``seq_len`` to the simulated rank's
    (``Entry.rank``) at the max context (``bench.stackmodel.docwork``, each length with its own draw). At
    the max context this is the row's own step (``bench.measure.run.build_row``: ``slowest_rank_counts``)."""
    simulated = trial_work(entry.trial.with_seq_len(entry.max_context))
    target = trial_work(entry.trial.with_seq_len(seq_len))
    if simulated is None or target is None or simulated.pairs[entry.rank] <= 0:
        return scaled
    ratio = max(target.pairs) / simulated.pairs[entry.rank]
    counts = entry.step_counts
    return dataclasses.replace(scaled, flops_attention=counts.flops_attention * ratio,
                               flops_attention_varlen_excess=counts.flops_attention_varlen_excess * ratio)


def check_docs(docs: DocsSpec | None) -> None:
    """The plan's documents: a distribution (each probed length packs its own draw); explicit lengths
    fix the sequence length, which the plan varies (``ValueError``, before any work)."""
    if docs is None:
        return
    if not isinstance(docs, DocsSpec):
        raise ValueError(f"docs must be a records.workloads.DocsSpec, got {type(docs).__name__}")
    if docs.lengths is not None:
        raise ValueError("explicit document lengths fix the sequence length, which the plan varies; "
                         "give a distribution (--docs NAME[:SEED]), or time those lengths with python -m bench run")


# --------------------------------------------------------------------------- the plan


COMMITTED_CACHE = RESULTS_DIR / "plan" / "sims.ndjson"


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it lies in it (the committed cache as the plans name it)."""
    try:
        return str(path.resolve().relative_to(RESULTS_DIR.parent))
    except ValueError:
        return str(path)


def _lines(path: Path | None) -> int:
    return sum(1 for _ in path.open()) if path is not None and path.exists() else 0


def pareto_front(entries_: list[Entry]) -> list[Entry]:
    """Entries no other beats on both counts: a longer (or equal) context at a shorter (or equal)
    modelled step time at the common length, one of them strictly."""
    timed = [e for e in entries_ if e.step_time_s]

    def beaten(e: Entry) -> bool:
        return any(o.max_context >= e.max_context and o.step_time_s <= e.step_time_s
                   and (o.max_context > e.max_context or o.step_time_s < e.step_time_s) for o in timed)
    return [e for e in timed if not beaten(e)]


def recommend(entries_: list[Entry], baseline: Entry | None) -> Entry | None:
    """The longest context among the configurations at most ``MAX_COST`` x the baseline's step time
    at the common length (ties: the faster); with no baseline, the longest context."""
    timed = [e for e in entries_ if e.step_time_s]
    if baseline is not None and baseline.step_time_s:
        timed = [e for e in timed if e.step_time_s <= MAX_COST * baseline.step_time_s]
    return max(timed, key=lambda e: (e.max_context, -e.step_time_s), default=None)


def plan(model: str, gpus: int, device: str, nodes: int = 1, max_seq_len: int = 32 << 20,
         granularity: int = 1 << 20, workers: int | None = None,
         progress=sys.stderr, stack: str = "paper", beyond: bool = True,
         cache: Path | None = None, use_cache: bool = True, pools: str | None = None,
         committed: Path | None = None, simulate: bool = True, docs: DocsSpec | None = None) -> dict[str, Any]:
    """The plan (module docstring). ``cache``: the user's simulation cache file (``SimCache``;
    None with ``use_cache``: none written, the committed one still read); ``pools``: the paper
    stack's allocator pools (None: ``PAPER_POOLS``; refused under ``hf``: ``check_stack_options``);
    ``committed``: the committed cache (default ``COMMITTED_CACHE``);
    ``simulate`` off: a simulation missing from the caches is a ``LookupError`` (``SimCache.allow``);
    ``docs``: packed documents drawn from a distribution (``check_docs``; None: one sequence)."""
    committed = Path(committed) if committed is not None else COMMITTED_CACHE
    global _CACHE
    cfg = get_config(model)
    preset = get_device(device)
    if gpus % nodes:
        raise ValueError(f"--gpus {gpus} is not divisible by --nodes {nodes}")
    check_stack_options(stack, nodes, beyond, pools)
    check_docs(docs)
    t0 = time.perf_counter()
    todo = entries(model, gpus, nodes, device, granularity, stack, beyond, pools, docs)
    if todo:
        deciding_ranks(todo[0].trial)  # a bad $CPAB_SIM_RANKS is one line before any simulation
    workers = workers or max(1, min(len(todo), os.cpu_count() or 1))
    cache_args = (cache, (committed,), simulate) if use_cache else None
    _CACHE = SimCache(*cache_args) if cache_args else None
    cached_before = len(_CACHE.entries) if _CACHE else 0
    lines_before = _lines(cache) if _CACHE else 0
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as workdir:
        searched = [e for e in todo if not e.auto]
        pool = (ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                    initargs=(cache_args,))
                if workers > 1 else None)
        try:
            found = []
            print(f"[plan] {len(searched)} searches on {workers} worker(s)"
                  + (f", documents {docs.label} drawn per length" if docs is not None else "")
                  + "; a line as each finishes", file=progress, flush=True)
            for e in run_searches(searched, pool, workers, (granularity, max_seq_len, workdir)):
                found.append(e)
                what = e.skipped or e.error or f"max context {human(e.max_context)}"
                print(f"[plan] {e.label}: {what} ({e.points} simulations, {e.seconds:.0f}s)",
                      file=progress, flush=True)
            by_trial = {e.trial: e for e in found}
            done = []
            for e in todo:
                if not e.auto:
                    done.append(by_trial[e.trial])
                    continue
                base = by_trial[with_chunk(e.trial, None)]  # auto's limit is U = u's (module docstring)
                done.append(dataclasses.replace(base, label=e.label, trial=e.trial))
                try:
                    e.trial.validate(check_seq_len=False)
                    if not candidates(e.trial):
                        raise ValueError(f"{e.method}: no valid chunk_heads for {cfg.name} at {gpus} GPUs")
                except ValueError as err:
                    done[-1].skipped = str(err).splitlines()[0][:160]
            ok = [e for e in done if not e.skipped and e.max_context > 0]
            longest = max((e.max_context for e in ok), default=0)
            common = min((e.max_context for e in ok), default=0)
            autos = [e for e in ok if e.auto]
            args = [(e, common, workdir) for e in autos]
            us = list(pool.map(_resolve_u_job, args)) if pool else [_resolve_u_job(a) for a in args]
            for e, u in zip(autos, us, strict=False):
                e.resolved_u = u
        finally:
            if pool:
                pool.shutdown()
    measured_rows = real_rows() if ok else []
    for e in ok:
        measured = measured_time(e.trial.with_seq_len(common), measured_rows)
        if measured is not None:
            e.step_time_s, e.time_source = measured, "measured"
        else:
            e.step_time_s, e.time_source = modelled_time(e, device, common), "model"
        if docs is not None:
            e.work = trial_work(e.trial.with_seq_len(common))
    pareto = pareto_front(ok)
    baseline = ok[0] if ok and ok[0] is done[0] else None  # UPipe's paper setup, or hf's ALST (the first entry)
    pick = recommend(ok, baseline)
    at_longest = [e for e in ok if e.max_context == longest]
    fastest_longest = min(at_longest, key=lambda e: modelled_time(e, device, longest) or math.inf, default=None)
    fastest_common = min((e for e in ok if e.step_time_s), key=lambda e: e.step_time_s, default=None)
    host_usable = preset.host_usable()
    user = f", {cache}" if cache and Path(cache).resolve() != committed.resolve() else ""
    cache_line = f"{_lines(cache) - lines_before} new simulations, {cached_before} cached ({_shown(committed)}{user})"
    result = {
        "model": cfg.name, "gpus": gpus, "nodes": nodes, "device": device, "granularity": granularity,
        "max_seq_len": max_seq_len, "entries": done, "longest": longest, "common": common,
        "usable_gib": paper_stack.usable_bytes(preset, stack) / GiB,
        "host_note": f" and {host_usable / GiB:.0f} GiB of host memory for offloads" if host_usable else "",
        "layers": cfg.n_layers, "seconds": time.perf_counter() - t0,
        "fastest_longest": fastest_longest, "fastest_common": fastest_common,
        "stack": stack, "pools": pools or paper_stack.PAPER_POOLS, "pareto": pareto, "baseline": baseline,
        "baseline_of": "ALST's recipe" if stack == hfstack.NAME else "UPipe's paper setup", "pick": pick,
        "cache": cache_line if _CACHE else "no cache (--no-cache)", "docs": docs,
        "sim_ranks": os.environ.get(SIM_RANKS_ENV, "deciding"),
    }
    return result
