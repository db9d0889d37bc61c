"""Real-GPU rows beside their simulation: ``compare.md`` and ``segments.md`` of a ``results/gpu/`` folder.

``scripts/gpu/compare.py`` simulates the real rows' trials (or, with ``--from-rows``, reads the
simulated rows it wrote); this module renders both side by side (``compare_markdown``: memory,
step time against the step-time model, kernel rates) and the real allocator's segments per
stream (``segments_markdown``), and writes them (``write_gpu_report``), so the tables of
``results/gpu/`` have the same writer as ``paper_figs/``.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from bench.stackmodel.counts import StepCounts
from bench.stackmodel.hardware import get_device, get_link
from bench.stackmodel.steptime import FITTED, STEPTIME_VERSION, constants_for, step_time

GiB = 2**30


def trial_key(row: dict) -> tuple:
    key = row["method"], row["seq_len"], row["world_size"], tuple(opt_args(row)), model_arg(row), \
        tuple(lever_args(row))
    docs = tuple(docs_args(row))
    return (*key, docs) if docs else key


def opt_args(row: dict) -> list[str]:
    """The real run's ``--opt`` arguments, to pass on to its simulation."""
    argv, out = row["env"]["argv"], []
    for i, a in enumerate(argv[:-1]):
        if a == "--opt":
            out += ["--opt", argv[i + 1]]
    return out


def docs_args(row: dict) -> list[str]:
    """The real run's packed documents (``--docs NAME[:SEED]`` or ``--docs-lengths``), to pass on to its
    simulation; empty for one sequence."""
    argv, out = row["env"]["argv"], []
    for i, a in enumerate(argv[:-1]):
        if a in ("--docs", "--docs-lengths"):
            out += [a, argv[i + 1]]
    return out


def model_arg(row: dict) -> str:
    """The real run's ``--model`` argument (a name or a config file)."""
    argv = row["env"]["argv"]
    return argv[argv.index("--model") + 1]


# levers a real row may set away from the CLI's defaults, and how to pass them on to its simulation
LEVER_ARGS = {"offload_keep": ("--offload-keep", "first_last"), "rope_table": ("--rope-table", "auto"),
              "ring_barrier": ("--ring-barrier", False)}


def lever_args(row: dict) -> list[str]:
    """The real run's levers (those of ``LEVER_ARGS`` away from their defaults) as arguments."""
    out = []
    for name, (flag, default) in LEVER_ARGS.items():
        value = row["levers"].get(name, default)
        if value != default:
            out += [flag] if value is True else [flag, str(value)]
    return out


def skipped(row: dict) -> bool:
    """Whether the emulated row skipped the attention arithmetic (bench.measure.skipmath)."""
    return row["levers"].get("attention_math") == "skip"


def modelled_step_s(sim: dict, compute_only: bool = False, attention: bool = True) -> float:
    """The modelled step on the simulation's counts with the kernel that ran (FA2); its compute
    part alone for an emulated row, whose collectives took no time; without the attention
    kernels for a row that skipped their arithmetic."""
    counts = StepCounts.from_flat(sim["figures"]["step_time_model"]["counts"])
    device = get_device(sim["device"])
    model = step_time(counts, device, get_link(device.link), constants_for(counts), "fa2")  # those of its version
    seconds = model["compute_time_s" if compute_only else "step_time_s"]
    return seconds if attention else seconds - model["terms"]["compute_attention_s"]


def pct(ours: float, real: float) -> str:
    return f"{100 * (ours - real) / real:+.1f}%"


def worst_gap(values: dict[int, int]) -> str:
    """The worst rank of ``values`` (bytes by rank, rank 0 among them; a tie to the lowest rank) and
    how much more it holds than rank 0."""
    top = max(values, key=lambda r: (values[r], -r))
    return f"rank {top} +{(values[top] - values[0]) / GiB:.2f} GiB"


