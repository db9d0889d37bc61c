"""One trial (method x model x sequence length x world size x mode x levers) -> one row.

Modes (recorded in every row):

* ``real``: real ranks (``bench.measure.launch``: spawned gloo ranks on this host, or the ranks
  torchrun/submitit started; NCCL on CUDA). Step time is measured (max over ranks), memory
  is ``torch.cuda.max_memory_allocated``/``reserved`` on CUDA, and on CPU torch's
  ``MemTracker`` over real tensors (CPU has no allocator peak statistics in torch, and RSS
  counts the interpreter, libraries and memory malloc has not returned; MemTracker counts
  live tensor storage exactly as CUDA's allocated figure does).
* ``emulated``: one real rank of a ``world_size``-rank job at a time on this device, with a
  ``fake`` process group: compute and memory are real, collectives return at once, and their
  time comes from the link model (``bench.stackmodel.hardware``) over the bytes actually issued:
  ``step_time = measured compute + modelled communication`` (no overlap assumed). The ranks
  measured are those a simulation measures (``deciding_ranks``), one after another in this
  process, the device freed between them; the worst rank's figures make the row (``worst_of``:
  its memory, and its step time too), with ``figures.worst_rank``, each rank's allocated peak
  (``rank_peaks``) and, on CUDA, each rank's reserved peak (``rank_reserved_peaks``).
* ``simulated``: FakeTensorMode + fake process group + MemTracker: one rank's peak for any
  shape and world size with nothing allocated, for each rank that can decide the trial's memory
  (``AttentionMethod.deciding_ranks``: every rank of the ring family, rank 0 of a method whose ranks
  are symmetric), one after another in this process; the worst rank's figures make the row
  (``measure_worst_rank``), with ``figures.worst_rank`` and each rank's judged peak. For a GPU
  preset the step runs on fake CUDA tensors (the GPU code path: CUDA SDPA ops, the methods' and
  libraries' CUDA branches, pinned host buffers; ``bench.stackmodel.simcuda`` says how streams
  and events are stood in for) and host memory is the fake CPU device. ``sim_device="cpu"`` selects the CPU code
  path: the accelerator is a fake CPU device and host memory the ``meta`` device (for the
  checkpoint offload here, and for the methods' own offloading through
  ``methods.core.hostmem``), so the two are still counted apart. Step time is not simulated;
  the communication bytes and their modelled time are recorded.
  With ``allocator_model`` (classic or expandable) the step's allocations are also replayed
  through a model of the CUDA caching allocator (``bench.stackmodel.allocator``), which adds
  ``peak_reserved_bytes``. Under the ``lean`` stack the fit is decided by the allocated peak,
  under the ``paper`` stack (``bench.stackmodel.stack``, which turns the allocator model on) by
  the reserved peak against the device less the CUDA context.

A trial "fits" in simulated mode (and on a CPU device in the other modes, which have no
out-of-memory error to catch) when its peak is within the preset's usable bytes; otherwise
its status is ``oom``. On CUDA an out-of-memory error is caught and makes the row ``oom``.
Any other exception makes an ``error`` row: a trial never raises.

Every mode's measurement is a ``bench.measure.result.Measurement`` (the simulated step's counts
in it: ``bench.stackmodel.counts.StepCounts``); :func:`build_row` makes the row of one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable

import torch

import methods
from records import Figures, GiB, Row, cpu_name, environment

from ..model.config import flops_per_device
from ..stackmodel import docwork, fake_flash_attn, simcuda, stack
from ..stackmodel.allocator import Trace, record_step, replay
from ..stackmodel.counts import StepCounts
from ..stackmodel.hardware import CommCounter
from ..stackmodel.stepcount import StepCounter
from ..stackmodel.steptime import (
    attention_kernel,
    attention_rate,
    comm_counts,
    figures_from_counts,
    slowest_rank_counts,
    stack_constants,
)
from ..stackmodel.workspace import KernelWorkspace
from ..training.step import build_attention, build_model, make_batch, maybe_prime_optimizer, step_fn
from . import launch
from .attntime import CLOCK_SAID, MIXED_CLOCKS, NONE_SEEN, NOT_ON_CUDA, AttentionTimer, median_seconds, timed_device
from .attntime import imbalance as attention_imbalance
from .fakeroute import fast_fake
from .result import AllocatorReplay, KeptTrace, LoadAround, Measurement, failed
from .simulate import fake_process_group, fake_tensors, no_param_init, track_peaks
from .skipmath import NOTE as SKIP_NOTE
from .skipmath import SkipAttentionMath
from .timing import MIN_TIMED_STEPS, HostLoad, StepStats, host_shared, slowest_rank_steps
from .trial import Trial

# --------------------------------------------------------------------------- helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, (RuntimeError, MemoryError)) and (
        "out of memory" in text or "can't allocate memory" in text or isinstance(err, MemoryError)
    )


def short_error(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    where = ""
    tb = traceback.extract_tb(err.__traceback__)
    if tb:
        frame = tb[-1]
        where = f" (at {frame.filename.rsplit('/', 2)[-2:][-1]}:{frame.lineno})"
    return f"{type(err).__name__}: {first[:400]}{where}"


def _build(trial: Trial, group, device: torch.device, host: str, fake: bool):
    """(built, batch): the model and optimizer, or the attention case. An emulated rank on a
    GPU builds on meta and materialises its shards only (``build_model(meta_init=True)``): its
    values do not matter, and a 32B model's whole fp32 weights would not fit the device."""
    cfg, step, docs = trial.config(), trial.step, trial.documents()
    if step.scope == "attention":
        case = build_attention(cfg, trial.method, trial.opts, group, step, trial.seq_len, device,
                               fake=fake, seed=trial.seed, docs=docs)
        return case, None
    meta_init = (trial.mode == "emulated" and device.type == "cuda" and step.fsdp and not step.fsdp_offload)
    model, opt = build_model(cfg, trial.method, trial.opts, group, step, device, host=host,
                             seed=None if fake else trial.seed, seq_len=trial.seq_len, meta_init=meta_init,
                             docs=docs)
    batch = make_batch(model, trial.seq_len, step.batch, device, seed=trial.seed + 1, fake=fake, docs=docs)
    return (model, opt), batch


