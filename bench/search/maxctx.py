"""Maximum context: the longest sequence that fits, by a bracket narrowed on the memory's load.

Lengths are multiples of the step ``g = lcm(granularity, seq_multiple)`` where
``seq_multiple`` is the method's layout granularity at that world size (so every trial is
a valid length). From ``start``, each next length is where the binding budget's load (peak over
usable memory, device or host: ``row_load``) reaches 1 on the secant through the two nearest
probes, kept inside the bracket between the longest fit and the shortest failure, with a doubling
or bisection step instead whenever a probe has no load or the secant stops halving the bracket
(``load_guided``); memory that grows about linearly with the length is bracketed in a few probes.
The search ends when the bracket is one step wide, so the answer is exact to ``g`` whatever the
proposals were: ``max_context`` fits and ``max_context + g`` does not (or is beyond the search
limit, which the final row says). ``search(..., propose=doubling)`` is the plain doubling (up to
``max_seq_len``) and bisection.

Isolation: every trial in real or emulated mode runs in its own process (real mode then spawns its
ranks from there), so an out-of-memory error, or the out-of-memory killer, ends that trial only; a
child that dies without reporting becomes an ``oom`` (killed by SIGKILL) or ``error`` row. Simulated
trials allocate nothing and every failure is caught into a row, so they may run in this process
(``default_runner``); the CLI isolates them too unless told ``--in-process`` (``isolated_runner``),
since a method could keep state, such as cached subgroups, from one trial's process group into the
next. An isolated simulated trial is forked from a fork server that imported the package once
(``isolation_context``). Every trial is a row, OOMs included; a final ``max_context`` row carries
the answer and the figures of the longest fitting trial. An ``error`` trial (not a memory failure)
stops the search: its answer is then only a lower bound, and the final row says so with status
``error``.
"""
from __future__ import annotations

import atexit
import dataclasses
import math
import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from records import Figures, GiB, Kind, Row, human, validate_row

from ..measure import launch
from ..measure.result import failed
from ..measure.run import budgeted_peak, build_row
from ..measure.trial import Trial
from .autochunk import run


def _child(trial: Trial, conn) -> None:
    try:
        row = run(trial)
        conn.send(("row", row.to_dict()))
    except BaseException as err:  # noqa: BLE001
        conn.send(("raise", f"{type(err).__name__}: {err}"))
    finally:
        conn.close()


_PRELOADED = ["bench.search.maxctx"]  # what the fork server imports once (torch, the package, the methods)


def isolation_context(trial: Trial) -> mp.context.BaseContext:
    """Where ``run_isolated`` starts ``trial``'s process. A simulated trial: forked from a fork server that
    imported the package (and torch) once and never runs a trial, so each probe of a search is still a
    fresh process with no state from the last (no process group, no cached subgroup, no flash-attn stand-in
    or library imported: the child imports those itself, as a fresh interpreter does) without paying the
    imports again (about 5 CPU-s a probe). A real or emulated one: spawned, a new interpreter (its CUDA
    must start in a process that never forked)."""
    if trial.mode != "simulated":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if not _FORK_SERVER_STOPS:
        ctx.set_forkserver_preload(_PRELOADED)
        atexit.register(_stop_fork_server)
        _FORK_SERVER_STOPS.append(True)
    return ctx


_FORK_SERVER_STOPS: list[bool] = []


