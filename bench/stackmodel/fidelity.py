"""``python -m bench fidelity``: the simulation against the paper's own numbers.

The anchors are read from the transcribed tables in ``results/paper/`` (never typed in here):

* ``memory_anchors.csv``: the two 128K peaks (Llama3-8B on 8 GPUs, Qwen3-32B on 16);
* ``fig1_memory_breakdown.csv``: Fig. 1's ladder at 3M, one anchor per bar that has a rung of
  ours (``FIG1_RUNGS``: the levers each bar adds): ALST's and UPipe's totals are memory anchors,
  the bars the paper shows out of memory (FSDP, +Ulysses, +AC, +AO) boundaries that must not fit
  (their paper value is the GiB printed on the bar). These rows are what ``paper_figs``' Fig. 1
  draws beside the paper's bars (``python -m bench fidelity --anchors fig1-``);
* ``fig5_multinode.csv``: Fig. 5's memory points (kind ``point``), USP and UPipe on 16 GPUs; a
  point marked ``oom`` (USP at 8M) is a boundary that must not fit;
* ``table3_throughput.csv``: for each method and model, the longest length the paper ran must
  fit and the first OOM length must not.

Each anchor runs the paper's implementation of its method (docs/paper.md, "Baselines and the
implementations the paper ran"; :func:`implementation`) in simulated mode on the ``h100-80g``
preset, once under the paper stack and once under the lean one (``bench.stackmodel.stack``),
through ``bench.search.extrapolate`` (3- and 4-layer simulations extrapolated over the layers).
Memory compared: the reserved peak under the paper stack, the allocated peak under lean.
An anchor passes on the paper stack: a memory anchor when the run fits and its residual is
within the anchor's tolerance (10%; Fig. 5's values, read by eye: 1 GiB + 10%), a boundary
when the run fits or runs out of memory as the paper's did. Fit is judged on the device, as
the paper measured it: offloads beyond the preset's assumed host memory (the paper does not
state its hosts') are reported in the cell, not counted as out of memory (:func:`device_status`).
"""
from __future__ import annotations

import concurrent.futures as futures
import csv
import dataclasses
import multiprocessing
import resource
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import methods
from records import GiB, Row, fidelity_anchor_note, human, read_rows, trial_key
from records.facts import TABLE3_COLUMNS

from ..measure.config import StepConfig
from ..measure.run import HOST_OOM, deciding_ranks
from ..measure.trial import Trial
from ..resolve import Request, resolve
from ..search.extrapolate import layer_extrapolated_runner
from . import stack as paper_stack

PAPER_DIR = Path(__file__).resolve().parents[2] / "results" / "paper"
GPU_DIR = Path(__file__).resolve().parents[2] / "results" / "gpu"  # rows measured on a real GPU
COMMITTED_ROWS = Path(__file__).resolve().parents[2] / "results" / "fidelity" / "fidelity.jsonl"
DEVICE = "h100-80g"
STACKS = ("paper", "lean")
KINDS = ("memory", "boundary")
REL_TOL = 0.10  # the target for memory anchors
EYE_TOL_GIB = 1.0  # Fig. 5 was read by eye, +-1 GiB
TABLE3_METHODS = TABLE3_COLUMNS


@dataclass(frozen=True)
class Impl:
    """The suite method that stands for one of the paper's, with its options and levers."""

    method: str
    options: dict = field(default_factory=dict)
    levers: dict = field(default_factory=dict)

    def describe(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted({**self.options, **self.levers}.items()))
        return f"{self.method}[{opts}]" if opts else self.method


