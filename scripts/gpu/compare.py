"""Set the real-GPU rows of scripts/gpu/validate.sh beside the simulation of the same trials.

For every distinct real trial in ``DIR/real.jsonl`` (method, sequence length, levers) this
simulates the same trial (``python -m bench run --mode simulated``: the row's world size, model,
device preset, options and levers, the GPU code path) with the allocator model as the real run
set it (expandable segments) and the kernel the real run called (torch's SDPA flash, so the
FA2 backward scratch model), once with one pool for every stream and once with a pool per
stream, and writes

* ``DIR/simulated.jsonl``: the simulated rows;
* ``compare.md`` in DIR: per trial, real against simulated allocated and reserved peaks, and the
  real step time (median, min, max of its timed steps) against the step-time model evaluated
  on the simulation's counts with the kernel that ran (``fa2``), plus the kernel rates of
  ``DIR/kernels.ndjson`` against the model's fitted efficiencies;
* ``segments.md`` in DIR: the caching allocator's segments per stream after the timed step
  (``DIR/segments.ndjson``), real.

Usage: ``python scripts/gpu/compare.py results/gpu/h100-ws1`` (about 3 minutes on 2 cores);
``--from-rows`` re-renders the tables from the simulated rows already in DIR (no simulation: after a
change to the step-time model, which reads only their counts).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.stackmodel.counts import StepCounts  # noqa: E402
from bench.stackmodel.hardware import get_device, get_link  # noqa: E402
from bench.stackmodel.steptime import FITTED, STEPTIME_VERSION, step_time  # noqa: E402

GiB = 2**30
POOLS = ("shared", "per-stream")


def trial_key(row: dict) -> tuple:
    return row["method"], row["seq_len"], row["world_size"], tuple(opt_args(row)), model_arg(row), \
        tuple(lever_args(row))


def opt_args(row: dict) -> list[str]:
    """The real run's ``--opt`` arguments, to pass on to its simulation."""
    argv, out = row["env"]["argv"], []
    for i, a in enumerate(argv[:-1]):
        if a == "--opt":
            out += ["--opt", argv[i + 1]]
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


