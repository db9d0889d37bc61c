"""Regenerate every table and figure into one folder, with an index (``README.md``).

``ARTEFACTS`` is the list: what each output regenerates in the paper, the function that
builds it and the sweeps whose rows it reads. ``make_all`` writes them all from whatever
rows exist (none at all gives the paper-only versions, with our cells missing).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import yaml

from records.outputs import check_dir, runs_dir

from . import derived, documents, figures, tables
from .load import REPO, describe_bad_lines, load_rows

CONFIGS = REPO / "sweeps" / "configs"


@dataclass(frozen=True)
class Artefact:
    name: str  # output file stem (Table/Plot.name)
    paper: str  # the paper's table or figure it regenerates
    build: Callable
    sweeps: tuple[str, ...]  # sweep-name prefixes whose rows it draws
    kind: str  # "table" | "figure"
    cpu: str = "also"  # the sweeps' CPU-scale variants (``*-cpu``): "also" drawn, "no" not, "only"
    commands: tuple[tuple[str, str], ...] = ()  # (command, note): non-sweep commands writing rows it draws
    docs_filter: bool = False  # build takes ``docs=`` (make_all's ``max_context_docs``: which documents' rows)


# the paper-scale simulated rows of Fig. 1 (its ladder) and Fig. 5 are fidelity anchors (bench.stackmodel.fidelity)
FIDELITY_COMMAND = "python -m bench fidelity --out results/fidelity --figs-dir paper_figs"
FIG1_COMMAND = ("python -m bench fidelity --anchors fig1- --out results/fidelity", "paper-scale ladder, simulated")
FIG5_COMMAND = ("python -m bench fidelity --anchors fig5- --out results/fidelity", "paper scale, simulated")
# outputs of what bench computes (analysis.derived renders them, from committed data under make figs;
# the results/ ones by the commands named), listed in the index after the row-based ones
OTHER_OUTPUTS: tuple[tuple[str, str, str, str], ...] = (
    ("[fidelity.md](fidelity.md), [fidelity.png](fidelity.png)",
     "the paper's memory anchors (128K, Fig. 1's ladder, Fig. 5) and Table 3's fits/OOM boundaries against "
     "the simulation, paper stack (a pool per stream) and lean stack",
     f"`{FIDELITY_COMMAND}` (simulates, writes its rows and these two); `make figs` re-renders them from "
     "the committed rows results/fidelity/fidelity.jsonl, as `--from-rows` does",
     "simulated (h100-80g, paper and lean stacks)"),
    ("[../results/fidelity/shared-pool/fidelity.md](../results/fidelity/shared-pool/fidelity.md), "
     "[fidelity.png](../results/fidelity/shared-pool/fidelity.png)",
     "the same anchors with the paper stack's allocator keeping one pool for every stream (the default before "
     "the H100 check; docs/paper.md, \"The allocator's pools per stream\"); its rows: the paper stack only",
     "`python -m bench fidelity --allocator-pools shared --out results/fidelity/shared-pool` "
     "(then its lean rows, the same trials as results/fidelity's, dropped)",
     "simulated (h100-80g, paper stack)"),
    ("[../results/gpu/h100-ws1/compare.md](../results/gpu/h100-ws1/compare.md), "
     "[../results/gpu/h100-ws1/segments.md](../results/gpu/h100-ws1/segments.md)",
     "**real** NVIDIA H100 (world size 1, 4 blocks of Llama3-8B, 64K-256K): allocated and reserved peaks, "
     "step times and kernel rates against the simulation of the same trials (shared and per-stream pools)",
     "`bash scripts/gpu/validate.sh OUT PHASE...` on the GPU, then `python scripts/gpu/compare.py "
     "results/gpu/h100-ws1` (results/gpu/README.md)",
     "real (NVIDIA H100) beside simulated (h100-80g, paper stack)"),
    ("[table3_model.md](table3_model.md), [table3_model.csv](table3_model.csv)",
     "Table 3 with the modelled step time (bench.stackmodel.steptime) beside the paper's tokens/s, per cell: "
     "residual and whether the cell was used to fit",
     "`make figs`, or `python -m bench steptime --figs paper_figs` (both from the committed counts "
     "results/fidelity/steptime.jsonl)",
     "simulated (h100-80g, paper and lean stacks)"),
    ("[plan_llama3-8b_8xh100-80g.md](plan_llama3-8b_8xh100-80g.md), "
     "[plan_llama3-8b_8xh100-80g.png](plan_llama3-8b_8xh100-80g.png)",
     "the planner's answer for Llama3-8B on 8 x H100: max context and modelled step time of the paper's setups "
     "and of the levers beyond it, Pareto front, recommendation (paper stack, a pool per stream)",
     "`python -m bench plan --model llama3-8b --gpus 8 --device h100-80g --cache results/plan/sims.ndjson "
     "--out-dir paper_figs` (results/plan/README.md); `make figs-plans` re-renders it from that cache",
     "simulated (h100-80g, paper and lean stacks)"),
    ("[plan_llama3-8b_16xh100-80g.md](plan_llama3-8b_16xh100-80g.md), "
     "[plan_llama3-8b_16xh100-80g.png](plan_llama3-8b_16xh100-80g.png)",
     "the same for Llama3-8B on 16 x H100 in 2 nodes (usp and usp-upipe added; the levers are added to "
     "usp-upipe, which has no fused attention norm)",
     "`python -m bench plan --model llama3-8b --gpus 16 --nodes 2 --device h100-80g --allocator-pools shared "
     "--cache results/plan/sims.ndjson --out-dir paper_figs` (results/plan/README.md; every deciding "
     "rank); `make figs-plans` re-renders it from that cache",
     "simulated (h100-80g, paper and lean stacks)"),
    ("[plan_qwen3-32b_16xh100-80g.md](plan_qwen3-32b_16xh100-80g.md), "
     "[plan_qwen3-32b_16xh100-80g.png](plan_qwen3-32b_16xh100-80g.png)",
     "the same for Qwen3-32B on 16 x H100 in 2 nodes (as Llama3-8B's 16-GPU plan)",
     "`python -m bench plan --model qwen3-32b --gpus 16 --nodes 2 --device h100-80g --allocator-pools shared "
     "--cache results/plan/sims.ndjson --out-dir paper_figs` (results/plan/README.md; every deciding "
     "rank); `make figs-plans` re-renders it from that cache",
     "simulated (h100-80g, paper and lean stacks)"),
    ("[hf_fidelity.md](hf_fidelity.md)",
     "the Hugging Face stack's published anchors (ALST: Llama-8B at 500K on 1 H100, 3.7M on 8, 15M on 32) against "
     "the simulation under the hf stack",
     "`python -m bench fidelity --hf --out results/fidelity --figs-dir paper_figs` (simulates; its rows "
     "results/fidelity/hf_fidelity.jsonl; results/hf/README.md)",
     "simulated (h100-80g, hf stack)"),
    ("[plan_Llama-3.1-8B_8xh100-80g_stack-hf.md](plan_Llama-3.1-8B_8xh100-80g_stack-hf.md), "
     "[plan_Llama-3.1-8B_8xh100-80g_stack-hf.png](plan_Llama-3.1-8B_8xh100-80g_stack-hf.png)",
     "the planner's answer on the Hugging Face stack for Llama-3.1-8B's config.json on 8 x H100: ALST, "
     "PyTorch CP and UPipe with that stack's levers",
     "`python -m bench plan --model bench/model_configs/hf/Llama-3.1-8B/config.json --gpus 8 --stack hf "
     "--cache results/plan/sims.ndjson --out-dir paper_figs` (results/plan/README.md); `make figs-plans` "
     "re-renders it from that cache",
     "simulated (h100-80g, hf stack)"),
)

ARTEFACTS: tuple[Artefact, ...] = (
    Artefact("table3_llama3-8b", "Table 3, top half: tokens/s per GPU, Llama3-8B, 8×H100",
             lambda r: tables.table3(r, "llama3-8b"), ("table3-llama3-8b",), "table", "no"),
    Artefact("table3_qwen3-32b", "Table 3, bottom half: tokens/s per GPU, Qwen3-32B, 16×H100",
             lambda r: tables.table3(r, "qwen3-32b"), ("table3-qwen3-32b",), "table", "no"),
    Artefact("table3_ratios", "Table 3, each method's throughput / Ulysses' (derived; comparable across hardware)",
             tables.table3_ratios, ("table3-llama3-8b", "table3-qwen3-32b"), "table", "no"),
    Artefact("table3_cpu", "Table 3 on CPU (ours: small models, gloo ranks) with ratios to Ulysses",
             tables.table3_cpu, ("table3",), "table", "only"),
    Artefact("table3_throughput", "Table 3 drawn as curves (tokens/s per GPU vs length)",
             figures.table3_plot, ("table3-llama3-8b", "table3-qwen3-32b"), "figure", "no"),
    Artefact("max_context", "Max context per method (derived from Table 3; Fig. 5's 8M vs 6M claim)",
             tables.max_context_table, ("maxctx", "table3-llama3-8b", "table3-qwen3-32b"), "table",
             docs_filter=True),
    Artefact("max_context", "Max context per method, as bars",
             figures.max_context_plot, ("maxctx", "table3-llama3-8b", "table3-qwen3-32b"), "figure",
             docs_filter=True),
    Artefact("memory_vs_seq", "Peak memory vs length per method "
             "(docs/paper.md, section 'Peak memory vs length'; paper: two 128K anchors)",
             tables.memory_vs_seq_table, ("table3-llama3-8b", "table3-qwen3-32b"), "table", "no"),
    Artefact("memory_vs_seq", "Peak memory vs length per method, as curves",
             figures.memory_vs_seq_plot, ("table3-llama3-8b", "table3-qwen3-32b"), "figure", "no"),
    Artefact("fig1_memory_breakdown", "Fig. 1 (number probable): memory breakdown, Llama3-8B, 3M, 8 GPUs",
             tables.fig1_table, ("fig1-memory-breakdown",), "table", commands=(FIG1_COMMAND,)),
    Artefact("fig1_memory_breakdown", "Fig. 1 (number probable), stacked bars",
             figures.fig1_plot, ("fig1-memory-breakdown",), "figure", commands=(FIG1_COMMAND,)),
    Artefact("fig5_multinode", "Figure 5: UPipe vs USP-Hybrid, Llama3-8B, 16 GPUs (8×2)",
             tables.fig5_table, ("fig5-multinode",), "table", commands=(FIG5_COMMAND,)),
    Artefact("fig5_multinode", "Figure 5, memory bars + normalised throughput",
             figures.fig5_plot, ("fig5-multinode",), "figure", commands=(FIG5_COMMAND,)),
    Artefact("attn_memory", "Attention-memory micro-benchmark (the 75% / 87.5% claims)",
             tables.attn_memory_table, ("attn-memory",), "table"),
    Artefact("attn_memory", "Attention-memory micro-benchmark, over length and U",
             figures.attn_memory_plot, ("attn-memory",), "figure"),
    Artefact("u_ablation", "U ablation (authors' rebuttal branch; no paper numbers)",
             tables.u_ablation_table, ("u-ablation",), "table"),
    Artefact("u_ablation", "U ablation, throughput and memory vs U",
             figures.u_ablation_plot, ("u-ablation",), "figure"),
    Artefact("docs_llama3-8b", "none: packed documents, modelled tokens/s per GPU and per-rank imbalance by method, "
             "layout and distribution beside the single sequence, Llama3-8B, 8×H100",
             lambda r: documents.docs_table(r, documents.DOCS_LLAMA), ("docs-llama3-8b",), "table", "no"),
    Artefact("docs_llama3-8b", "none: packed documents, Llama3-8B on 8 GPUs, as bars",
             lambda r: documents.docs_plot(r, documents.DOCS_LLAMA), ("docs-llama3-8b",), "figure", "no"),
    Artefact("docs_qwen3-32b", "none: packed documents, Qwen3-32B, 16×H100 (8×2 meshes)",
             lambda r: documents.docs_table(r, documents.DOCS_QWEN), ("docs-qwen3-32b",), "table", "no"),
    Artefact("docs_qwen3-32b", "none: packed documents, Qwen3-32B on 16 GPUs, as bars",
             lambda r: documents.docs_plot(r, documents.DOCS_QWEN), ("docs-qwen3-32b",), "figure", "no"),
    Artefact("docs_cpu", "none: packed documents on CPU (ours: small models, gloo ranks), measured tokens/s per rank",
             lambda r: documents.docs_table(r, documents.DOCS_CPU), ("docs-",), "table", "only"),
    Artefact("compare_methods", "none: every method present, throughput (the 'compare my method' table)",
             tables.compare_methods, ("any",), "table"),
    Artefact("compare_methods_mem_gib", "none: every method present, peak memory",
             lambda r: tables.compare_methods(r, metric="mem_gib"), ("any",), "table"),
)


def expected_files() -> list[str]:
    """Every file ``make_all`` writes (names only)."""
    out = ["README.md"]
    for a in ARTEFACTS:
        out += [f"{a.name}.md", f"{a.name}.csv"] if a.kind == "table" else [f"{a.name}.png", f"{a.name}.svg"]
    return out


def sweep_configs(configs_dir: Path = CONFIGS) -> list[dict]:
    """name, path, mode, device of every sweep spec (read as plain YAML; unreadable ones skipped)."""
    out = []
    for path in sorted(Path(configs_dir).glob("*.yaml")):
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(raw, dict):
            out.append({"name": str(raw.get("name", path.stem)), "path": path, "mode": raw.get("mode", "?"),
                        "device": str(raw.get("device", "cpu"))})
    return out


def sweep_command(cfg: dict) -> str:
    """The command that (re)generates a sweep's rows; GPU sweeps in real mode go to Slurm."""
    try:
        rel = cfg["path"].relative_to(REPO)
    except ValueError:
        rel = cfg["path"]
    executor = "slurm" if cfg["mode"] == "real" and cfg["device"] != "cpu" else "local"
    return f"python -m sweeps run {rel} --executor {executor}"


