"""``python -m bench steptime``: the step-time model (``bench.stackmodel.steptime``) against Table 3.

    python -m bench steptime                   # fit on FIT_CELLS from the committed counts, print every cell
    python -m bench steptime --collect         # re-simulate the counts (minutes) into --counts
    python -m bench steptime --figs paper_figs # also write table3_model.md/.csv there (on purpose)
    python -m bench steptime --refresh         # after FITTED changed: the counts rows' figures with it

Per-cell records go to ``--out`` (default ``<runs>/steptime/table3_model.jsonl``, ``records.outputs.runs_dir``).

Counts. For every method and model of ``results/paper/table3_throughput.csv`` the paper's
implementation (``bench.stackmodel.fidelity.implementation``) is simulated under the lean stack with the
paper's record levers (FSDP2, AC offloaded to host, tiled MLP/norm, chunked loss; torch-cp
without tiled MLP/norms) and the paper-stack terms that change what runs (``as_paper_runs``)
at ``COUNT_LENGTHS`` (3 lengths), through layer extrapolation
(``bench.search.extrapolate``). The rows go to ``results/fidelity/steptime.jsonl``. FLOPs,
collective bytes and calls, and host bytes are exact functions of the configuration: at a
fixed model, method and ranks every count is ``a + b·S + c·S²`` (attention's S², the rest
linear, call counts constant), so the 3 lengths determine it at any length (``interpolate``;
``CHECK_CELL`` is simulated directly as well and ``tests/bench/stackmodel/test_steptime.py`` compares).
The paper stack's allocator and scratch models do not change them; its ``offload_first_only`` and
``tiled_mlp_deepspeed`` change what runs (more host traffic; DeepSpeed's TiledMLP instead of ours,
the same FLOPs since both recompute each tile in backward, other temporaries), so those are set
(``as_paper_runs``; a test checks the counts equal the paper stack's on a small case).

Known residuals (named, not tuned away; ``paper_figs/table3_model.md`` shows them):

* Fixed, no longer a residual: yunchang 0.6.4's FlashAttention-3 path
  (``yunchang/kernels/attention.py``, ``flash_attn3_func_forward``/``_backward``) calls the
  kernel with ``causal=False`` whatever it is given, so its zigzag ring computed every diagonal
  block unmasked (1/R more attention FLOPs at ring degree R: Ring on 8 GPUs +12.5%, USP 8x2 on
  16 GPUs +50%), which made the modelled Ring (Llama3-8B) and Ulysses (Qwen3-32B, 8x2) slower
  than the paper's and the Qwen3-32B UPipe/Ulysses ratio 1.0-1.5. ``yc-ring``/``yc-usp`` now
  pass the ring's causal flag to FA3 (``methods.core.yc_fa3``), as the authors' vendored
  yunchang did, and the counts of those cells were re-collected with it (their rows say so).
* Fixed, no longer a residual: Ring on two nodes (Qwen3-32B, 1x16) at 128K was modelled 37% faster
  than the paper's (256K: 18%). The ring code the paper ran ends every ring step with a barrier
  (paper stack term 9, ``methods.core.ringsync``: 61 per layer at a ring of 16, 3904 a step), which
  the counts lacked. With the barriers counted and priced at ``barrier_s`` (fitted on the Llama3-8B
  cells, where only Ring has them) that cell is +3.9%, 256K +8.5%.
* UPipe 8x2 (Qwen3-32B) at 128K: modelled 10.5% slower than the paper's, so the UPipe/Ulysses
  ratio there is 0.74 against the paper's 0.886. Its 8 stages each run a two-rank ring across the
  nodes, 40 barriers per layer (2560 a step), each charged the ``barrier_s`` of Ring's eight-rank
  ring. The paper's UPipe step there is 1.93 s longer than its Ulysses step (16.95 s against
  15.02 s); ours has 2240 more barriers and 3840 more all-to-alls (72 all-to-alls per block and
  pass triple, as the authors' ``untied_ulysses/fully_fused_attn.py`` issues: a Q exchange per
  stage, K/V once per KV head, the output per stage; backward also dout, dQ per stage and dK/dV
  per KV head), so in the paper's run a barrier of the two-rank ring cost at most 0.86 ms even
  with free all-to-alls, where the fit gives Ring's eight-rank barrier 1.22 ms. What makes a
  barrier dearer in a larger group is not known: NCCL's own latency for a one-element all-reduce
  is tens of microseconds in either group, far below the difference. Llama3-8B shows the same
  direction without barriers: the paper's UPipe costs 0.12 s more than its Ulysses at 128K for
  896 more all-to-alls (at most 0.14 ms each), the model charges them ``latency_s`` (0.46 ms) each, and
  its ratio there is 0.923 against the paper's 0.983 (from 512K on within 0.026 of the paper's).
* Fixed, no longer a residual: FPDT between 256K and 1M was 24-30% fast. The counts were of 16
  chunks per rank at every length where the paper's runs used chunks of 65,536 tokens (2 per rank
  at 128K, 64 at 4M: the chunk ``methods/fpdt.py`` declares for the paper's FPDT), and the model had no term for
  DeepSpeed FPDT's per-chunk host synchronisation, which the one ``latency_s`` absorbed (0.9 ms a
  call, for every method). With both (``ds_fpdt_chunk_s``, ``bench.stackmodel.steptime``) every FPDT
  cell of both models is within -6%..+3%, from two fitted Llama3-8B cells.
* Native PyTorch on two nodes (Qwen3-32B, 1x16) at 128K and 256K: +46.8% and +22.6%, while 512K
  agrees (-2.0%). The paper's steps are 64.5 s, 146.0 s and 358.6 s, the modelled 43.9 s, 119.1 s
  and 366.0 s: the missing time, 20.6 s, 26.9 s and -7.4 s, is neither constant nor linear nor
  quadratic in the length, so no term of the counted work (FSDP's traffic, constant; the K/V
  all-gathers and dK/dV rotations, linear; attention, quadratic) scales to it. The K/V
  all-gathers (192 a step, 4.3 GB each, the K/V heads repeated to 64 as the paper's code does)
  are on the critical path at one NIC's 50 GB/s already. The authors' TorchTitan config sets
  ``context_parallel_rotate_method = "allgather"`` (``llama3_8b_test_2d.toml``), which the counts
  run. Two known simplifications pull in opposite directions and are left as they are: torch's
  dK/dV rotation (``permute_tensor``: an all-to-all with one peer, fp32) is priced as an even
  all-to-all (half of it over InfiniBand, where rank 0 receives all of it from the other node)
  and as critical, where it overlaps the next block's kernel. Host-bound execution has the
  shape (a cost exposed only while the kernels are shorter than the host's time to issue them,
  hidden at 512K where they are 16 times longer than at 128K), but would need the host to take
  about 21 ms per ring step (64.5 s over 64 blocks x 3 passes x 16 steps), where torch's context
  parallel issues a few kernels per step from Python; so probably not that either.

Fit: ``FITTED``'s five fitted constants (``eff_attention``, ``eff_attention_fa2``, ``latency_s``,
``ds_fpdt_chunk_s``, ``barrier_s``; ``eff_matmul`` is the measured H100 GEMM rate, ``measured_eff_matmul``) minimise
the squared log residual of the modelled tokens/s on the declared ``FIT_CELLS`` (every method at
those lengths, both found in the paper), with ``torch.optim.LBFGS`` over their logarithms from a
fixed start; every other cell is validation.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import methods
from records import append_rows, human, read_rows

from ..measure.config import StepConfig
from ..measure.trial import Trial
from . import stack
from .counts import StepCounts
from .fidelity import PAPER_DIR, TABLE3_METHODS, implementation
from .hardware import get_device, get_link
from .steptime import EFF_MATMUL_MEASURED, FIT_CELLS, FITTED, StepTimeConstants, attention_kernel, step_time

ROOT = Path(__file__).resolve().parents[2]
COUNTS = ROOT / "results" / "fidelity" / "steptime.jsonl"
MAX_CONTEXT_ROWS = ROOT / "results" / "bench" / "simulated.jsonl"  # the paper-stack max-context searches
DEVICE = "h100-80g"
# three lengths per model, all with >= 2 MLP tiles per rank (local tokens > dim): with one tile
# DeepSpeed's TiledMLP runs no backward recompute, so shorter lengths are another regime (not a + b·S)
COUNT_LENGTHS = {"llama3-8b": (65536, 131072, 262144), "qwen3-32b": (131072, 262144, 524288)}
CHECK_CELL = ("llama3-8b", "upipe", 524288)  # simulated directly too: the interpolation's check
SETUPS = {"llama3-8b": 8, "qwen3-32b": 16}
LABEL = "simulated, h100-80g, modelled step time (bench.stackmodel.steptime)"


def as_paper_runs(step: StepConfig, method: str) -> StepConfig:
    """The lean stack with the paper stack's terms that change what executes (not only what is
    accounted): checkpoints of all blocks but the first offloaded (``offload_first_only``: more host
    traffic), DeepSpeed's TiledMLP (``tiled_mlp_deepspeed``: the same FLOPs as ours, both recompute
    each tile's forward in backward, but its own elementwise work) and TorchTitan's RoPE table
    (``rope_table``: offloaded with every offloaded block's input, more host traffic) and the paper's
    ring code's barrier after every ring step (``ring_step_barrier``: more collective calls). The allocator
    and scratch models change memory only, not the counts (``tests/bench/stackmodel/test_steptime.py`` checks
    this equals the paper stack's counts)."""
    paper, _ = stack.apply(dataclasses.replace(step, stack="paper"), method)
    return dataclasses.replace(step, offload_keep=paper.offload_keep, tiled_mlp_impl=paper.tiled_mlp_impl,
                               rope_table=paper.rope_table, ring_barrier=paper.ring_barrier)


def trial(model: str, method: str, seq_len: int) -> Trial:
    impl = implementation(method, SETUPS[model])
    step = as_paper_runs(StepConfig(stack="lean", **impl.levers), impl.method)
    return Trial.make(impl.method, model, seq_len, SETUPS[model], dict(impl.options), mode="simulated",
                      device=DEVICE, step=step)


def collect(out: Path, models: tuple[str, ...] = tuple(SETUPS), methods: tuple[str, ...] = TABLE3_METHODS,
            lengths: tuple[int, ...] | None = None, check: bool = True, progress=sys.stderr) -> list:
    """Simulate the counts (layer-extrapolated, lean stack) and append the rows to ``out``
    (``lengths``: default each model's ``COUNT_LENGTHS``)."""
    from ..search.extrapolate import layer_extrapolated_runner

    todo = [(m, meth, s) for m in models for meth in methods for s in (lengths or COUNT_LENGTHS[m])]
    if check and CHECK_CELL[0] in models and CHECK_CELL[1] in methods:
        todo.append(CHECK_CELL)
    todo = list(dict.fromkeys(todo))
    done = set(load_counts(out)) if Path(out).exists() else set()
    todo = [t for t in todo if t not in done]  # a rerun completes what is missing
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-steptime-") as work:
        run = layer_extrapolated_runner(work)
        for m, meth, s in todo:
            row = run(trial(m, meth, s))
            row.notes.append(f"steptime counts for the paper's {meth!r} ({implementation(meth, SETUPS[m]).describe()})")
            print(f"  {m} {meth} {human(s)}: {row.status} {row.figures.wall_s:.0f}s", file=progress, flush=True)
            append_rows(out, [row])
            rows.append(row)
    return rows


def refresh_rows(path: Path, constants: StepTimeConstants = FITTED) -> int:
    """Recompute the step-time figures of the counts rows at ``path`` from their counts with
    ``constants`` (after a refit changed ``FITTED``): nothing is simulated again. Returns the rows rewritten."""
    from records import validate_row

    from .steptime import figures_from_counts

    rows = list(read_rows(path))
    for r in rows:
        model = r.figures.step_time_model
        if not model:
            continue
        dev = get_device(r.device)
        figs = figures_from_counts(StepCounts.from_flat(model["counts"]), dev,
                                   get_link((r.link or {}).get("name") or dev.link),
                                   r.figures.tokens_per_device, r.method, constants)
        for key, value in figs.items():
            setattr(r.figures, key, value)
        if r.figures.step_time_s and r.figures.flops_per_device:
            r.figures.tflops_per_device = r.figures.flops_per_device / r.figures.step_time_s / 1e12
    text = "".join(json.dumps(validate_row(r).to_dict(), allow_nan=False) + "\n" for r in rows)
    Path(path).write_text(text)
    return len(rows)


def paper_method(row) -> str | None:
    """The Table 3 column a counts row stands for (its note, written by ``collect``)."""
    for note in row.notes:
        found = re.match(r"steptime counts for the paper's '([^']+)'", note)
        if found:
            return found.group(1)
    return None


def load_counts(path: Path = COUNTS) -> dict[tuple[str, str, int], StepCounts]:
    """(model, paper method, seq_len) -> counts, from the committed rows."""
    out = {}
    for r in read_rows(path):
        meth = paper_method(r)
        model = r.model
        if meth and r.status in ("ok", "oom") and r.figures.step_time_model:  # oom: the counts are still whole
            out[(model, meth, r.seq_len)] = StepCounts.from_flat(r.figures.step_time_model["counts"])
    return out


def interpolate(points: dict[int, StepCounts], seq_len: int) -> StepCounts:
    """Counts at ``seq_len`` from three lengths: the quadratic through them, figure by figure."""
    xs = sorted(points)
    if len(xs) != 3:
        raise ValueError(f"need counts at exactly 3 lengths to interpolate, got {xs}")

    def quadratic(*ys: float) -> float:
        val = 0.0
        for i, xi in enumerate(xs):  # Lagrange basis
            w = 1.0
            for j, xj in enumerate(xs):
                if j != i:
                    w *= (seq_len - xj) / (xi - xj)
            val += w * ys[i]
        return max(0.0, val)

    return StepCounts.combine([points[x] for x in xs], quadratic)


def paper_cells(paper_dir: Path = PAPER_DIR) -> list[dict[str, Any]]:
    with open(Path(paper_dir) / "table3_throughput.csv", newline="") as handle:
        return [r for r in csv.DictReader(handle) if r["status"] in ("ok", "oom")]


def counts_for(all_counts, model: str, method: str, seq_len: int) -> StepCounts:
    """The counts at ``seq_len``: always the quadratic through the model's ``COUNT_LENGTHS`` (exact
    there; the direct ``CHECK_CELL`` simulation is for the test only)."""
    return interpolate({s: all_counts[(model, method, s)] for s in COUNT_LENGTHS[model]}, seq_len)


def is_ds_fpdt(method: str) -> bool:
    """Whether the paper's ``method`` (a Table 3 column) ran DeepSpeed's FPDT, so its cells pay the
    per-chunk synchronisation: the paper's code for the column is DeepSpeed's (``MethodFacts``:
    ``paper_code`` with ``library`` DeepSpeed; the one such column is FPDT, ``ds-fpdt``)."""
    return any(info.facts.paper_code and info.facts.column == method and info.facts.library == "DeepSpeed"
               for info in methods.all_infos())


def kernel_of(model: str, method: str) -> str:
    return attention_kernel(implementation(method, SETUPS[model]).method)


def modelled_tps(counts: StepCounts, model: str, method: str, seq_len: int,
                 constants: StepTimeConstants) -> tuple[float, dict]:
    """Tokens/s per GPU of the paper's ``method``; its FPDT is DeepSpeed's, with the per-chunk synchronisation."""
    gpus = SETUPS[model]
    dev = get_device(DEVICE)
    res = step_time(counts, dev, get_link(dev.link), constants, kernel_of(model, method),
                    ds_fpdt_sync=is_ds_fpdt(method))
    return seq_len / gpus / res["step_time_s"], res


FIT_START = StepTimeConstants(EFF_MATMUL_MEASURED, 0.5, 0.5, 2e-5, 0.01, 1e-4)  # where the least squares starts


def fit(cells: list[dict[str, Any]], all_counts,
        start: StepTimeConstants = FIT_START,
        iters: int = 200) -> StepTimeConstants:
    """Least squares on log(tokens/s) over ``cells`` (torch LBFGS over the fitted constants' logs);
    ``eff_matmul`` stays at ``start``'s (measured, ``EFF_MATMUL_MEASURED``)."""
    import torch

    data = [(counts_for(all_counts, c["model"], c["method"], int(c["seq_len"])), c["model"], int(c["seq_len"]),
             float(c["tokens_per_s_per_gpu"]), kernel_of(c["model"], c["method"]), is_ds_fpdt(c["method"]))
            for c in cells]
    logs = torch.tensor([math.log(start.eff_attention), math.log(start.eff_attention_fa2), math.log(start.latency_s),
                         math.log(start.ds_fpdt_chunk_s), math.log(start.barrier_s)], dtype=torch.float64,
                        requires_grad=True)
    dev = get_device(DEVICE)
    link = get_link(dev.link)

    def loss():
        opt.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        e = logs.exp()
        for counts, model, s, paper, kernel, ds_fpdt in data:
            consts = _TensorConstants(start.eff_matmul, e[0] if kernel == "fa3" else e[1], e[2], e[3], e[4])
            t = _step_time_t(counts, dev, link, consts, ds_fpdt)
            total = total + (torch.log(s / SETUPS[model] / t) - math.log(paper)) ** 2
        total.backward()
        return total

    opt = torch.optim.LBFGS([logs], lr=0.5, max_iter=iters, tolerance_grad=1e-12, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")
    opt.step(loss)
    e = logs.detach().exp().tolist()
    return StepTimeConstants(start.eff_matmul, min(1.0, e[0]), min(1.0, e[1]), e[2], e[3], e[4])


def measured_eff_matmul(path: Path = ROOT / "results" / "gpu" / "h100-ws1" / "kernels.ndjson") -> float:
    """The FLOP-weighted bf16 GEMM rate of the real H100 rows at ``path``, as a fraction of the h100-80g
    preset's peak (what ``EFF_MATMUL_MEASURED`` holds)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    gemms = [r for r in rows if r.get("kind") == "matmul"]
    flops = sum(2 * r["m"] * r["k"] * r["n"] for r in gemms)
    seconds = sum(r["median_ms"] for r in gemms) / 1e3
    return flops / seconds / get_device(DEVICE).peak_bf16_flops


def measured_eff_sdpa_flash(path: Path = ROOT / "results" / "gpu" / "h100-ws1" / "kernels.ndjson") -> float:
    """The FLOP-weighted forward + backward rate of torch's SDPA flash kernel in the real H100 rows at
    ``path``, as a fraction of the h100-80g preset's peak (what ``EFF_SDPA_FLASH_MEASURED`` holds)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    passes = [r[p] for r in rows if r.get("kind") == "attention" for p in ("fwd", "bwd")]
    flops = sum(p["tflops"] * 1e12 * p["median_ms"] / 1e3 for p in passes)
    seconds = sum(p["median_ms"] for p in passes) / 1e3
    return flops / seconds / get_device(DEVICE).peak_bf16_flops


@dataclasses.dataclass
class _TensorConstants:  # StepTimeConstants' fields as tensors, for the fit's gradients
    eff_matmul: Any
    eff_attention: Any  # the kernel's: FA3's or FA2's
    latency_s: Any
    ds_fpdt_chunk_s: Any
    barrier_s: Any


def _step_time_t(counts: StepCounts, dev, link, consts, ds_fpdt: bool = False):
    """``step_time``'s total with tensor constants (the same formula, differentiable)."""
    import torch

    from .steptime import HOST_LINK_Bps, _comm_terms, ds_fpdt_sync_seconds, memory_bound_seconds

    peak = dev.peak_bf16_flops
    mm = (counts.flops_matmul + counts.flops_other) / (consts.eff_matmul * peak)
    attn = counts.flops_attention / (consts.eff_attention * peak)
    compute = mm + attn + memory_bound_seconds(counts, dev)
    bw = _comm_terms(counts, link, 0.0, 0.0)
    critical = (bw["critical_s"] + consts.latency_s * (bw["critical_calls"] - bw["barrier_calls"])
                + consts.barrier_s * bw["barrier_calls"])
    overlapped = bw["overlapped_s"] + consts.latency_s * bw["overlapped_calls"]
    offload = counts.host_bytes("offload") / HOST_LINK_Bps
    method = counts.host_bytes("method") / HOST_LINK_Bps
    sync = ds_fpdt_sync_seconds(counts, consts) if ds_fpdt else 0.0
    zero = torch.zeros((), dtype=torch.float64)
    return (compute + critical + torch.maximum(zero, overlapped - compute) + offload
            + torch.maximum(zero, method - attn) + sync)


def is_fit_cell(model: str, seq_len: int) -> bool:
    return (model, seq_len) in FIT_CELLS


def table(all_counts, constants: StepTimeConstants, oom: dict | None = None) -> list[dict[str, Any]]:
    """One record per Table 3 cell (and per modelled length of every method)."""
    out = []
    oom = oom or {}
    for c in paper_cells():
        model, meth, s = c["model"], c["method"], int(c["seq_len"])
        tps, res = modelled_tps(counts_for(all_counts, model, meth, s), model, meth, s, constants)
        paper = float(c["tokens_per_s_per_gpu"]) if c["status"] == "ok" else None
        limit = oom.get((model, meth))
        out.append({"model": model, "gpus": SETUPS[model], "method": meth, "seq_len": s,
                    "paper_status": c["status"], "paper_tps": paper, "model_tps": tps,
                    "model_status": "oom" if limit is not None and s > limit else "ok",
                    "residual": (tps / paper - 1) if paper else None,
                    "fit": is_fit_cell(model, s) and paper is not None,
                    "terms": res["terms"], "impl": implementation(meth, SETUPS[model]).describe()})
    return out


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    val = sorted(abs(r["residual"]) for r in records if r["residual"] is not None and not r["fit"])
    median = val[len(val) // 2] if len(val) % 2 else (val[len(val) // 2 - 1] + val[len(val) // 2]) / 2
    tps = {(r["model"], r["method"], r["seq_len"]): r["model_tps"] for r in records}
    ratio = {(m, s): tps[(m, "upipe", s)] / tps[(m, "ulysses", s)]
             for (m, meth, s) in tps if meth == "upipe" and (m, "ulysses", s) in tps}
    paper = {(r["model"], r["method"], r["seq_len"]): r["paper_tps"] for r in records if r["paper_tps"]}
    paper_ratio = {(m, s): paper[(m, "upipe", s)] / paper[(m, "ulysses", s)]
                   for (m, meth, s) in paper if meth == "upipe" and (m, "ulysses", s) in paper}
    return {"validation_cells": len(val), "median_abs_residual": median, "max_abs_residual": val[-1],
            "upipe_over_ulysses": ratio, "paper_upipe_over_ulysses": paper_ratio}


# the step-time model's targets (what the reader is promised): the validation cells' residuals, the UPipe/Ulysses
# ratio's course with length, FPDT's slowdown at the shortest length
MEDIAN_TARGET, MAX_TARGET = 0.10, 0.25
RATIO_BAND = {"llama3-8b": (524288, 0.97, 1.03)}  # from this length on the modelled ratio stays in the band
RATIO_TOLERANCE = 0.03  # qwen3-32b: the modelled ratio within this of the paper's at every length both have
FPDT_SLOWDOWN_TOLERANCE = 0.15  # fpdt/ulysses at the shortest length, relative to the paper's


def targets(records: list[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(target, what the model gives, met) for each target of the step-time model, judged on ``records``
    (``table``): reported as they come out, met or not."""
    s = summary(records)
    out: list[tuple[str, str, bool]] = []
    out.append((f"median |residual| of the validation cells <= {MEDIAN_TARGET:.0%}",
                f"{s['median_abs_residual']:.1%}", s["median_abs_residual"] <= MEDIAN_TARGET))
    over = [r for r in records if r["residual"] is not None and not r["fit"] and abs(r["residual"]) > MAX_TARGET]
    out.append((f"no validation cell above {MAX_TARGET:.0%}",
                "none" if not over else ", ".join(f"{r['model']} {r['method']} {human(r['seq_len'])} "
                                                  f"{r['residual']:+.1%}" for r in over), not over))
    for model, (past, lo, hi) in RATIO_BAND.items():
        vals = {k: v for (m, k), v in s["upipe_over_ulysses"].items() if m == model and k >= past}
        ok = all(lo <= v <= hi for v in vals.values())
        out.append((f"{model} modelled UPipe/Ulysses within {lo}-{hi} from {human(past)} on",
                    ", ".join(f"{human(k)} {v:.3f}" for k, v in sorted(vals.items())), ok))
    paper_ratio = s["paper_upipe_over_ulysses"]
    for model in sorted({m for m, _ in paper_ratio} - set(RATIO_BAND)):
        pairs = sorted((k, s["upipe_over_ulysses"][(m, k)], v) for (m, k), v in paper_ratio.items()
                       if m == model and (m, k) in s["upipe_over_ulysses"])
        ok = all(abs(mod - pap) <= RATIO_TOLERANCE for _, mod, pap in pairs)
        out.append((f"{model} modelled UPipe/Ulysses within {RATIO_TOLERANCE} of the paper's at every length",
                    ", ".join(f"{human(k)} {mod:.3f} (paper {pap:.3f})" for k, mod, pap in pairs), ok))
    tps = {(r["model"], r["method"], r["seq_len"]): (r["model_tps"], r["paper_tps"]) for r in records}
    for model in sorted({r["model"] for r in records}):
        lengths = sorted(k for (m, meth, k), (_, pap) in tps.items() if m == model and meth == "fpdt" and pap)
        if not lengths or (model, "ulysses", lengths[0]) not in tps:
            continue
        k = lengths[0]
        (f_mod, f_pap), (u_mod, u_pap) = tps[(model, "fpdt", k)], tps[(model, "ulysses", k)]
        if not u_pap:
            continue
        rel = (f_mod / u_mod) / (f_pap / u_pap) - 1
        out.append((f"{model} FPDT/Ulysses at {human(k)} within {FPDT_SLOWDOWN_TOLERANCE:.0%} of the paper's",
                    f"{f_mod / u_mod:.3f} (paper {f_pap / u_pap:.3f}, {rel:+.1%})",
                    abs(rel) <= FPDT_SLOWDOWN_TOLERANCE))
    return out


def max_context_limits(path: Path = MAX_CONTEXT_ROWS) -> dict:
    """(model, paper method) -> longest fitting length, from the paper-stack max_context rows."""
    out: dict = {}
    if not path.exists():
        return out
    for r in read_rows(path, on_error="skip"):
        if r.kind != "max_context" or r.mode != "simulated" or r.device != DEVICE or r.status != "ok":
            continue
        if (r.levers or {}).get("stack") != "paper":
            continue
        for meth in TABLE3_METHODS:
            for model, gpus in SETUPS.items():
                impl = implementation(meth, gpus)
                if r.model == model and r.world_size == gpus and r.method == impl.method and all(
                        (r.options or {}).get(k) == v for k, v in impl.options.items()):
                    out[(model, meth)] = max(out.get((model, meth), 0), r.figures.max_context or 0)
    return out


def model_table3(all_counts, fit_now: bool = True, max_context_rows: Path = MAX_CONTEXT_ROWS,
                 ) -> tuple[list[dict[str, Any]], StepTimeConstants]:
    """Every Table 3 cell modelled (``table``) with the constants fitted now on ``FIT_CELLS`` (``fit``)
    or, without ``fit_now``, with ``FITTED``; lengths past the paper-stack max-context rows
    (``max_context_rows``, ``max_context_limits``) marked ``oom``."""
    cells = [c for c in paper_cells() if c["status"] == "ok" and is_fit_cell(c["model"], int(c["seq_len"]))]
    constants = fit(cells, all_counts) if fit_now else FITTED
    return table(all_counts, constants, max_context_limits(max_context_rows)), constants
