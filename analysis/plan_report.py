"""The planner's report: ``bench.search.plan``'s result as text, ``plan_<model>_<gpus>x<device>.md`` and a figure.

``python -m bench plan`` searches every configuration's max context and models its step time;
this module renders the result (``render``: the table it prints) and writes the Markdown and
the bar chart (``write_plan``; the chart: ``analysis.plan_figure``). ``python -m analysis figs
--plans`` re-renders the committed plans from the committed simulation cache through the same
code (``analysis.derived``), so ``paper_figs/plan_*`` have one writer.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import methods
from bench.search.plan import MAX_COST
from bench.stackmodel import hfstack
from bench.stackmodel.counts import COUNTS_VERSION
from bench.stackmodel.steptime import constants_of, counts_version, stack_constants
from records import GiB, human

from .plan_figure import draw_plan


def tokens_per_s_per_gpu(e, seq_len: int) -> float | None:
    """The entry's tokens per second per GPU at ``seq_len`` (its step time there), as a row's
    ``tokens_per_s_per_device``: every rank holds ``seq_len / C`` tokens (all of them for a method
    that splits no sequence)."""
    if not e.step_time_s or not seq_len:
        return None
    ranks = e.trial.world_size if methods.get_info(e.method).cls.splits_sequence else 1
    return seq_len // ranks / e.step_time_s


def ranks_said(choice: str) -> str:
    """The header's words for the ranks simulated (``$CPAB_SIM_RANKS``: ``deciding``, or one rank's number)."""
    if choice == "deciding":
        return ("the worst deciding rank's peak: every rank of a method whose ranks differ, one per ring position "
                "on USP's mesh, rank 0 of a symmetric one")
    return f"rank {choice}'s peak alone, $CPAB_SIM_RANKS={choice}: a ring's other ranks may hold more"


def docs_line(res: dict[str, Any]) -> str:
    """The header line of a plan under documents: what they are and how the columns they add were had."""
    return (f"documents: {res['docs'].label} (records.workloads), each probed length packed with its own draw; "
            f"step time with the slowest rank's attention, carried to {human(res['common']) if res['common'] else '-'} "
            f"by the ranks' counted (query, key) pairs there (bench.stackmodel.docwork), varlen calls at their "
            f"measured rate (bench.stackmodel.varlenrate); tok/s/GPU = {human(res['common']) if res['common'] else '-'}"
            f" / GPUs / step s; imbal = the slowest rank's attention work / the mean at that length")


HF_SETUP = ("hf stack (bench.stackmodel.hfstack): the methods the Hugging Face stack runs, each with that stack's "
            "levers only: ALST's recipe (ArcticTraining run-h100-sp*-llama-8b.yml: ZeRO-3 with the optimizer on the "
            "host, every layer's checkpoint on the host, TiledMLP, Liger's loss, FA2) for Accelerate's sp_size path "
            "(ds-ulysses-hf, and upipe with UPipe's attention in ALST's place), Accelerate's cp_size example (FSDP2, "
            "checkpoints on the device, TRL's chunked loss, cuDNN SDPA) for torch-cp; bf16, batch 1")


def render(res: dict[str, Any], wall_times: bool = True) -> str:
    """The plan as the table ``python -m bench plan`` prints (and its Markdown holds); with documents
    (``res["docs"]``) a line saying what they are and the tok/s/GPU and imbalance columns.
    ``wall_times`` off: no wall seconds (the plan's and each search's), so that a rendering from the
    cache is the same every time."""
    docs = res.get("docs") is not None
    hf = res["stack"] == hfstack.NAME
    counted = [e.step_counts for e in res["entries"] if getattr(e, "step_counts", None)]
    version = min((counts_version(c) for c in counted), default=COUNTS_VERSION)  # the cache may mix; say the oldest
    consts = stack_constants(hfstack.NAME, version)[0] if hf else constants_of(version)
    baseline_of = res.get("baseline_of", "UPipe's paper setup")
    lines = [
        f"plan: {res['model']} on {res['gpus']} x {res['device']} ({res['nodes']} node(s)), "
        f"{res['usable_gib']:.1f} GiB usable per GPU"
        + (" less each configuration's NCCL buffers" if res["stack"] in ("paper", "hf") else "")
        + f"{res['host_note']}; "
        + (HF_SETUP if hf else
           f"{res['stack']} stack (bench.stackmodel.stack"
           + (f"; allocator: {'a pool per stream' if res.get('pools') == 'per-stream' else 'one shared pool'}"
              if res["stack"] == "paper" else "")
           + "); paper record setup (FSDP2, AC offloaded to host, "
           "tiled MLP/norm, chunked loss, bf16, batch 1) unless a row adds levers (+...)"),
        f"max context: simulated ({ranks_said(res['sim_ranks'])}, FakeTensorMode), "
        f"exact to {human(res['granularity'])}, "
        f"search limit {human(res['max_seq_len'])}"
        + (f"; layer extrapolation from 3- and 4-layer simulations to {res['layers']} layers"
           + ("" if hf else "; two-level checkpoints (2-level AC) by group extrapolation or whole, as the row says")
           if res["layers"] > 4 else ""),
        f"step time at the common length {human(res['common']) if res['common'] else '-'} "
        f"(longest that every method fits); source per row: measured = results/ real rows, "
        f"model = bench.stackmodel.steptime on counts of v{version} (counted FLOPs at eff {consts.eff_matmul:.2f} "
        f"matmul / {consts.eff_attention:.2f} attention"
        + (" (the hf stack's FA2 rate, bench.stackmodel.steptime.stack_constants)" if hf else "")
        + f", collectives through the link model with {consts.latency_s * 1e6:.0f} us per call"
        + ("" if hf else f" ({consts.barrier_s * 1e6:.0f} us per ring-step barrier of the paper's ring code)")
        + ", host copies over PCIe 5 x16"
        + (", memory-bound kernels at the HBM bandwidth)" if version >= 3 else
           "; counts made before v3: the constants fitted on such counts, bench.stackmodel.steptime.FITTED_V2)"),
        *([docs_line(res)] if docs else []),
        "",
        f"simulations: {res['cache']}; rel = step time / {res['baseline'].label if res['baseline'] else '-'}'s "
        f"({baseline_of}); P = on the Pareto front of max context vs step time",
        "",
        f"{'configuration':44} {'max ctx':>8} {'peak GiB':>9} {'host GiB':>9} {'step s':>8} {'rel':>6} "
        + (f"{'tok/s/GPU':>9} {'imbal':>6} " if docs else "") + f"{'source':8} note",
    ]
    fastest = res["baseline"] or res["fastest_common"]
    front = {id(e) for e in res["pareto"]}
    for e in res["entries"]:
        if e.skipped:
            lines.append(f"{e.label:44} {'-':>8} {'-':>9} {'-':>9} {'-':>8} {'-':>6} "
                         + (f"{'-':>9} {'-':>6} " if docs else "") + f"{'':8} skipped: {e.skipped}")
            continue
        limit = ">=" if e.max_context >= res["max_seq_len"] - res["granularity"] + 1 and e.max_context else ""
        rel = e.step_time_s / fastest.step_time_s if fastest and e.step_time_s else None
        note = []
        if e.resolved_u is not None:
            note.append(f"auto -> U={e.resolved_u} at {human(res['common'])}")
        if e.error:
            note.append(f"error: {e.error}")
        if e.extra.get("sims") and not e.auto:
            note.append(e.extra["sims"])
        if e.extra.get("rank") and not e.auto:
            note.append(e.extra["rank"])
        if e.points and not e.auto:
            note.append(f"{e.points} sims, {e.seconds:.0f}s" if wall_times else f"{e.points} sims")
        if rel and rel > MAX_COST:
            setup = "the paper setup's" if baseline_of == "UPipe's paper setup" else f"{baseline_of}'s"
            note.append(f"over {MAX_COST:g}x {setup} step time: reported, not recommended")
        peak = f"{e.peak_bytes / GiB:9.2f}" if e.peak_bytes is not None else f"{'-':>9}"
        host = f"{e.host_peak_bytes / GiB:9.2f}" if e.host_peak_bytes is not None else f"{'-':>9}"
        label = ("P " if id(e) in front else "  ") + e.label
        workload = ""
        if docs:
            tps = tokens_per_s_per_gpu(e, res["common"])
            imbalance = e.work.imbalance if getattr(e, "work", None) is not None else None
            workload = (f"{(f'{tps:9.0f}' if tps else f'{chr(45):>9}')} "
                        f"{(f'{imbalance:6.3f}' if imbalance else f'{chr(45):>6}')} ")
        lines.append(
            f"{label:44} {limit + (human(e.max_context) if e.max_context else '0'):>8} {peak} {host} "
            f"{(f'{e.step_time_s:8.2f}' if e.step_time_s else f'{chr(45):>8}')} "
            f"{(f'{rel:6.2f}' if rel else f'{chr(45):>6}')} {workload}{e.time_source:8} {'; '.join(note)}")
    fl = res["fastest_longest"]
    if fl is None:
        lines.append("recommendation: nothing fits (even one step of the search)")
    else:
        fits = [e.label for e in res["entries"] if not e.skipped and e.max_context == res["longest"]]
        lines.append("")
        lines.append(
            f"longest context: {human(res['longest'])} with {', '.join(fits)}; "
            f"fastest at that length: {fl.label} (model); fastest at {human(res['common'])}: "
            f"{res['fastest_common'].label} ({res['fastest_common'].time_source})")
        pick, base = res["pick"], res["baseline"]
        if pick is not None:
            cost = (f", {pick.step_time_s / base.step_time_s:.2f}x the step time of {baseline_of} "
                    f"({base.label}, {human(base.max_context)}) at {human(res['common'])}"
                    if base is not None and base.step_time_s else "")
            lines.append(f"recommendation: {pick.label}: {human(pick.max_context)} tokens{cost}; "
                         f"configurations over {MAX_COST:g}x are not recommended")
    if wall_times:
        lines.append(f"[plan took {res['seconds']:.1f}s]")
    return "\n".join(lines)


def write_plan(res: dict[str, Any], out_dir: Path, wall_times: bool = True) -> list[str]:
    """The plan as ``plan_<model>_<gpus>x<device>.md`` and its figure (drawn by ``analysis``); a plan
    under documents adds ``_docs-<distribution>-<seed>`` to the name and its documents to the title, one
    under the hf stack ``_stack-hf`` and the stack. ``wall_times``: as ``render``'s."""
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = res.get("docs")
    hf = res["stack"] == hfstack.NAME
    stem = f"plan_{res['model'].replace('/', '_')}_{res['gpus']}x{res['device']}" + (
        f"_docs-{docs.label.replace(':', '-')}" if docs is not None else "") + ("_stack-hf" if hf else "")
    title = f"{res['model']} on {res['gpus']} x {res['device']}" + (
        f", documents {docs.label}" if docs is not None else "") + (", hf stack" if hf else "")
    md = out_dir / f"{stem}.md"
    stack = ("The hf stack's levers are ALST's recipe and Accelerate's cp_size example, as "
             "[bench/stackmodel/hfstack.py](../bench/stackmodel/hfstack.py) sets them.\n\n" if hf else "")
    md.write_text(f"# Plan: {title}\n\n"
                  f"Generated by `python -m bench plan` (bench/search/plan.py).\n\n{stack}```\n"
                  f"{render(res, wall_times)}\n```\n")
    png = out_dir / f"{stem}.png"
    shown = [(e.label, e.max_context) for e in res["entries"] if not e.skipped]
    draw_plan(shown, f"{title}: max context per method", png)
    return [str(md), str(png)]