def is_cpu_variant(cfg: dict) -> bool:
    return cfg["name"].endswith("-cpu") or cfg["device"] == "cpu"


def _commands(art: Artefact, configs: list[dict]) -> list[str]:
    """Markdown: the commands (in backticks) regenerating the rows an artefact draws."""
    if art.sweeps == ("any",):
        return ["any sweep (e.g. the Table 3 and max-context ones), or `python -m bench run ...`"]
    picked = sorted((c for c in configs if any(c["name"].startswith(p) for p in art.sweeps)),
                    key=lambda c: (is_cpu_variant(c), c["name"]))
    if art.cpu == "no":
        picked = [c for c in picked if not is_cpu_variant(c)]
    elif art.cpu == "only":
        picked = [c for c in picked if is_cpu_variant(c)]
    out = [f"`{cmd}` ({note})" for cmd, note in art.commands]
    out += [f"`{sweep_command(c)}`" + (" (CPU variant)" if is_cpu_variant(c) and art.cpu != "only" else "")
            for c in picked]
    if out:
        return out
    if art.cpu == "only":
        return ["a CPU variant of the Table 3 sweep (`sweeps/configs/table3-*-cpu.yaml`, `device: cpu`), "
                "run with `--executor local`"]
    return [f"(no sweep spec named {', '.join(art.sweeps)}* yet)"]