def ranks_markdown(by_trial: dict[tuple, list[dict]], rank_sims: dict[tuple, dict[int, dict[str, dict]]],
                   pools: list[str]) -> list[str]:
    """The section of ``compare.md`` for real rows that measured several ranks (an emulated row's
    ``rank_peaks`` and ``rank_reserved_peaks``): each rank's real allocated and reserved peaks beside
    that rank simulated alone (``rank_sims``: by trial, rank and pools), and per trial how much more
    the worst rank holds than rank 0, real and simulated."""
    lines = ["", "## Each rank", "",
             "Emulated rows that measured every deciding rank (`bench.measure.run._emulated`: each rank in turn on "
             "the GPU with its own fake process-group rank, the device freed between ranks): each rank's real "
             "allocated and reserved peaks (`figures.rank_peaks`, `figures.rank_reserved_peaks`) against the same "
             "rank simulated alone (`CPAB_SIM_RANKS=r`, as above). `*`: the row's worst rank (real, by allocated "
             "peak), whose figures the table above compares.", "",
             "| method | ws | tokens | rank | allocated real | sim | Δ | reserved real | "
             + " | ".join(f"sim {p} | Δ" for p in pools) + " |",
             "|" + "---|" * (8 + 2 * len(pools))]
    gaps = []
    for key in sorted(rank_sims):
        row = by_trial[key][0]
        f = row["figures"]
        allocated, reserved = dict(map(tuple, f["rank_peaks"])), dict(map(tuple, f.get("rank_reserved_peaks") or []))
        opts = " ".join([*key[3][1::2], *(f"docs {d}" for d in docs_args(row)[1::2])])
        label = f"{key[0]}{f' ({opts})' if opts else ''}"
        for rank, sim in rank_sims[key].items():
            sa = sim[pools[0]]["figures"]["peak_bytes"]
            rr = reserved.get(rank)
            cells = " | ".join(
                f"{sim[p]['figures']['peak_reserved_bytes'] / GiB:.2f} | "
                + (pct(sim[p]['figures']['peak_reserved_bytes'], rr) if rr else "") for p in pools)
            star = "*" if rank == f.get("worst_rank") else ""
            lines.append(f"| {label} | {key[2]} | {key[1] // 1024}K | {rank}{star} | {allocated[rank] / GiB:.2f} "
                         f"| {sa / GiB:.2f} | {pct(sa, allocated[rank])} | {f'{rr / GiB:.2f}' if rr else '-'} "
                         f"| {cells} |")
        ranks = list(rank_sims[key])
        if 0 in rank_sims[key] and len(ranks) > 1:
            sim_alloc = {r: rank_sims[key][r][pools[0]]["figures"]["peak_bytes"] for r in ranks}
            parts = [f"allocated real {worst_gap(allocated)}, simulated {worst_gap(sim_alloc)}"]
            if reserved:
                parts.append(f"reserved real {worst_gap(reserved)}, " + ", ".join(
                    f"simulated {p} " + worst_gap({r: rank_sims[key][r][p]['figures']['peak_reserved_bytes']
                                                   for r in ranks}) for p in pools))
            gaps.append(f"- {label}, {key[2]} ranks, {key[1] // 1024}K: the worst rank over rank 0: "
                        + "; ".join(parts) + ".")
    return lines + ([""] + gaps if gaps else [])