# Fig. 1's ladder (docs/paper.md, "Fig. 1: memory breakdown", after the paper's Fig. 1:
# Default -> FSDP -> +Ulysses -> +AC -> +AO -> ALST (+tiled MLP/loss) -> UPipe): the levers each
# bar of results/paper/fig1_memory_breakdown.csv has, by its ``config``.
# Every bar shards the model with FSDP; "fsdp" splits no sequence (``no-cp``: all 3M tokens on
# each GPU); the Ulysses bars run the paper's Ulysses (yunchang's USP at Ulysses degree 8, as
# Table 3's). "default" (no FSDP) has no rung: the paper's 119 GiB is bf16 weights and gradients
# plus fp32 Adam state and master weights (docs/paper.md), while our step without FSDP keeps no
# fp32 master copy, so it would not be the same configuration.
NO_LEVERS = {"ac": False, "ac_offload": False, "tiled_mlp": False, "tiled_norm": False, "chunked_loss": False}
FIG1_RUNGS: dict[str, tuple[str, dict]] = {
    "fsdp": ("fsdp", NO_LEVERS),
    "fsdp+ulysses": ("ulysses", NO_LEVERS),
    "+ac": ("ulysses", {**NO_LEVERS, "ac": True}),
    "+ao": ("ulysses", {**NO_LEVERS, "ac": True, "ac_offload": True}),
    "alst": ("alst", {}),  # every lever: the Table 3 Ulysses configuration (docs/paper.md, ALST)
    "upipe": ("upipe", {}),
}


def fig1_rung(config: str, gpus: int) -> Impl:
    """The implementation and levers of one bar of Fig. 1's ladder (``FIG1_RUNGS``)."""
    if config not in FIG1_RUNGS:
        raise ValueError(f"Fig. 1 has no rung of ours for {config!r}; rungs: {sorted(FIG1_RUNGS)}")
    method, levers = FIG1_RUNGS[config]
    impl = implementation(method, gpus)
    return dataclasses.replace(impl, levers={**impl.levers, **levers})


def implementation(method: str, gpus: int) -> Impl:
    """The implementation the paper ran for ``method`` (its name in the paper's tables, a
    ``records.facts.PAPER_COLUMNS``) on ``gpus``: the registered method whose facts say it
    simulates that column on that many GPUs (``MethodFacts.simulates``), with the run's options
    and the levers the paper ran the column with (``MethodFacts.levers``)."""
    found = [(info, run) for info in methods.all_infos() for run in info.facts.simulates
             if run.column == method and run.covers(gpus)]
    if not found:
        known = sorted({run.column for info in methods.all_infos() for run in info.facts.simulates})
        raise ValueError(f"no implementation known for the paper's method {method!r} on {gpus} GPUs; "
                         f"the methods' facts simulate {known}")
    if len(found) > 1:
        raise ValueError(f"the paper's method {method!r} on {gpus} GPUs is simulated by "
                         f"{[info.name for info, _ in found]}: the methods' facts must name one")
    info, run = found[0]
    return Impl(info.name, dict(run.options), dict(info.facts.levers))


@dataclass(frozen=True)
class Anchor:
    """One number (or one fits/OOM outcome) of the paper the simulation must reproduce."""

    name: str
    kind: str  # memory | boundary
    source: str  # the results/paper table it comes from
    paper_method: str
    model: str
    gpus: int
    seq_len: int
    impl: Impl
    expect: str = "fits"  # fits | oom
    paper_gib: float | None = None  # memory anchors
    paper_need_gib: float | None = None  # an OOM boundary whose paper bar is labelled with the GiB it needed
    rel_tol: float = REL_TOL
    abs_tol_gib: float = 0.0

    def tolerance_gib(self) -> float:
        return self.abs_tol_gib + self.rel_tol * (self.paper_gib or 0.0)

    def paper_value(self) -> str:
        if self.kind == "memory":
            return f"{self.paper_gib:.2f} GiB"
        return self.expect if self.paper_need_gib is None else f"{self.expect} ({self.paper_need_gib:g} GiB)"

    def trial(self, stack: str, pools: str = paper_stack.PAPER_POOLS) -> Trial:
        """The anchor's trial under ``stack``; ``pools``: the paper stack's allocator pools
        (``bench.stackmodel.stack.allocator_pools``; the lean stack has no allocator model)."""
        levers = {**self.impl.levers, "stack": stack, "allocator_pools": paper_stack.allocator_pools(stack, pools)}
        request = Request(self.impl.method, self.model, self.seq_len, self.gpus, dict(self.impl.options),
                          mode="simulated", device=DEVICE, levers=levers)
        return resolve(request, validate=False)  # run_anchors validates each trial it simulates