def _rel(path: Path) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return str(path) if rel.startswith("..") else rel


def write_index(out_dir: Path, done: list[tuple[Artefact, object, list[Path]]], rows: pd.DataFrame,
                results_dir: Path, user_dirs: tuple[Path, ...] = ()) -> Path:
    configs = sweep_configs()
    mine = ("; your rows (series labelled `yours`) from " + ", ".join(f"`{_rel(d)}`" for d in user_dirs)
            if user_dirs else "")
    lines = [
        "# paper_figs: the paper's tables and figures, regenerated",
        "",
        "Written by `python -m analysis figs` (`make figs`) from the rows under "
        f"`{_rel(results_dir)}`{mine} ({len(rows)} rows after keeping the newest per trial"
        + (f"; {len(rows.attrs.get('bad_lines', []))} corrupt lines skipped" if rows.attrs.get("bad_lines") else "")
        + "). Do not edit by hand: run the sweeps below, then `make figs`.",
        "",
        "Conventions: **paper** values are hollow (hatched unfilled bars, dashed lines with open markers) and "
        "say `paper`; **ours** are solid and name their mode (real / emulated / simulated) and device. "
        "In tables, `—` is a missing cell (no row, or not reported), `OOM` ran out of memory, `fits` ran "
        "without OOM in a mode that does not measure that figure (simulated: memory only), `error` failed. "
        "Nothing is interpolated. Sequence lengths: K = 1024, M = 1024² tokens.",
        "",
        "| Output | Regenerates | Rows come from | Modes of the rows drawn |",
        "|---|---|---|---|",
    ]
    for art, obj, paths in done:
        files = ", ".join(f"[{p.name}]({p.name})" for p in paths)
        cmds = "<br>".join(_commands(art, configs))
        lines.append(f"| {files} | {art.paper} | {cmds} | {obj.modes} |")
    for files, paper, cmd, modes in OTHER_OUTPUTS:
        lines.append(f"| {files} | {paper} | {cmd} | {modes} |")
    bad = describe_bad_lines(rows)
    if bad:
        lines += ["", "Corrupt lines skipped (not fatal):", ""] + [f"- `{b}`" for b in bad]
    lines += ["", "Regenerate everything here: `make figs` or "
              "`python -m analysis figs --results results --out paper_figs` (the tables and figures of the rows, "
              "then fidelity and table3_model from the committed data under `results`); the plans: "
              "`make figs-plans` (`--plans`: from the committed simulation cache, no simulation; a plan whose "
              "trials it lacks is left as it is, and the command says which trial).", ""]
    path = out_dir / "README.md"
    path.write_text("\n".join(lines))
    return path