def _externals(trial: Trial, built) -> tuple:
    if trial.step.scope == "attention":
        return (built.block, built.x, built.dy)
    model, opt = built
    return (model, opt)


# --------------------------------------------------------------------------- the three modes


def simulated_device(trial: Trial) -> torch.device:
    """The fake device a simulated trial runs on: the preset's own (``cuda`` for a GPU preset:
    the GPU code path, ``bench.stackmodel.simcuda``), or ``cpu`` when the step asks for the CPU
    code path (``sim_device="cpu"``) or the preset is a CPU."""
    if trial.preset().kind == "cpu" or trial.step.sim_device == "cpu" \
            or trial.method_cls().simulated_cpu_path_reason:
        return torch.device("cpu")
    return torch.device("cuda", 0)


def _replayed(trial: Trial, trace: Trace, device_key: str, counts: StepCounts | None,
              reserve: int = 0) -> tuple[int, AllocatorReplay]:
    """(reserved peak, the replay) of ``trace`` replayed against what the allocator may map: the
    device less what lives outside it (the CUDA context; under the paper stack NCCL's buffers for
    the collectives in ``counts`` too), less ``reserve`` bytes held by something the trace does not contain."""
    t0 = time.perf_counter()
    nccl = stack.nccl_buffer_bytes(counts) if stack.reserved(trial.step.stack) else 0
    capacity = stack.usable_bytes(trial.preset(), "paper", nccl=nccl) - reserve
    replayed = replay(trace, device_key, expandable_segments=trial.step.allocator_model == "expandable",
                      capacity=capacity, per_stream=trial.step.allocator_pools == "per-stream",
                      device_bytes=trial.preset().capacity())
    return replayed.peak_reserved + reserve, AllocatorReplay(
        model=trial.step.allocator_model, pools=trial.step.allocator_pools,
        peak_allocated_bytes=replayed.peak_allocated + reserve, events=replayed.events,
        replay_s=time.perf_counter() - t0, cache_releases=replayed.cache_releases, oom=replayed.oom,
        reserve_bytes=reserve or None)


def replay_with_reserve(result: Measurement, reserve: int) -> tuple[int, AllocatorReplay]:
    """(reserved peak, the replay): ``result``'s allocator figures replayed again from its trace
    (``measure_simulated(keep_trace=True)``) as if ``reserve`` more bytes were held on the
    device for the whole step: what a deeper model's extra layers hold (their sharded parameters,
    gradients and optimizer state; ``bench.search.extrapolate``). The caching allocator then meets
    its capacity earlier and, as the real one does, releases its cached blocks and retries before
    it fails, so the deeper model's reserved peak is not the shallow one's plus ``reserve``."""
    if result.trace is None:
        raise ValueError("replay_with_reserve needs the allocation trace: simulate with keep_trace=True "
                         "and allocator_model other than none")
    kept = result.trace
    return _replayed(kept.trial, kept.trace, kept.device_key, result.step_counts, reserve)


_heap_set_aside = False  # whether this process has simulated a trial before


def _set_aside_the_heap() -> None:
    """Before a simulated trial: the garbage of the trials before it collected (FSDP's modules hold reference
    cycles), then every object the process holds (its modules: torch's, DeepSpeed's; caches) frozen out of the
    cyclic collector's generations. The first trial of a process skips the collection: a fresh process has
    little garbage, which is frozen with the rest, and the full scan of its heap is not needed.

    Why: a simulation makes many short-lived containers (fake tensors, tuples, weak references), so the collector
    runs often, and each full collection scanned the whole heap of imported modules again (what it cost:
    results/speed/README.md). Nothing of the trial's own is frozen and no tracker is active yet. The full
    collections during the step come at other times: a storage the step tracks that died only at a collection
    (in a reference cycle) would be freed at another time. None does in the trials checked (the golden figures
    of tests/bench/stackmodel/test_sim_equality.py, the 68 fidelity rows, 1M trials of both stacks: every figure
    identical). The heap stays frozen after the trial: an object frozen then that later dies in a cycle is not
    collected. Unfreezing it after each trial instead made every later trial's collection scan the whole heap, a
    worker's caches included, and took the gain back (results/speed/README.md)."""
    global _heap_set_aside
    if _heap_set_aside:
        gc.collect()
    _heap_set_aside = True
    gc.freeze()