def fig1_slug(config: str) -> str:
    """A Fig. 1 config as an anchor-name part: ``+ac`` -> ``ac``, ``fsdp+ulysses`` -> ``fsdp-ulysses``."""
    return config.strip("+").replace("+", "-")


def _read(name: str, paper_dir: Path) -> list[dict[str, str]]:
    with open(Path(paper_dir) / f"{name}.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _memory(name: str, source: str, method: str, model: str, gpus: int, seq_len: int, gib: float,
            abs_tol: float = 0.0) -> Anchor:
    return Anchor(name, "memory", source, method, model, gpus, seq_len, implementation(method, gpus),
                  paper_gib=gib, abs_tol_gib=abs_tol)


def _boundary(name: str, source: str, method: str, model: str, gpus: int, seq_len: int, expect: str) -> Anchor:
    return Anchor(name, "boundary", source, method, model, gpus, seq_len, implementation(method, gpus),
                  expect=expect)


def load_anchors(paper_dir: str | Path = PAPER_DIR) -> list[Anchor]:
    """Every anchor, from the paper's tables (memory anchors first, then boundaries)."""
    memory: list[Anchor] = []
    bounds: list[Anchor] = []
    for r in _read("memory_anchors", paper_dir):
        seq, gpus = int(r["seq_len"]), int(r["gpus"])
        memory.append(_memory(f"128k-{r['model']}-{r['method']}-x{gpus}" if seq == 131072
                              else f"anchor-{r['model']}-{r['method']}-{human(seq)}-x{gpus}",
                              "memory_anchors", r["method"], r["model"], gpus, seq, float(r["peak_mem_gib"])))
    for r in _read("fig1_memory_breakdown", paper_dir):
        if r["config"] not in FIG1_RUNGS:
            continue
        seq, gpus = int(r["seq_len"]), int(r["gpus"])
        name = f"fig1-{fig1_slug(r['config'])}-{r['model']}-{human(seq)}"
        impl = fig1_rung(r["config"], gpus)
        if r["status"] == "ok" and r["total_gib"]:
            memory.append(Anchor(name, "memory", "fig1_memory_breakdown", r["config"], r["model"], gpus, seq, impl,
                                 paper_gib=float(r["total_gib"])))
        elif r["status"] == "oom":
            need = float(r["oom_required_gib"]) if r["oom_required_gib"] else None
            bounds.append(Anchor(name + "-oom", "boundary", "fig1_memory_breakdown", r["config"], r["model"], gpus,
                                 seq, impl, expect="oom", paper_need_gib=need))
    for r in _read("fig5_multinode", paper_dir):
        if r["kind"] != "point" or r["method"] not in ("usp", "upipe"):
            continue
        seq, gpus = int(r["seq_len"]), int(r["gpus"])
        name = f"fig5-{r['method']}-{human(seq)}"
        if r["status"] == "oom":
            bounds.append(_boundary(name + "-oom", "fig5_multinode", r["method"], r["model"], gpus, seq, "oom"))
        elif r["peak_mem_gib"]:
            memory.append(_memory(name, "fig5_multinode", r["method"], r["model"], gpus, seq,
                                  float(r["peak_mem_gib"]), EYE_TOL_GIB))
    cells: dict[tuple[str, str, int], list[tuple[int, str]]] = {}
    for r in _read("table3_throughput", paper_dir):
        if r["method"] in TABLE3_METHODS and r["status"] in ("ok", "oom"):
            cells.setdefault((r["model"], r["method"], int(r["gpus"])), []).append((int(r["seq_len"]), r["status"]))
    for (model, method, gpus), runs in cells.items():
        runs.sort()
        oom = next((s for s, st in runs if st == "oom"), None)
        ok = [s for s, st in runs if st == "ok" and (oom is None or s < oom)]
        if ok:
            bounds.append(_boundary(f"table3-{model}-{method}-fits-{human(ok[-1])}", "table3_throughput",
                                    method, model, gpus, ok[-1], "fits"))
        if oom is not None:
            bounds.append(_boundary(f"table3-{model}-{method}-oom-{human(oom)}", "table3_throughput",
                                    method, model, gpus, oom, "oom"))
    return memory + bounds