def compare_markdown(folder: Path, real_rows: list[dict], by_trial: dict[tuple, list[dict]],
                     sims: dict[tuple, dict[str, dict]], pools: list[str],
                     rank_sims: dict[tuple, dict[int, dict[str, dict]]] | None = None) -> str:
    """``compare.md``: per real trial (``by_trial``, keyed by ``trial_key``), its real allocated and
    reserved peaks and step times against its simulations (``sims``: one per allocator ``pools``, of
    the rank the real row's figures are) and the modelled step time; for real rows that measured
    several ranks, each rank against its simulation (``rank_sims``, :func:`ranks_markdown`); then the
    kernel rates of ``folder/kernels.ndjson``, if any."""
    any_sim = next(iter(next(iter(sims.values())).values()))
    emulated = any(r["mode"] == "emulated" for r in real_rows)
    by_ranks = any(r["figures"].get("rank_peaks") for r in real_rows if r["mode"] == "emulated")
    skips = any(skipped(r) for r in real_rows)
    device_name = real_rows[0]["env"]["device_name"]
    levers = ("the levers of `python -m bench run` (FSDP2, checkpoints offloaded but the first block's, "
              "tiled MLP and norms, chunked loss) with the row's own (`levers` in the real rows; the "
              "simulation is given the same), the attention arithmetic skipped (`--attention-math skip`, "
              "`bench.measure.skipmath`: the kernels' outputs and backward scratch allocated at their real "
              "shapes, no FLOPs; yunchang's flash-attn 3 calls go to `bench.stackmodel.fake_flash_attn`, our "
              "methods' to torch's SDPA flash ops). Memory is the step after the first" if skips else
              "the default levers of `python -m bench run` (FSDP2, checkpoints offloaded but the first and last "
              "block's, tiled MLP and norms, chunked loss), torch's SDPA flash kernel. Memory is the step after "
              "the first (peaks reset between); a trial run twice gave the same bytes both times")
    lines = [
        f"# Real {'H200' if 'H200' in device_name else 'H100'} against the simulation",
        "",
        f"Real: `bash scripts/gpu/validate.sh OUT ...` on {device_name} "
        f"(torch {real_rows[0]['env']['torch']}), `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, "
        f"{levers}. "
        + ("Mode `emulated` (column ws): "
           + ("each deciding rank of a `ws`-rank job in turn on one GPU (rank 0 alone for a method whose ranks "
              "are symmetric)" if by_ranks else "rank 0 of a `ws`-rank job on one GPU")
           + ", with a fake process group: kernels, allocator and host offloads are real, collectives return at "
           "once (their output buffers are still allocated), so the memory is "
           + ("each rank's; the row's figures are its worst rank's (by allocated peak), simulated on that rank; "
              "the time compared is that rank's measured compute " if by_ranks else
              "rank 0's; the time compared is the measured compute ")
           + "against the model's compute part (no communication"
           + ("; where the attention was skipped, without the attention kernels" if skips else "") + "). "
           if emulated else "")
        + "Simulated: `python scripts/gpu/compare.py` (fake tensors on the GPU code path, torch "
        f"{any_sim['env']['torch']}, lean stack + expandable-segments allocator model + FA2 backward "
        "scratch), with the allocator pools of the column (`shared`: one pool for all streams; "
        "`per-stream`: a pool per stream, as the caching allocator keeps them). "
        f"Modelled step time: `bench.stackmodel.steptime` (version {STEPTIME_VERSION}) on the simulation's "
        "counts, with its constants: the attention efficiencies and the per-call latency fitted on Table 3 "
        "(not on these rows), `eff_matmul` measured on "
        + ("this device's GEMMs (the kernel table below)" if (folder / "kernels.ndjson").exists()
           else "the H100 GEMMs of `results/gpu/h100-ws1/kernels.ndjson`")
        + "; attention at the FA2 efficiency (the kernel that ran).",
        "",
        "| method | mode | ws | model | tokens | allocated real | sim | Δ | reserved real | "
        + " | ".join(f"sim {p} | Δ" for p in pools)
        + " | time real (min-max) s | modelled s | Δ |",
        "|" + "---|" * (12 + 2 * len(pools)),
    ]
    for key, rows in sorted(by_trial.items(), key=lambda kv: (kv[0][2], kv[0][0] != "ulysses", kv[0])):
        real = rows[0]["figures"]
        sim = sims[key]
        first = next(iter(sim.values()))
        base = first["figures"]
        emu = rows[0]["mode"] == "emulated"
        # emulated: the measured compute (its step time adds modelled communication)
        times = [t - ((r["figures"].get("comm_time_s") or 0.0) if emu else 0.0)
                 for r in rows for t in r["figures"]["step_times_s"]]
        med = sorted(times)[len(times) // 2]
        model_s = modelled_step_s(first, compute_only=emu, attention=not skipped(rows[0]))
        rr, ra = real["peak_reserved_bytes"], real["peak_bytes"]
        model_name = Path(model_arg(rows[0])).stem
        opts = " ".join([*key[3][1::2], *(f"docs {d}" for d in docs_args(rows[0])[1::2])])
        if skipped(rows[0]):
            what = "attention skipped" + (", RoPE table" if rows[0]["levers"].get("rope_table") == "checkpointed"
                                          else "")
            opts = f"{opts}; {what}" if opts else what
        reserved = " | ".join(f"{sim[p]['figures']['peak_reserved_bytes'] / GiB:.2f} "
                              f"| {pct(sim[p]['figures']['peak_reserved_bytes'], rr)}" for p in pools)
        lines.append(
            f"| {key[0]}{f' ({opts})' if opts else ''} | {rows[0]['mode']} | {key[2]} | {model_name} "
            f"| {key[1] // 1024}K | {ra / GiB:.2f} | {base['peak_bytes'] / GiB:.2f} "
            f"| {pct(base['peak_bytes'], ra)} | {rr / GiB:.2f} | {reserved} "
            f"| {med:.2f} ({min(times):.2f}-{max(times):.2f}, n={len(times)}) | {model_s:.2f} | {pct(model_s, med)} |")
    if rank_sims:
        lines += ranks_markdown(by_trial, rank_sims, pools)
    kernels = [json.loads(line) for line in (folder / "kernels.ndjson").open()] \
        if (folder / "kernels.ndjson").exists() else []
    if kernels:
        peak = get_device("h100-80g").peak_bf16_flops
        header = "| kernel | shape | TFLOP/s | fraction of peak | model's efficiency |"
        fa2 = f"eff_attention_fa2 {FITTED.eff_attention_fa2:.3f}"
        lines += ["", "## Kernel rates (real) against the model's efficiencies", "",
                  f"Fraction of the preset's dense bf16 peak ({peak / 1e12:.0f} TFLOP/s); CUDA events, median "
                  "of 5-10 calls after warm-up. The model's (`bench.stackmodel.steptime.FITTED`): `eff_matmul` is "
                  "the FLOP-weighted rate of the four GEMMs below (`EFF_MATMUL_MEASURED`, since version 4); the "
                  "attention efficiencies are fitted on Table 3 cells only (never on these rows), so they may "
                  "absorb other work of the step: not kernel rates by construction.", "",
                  header, "|---|---|---|---|---|"]
        for k in kernels:
            if k["kind"] == "check":
                errs = ", ".join(f"{n} {e:.1e}" for n, e in k["rel_err"].items())
                verdict = "ok" if k["ok"] else "FAIL"
                lines.insert(lines.index(header) - 1,
                             f"The CUDA kernel against the fp32 math kernel (bf16, causal, GQA {k['heads']}/"
                             f"{k['kv_heads']}, {k['seq']} tokens): relative error {errs} ({verdict}).\n")
            elif k["kind"] == "matmul":
                lines.append(f"| bf16 matmul ({k['name']}) | {k['m']}x{k['k']} @ {k['k']}x{k['n']} | {k['tflops']:.0f} "
                             f"| {k['tflops'] * 1e12 / peak:.2f} | eff_matmul {FITTED.eff_matmul:.3f} |")
            elif k["kind"] == "attention":
                shape = f"S={k['seq'] // 1024}K, {k['heads']}/{k['kv_heads']} heads, d={k['head_dim']}, causal"
                for part in ("fwd", "bwd"):
                    lines.append(f"| SDPA flash (FA2) {part} | {shape} | {k[part]['tflops']:.0f} "
                                 f"| {k[part]['tflops'] * 1e12 / peak:.2f} | {fa2} |")
    return "\n".join(lines) + "\n"


def segments_markdown(folder: Path) -> str | None:
    """``segments.md``: the real allocator's segments per stream (``folder/segments.ndjson``); None without it."""
    path = folder / "segments.ndjson"
    if not path.exists():
        return None
    lines = ["# The caching allocator's segments per stream (real GPU: the device of compare.md)", "",
             "`torch.cuda.memory_snapshot()` after the timed step, just before the trial's `empty_cache` "
             "(scripts/gpu/snap/sitecustomize.py). With expandable segments a stream's segment stays mapped "
             "at its largest size until `empty_cache`, so the mapped sizes are what each stream's pool "
             "reserved at the step's peak; their sum is `max_memory_reserved`, unless an allocation retry released "
             "cached blocks (`num_alloc_retries` > 0: fpdt's row), when less is mapped at the end than at the peak.",
             "",
             "| method | tokens | stream | segments | mapped GiB | allocated at the end GiB |",
             "|---|---|---|---|---|---|"]
    for line in path.open():
        d = json.loads(line)
        by: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        for s in d["segments"]:
            b = by[s["stream"]]
            b[0] += 1
            b[1] += s["total_size"]
            b[2] += s["allocated_size"]
        for stream, (n, mapped, alloc) in sorted(by.items(), key=lambda kv: -kv[1][1]):
            name = "default" if stream == 0 else f"side {stream:#x}"
            lines.append(f"| {d['method']} | {d['seq_len']} | {name} | {n} | {mapped / GiB:.2f} | {alloc / GiB:.2f} |")
        stats = d["stats"]
        reserved, allocated = stats["reserved_bytes.all.peak"] / GiB, stats["allocated_bytes.all.peak"] / GiB
        lines.append(f"| {d['method']} | {d['seq_len']} | **all** (peak reserved / allocated) | "
                     f"| **{reserved:.2f}** | {allocated:.2f} |")
    return "\n".join(lines) + "\n"


def write_gpu_report(folder: Path, real_rows: list[dict], by_trial: dict[tuple, list[dict]],
                     sims: dict[tuple, dict[str, dict]], pools: list[str],
                     rank_sims: dict[tuple, dict[int, dict[str, dict]]] | None = None) -> list[Path]:
    """``compare.md`` and, where the folder has segments, ``segments.md`` in ``folder``."""
    compare = folder / "compare.md"
    compare.write_text(compare_markdown(folder, real_rows, by_trial, sims, pools, rank_sims))
    written = [compare]
    text = segments_markdown(folder)
    if text is not None:
        (folder / "segments.md").write_text(text)
        written.append(folder / "segments.md")
    return written