def measure_simulated(trial: Trial, keep_trace: bool = False, rank: int = 0) -> Measurement:
    """Rank ``rank``'s peak under FakeTensorMode with a fake process group (nothing allocated).

    Where no flash-attn is installed, ``fake_flash_attn`` supplies one (installed before the
    method is built, so that the libraries it wraps import it) whose kernels allocate what
    flash-attn's do, scratch included. ``keep_trace``: the result also carries the allocation
    trace (``Measurement.trace``, not a row field; :func:`replay_with_reserve` replays it again)."""
    resolution = trial.resolved()  # what runs: the levers after the presets (bench.resolve)
    stack_notes = list(resolution.notes)
    trial = dataclasses.replace(trial, step=resolution.step)
    _set_aside_the_heap()
    device = simulated_device(trial)
    on_gpu_path = device.type == "cuda"
    if on_gpu_path:
        simcuda.require()
    # the GPU code path: host memory is the (fake) CPU; the CPU code path of a GPU preset:
    # host memory is the meta device; simulating a CPU: the host is the device itself and
    # offloading does nothing, as on a real CPU
    accelerator = trial.preset().kind != "cpu"
    host = "cpu" if on_gpu_path else ("meta" if accelerator else "cpu")
    runtime = simcuda.runtime() if on_gpu_path else contextlib.nullcontext()
    needs = fake_flash_attn.needs_it(methods.get_info(trial.method).requires)
    with fake_flash_attn.installed(check=needs) as added, fake_process_group(trial.world_size, rank) as group, \
            runtime, fake_tensors(torch.float32, meta_host=accelerator and not on_gpu_path), no_param_init():
        with fast_fake():  # untracked: FakeTensorMode's known answers without its dispatch (fakeroute)
            built, batch = _build(trial, group, device, host=host, fake=True)
            if trial.step.scope == "model":
                maybe_prime_optimizer(*built)
        run = step_fn(trial.step.scope, built, batch, trial.step, group)
        # paper stack, term 8: the cuBLAS workspaces the caching allocator holds from the first GEMMs
        workspaces = [torch.empty(n, dtype=torch.uint8, device=device)
                      for n in (stack.cublas_workspace_sizes(trial.preset()) if stack.reserved(trial.step.stack)
                                and on_gpu_path else ())]
        if workspaces:
            stack_notes.append(stack.cublas_note(trial.preset()))
        counter = CommCounter()
        steps = StepCounter(device.type, host)
        workspace = KernelWorkspace(trial.step.kernel_workspace)
        modelled = trial.step.kernel_workspace != "none"

        def tracked():
            # the counters join the memory tracker's dispatch mode (simulate.PeakTracker, a SimulationMode:
            # one Python dispatch per operator for all of them), in the order they nest; the tracker, inside
            # them, sees the scratch buffers the workspace counter makes
            with counter, steps.counting(), (workspace if modelled else contextlib.nullcontext()):
                run()

        allocator = trial.step.allocator_model
        if allocator == "none":
            peaks = track_peaks(tracked, *_externals(trial, built), *workspaces)
        else:
            peaks, trace = record_step(tracked, *_externals(trial, built), *workspaces)
    device_key = str(device)  # the simulated accelerator's device
    device_peak = peaks.get(device_key)
    host_peak = peaks.get(host) if host != device_key else None
    # the collectives' members in the simulated rank's own node (rank 8 of 16: node 1), not rank 0's
    counts = dataclasses.replace(steps.counts(),
                                 collectives=comm_counts(counter, trial.link_model().ranks_per_node, rank))
    out = Measurement(
        peak_bytes=device_peak.total if device_peak else 0,
        peak_by_category=dict(device_peak.by_category) if device_peak else {},
        host_peak_bytes=host_peak.total if host_peak else 0,
        comm_bytes=counter.bytes,
        comm_bytes_by_op=counter.by_op(),
        comm_time_s=counter.time(trial.link_model()),
        step_counts=counts,
        sim_device=str(device),
        flash_attn_simulated=needs and "flash_attn" in added,
        stack_notes=stack_notes,
    )
    if allocator != "none":
        out.peak_reserved_bytes, out.allocator = _replayed(trial, trace, device_key, counts)
        if keep_trace:
            out.trace = KeptTrace(trace, device_key, trial)  # the trial as the stack ran it
    return out


# "deciding" (default), "0": simulate (or emulate) rank 0 alone, C times faster for a ring, or another rank
# number: that rank alone (scripts/gpu/compare.py simulates each rank of an emulated row so)
SIM_RANKS_ENV = "CPAB_SIM_RANKS"


def deciding_ranks(trial: Trial) -> tuple[int, ...]:
    """The ranks a simulation (or an emulation) of ``trial`` measures: its method's ``deciding_ranks``
    (every rank of the ring family, rank 0 of a method whose ranks are symmetric); rank ``r`` alone
    where ``$CPAB_SIM_RANKS`` is a rank number ``r``, such as ``0`` (an asymmetric method's row then
    says its figures are that rank's)."""
    choice = os.environ.get(SIM_RANKS_ENV, "deciding")
    if choice != "deciding" and not (choice.isdigit() and int(choice) < trial.world_size):
        raise ValueError(f"{SIM_RANKS_ENV}={choice!r}: use 'deciding' (every rank that can decide memory) "
                         f"or a rank number below the world size {trial.world_size} (that rank alone, e.g. '0')")
    if choice != "deciding":
        return (int(choice),)
    cls = trial.method_cls()
    ranks = cls.deciding_ranks(trial.world_size, trial.options, trial.config().attn_spec(), trial.documents())
    if not ranks or any(not 0 <= r < trial.world_size for r in ranks):
        raise ValueError(f"method {trial.method!r} names deciding ranks {ranks} at world size {trial.world_size}: "
                         f"fix its deciding_ranks to return ranks in 0..{trial.world_size - 1}")
    return tuple(ranks)


def judged_peak(trial: Trial, result: Measurement) -> int:
    """The device peak a simulation's fit is judged on (``budgeted_peak``'s, from a measurement): the
    modelled allocator's reserved peak under the paper stack (never below the allocated one), else the
    allocated peak."""
    allocated = result.peak_bytes or 0
    if stack.reserved(trial.step.stack) and result.peak_reserved_bytes is not None:
        return max(result.peak_reserved_bytes, allocated)
    return allocated


def worst_of(trial: Trial, by_rank: dict[int, Measurement]) -> Measurement:
    """The worst of one trial's per-rank simulations, with ``rank`` (the worst) and, where there are
    several, ``rank_peaks`` (each rank's judged peak): a failed rank first (an error before an OOM), then
    a rank whose modelled allocator ran out, then the largest judged device peak, then the largest host
    peak; a tie goes to the lowest rank. The worst rank's whole measurement stands for the trial (its
    counts, communication and notes too), but for the counts of the slowest rank under packed documents
    (``_slowest_rank_counts``)."""
    severity = {"error": 2, "oom": 1}

    def key(rank: int) -> tuple:
        r = by_rank[rank]
        if r.status != "ok":
            return (severity.get(r.status, 2), 0, 0, 0, -rank)
        return (0, int(r.allocator is not None and r.allocator.oom is not None), judged_peak(trial, r),
                r.host_peak_bytes or 0, -rank)

    worst = max(by_rank, key=key)
    out = dataclasses.replace(by_rank[worst], rank=worst)
    if len(by_rank) > 1 and all(r.status == "ok" for r in by_rank.values()):
        out.rank_peaks = [[rank, judged_peak(trial, by_rank[rank])] for rank in sorted(by_rank)]
        _slowest_rank_counts(trial, by_rank, out)
    return out