def select(anchors: list[Anchor], only: str = "all", names: Iterable[str] | None = None) -> list[Anchor]:
    """Anchors of one kind (``memory``/``boundaries``/``all``) and, if given, of those names or name prefixes."""
    if only not in ("memory", "boundaries", "all"):
        raise ValueError(f"--only must be memory, boundaries or all, got {only!r}")
    out = [a for a in anchors if only == "all" or a.kind == ("memory" if only == "memory" else "boundary")]
    if names:
        names = list(names)
        unknown = [n for n in names if not any(a.name == n or a.name.startswith(n) for a in anchors)]
        if unknown:
            raise ValueError(f"unknown anchor(s) {unknown}; known: {[a.name for a in anchors]}")
        out = [a for a in out if any(a.name == n or a.name.startswith(n) for n in names)]
    return out


# ----------------------------------------------------------------------------- judging

def residual_pct(ours_gib: float | None, paper_gib: float | None) -> float | None:
    """(ours - paper) / paper, in percent."""
    if ours_gib is None or not paper_gib:
        return None
    return (ours_gib - paper_gib) / paper_gib * 100.0


def memory_passes(anchor: Anchor, status: str, ours_gib: float | None) -> bool:
    """The run fits (the paper's did) and its memory is within the anchor's tolerance."""
    return (status == "ok" and ours_gib is not None and anchor.paper_gib is not None
            and abs(ours_gib - anchor.paper_gib) <= anchor.tolerance_gib() + 1e-9)


def boundary_passes(expect: str, status: str) -> bool:
    """Fits where the paper's run fitted, runs out of memory where the paper's did."""
    return status == ("ok" if expect == "fits" else "oom")


def memory_gib(row: Row, stack: str) -> float | None:
    """Reserved peak under the paper stack, allocated peak under lean, in GiB."""
    value = row.figures.peak_reserved_bytes if stack == "paper" else row.figures.peak_bytes
    return None if value is None else value / GiB


def host_only_oom(row: Row) -> bool:
    """Out of memory on the host only: the device fitted, the offloads exceeded the preset's
    *assumed* host memory per GPU (the paper does not state its hosts')."""
    return row.status == "oom" and row.message.startswith(HOST_OOM)


def device_status(row: Row) -> str:
    """The row's status on the device alone: what the paper measured (``max_reserved``)."""
    return "ok" if host_only_oom(row) else row.status


def outcome(row: Row) -> str:
    status = device_status(row)
    word = {"ok": "fits", "oom": "oom"}.get(status, status)
    if host_only_oom(row):
        f = row.figures
        word += f"; host {f.host_peak_bytes / GiB:.0f} > {f.host_usable_bytes / GiB:.0f} GiB assumed"
    return word


@dataclass
class Result:
    anchor: Anchor
    rows: dict[str, Row]  # by stack

    def gib(self, stack: str) -> float | None:
        return memory_gib(self.rows[stack], stack)

    @property
    def residual(self) -> float | None:
        return residual_pct(self.gib("paper"), self.anchor.paper_gib) if self.anchor.kind == "memory" else None

    def passes(self, stack: str = "paper") -> bool:
        row = self.rows[stack]
        if self.anchor.kind == "memory":
            return memory_passes(self.anchor, device_status(row), self.gib(stack))
        return boundary_passes(self.anchor.expect, device_status(row))

    def ours(self, stack: str) -> str:
        row = self.rows[stack]
        gib = self.gib(stack)
        mem = "-" if gib is None else f"{gib:.2f} GiB"
        if self.anchor.kind == "memory":
            return mem if row.status == "ok" else f"{mem} ({outcome(row)})"  # host-only OOM shown, not failed
        usable = row.figures.usable_bytes
        return f"{outcome(row)} ({mem}{f'; usable {usable / GiB:.2f} GiB' if gib is not None and usable else ''})"


# ----------------------------------------------------------------------------- running