def _stop_fork_server() -> None:
    """At exit, stop the fork server and wait for it (``ForkServer._stop``, as Python's own tests do), so that
    the CPU time of the trials it ran counts as this process's children's (``resource.RUSAGE_CHILDREN``,
    ``time``), as spawned trials' does; left to ``multiprocessing``, the server outlives this process."""
    stop = getattr(getattr(mp_forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        stop()


def _as_called(environment: dict[str, str], cwd: str, target: Callable, trial: Trial, conn) -> None:
    """``target(trial, conn)`` in the caller's environment and working directory at the call: a fork server's
    children inherit the server's, from when it started, where a spawned child inherits the caller's."""
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(cwd)
    target(trial, conn)


def run_isolated(trial: Trial, timeout_s: float = 3600, target: Callable = _child) -> Row:
    """``run`` in a fresh process (``isolation_context``); a child that dies becomes a row.

    ``target(trial, conn)`` is what the child runs (tests replace it), in this process's environment and
    working directory as they are now."""
    ctx = isolation_context(trial)
    parent, child = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    proc = ctx.Process(target=_as_called, args=(dict(os.environ), os.getcwd(), target, trial, child))
    proc.start()
    child.close()
    message = None
    if parent.poll(timeout_s):
        try:
            kind, payload = parent.recv()
        except EOFError:
            kind, payload = "died", None
    else:
        kind, payload = "timeout", None
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if kind == "row":
        return validate_row(payload)
    if kind == "raise":
        raise ValueError(payload)
    code = proc.exitcode
    killed = code in (-9, 137)
    if kind == "timeout":
        message = f"trial timed out after {timeout_s:.0f}s"
    else:
        message = (f"trial process killed by SIGKILL (exit {code}): host out of memory?" if killed
                   else f"trial process died without a result (exit code {code})")
    return build_row(trial, failed("oom" if killed else "error", message), time.perf_counter() - t0)


def default_runner(trial: Trial) -> Row:
    """In-process for simulated trials, or when this process is already a launched rank
    (torchrun/submitit: there is no separate process to give each trial); else isolated."""
    if trial.mode == "simulated" or launch.launched_env() is not None:
        return run(trial)
    return run_isolated(trial)


def isolated_runner(trial: Trial) -> Row:
    """Every trial in its own process, simulated ones too (unless this process is a launched
    rank). Costs an interpreter start per trial, but no state survives from one trial to the
    next: a method that caches process groups across trials cannot see a destroyed one."""
    if launch.launched_env() is not None:
        return run(trial)
    return run_isolated(trial)


# ----------------------------------------------------------------------------- the search, shared

Propose = Callable[[int, Any, dict, int, int, int], int]


def doubling(k: int, point: Any, points: dict, lo: int, hi: int, k_max: int) -> int:
    """Double while every length fits (up to ``k_max``), then bisect the bracket."""
    return min(2 * k, k_max) if hi > k_max else (lo + hi) // 2


def secant_on_load(k: int, point: Any, points: dict, lo: int, hi: int, k_max: int) -> int:
    """The next multiple where the load (the binding budget's fill, ``point.load``: 1.0 is full)
    reaches 1, on the secant through the two probes nearest ``k``; from one probe, proportional
    (memory grows at least linearly), one step past it. Kept inside the bracket."""
    near = sorted((j for j in points if getattr(points[j], "load", None) is not None), key=lambda j: abs(j - k))[:2]
    if len(near) == 2 and points[near[0]].load != points[near[1]].load:
        (k1, p1), (k2, p2) = [(j, points[j].load) for j in near]
        nxt = math.floor(k1 + (1.0 - p1) * (k2 - k1) / (p2 - p1))
    else:
        nxt = math.floor(k / max(1e-9, point.load)) + (1 if point.status == "ok" else 0)
    nxt = min(max(nxt, lo + 1), hi - 1)
    return (lo + hi) // 2 if nxt in points else nxt


def load_guided() -> Propose:
    """``secant_on_load`` guarded by bisection. A probe without a load (a real out-of-memory error
    records no peak) is followed by ``doubling``'s step, and so is a secant step that did not halve the
    bracket once a failure bounds it: a load far from linear in the length (a step in it) would
    otherwise have the secant creep along one end; guarded, it costs at most two probes per halving.
    Memory that grows about linearly with the length is bracketed in two or three probes, against
    doubling's ``log2`` of the range plus the bisection's. The answer is the same, exact to the step,
    since the search ends only on a bracket one step wide."""
    widths: list[int] = []  # the bracket's width after the last secant step, once a failure bounds it

    def propose(k: int, point: Any, points: dict, lo: int, hi: int, k_max: int) -> int:
        slow = bool(widths) and hi - lo > widths[-1] // 2
        if slow or getattr(point, "load", None) is None:
            widths.clear()
            return doubling(k, point, points, lo, hi, k_max)
        widths[:] = [hi - lo] if hi <= k_max else []
        return secant_on_load(k, point, points, lo, hi, k_max)

    return propose


def bracket(probe: Callable[[int], Any], points: dict, k_max: int, k: int, propose: Propose = doubling,
            settle: Callable[[int, int], bool] | None = None) -> tuple[int, int, Any]:
    """The max-context search over step counts ``1..k_max``: ``(lo, hi, error)``, ``lo`` the most
    steps that fit (0: none), ``hi`` the fewest that do not (``k_max + 1``: none within the limit),
    one apart unless ``error`` (a probe with status ``error``, which stops the search).

    ``probe(k)`` returns the probe at ``k`` steps (anything with a ``status``: ok / oom / error),
    recorded in ``points`` (``k`` -> probe; the caller's dict, which ``probe`` may fill itself);
    ``propose`` picks the next ``k`` inside the bracket (``doubling`` or ``secant_on_load``). A
    probe may be approximate: ``settle(lo, hi)`` then makes the bracket's ends exact and says
    whether an end's status changed, and the search goes on from the probes recorded."""
    lo, hi = 0, k_max + 1
    error = None
    while True:
        while hi - lo > 1:
            p = points[k] = probe(k)
            if p.status == "error":
                error, hi = p, k
                break
            if p.status == "ok":
                lo = k
            else:
                hi = k
            if hi - lo <= 1:
                break
            k = propose(k, p, points, lo, hi, k_max)
        if error is not None or settle is None or not settle(lo, hi):
            return lo, hi, error
        lo = max([j for j, q in points.items() if q.status == "ok"], default=0)
        hi = min([j for j, q in points.items() if q.status != "ok"] + [k_max + 1])
        k = (lo + hi) // 2


@dataclasses.dataclass(frozen=True)
class Probe:
    """One probe of ``search``: its row, and the load of the budget that binds (``row_load``)."""

    row: Row
    load: float | None

    @property
    def status(self) -> str:
        return self.row.status


def row_load(trial: Trial, row: Row) -> float | None:
    """How full the binding budget is at ``row`` (1.0: exactly full): the peak judged against the
    device's usable bytes (``budgeted_peak``: the modelled reserved peak on the paper stack), or the
    host peak against the host memory offloads may fill, whichever is fuller; at least just over 1 for
    an out-of-memory row. None when the row has no peak to judge (a real out-of-memory error)."""
    f = row.figures
    _, peak = budgeted_peak(trial, f)
    if peak is None or not f.usable_bytes:
        return None
    load = peak / f.usable_bytes
    if f.host_usable_bytes and f.host_peak_bytes is not None:
        load = max(load, f.host_peak_bytes / f.host_usable_bytes)
    return max(load, 1.0 + 1e-9) if row.status == "oom" else load


def search(
    trial: Trial,
    runner: Callable[[Trial], Row] = default_runner,
    on_row: Callable[[Row], None] | None = None,
    progress: TextIO | None = sys.stderr,
    propose: Propose | None = None,
) -> Row:
    """Run the max-context search ``trial`` (kind ``max_context``); returns the final row.

    ``on_row`` receives every probe's row as it finishes (to append it to a file). ``propose`` picks
    each next length (default ``load_guided()``: the secant on the rows' load, guarded by bisection;
    ``doubling`` gives the plain doubling and bisection).
    """
    if trial.kind != Kind.MAX_CONTEXT:
        raise ValueError(f"search needs a max_context trial, got kind {trial.kind!r}")
    trial.validate()
    step = trial.search_step()
    max_seq_len, start = trial.search.max_seq_len, trial.search.start
    trial.probe(step).validate()
    k_max = max_seq_len // step
    k = min(k_max, max(1, math.ceil((start or step) / step)))
    probes: dict[int, Probe] = {}
    last: list[Row] = []
    label = (f"[max-context {trial.mode} {trial.world_size}x{trial.device} {trial.method} "
             f"{trial.model}]")

    def attempt(k: int) -> Probe:
        t0 = time.perf_counter()
        probed = trial.probe(k * step)
        row = runner(probed)
        last[:] = [row]
        if on_row is not None:
            on_row(row)
        if progress is not None:
            peak = row.figures.peak_bytes
            usable = row.figures.usable_bytes
            mem = f"peak {peak / GiB:.2f} of {usable / GiB:.2f} GiB usable" if peak is not None and usable else ""
            detail = row.message if row.status != "ok" else mem
            print(f"{label} trial {len(probes) + 1}: {human(k * step)} -> {row.status} {detail} "
                  f"[{time.perf_counter() - t0:.1f}s]", file=progress, flush=True)
        return Probe(row, row_load(probed, row))

    lo, hi, stop = bracket(attempt, probes, k_max, k, propose or load_guided())
    best = probes[lo].row if lo in probes else None
    stop_row = stop.row if stop is not None else None
    return _final_row(trial, lo * step, best, stop_row or (last[0] if best is None else None), len(probes),
                      limit_reached=(hi > k_max))


def _final_row(trial: Trial, max_context: int, best: Row | None, stop: Row | None, count: int,
               limit_reached: bool) -> Row:
    step, max_seq_len = trial.search_step(), trial.search.max_seq_len
    base = best or stop  # the longest fit, else the failure that ended the search
    if base is None:  # cannot happen: at least one trial runs
        raise RuntimeError("max-context search ran no trial")
    figures = dataclasses.replace(best.figures) if best is not None else Figures(
        capacity_bytes=base.figures.capacity_bytes, usable_bytes=base.figures.usable_bytes)
    figures.max_context = max_context
    figures.trials = count
    notes = list(base.notes)
    if limit_reached:
        notes.append(f"lower bound: the search limit {max_seq_len} fits; the maximum may be larger")
    elif max_context == 0:
        notes.append(f"nothing fits: even {step} tokens failed")
    else:
        notes.append(f"exact to {step} tokens: {max_context} fits, {max_context + step} does not")
    stopped = stop is not None and stop.status == "error"
    status, message = ("error", f"search stopped by an error at a trial: {stop.message}") if stopped else ("ok", "")
    return Row(**{**trial.row_fields(), "link": base.link}, status=status, message=message, figures=figures,
               env=base.env, model_arch=base.model_arch, notes=notes)