def _slowest_rank_counts(trial: Trial, by_rank: dict[int, Measurement], out: Measurement) -> None:
    """Under packed documents the step waits for the slowest rank (``bench.stackmodel.docwork``). Where a rank
    with the most counted attention pairs was simulated and the worst by memory has fewer, ``out``'s counts are
    that rank's own: its attention FLOPs and varlen excess (the excess goes by its calls' document lengths, not
    by pairs) and the rest of its step (a ring's packed pieces differ by rank in their gathers and scatters too),
    so that the modelled step is one rank's; ``out.attention_rank`` says which. Otherwise ``build_row`` carries
    the worst rank's attention over by the pairs."""
    work = docwork.trial_work(trial) if trial.mode == "simulated" else None
    if work is None or out.step_counts is None or work.pairs[out.rank] == max(work.pairs):
        return
    # a simulated rank with the most pairs (on a USP mesh the ranks of a ring position have the same)
    slow = next((r for r in sorted(by_rank) if work.pairs[r] == max(work.pairs)), None)
    if slow is None or by_rank[slow].step_counts is None:
        return
    out.step_counts = by_rank[slow].step_counts
    out.attention_rank = slow


def measure_worst_rank(trial: Trial, keep_trace: bool = False,
                       measure: Callable[..., Measurement] | None = None) -> Measurement:
    """Every deciding rank (``deciding_ranks``) simulated in turn, each in a fresh fake process group
    in this process (``fake_process_group`` tears its group down on exit), and the worst of them
    (``worst_of``). ``measure(trial, keep_trace, rank)`` simulates one rank (default
    ``measure_simulated``, guarded: a failing rank is a failed measurement); ``keep_trace``: only
    the worst rank's trace is kept. A failed rank stops the loop (the trial fails whatever the others
    hold)."""
    measure = measure or (lambda t, keep, rank: guarded(measure_simulated, t, keep, rank))
    by_rank: dict[int, Measurement] = {}
    for rank in deciding_ranks(trial):
        by_rank[rank] = measure(trial, keep_trace, rank)
        if by_rank[rank].status != "ok":
            break
        if keep_trace and len(by_rank) > 1:  # only the worst so far keeps its trace
            best = worst_of(trial, by_rank).rank
            for other, r in by_rank.items():
                if other != best:
                    r.trace = None
    return worst_of(trial, by_rank)


def measure_on_device(trial: Trial, group, device: torch.device,
                      around_step: contextlib.AbstractContextManager | None = None,
                      time_attention: bool = False) -> Measurement:
    """Build, warm up, measure memory and time ``trial.iters`` steps on real tensors; the
    host's load average is read before and after the timed steps (``bench.measure.timing``).
    ``around_step``: a reusable context every step runs in (``SkipAttentionMath``).
    ``time_attention``: on a CPU device, also time the attention kernel calls of each timed step
    (``bench.measure.attntime``; warm-up steps are not timed)."""
    if trial.threads:
        torch.set_num_threads(trial.threads)
    built, batch = _build(trial, group, device, host="cpu", fake=False)
    if device.type == "cuda":
        # the builder makes every parameter whole (fp32) before FSDP shards it; the cached
        # segments of those whole weights would count in every later reserved peak (at world
        # size 8 of Llama3-8B, 32 GB). A training job builds on meta or loads shards, and the
        # simulation replays the step through a fresh allocator: release them first.
        torch.cuda.empty_cache()
    step = step_fn(trial.step.scope, built, batch, trial.step, group)

    def run():
        with around_step if around_step is not None else contextlib.nullcontext():
            return step()

    counter = CommCounter()
    _sync(device)
    with counter:  # the first step builds optimizer state and caches; it counts the collectives
        loss = run()
    for _ in range(trial.warmup - 1):
        run()
    _sync(device)
    out = Measurement(comm_bytes=counter.bytes, comm_bytes_by_op=counter.by_op(), comm_calls=list(counter.calls))
    if device.type == "cpu":
        peaks = track_peaks(run, *_externals(trial, built))
        peak = peaks.get("cpu")
        out.peak_bytes = peak.total if peak else 0
        out.peak_by_category = dict(peak.by_category) if peak else {}
    else:
        torch.cuda.reset_peak_memory_stats(device)
    load_before = HostLoad.now()
    times = []
    attention = AttentionTimer() if time_attention and timed_device(device) else None
    for _ in range(trial.iters):
        _sync(device)
        t0 = time.perf_counter()
        with attention.step() if attention is not None else contextlib.nullcontext():
            loss = run()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if attention is not None:
        out.attention_times_s, out.attention_calls = attention.seconds(), attention.calls()
        out.attention_clock = attention.clock
    if device.type == "cuda":
        out.peak_bytes = torch.cuda.max_memory_allocated(device)
        out.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
    load_after = HostLoad.now()
    out.compute_time_s = StepStats(tuple(times)).median
    out.step_times_s = times
    out.host = socket.gethostname()
    out.host_load = LoadAround(load_before.load_1m, load_after.load_1m, load_after.cpus)
    if loss is not None and trial.step.scope == "model":
        out.loss = float(loss)
    out.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    out.threads = torch.get_num_threads()
    return out