def simulate(row: dict, pools: str) -> dict:
    """The simulated twin of a real or emulated row (same method, options, model, world size,
    length, levers, device preset)."""
    cmd = [sys.executable, "-m", "bench", "run", "--mode", "simulated", "--device", row["device"],
           "--world-size", str(row["world_size"]), "--model", model_arg(row), "--method", row["method"],
           "--seq-len", str(row["seq_len"]), *opt_args(row), *lever_args(row),
           "--stack", "lean", "--allocator-model", "expandable", "--allocator-pools", pools,
           "--kernel-workspace", "fa2", "--no-save", "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def modelled_step_s(sim: dict, compute_only: bool = False, attention: bool = True) -> float:
    """The modelled step on the simulation's counts with the kernel that ran (FA2); its compute
    part alone for an emulated row, whose collectives took no time; without the attention
    kernels for a row that skipped their arithmetic."""
    counts = StepCounts.from_flat(sim["figures"]["step_time_model"]["counts"])
    device = get_device(sim["device"])
    model = step_time(counts, device, get_link(device.link), FITTED, "fa2")
    seconds = model["compute_time_s" if compute_only else "step_time_s"]
    return seconds if attention else seconds - model["terms"]["compute_attention_s"]


def pct(ours: float, real: float) -> str:
    return f"{100 * (ours - real) / real:+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--pools", nargs="+", choices=POOLS, default=list(POOLS),
                        help="the allocator model's pools to simulate (default: both)")
    parser.add_argument("--from-rows", action="store_true",
                        help="render from DIR's simulated rows (in the order written) instead of simulating")
    args = parser.parse_args()
    # real.jsonl, or real.ndjson where the rows must stay out of the analysis figures (which read
    # every results/**/*.jsonl as sweep rows): the simulated rows take the same suffix
    suffix = ".jsonl" if (args.dir / "real.jsonl").exists() else ".ndjson"
    real_rows = [json.loads(line) for line in (args.dir / f"real{suffix}").open()]
    by_trial: dict[tuple, list[dict]] = defaultdict(list)
    for row in real_rows:
        if row["status"] == "ok":
            by_trial[trial_key(row)].append(row)
    sims: dict[tuple, dict[str, dict]] = {}
    sim_path = args.dir / f"simulated{suffix}"
    if args.from_rows:  # written trial by trial (sorted), each in args.pools' order
        if not sim_path.exists():
            sys.exit(f"compare.py: --from-rows needs {sim_path}; run without --from-rows to simulate")
        rows = [json.loads(line) for line in sim_path.open()]
        if len(rows) != len(by_trial) * len(args.pools):
            sys.exit(f"compare.py: {sim_path} holds {len(rows)} rows, not one per real trial and pool "
                     f"({len(by_trial)} x {len(args.pools)}); run without --from-rows to simulate")
        stored = iter(rows)
        for key in sorted(by_trial):
            sims[key] = {pools: next(stored) for pools in args.pools}
    else:
        with sim_path.open("w") as f:
            for n, (key, rows) in enumerate(sorted(by_trial.items()), 1):
                sims[key] = {}
                for pools in args.pools:
                    print(f"[{n}/{len(by_trial)}] simulating {key[0]} at {key[1]} tokens, {pools} pools", flush=True)
                    sims[key][pools] = sim = simulate(rows[0], pools)
                    f.write(json.dumps(sim) + "\n")
    any_sim = next(iter(next(iter(sims.values())).values()))
    emulated = any(r["mode"] == "emulated" for r in real_rows)
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
        + ("Mode `emulated` (column ws): rank 0 of a `ws`-rank job on one GPU, with a fake process group: "
           "kernels, allocator and host offloads are real, collectives return at once (their output buffers "
           "are still allocated), so the memory is rank 0's; the time compared is the measured compute "
           "against the model's compute part (no communication"
           + ("; where the attention was skipped, without the attention kernels" if skips else "") + "). "
           if emulated else "")
        + "Simulated: `python scripts/gpu/compare.py` (fake tensors on the GPU code path, torch "
        f"{any_sim['env']['torch']}, lean stack + expandable-segments allocator model + FA2 backward "
        "scratch), with the allocator pools of the column (`shared`: one pool for all streams; "
        "`per-stream`: a pool per stream, as the caching allocator keeps them). "
        f"Modelled step time: `bench.stackmodel.steptime` (version {STEPTIME_VERSION}) on the simulation's "
        "counts, with its constants: the attention efficiencies and the per-call latency fitted on Table 3 "
        "(not on these rows), `eff_matmul` measured on "
        + ("this device's GEMMs (the kernel table below)" if (args.dir / "kernels.ndjson").exists()
           else "the H100 GEMMs of `results/gpu/h100-ws1/kernels.ndjson`")
        + "; attention at the FA2 efficiency (the kernel that ran).",
        "",
        "| method | mode | ws | model | tokens | allocated real | sim | Δ | reserved real | "
        + " | ".join(f"sim {p} | Δ" for p in args.pools)
        + " | time real (min-max) s | modelled s | Δ |",
        "|" + "---|" * (12 + 2 * len(args.pools)),
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
        opts = " ".join(key[3][1::2])
        if skipped(rows[0]):
            what = "attention skipped" + (", RoPE table" if rows[0]["levers"].get("rope_table") == "checkpointed"
                                          else "")
            opts = f"{opts}; {what}" if opts else what
        reserved = " | ".join(f"{sim[p]['figures']['peak_reserved_bytes'] / GiB:.2f} "
                              f"| {pct(sim[p]['figures']['peak_reserved_bytes'], rr)}" for p in args.pools)
        lines.append(
            f"| {key[0]}{f' ({opts})' if opts else ''} | {rows[0]['mode']} | {key[2]} | {model_name} "
            f"| {key[1] // 1024}K | {ra / GiB:.2f} | {base['peak_bytes'] / GiB:.2f} "
            f"| {pct(base['peak_bytes'], ra)} | {rr / GiB:.2f} | {reserved} "
            f"| {med:.2f} ({min(times):.2f}-{max(times):.2f}, n={len(times)}) | {model_s:.2f} | {pct(model_s, med)} |")
    kernels = [json.loads(line) for line in (args.dir / "kernels.ndjson").open()] \
        if (args.dir / "kernels.ndjson").exists() else []
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
    (args.dir / "compare.md").write_text("\n".join(lines) + "\n")
    segments_md(args.dir)
    print("\n".join(lines))


def segments_md(folder: Path) -> None:
    path = folder / "segments.ndjson"
    if not path.exists():
        return
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
    (folder / "segments.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