_RUNNER: Callable[[Trial], Row] | None = None


def cpu_seconds() -> float:
    """CPU time of this process and its waited-for children (the pool's workers), user + system:
    on a shared host the figure that says what a run cost, where wall time says how busy it was."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def cost(trial: Trial) -> tuple[int, bool, int]:
    """A trial's relative cost, for ordering a pool: first the ranks simulated (``deciding_ranks``: each is a
    whole simulation, every rank of a 16-rank ring); then the paper stack, slower than the lean one (DeepSpeed's
    TiledMLP and the allocator trace); then the tokens per rank times the layers simulated."""
    return (len(deciding_ranks(trial)), trial.step.stack == "paper",
            trial.seq_len // trial.world_size * min(trial.config().n_layers, 4))


def committed_seconds(path: Path = COMMITTED_ROWS) -> dict[tuple, float]:
    """Each committed fidelity row's wall time by its trial's key (the last run's own measure of what a trial
    costs, for ordering a pool); empty where there is no such file or a row cannot be read."""
    if not path.is_file():
        return {}
    try:
        rows = read_rows(path, on_error="raise")
    except (OSError, ValueError):
        return {}
    return {trial_key(row): row.figures.wall_s for row in rows if row.figures.wall_s}


def pool_order(trials: dict[tuple, Trial], seconds: dict[tuple, float]) -> list[tuple]:
    """The longest first (so that no long trial starts last and runs alone while the other workers idle): by
    the wall time its committed row took (``committed_seconds``), a trial without one before all of those,
    by ``cost``."""
    return sorted(trials, key=lambda k: (k not in seconds, seconds.get(k, 0.0), cost(trials[k])), reverse=True)


def run_one(trial: Trial) -> Row:
    """One trial through the layer-extrapolating runner (one per process)."""
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = layer_extrapolated_runner()
    return _RUNNER(trial)


def run_anchors(anchors: list[Anchor], jobs: int = 1, log: Callable[[str], None] | None = None,
                runner: Callable[[Trial], Row] | None = None, pools: str = paper_stack.PAPER_POOLS) -> list[Result]:
    """Run every anchor under both stacks (a trial shared by anchors runs once); ``jobs`` > 1:
    a process pool. ``log`` gets one progress line per trial; ``pools``: the paper stack's
    allocator pools (``Anchor.trial``)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    runner = runner or run_one
    todo: dict[tuple, tuple[Trial, list[str]]] = {}
    for a in anchors:
        for stack in STACKS:
            trial = a.trial(stack, pools)
            trial.validate(here=False)
            todo.setdefault(trial.key(), (trial, []))[1].append(a.name)
    # a pool gets the longest trials first (serial: as listed)
    keys = list(todo) if jobs <= 1 else pool_order({k: t for k, (t, _) in todo.items()}, committed_seconds())
    rows: dict[tuple, Row] = {}
    t0, cpu0 = time.perf_counter(), cpu_seconds()

    def done(i: int, key: tuple, row: Row, seconds: float) -> None:
        trial, names = todo[key]
        rows[key] = dataclasses.replace(row, notes=list(row.notes) + [fidelity_anchor_note(names)])
        gib = memory_gib(row, trial.step.stack)
        mem = "-" if gib is None else f"{gib:.2f} GiB"
        log(f"[{i}/{len(keys)}] {', '.join(names)} {trial.step.stack}: {outcome(row)} {mem} [{seconds:.1f}s]")

    if jobs <= 1 or len(keys) <= 1:
        for i, key in enumerate(keys, 1):
            start = time.perf_counter()
            row = runner(todo[key][0])
            done(i, key, row, time.perf_counter() - start)
    else:
        with futures.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            pending = {pool.submit(runner, todo[key][0]): key for key in keys}
            for i, fut in enumerate(futures.as_completed(pending), 1):
                row = fut.result()
                done(i, pending[fut], row, row.figures.wall_s or time.perf_counter() - t0)
    log(f"{len(keys)} trials in {time.perf_counter() - t0:.0f} s wall, {cpu_seconds() - cpu0:.0f} s CPU "
        f"(this process and its finished workers; jobs={jobs})")
    return [Result(a, {stack: rows[a.trial(stack, pools).key()] for stack in STACKS}) for a in anchors]