def guarded(fn: Callable[..., Measurement], *args) -> Measurement:
    """Run a measurement; turn an exception into a status (so ranks report, not crash)."""
    try:
        return fn(*args)
    except BaseException as err:  # noqa: BLE001 - every failure becomes a row
        if isinstance(err, KeyboardInterrupt):
            raise
        return failed("oom" if is_oom(err) else "error", short_error(err), traceback.format_exc())
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def real_rank(group, trial: Trial) -> Measurement:
    """Run on every real rank (module level: it is sent to spawned processes)."""
    device = launch.local_device(trial.preset().kind)
    return guarded(measure_on_device, trial, group, device, None, True)


def release_device(device: torch.device) -> None:
    """Free what a measured rank left on ``device`` before the next rank is built: the model and
    optimizer of the rank just measured are unreachable once its measurement returns, but FSDP's
    modules hold reference cycles, so they go only at a collection; then the caching allocator's
    segments are returned and the peak counters reset, so that each rank's peaks are its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def emulated_rank(trial: Trial, rank: int, device: torch.device) -> Measurement:
    """Rank ``rank`` of the job on ``device`` with a fake process group (the group gives the rank
    its place: its part of the sequence in the method's layout, its documents' cut, its FSDP
    shards, its steps of the ring). With ``attention_math="skip"`` the memory-faithful flash-attn
    stands in where none is installed (as in simulated mode) and every step runs under
    ``SkipAttentionMath`` (``bench.measure.skipmath``)."""
    if trial.step.attention_math != "skip":
        with fake_process_group(trial.world_size, rank) as group:
            return measure_on_device(trial, group, device)
    needs = fake_flash_attn.needs_it(methods.get_info(trial.method).requires)
    skip = SkipAttentionMath()
    with fake_flash_attn.installed(check=needs) as added, fake_process_group(trial.world_size, rank) as group:
        out = measure_on_device(trial, group, device, around_step=skip)
    if not skip.calls:
        raise RuntimeError(f"attention_math='skip': no attention kernel of {trial.method!r} was answered "
                           f"(it calls none that bench.measure.skipmath knows); drop --attention-math skip")
    out.skipped_calls = dict(skip.calls)
    out.flash_attn_simulated = needs and "flash_attn" in added
    return out


def _emulated(trial: Trial) -> Measurement:
    """Each deciding rank (``deciding_ranks``: every rank of the ring family, rank 0 of a method whose
    ranks are symmetric; rank 0 alone under ``$CPAB_SIM_RANKS=0``) measured in turn on this device
    (``emulated_rank``), the device freed between ranks (``release_device``), and the worst of them
    (``worst_of``: emulated rows count allocated bytes, so the largest allocated peak). The row's
    step time is that worst-memory rank's too: a measured rank's compute time is its own. A failed
    rank stops the loop, as in simulation. On CUDA, each rank's reserved peak goes beside the
    allocated ones (``rank_reserved_peaks``), for the comparison with simulated ranks
    (``scripts/gpu/compare.py``)."""
    device = launch.local_device(trial.preset().kind)
    ranks = deciding_ranks(trial)
    by_rank: dict[int, Measurement] = {}
    left: dict[int, int] = {}  # CUDA: bytes still allocated when a rank began (what release_device missed)
    for rank in ranks:
        t0 = time.perf_counter()
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if before:
            left[rank] = before
        by_rank[rank] = r = guarded(emulated_rank, trial, rank, device)
        release_device(device)
        if len(ranks) > 1:  # progress of a long trial, on stderr (the row is the output)
            said = (f"allocated {(r.peak_bytes or 0) / GiB:.2f} GiB" + (
                f", reserved {r.peak_reserved_bytes / GiB:.2f} GiB" if r.peak_reserved_bytes is not None else "")
                + f", compute {r.compute_time_s:.2f} s" if r.status == "ok" else f"{r.status}: {r.message}")
            said += f" ({before} bytes still allocated before it)" if before else ""
            print(f"[emulated] rank {rank} ({len(by_rank)}/{len(ranks)}): {said}; {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
        if r.status != "ok":
            break
    out = worst_of(trial, by_rank)
    if out.rank_peaks and all(r.peak_reserved_bytes is not None for r in by_rank.values()):
        out.rank_reserved_peaks = [[rank, by_rank[rank].peak_reserved_bytes] for rank in sorted(by_rank)]
    if left:
        out.stack_notes = [*(out.stack_notes or []), "emulated: bytes still allocated on the device when a rank "
                           "began (left by the ranks before it; its peaks include them): "
                           + ", ".join(f"rank {rank} {n / GiB:.3f} GiB" for rank, n in left.items())]
    return out


# --------------------------------------------------------------------------- rows


def _worst(values: Iterable[float | None]) -> float | None:
    """The largest of the values measured (None where no rank measured it)."""
    measured = [v for v in values if v is not None]
    return max(measured) if measured else None


def _combine_ranks(results: list[Measurement]) -> Measurement:
    """Real mode: the worst rank decides (first failure; max peak; each step as long as its
    slowest rank's; mean loss). Host load is rank 0's host's; the trial's own threads there
    are those of the ranks on that host. Each rank's attention time (the median of its timed
    steps', ``bench.measure.attntime``) is kept in rank order where every rank timed some."""
    for r in results:
        if r.status != "ok":
            return r
    first = results[0]
    out = dataclasses.replace(first, peak_bytes=_worst(r.peak_bytes for r in results),
                              peak_reserved_bytes=_worst(r.peak_reserved_bytes for r in results),
                              compute_time_s=_worst(r.compute_time_s for r in results))
    if all(r.step_times_s for r in results):
        out.step_times_s = slowest_rank_steps([r.step_times_s for r in results])
        out.compute_time_s = StepStats(tuple(out.step_times_s)).median
    out.own_threads = sum(r.threads or 1 for r in results if r.host == first.host)
    clocks = {r.attention_clock for r in results}
    out.attention_clock = clocks.pop() if len(clocks) == 1 else None
    if all(r.attention_times_s for r in results) and out.attention_clock:  # every rank timed it, on one clock
        out.rank_attention_s = [median_seconds(r.attention_times_s) for r in results]
        out.rank_attention_calls = [[(r.attention_calls or {}).get(d, 0) for d in ("forward", "backward")]
                                    for r in results]
    losses = [r.loss for r in results if r.loss is not None]
    if losses:
        out.loss = sum(losses) / len(losses)
    return out


def _load_figures(f: Figures, result: Measurement) -> list[str]:
    """Host load around the timed steps into ``f``; the notes that say whether the host was shared."""
    load = result.host_load
    if not load:
        return []
    own = result.own_threads or result.threads or 1
    f.host_load_before, f.host_load_after = round(load.before, 2), round(load.after, 2)
    f.host_cpus, f.trial_threads = load.cpus, own
    f.host_shared = host_shared(load.before, load.after, own)
    said = (f"1-min load average {f.host_load_before:.2f} before / {f.host_load_after:.2f} after the timed "
            f"steps, {f.host_cpus} logical CPUs, {own} thread(s) of this trial")
    notes = [f"host shared: {said}: other work ran on the host while the steps were timed" if f.host_shared
             else f"host load: {said} (not above the trial's own)"]
    if own > f.host_cpus:
        notes.append(f"the trial's {own} threads share {f.host_cpus} logical CPUs: its ranks are time-sliced")
    return notes


def _attention_figures(f: Figures, result: Measurement, trial: Trial) -> list[str]:
    """A real row's measured attention time per rank and its imbalance into ``f``; the note that says
    how they were measured, beside the modelled imbalance where the row has documents, or why not."""
    if result.status != "ok":
        return []
    if result.rank_attention_s is None:
        if result.attention_times_s and result.attention_clock is None:  # timed, on clocks _combine_ranks refused
            return [MIXED_CLOCKS]
        return [NOT_ON_CUDA if trial.preset().kind == "cuda" else NONE_SEEN]
    f.rank_attention_s = list(result.rank_attention_s)
    f.attention_imbalance = round(attention_imbalance(f.rank_attention_s), 6)
    f.attention_clock = result.attention_clock
    calls = ", ".join(f"{fwd}+{bwd}" for fwd, bwd in result.rank_attention_calls or [])
    modelled = (f", the modelled one (doc_work.imbalance, counted pairs) {f.doc_work['imbalance']:.3f}"
                if f.doc_work else "")
    return [f"rank_attention_s: each rank's {CLOCK_SAID[f.attention_clock]} in attention kernel calls "
            f"(methods.core.kernels, around each synchronous CPU call; forward, recomputations included, + backward "
            f"calls per step by rank: {calls}), the median over the timed steps (bench.measure.attntime, "
            f"attention_clock {f.attention_clock}); measured imbalance (attention_imbalance, slowest rank over the "
            f"mean) {f.attention_imbalance:.3f}{modelled}"]


def _ranks_said(trial: Trial, result: Measurement) -> str:
    """Which rank a simulated row's figures are, as its notes say it: rank 0 (and why it stands for
    every rank, where the method says so), or the worst of the ranks simulated."""
    if result.rank_peaks:
        ranks = [r for r, _ in result.rank_peaks]
        which = (f"ranks 0-{ranks[-1]}" if ranks == list(range(len(ranks))) else
                 "ranks " + ", ".join(map(str, ranks)))
        return (f"on each of {which}, in turn; the figures are the worst rank's, rank {result.rank} "
                "(figures.worst_rank; each rank's judged peak in figures.rank_peaks)")
    reason = trial.method_cls().rank_symmetric_reason
    rank = result.rank or 0
    return f"on rank {rank}" + (f" alone (its ranks are symmetric: {reason})" if reason and rank == 0 else "")


def _emulated_said(trial: Trial, result: Measurement) -> str:
    """How an emulated row was measured, as its notes say it: which ranks ran, whose figures and step
    time the row carries (the worst-memory rank's)."""
    tail = "step_time = measured compute + modelled communication (no overlap)"
    if not result.rank_peaks:
        return f"emulated with a fake process group on this device, {_ranks_said(trial, result)}; {tail}"
    ranks = [r for r, _ in result.rank_peaks]
    which = f"ranks 0-{ranks[-1]}" if ranks == list(range(len(ranks))) else "ranks " + ", ".join(map(str, ranks))
    reserved = ", each one's reserved peak in figures.rank_reserved_peaks" if result.rank_reserved_peaks else ""
    return (f"emulated on {which} of a fake process group, one at a time on this device (the device freed between "
            f"ranks); the figures are the worst rank's by allocated peak, rank {result.rank} (figures.worst_rank; "
            f"each rank's allocated peak in figures.rank_peaks{reserved}), its step time too: {tail}")


# how the message of an OOM on the host budget alone starts (bench.stackmodel.fidelity reads it)
HOST_OOM = "host memory:"


def budgeted_peak(trial: Trial, f: Figures) -> tuple[bool, int | None]:
    """(judged on the paper stack, the peak judged against the device budget): under the paper
    stack the modelled allocator's reserved peak (never below the allocated one), else the
    allocated peak."""
    paper = trial.mode == "simulated" and stack.reserved(trial.step.stack) and f.peak_reserved_bytes is not None
    return paper, (max(f.peak_reserved_bytes, f.peak_bytes) if paper else f.peak_bytes)


def build_row(trial: Trial, result: Measurement, wall_s: float, device_name: str | None = None) -> Row:
    """The row of ``trial`` from its measurement: the figures, the budget's verdict (``oom`` past the
    usable bytes), the modelled step time of a simulation and the notes that say how each was had."""
    cfg = trial.config()
    preset = trial.preset()
    status = result.status
    message = result.message or ""
    notes: list[str] = []
    f = Figures(peak_bytes=result.peak_bytes, peak_reserved_bytes=result.peak_reserved_bytes,
                peak_by_category=result.peak_by_category, host_peak_bytes=result.host_peak_bytes,
                comm_bytes=result.comm_bytes, comm_bytes_by_op=result.comm_bytes_by_op, loss=result.loss,
                compute_time_s=result.compute_time_s)
    if trial.mode == "emulated" and f.loss is not None and not math.isfinite(f.loss):
        # a fake process group's collectives return their output buffers unwritten, so the
        # values downstream of one are whatever memory held: the loss may not be a number
        notes.append(f"emulated: loss {f.loss} not recorded (collectives of a fake process group "
                     "return unwritten buffers; memory and compute time are still real)")
        f.loss = None
    if result.skipped_calls:
        f.loss = None  # the attention returned zeros: the loss is no measurement
    ranks_here = trial.world_size if preset.kind == "cpu" and trial.mode == "real" else 1
    f.capacity_bytes = preset.capacity(ranks_here)
    accounting = trial.step.stack if trial.mode == "simulated" else "lean"
    nccl = stack.nccl_buffer_bytes(result.step_counts) if stack.reserved(accounting) and preset.kind != "cpu" else 0
    f.usable_bytes = stack.usable_bytes(preset, accounting, ranks_here, nccl=nccl)
    outside = f"{stack.CUDA_CONTEXT_BYTES / GiB:.1f} GiB of CUDA context" + (
        f" and {nccl / GiB:.2f} GiB of NCCL buffers" if nccl else "")
    # ranks the sequence is split over: all of them, or one for a method that splits none (no-cp:
    # every rank processes every token)
    seq_ranks = trial.world_size if methods.get_info(trial.method).cls.splits_sequence else 1
    f.tokens_per_device = trial.step.batch * trial.seq_len // seq_ranks
    f.flops_per_device = flops_per_device(cfg, trial.seq_len, seq_ranks, trial.step.batch, trial.step.scope)
    f.wall_s = round(wall_s, 3)
    f.worst_rank, f.rank_peaks, f.rank_reserved_peaks = result.rank, result.rank_peaks, result.rank_reserved_peaks
    link = trial.link_model()
    work = docwork.trial_work(trial)  # packed documents: each rank's attention work (None: one sequence)
    if work is not None:
        constants, kernel = stack_constants(trial.step.stack)
        f.doc_work = work.to_dict(attention_rate(preset, constants, kernel or attention_kernel(trial.method)))
    if trial.mode == "emulated" and f.compute_time_s is not None:
        f.comm_time_s = sum(link.time(op, b, s) for op, b, s in result.comm_calls) \
            if result.comm_calls is not None else result.comm_time_s
        f.step_time_s = f.compute_time_s + (f.comm_time_s or 0.0)
    elif trial.mode == "simulated":
        f.comm_time_s = result.comm_time_s
        if trial.step.scope == "model":
            counts = result.step_counts
            if work is not None and counts is not None:  # the step waits for the slowest rank's attention
                if result.attention_rank is not None:  # the slowest rank's own, simulated (worst_of)
                    notes.append(docwork.NOTE_OWN.format(rank=result.attention_rank, worst=result.rank))
                else:  # the counts are the rank's simulated (the worst of those simulated): carried over
                    simulated = result.rank or 0
                    counts = slowest_rank_counts(counts, work.pairs[simulated], max(work.pairs))
                    ratio = max(work.pairs) / work.pairs[simulated] if work.pairs[simulated] else float("inf")
                    notes.append(docwork.NOTE.format(rank=work.slowest_rank, simulated=simulated, ratio=ratio))
            for key, value in figures_from_counts(counts, preset, link, f.tokens_per_device,
                                                  trial.method, *stack_constants(trial.step.stack)).items():
                setattr(f, key, value)
    elif trial.mode == "real":
        f.step_time_s = f.compute_time_s
        notes.extend(_attention_figures(f, result, trial))
    if result.step_times_s and f.step_time_s is not None:
        steps = StepStats(tuple(result.step_times_s)).plus(f.comm_time_s if trial.mode == "emulated" else 0.0)
        f.step_times_s = list(steps.times)
        f.step_time_s, f.step_time_min_s, f.step_time_max_s = steps.median, steps.min, steps.max
    notes.extend(_load_figures(f, result))
    if f.step_time_s:
        f.tokens_per_s_per_device = f.tokens_per_device / f.step_time_s  # (simulated: the model's)
        f.tflops_per_device = f.flops_per_device / f.step_time_s / 1e12
    # memory budget: simulation has no OOM to catch, nor does a CPU
    paper, compared = budgeted_peak(trial, f)
    # paper stack: a replay that ran out (even after releasing its cache) is an OOM whatever the
    # peak it reached
    allocator_oom = paper and result.allocator is not None and result.allocator.oom
    if status == "ok" and paper and allocator_oom:
        status = "oom"
        message = (f"the modelled caching allocator ran out of the {f.usable_bytes / GiB:.2f} GiB it may map "
                   f"(capacity less {outside}, {preset.name}): {allocator_oom}")
    if status == "ok" and compared is not None and (trial.mode == "simulated" or preset.kind == "cpu"):
        if compared > f.usable_bytes:
            status = "oom"
            budget = (f"capacity less {outside}" if paper
                      else f"{preset.usable_fraction:.0%} of {f.capacity_bytes / GiB:.2f} GiB")
            message = (f"{'reserved peak' if paper else 'peak'} {compared / GiB:.2f} GiB exceeds the usable "
                       f"{f.usable_bytes / GiB:.2f} GiB ({budget}, {preset.name})")
    if trial.mode == "simulated":
        f.host_usable_bytes = preset.host_usable()
        if status == "ok" and f.host_usable_bytes and (f.host_peak_bytes or 0) > f.host_usable_bytes:
            status = "oom"
            message = (f"{HOST_OOM} offloads of {f.host_peak_bytes / GiB:.2f} GiB per rank exceed the usable "
                       f"{f.host_usable_bytes / GiB:.2f} GiB of host memory per GPU ({preset.name})")
    if trial.step.ac_offload and trial.step.scope == "model" and (
            preset.kind == "cpu" and trial.mode != "simulated"):
        notes.append("ac_offload has no effect on a CPU device (the checkpoints are already in host memory)")
    notes.extend(trial.method_cls().run_notes(trial.options, trial.world_size))
    if trial.mode == "simulated" and trial.method_cls().simulated_cpu_path_reason and preset.kind != "cpu":
        notes.append(trial.method_cls().simulated_cpu_path_reason)
    if trial.mode == "simulated" and trial.step.kernel_workspace != "none":
        notes.append(f"attention backward scratch modelled as {trial.step.kernel_workspace} "
                     "(bench.stackmodel.workspace)")
    if result.flash_attn_simulated:
        notes.append("flash-attn (not installed) simulated by bench.stackmodel.fake_flash_attn: its kernels' outputs "
                     "and backward scratch (mha_bwd) are allocated whatever kernel_workspace says")
    allocator = result.allocator
    if trial.mode == "simulated" and allocator:
        notes.append(
            f"peak_reserved_bytes: the step's {allocator.events} device allocations and frees replayed through "
            f"a model of the CUDA caching allocator ({allocator.model} segments, "
            f"{allocator.pools or 'shared'} pools, bench.stackmodel.allocator; "
            f"its allocated peak {allocator.peak_allocated_bytes / GiB:.2f} GiB, "
            f"{allocator.cache_releases} cache releases, replay {allocator.replay_s:.2f} s)")
        if allocator.reserve_bytes:
            notes.append(f"extrapolated model: the larger simulation's trace replayed again with "
                         f"{allocator.reserve_bytes / GiB:.2f} GiB of the further layers held on the device, "
                         f"{allocator.cache_releases} cache releases (bench.search.extrapolate.under_pressure)")
        if allocator.oom:
            notes.append(f"the modelled allocator ran out of the device's memory (the reserved peak is up to "
                         f"that point; under the lean stack the allocated peak decides the status): {allocator.oom}")
    notes.extend(result.stack_notes or [])
    on_ranks = _ranks_said(trial, result)
    if trial.mode == "simulated" and trial.step.stack == "paper":
        notes.append("simulated, paper stack (bench.stackmodel.stack): FakeTensorMode + fake process group "
                     "+ MemTracker "
                     f"{on_ranks}; the fit compares the modelled allocator's reserved peak with the capacity less "
                     f"{outside}; Liger's loss not modelled")
    elif trial.mode == "simulated" and trial.step.stack == "hf":
        notes.append("simulated, hf stack (bench.stackmodel.hfstack): FakeTensorMode + fake process group + MemTracker "
                     f"{on_ranks}; the fit compares the modelled allocator's reserved peak with the capacity less "
                     f"{outside}; the step time with the measured SDPA flash rate (bench.stackmodel.steptime)")
    elif trial.mode == "simulated":
        unmodelled = "workspaces" if allocator else "workspaces and allocator fragmentation"
        notes.append(f"simulated: FakeTensorMode + fake process group + MemTracker {on_ranks}; CUDA context, "
                     f"NCCL buffers, {unmodelled} not modelled (see usable_bytes)")
    if trial.mode == "emulated":
        notes.append(_emulated_said(trial, result))
    if result.skipped_calls:
        calls = ", ".join(f"{name} x{n}" for name, n in sorted(result.skipped_calls.items()))
        notes.append(f"{SKIP_NOTE} (calls answered over the warm-up and timed steps: {calls})")
    if trial.step.scope == "attention":
        notes.append("scope attention: one attention block forward + backward; levers other than dtype unused")
    if result.threads and trial.mode != "simulated":
        notes.append(f"torch CPU threads per rank: {result.threads}")
    if f.step_times_s:
        notes.append("timed steps (s): " + ", ".join(f"{t:.4f}" for t in f.step_times_s)
                     + f"; step_time_s is their median ({f.step_time_min_s:.4f}-{f.step_time_max_s:.4f})")
        if len(f.step_times_s) < MIN_TIMED_STEPS:
            notes.append(f"smoke run: {len(f.step_times_s)} timed step(s), fewer than {MIN_TIMED_STEPS}: "
                         "the median and range are not a spread to report")
    kernel = trial.kernel_name()
    if device_name is None:
        device_name = result.device_name or (
            f"fake {(result.sim_device or 'cpu').split(':')[0]} tensors on {cpu_name()} (simulating {preset.name})"
            if trial.mode == "simulated" else cpu_name())
    resolution = trial.resolved()
    return Row(**trial.row_fields(), status=status, message=message, figures=f,
               env=environment(kernel, device_name), model_arch=cfg.to_dict(), notes=notes,
               ran=resolution.step.levers(), presets=list(resolution.presets))


def run_trial(trial: Trial) -> Row:
    """Run one trial in its mode, in this process; never raises for a failing trial (the row
    says ``oom`` or ``error``). Invalid trials raise ``ValueError`` (call ``validate`` first)."""
    if trial.auto_chunk is not None:
        raise ValueError("chunk_heads=auto is a request: resolve it first (bench.search.autochunk.run)")
    if trial.kind != "trial":
        raise ValueError("a max_context trial is a search: run it with bench.search.maxctx.search")
    trial.validate()
    t0 = time.perf_counter()
    if trial.mode == "simulated":
        result = guarded(measure_worst_rank, trial)
    elif trial.mode == "emulated":
        result = guarded(_emulated, trial)
    else:
        try:
            backend = "nccl" if trial.preset().kind == "cuda" else "gloo"
            per_rank = launch.run_ranks(trial.world_size, real_rank, trial, backend=backend)
            result = _combine_ranks(per_rank)
        except launch.RankError as err:
            killed = err.exitcode is not None and err.exitcode in (-9, 137)
            result = failed("oom" if killed else "error",
                            ("rank killed by SIGKILL (host out of memory?): " if killed else "")
                            + str(err).strip().splitlines()[0])
    return build_row(trial, result, time.perf_counter() - t0)