def make_all(results_dir: str | Path | None = None, out_dir: str | Path | None = None,
             verbose: bool = True, user_dirs: tuple[str | Path, ...] = (), plans: bool = False,
             max_context_docs: str | None = None) -> list[Path]:
    """Build every artefact from the committed rows under ``results_dir`` (and the user's under
    ``user_dirs``, labelled ``yours``) into ``out_dir``, then the outputs ``bench`` computes from
    the committed data there (``analysis.derived``: fidelity, the step-time table and, with
    ``plans``, the plans); returns the paths written. ``max_context_docs``: the packed documents
    whose rows the max-context table and figure draw (``select.docs_choice``: None, the default,
    one sequence; ``prolong64k:0`` that draw).

    ``out_dir`` defaults to ``runs/figs`` under the working directory: the committed
    ``paper_figs/`` are rewritten only when asked (``make figs``)."""
    results_dir = Path(results_dir) if results_dir is not None else REPO / "results"
    out_dir = check_dir(Path(out_dir) if out_dir is not None else runs_dir() / "figs", "--out")
    user_dirs = tuple(Path(d) for d in user_dirs)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = load_rows(results_dir, user_dirs=user_dirs)
    if verbose:
        print(f"read {len(rows)} rows from {_rel(results_dir)}"
              + (f" ({len(rows.attrs['bad_lines'])} corrupt lines skipped)" if rows.attrs.get("bad_lines") else ""))
    done = []
    written: list[Path] = []
    for art in ARTEFACTS:
        obj = art.build(rows, docs=max_context_docs) if art.docs_filter else art.build(rows)
        paths = obj.write(out_dir)
        if hasattr(obj, "fig"):
            plt.close(obj.fig)
        done.append((art, obj, paths))
        written += paths
        if verbose:
            for p in paths:
                print(f"wrote {_rel(p)}  ({art.paper}; ours: {obj.modes})")
    for name, build, _ in derived.DERIVED:
        paths = build(results_dir, out_dir)
        written += paths
        if verbose:
            for p in paths:
                print(f"wrote {_rel(p)}  ({name}, from the committed data under {_rel(results_dir)})")
    if plans:
        paths = derived.plans(results_dir, out_dir, log=print if verbose else lambda line: None)
        written += paths
        if verbose:
            for p in paths:
                print(f"wrote {_rel(p)}  (plan, from {_rel(results_dir / 'plan' / 'sims.ndjson')})")
    index = write_index(out_dir, done, rows, results_dir, user_dirs)
    written.append(index)
    if verbose:
        print(f"wrote {_rel(index)}  (index)")
    return written