# ----------------------------------------------------------------------------- the same trials on a real GPU

@dataclass(frozen=True)
class RealCheck:
    """A memory anchor's trial as it ran on a real GPU: what our step holds there, to tell a
    simulation error from a difference between our step and the paper's."""

    anchor: Anchor
    row: Row
    source: str  # the file under results/gpu
    twin: Row | None = None  # the same step simulated (scripts/gpu/compare.py, a pool per stream)

    def levers_away(self) -> str:
        """The run's levers that differ from ``python -m bench run``'s defaults, as ``name=value``."""
        defaults = {f.name: f.default for f in dataclasses.fields(StepConfig)}
        away = {k: v for k, v in (self.row.levers or {}).items() if k in defaults and v != defaults[k]}
        return ", ".join(f"{k}={v}" for k, v in sorted(away.items()))


def _same_trial(row: Row, other: Row) -> bool:
    return (row.method, dict(row.options), row.model, row.world_size, row.seq_len) == \
        (other.method, dict(other.options), other.model, other.world_size, other.seq_len)


def _twin(row: Row, folder: Path) -> Row | None:
    """``row``'s simulated twin in ``folder`` (compare.py's ``simulated.*``, per-stream pools)."""
    for path in (folder / "simulated.jsonl", folder / "simulated.ndjson"):
        for sim in read_rows(path, on_error="skip"):
            if _same_trial(sim, row) and (sim.levers or {}).get("allocator_pools") == "per-stream":
                return sim
    return None


def real_checks(results: list[Result], gpu_dir: Path = GPU_DIR) -> list[RealCheck]:
    """The memory anchors whose trial (method, options, model, ranks, length) was also run on a
    real GPU: rows of ``gpu_dir/*/real.jsonl`` or ``real.ndjson`` (``real``: every rank;
    ``emulated``: rank 0 of a fake process group), the first ok row of each, with its simulated
    twin where ``scripts/gpu/compare.py`` wrote one beside it."""
    rows: list[tuple[Row, Path]] = []
    for path in sorted([*gpu_dir.glob("*/real.jsonl"), *gpu_dir.glob("*/real.ndjson")]):
        rows += [(row, path) for row in read_rows(path, on_error="skip")]
    out = []
    for r in results:
        a = r.anchor
        if a.kind != "memory":
            continue
        for row, path in rows:
            if (row.status == "ok" and row.method == a.impl.method and dict(row.options) == dict(a.impl.options)
                    and row.model == a.model and row.world_size == a.gpus and row.seq_len == a.seq_len):
                out.append(RealCheck(a, row, str(path.relative_to(gpu_dir.parent.parent)), _twin(row, path.parent)))
                break
    return out


def rows_runner(paths: Iterable[str | Path]) -> Callable[[Trial], Row]:
    """A runner that simulates nothing: each trial's row from ``paths`` (the newest of its key),
    for re-rendering the tables from committed rows. A trial with no row raises ``LookupError``
    naming it."""
    found: dict[tuple, Row] = {}
    for path in paths:
        if not Path(path).is_file():
            raise LookupError(f"--from-rows {path}: no such file")
        for row in read_rows(Path(path), on_error="raise"):
            old = found.get(trial_key(row))
            if old is None or (row.env.time or "") >= (old.env.time or ""):
                found[trial_key(row)] = row

    def runner(trial: Trial) -> Row:
        row = found.get(trial.key())
        if row is None:
            raise LookupError(f"no row in {', '.join(map(str, paths))} for {trial.method} {trial.model} "
                              f"{trial.seq_len} tokens on {trial.world_size} ({trial.step.stack} stack, "
                              f"{trial.step.allocator_pools} pools); run without --from-rows to simulate it")
        return row

    return runner


def summary(results: list[Result]) -> dict[str, Any]:
    return {"anchors": len(results), "passed": sum(r.passes() for r in results),
            "fitted_bytes": paper_stack.FITTED}
