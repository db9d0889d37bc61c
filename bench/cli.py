"""``python -m bench``: run one trial, or search the maximum context.

    python -m bench run --method upipe --model llama3-8b --seq-len 1M --world-size 8 \\
        --mode simulated --device h100-80g [--opt chunk_heads=8 ...] [--scope model|attention] \\
        [--dtype bf16] [--docs NAME[:SEED] | --docs-lengths LENGTHS|FILE] [--out FILE] [--json]
    python -m bench max-context ... [--granularity 128K] [--max-seq-len 16M] [--start 128K]
    python -m bench list            # methods, models, devices, links
    python -m bench plan --model llama3-8b --gpus 8 --device h100-80g [--docs NAME[:SEED]] [--stack paper|lean|hf]
    python -m bench trial '<Trial JSON>' --out FILE [--extrapolate-layers]   # what a sweep's job runs
    python -m bench fidelity [--only memory|boundaries|all] [--anchors NAME...] [--quick] [--jobs N] \\
        [--out DIR] [--figs-dir DIR]   # the simulation against the paper's numbers (bench.stackmodel.fidelity)
    python -m bench fidelity --hf [--anchors NAME...] [--out DIR] [--figs-dir DIR]   # ALST's (hffidelity)

Sizes accept ``K``/``M``/``G`` suffixes with K = 1024 (``128K``, ``1M``, ``1.5M``).
Every run appends its validated rows (JSON Lines, ``records``) to ``--out``, by default
``runs/bench/<mode>.jsonl`` under the working directory (``$CPAB_RUNS`` replaces ``runs/``;
``--no-save``: none). The committed ``results/`` are written only when ``--out`` names them.
An output path that cannot be written is refused before the trial runs. Output: a short
table on stdout (``--json``: one JSON row per line), progress on stderr. Every bad argument
gets a one-line error and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import methods
from records import GiB, Kind, Row, append_rows, human
from records import parse_size as parse_tokens
from records.outputs import OutputError, check_dir, check_file, runs_dir
from records.sizes import positive_int
from records.workloads import DocsSpec
from records.workloads import names as distribution_names

from .measure.config import choices, lever_fields
from .measure.launch import is_rank_zero
from .measure.timing import MIN_TIMED_STEPS
from .measure.trial import Search, Trial
from .model.config import CONFIGS
from .resolve import Request, resolve
from .search.autochunk import run
from .search.extrapolate import layer_extrapolated_runner
from .search.maxctx import default_runner, isolated_runner, search
from .search.plan import plan
from .stackmodel import fidelity
from .stackmodel import stack as paper_stack
from .stackmodel.hardware import DEVICES, LINKS

QUICK_ANCHOR = "128k-llama3-8b-upipe-x8"


class UsageError(Exception):
    """A bad argument: one line on stderr, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(f"{self.prog}: error: {message} (see --help)")


def parse_size(text: str) -> int:
    """``128K`` -> 131072, ``1.5M`` -> 1572864, ``4096`` -> 4096 (K = 1024): ``records.sizes``."""
    try:
        return parse_tokens(text, "size")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("size: ")) from None


def parse_opt(text: str) -> tuple[str, Any]:
    """``name=value`` with value as int, float, true/false, none, or string."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--opt {text!r} must look like name=value")
    name, raw = text.split("=", 1)
    name = name.strip()
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--opt {text!r}: {name!r} is not an option name")
    low = raw.strip().lower()
    if low in ("true", "false"):
        return name, low == "true"
    if low in ("none", "null"):
        return name, None
    for cast in (int, float):
        try:
            return name, cast(raw)
        except ValueError:
            pass
    return name, raw


def parse_docs(text: str) -> DocsSpec:
    """``--docs NAME[:SEED]``: a document-length distribution (``records.workloads``) and its seed."""
    try:
        return DocsSpec.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_docs_lengths(text: str) -> DocsSpec:
    """``--docs-lengths``: explicit document lengths (``4K,4K,8K``), or a file of them."""
    try:
        return DocsSpec.from_argument(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_docs_flags(p: argparse.ArgumentParser, lengths_help: str = "packed documents of these lengths, summing to "
                   "--seq-len: comma-separated (4K,4K,8K) or a file of them (one per line, or a JSON list)") -> None:
    """``--docs`` and ``--docs-lengths`` (one of them; neither: one sequence), both into ``args.docs``."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--docs", type=parse_docs, default=None, metavar="NAME[:SEED]",
                       help="packed documents drawn from a document-length distribution with a seed (default 0): "
                       f"{', '.join(distribution_names())} (records/workloads/data/README.md); default: one sequence")
    group.add_argument("--docs-lengths", dest="docs", type=parse_docs_lengths, metavar="LENGTHS|FILE",
                       help=lengths_help)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", required=True, help="attention method (python -m bench list), or a named "
                   "configuration: upipe-best (bench.training.presets)")
    p.add_argument("--model", required=True, help="named model config or a .json/.yaml file")
    p.add_argument("--world-size", type=positive_int, required=True, help="context-parallel ranks C")
    p.add_argument("--mode", choices=["real", "emulated", "simulated"], default="simulated")
    p.add_argument("--device", default="h100-80g", help="device preset (memory capacity, default link)")
    p.add_argument("--link", default=None, help="link model for modelled communication (default: the device's)")
    p.add_argument("--opt", action="append", type=parse_opt, default=[], metavar="NAME=VALUE",
                   help="method option, repeatable (e.g. chunk_heads=8, kernel=math)")
    p.add_argument("--scope", choices=["model", "attention"], default="model")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--batch", type=positive_int, default=1)
    add_docs_flags(p)
    add_lever_flags(p)
    p.add_argument("--warmup", type=positive_int, default=1, help="untimed steps (real/emulated)")
    p.add_argument("--iters", type=positive_int, default=MIN_TIMED_STEPS,
                   help=f"timed steps (real/emulated; at least {MIN_TIMED_STEPS} unless --smoke): the row records "
                   "each, their median as step_time_s, and min/max")
    p.add_argument("--smoke", action="store_true",
                   help=f"allow fewer than {MIN_TIMED_STEPS} timed steps (a wiring check; the row's notes say so)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads per rank (real/emulated; default: cores / local ranks when spawned)")
    p.add_argument("--out", default=None, help="JSON Lines file to append rows to "
                   "(default runs/bench/<mode>.jsonl)")
    p.add_argument("--no-save", action="store_true", help="do not append rows to any file")
    p.add_argument("--json", action="store_true", help="print rows as JSON lines instead of a table")


def lever_flag(f) -> str:
    """The CLI flag of a ``StepConfig`` lever: its declared flag, else ``--no-<name>`` for a bool
    that defaults to True and ``--<name>`` otherwise (underscores as hyphens)."""
    name = f.name.replace("_", "-")
    return f.metadata["flag"] or (f"--no-{name}" if f.default is True else f"--{name}")


def add_lever_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``StepConfig`` lever, generated from its declaration (``bench.training.config``,
    ``bench.measure.config``), in a group per concern. A flag not given leaves its lever to the resolver
    (``bench.resolve``)."""
    titles = {"training": "training levers (what the step does)",
              "simulation": "simulated mode only (how a simulation accounts for memory)",
              "emulation": "emulated mode only"}
    groups = {concern: p.add_argument_group(title) for concern, title in titles.items()}
    for f in lever_fields():
        meta = f.metadata
        group = groups[meta["concern"]]
        text = meta["help"].replace("%", "%%")
        flag = lever_flag(f)
        if isinstance(f.default, bool):
            group.add_argument(flag, dest=f.name, action="store_false" if f.default else "store_true",
                               default=argparse.SUPPRESS, help=f"off: {text}" if f.default else text)
            continue
        allowed = choices(f.name)
        kind = parse_size if meta["size"] else positive_int if meta["metavar"] else type(f.default)
        group.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, metavar=meta["metavar"],
                           choices=list(allowed) if allowed else None, type=None if allowed else kind,
                           help=text if "bench.resolve" in text else f"{text} (default: {f.default})")


def build_parser() -> Parser:
    parser = Parser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    run = sub.add_parser("run", help="one trial")
    _common(run)
    run.add_argument("--seq-len", type=parse_size, required=True, help="global sequence length (128K, 1M...)")
    run.add_argument("--extrapolate-layers", action="store_true",
                     help="simulated mode: the step from 3- and 4-layer simulations extrapolated over the model's "
                     "layers (bench.search.extrapolate; several times faster on deep models; the row says so)")
    mc = sub.add_parser("max-context",
                        help="longest sequence that fits (a search narrowed on the memory load, exact to the step)")
    _common(mc)
    mc.add_argument("--granularity", type=parse_size, default=128 << 10, help="answer exact to this (default 128K)")
    mc.add_argument("--max-seq-len", type=parse_size, default=16 << 20, help="search limit (default 16M)")
    mc.add_argument("--start", type=parse_size, default=None, help="first length tried (default: granularity)")
    mc.add_argument("--in-process", action="store_true",
                    help="simulated trials in this process (faster; default: each in its own process)")
    mc.add_argument("--extrapolate-layers", action="store_true",
                    help="simulated mode: each probe from 3- and 4-layer simulations extrapolated over the "
                    "model's layers (bench.search.extrapolate; several times faster on deep models; in process)")
    sub.add_parser("list", help="methods, models, device presets and link models")
    sub.add_parser("steptime", help="the step-time model fitted on and compared with the paper's Table 3 "
                   "(bench.stackmodel.steptime_fit; python -m bench steptime --help)", add_help=False)
    tr = sub.add_parser("trial", help="run a trial given as JSON (bench.measure.trial.Trial.to_json; what sweeps send)")
    tr.add_argument("trial", help="the trial as JSON")
    tr.add_argument("--out", default=None,
                    help="JSON Lines file to append rows to (default runs/bench/<mode>.jsonl)")
    tr.add_argument("--no-save", action="store_true", help="do not append rows to any file")
    tr.add_argument("--json", action="store_true", help="print rows as JSON lines instead of a table")
    tr.add_argument("--in-process", action="store_true", help="a search's simulated probes in this process")
    tr.add_argument("--extrapolate-layers", action="store_true",
                    help="simulated: the trial (a search: each probe) from 3- and 4-layer simulations extrapolated "
                    "over the model's layers (as run/max-context --extrapolate-layers; what a spec's layers sets)")
    pl = sub.add_parser("plan", help="max context and step time per method for a model on N GPUs (bench.search.plan)")
    pl.add_argument("--model", required=True, help="named model config or a .json/.yaml file")
    pl.add_argument("--gpus", type=positive_int, required=True, help="context-parallel ranks C")
    pl.add_argument("--device", default="h100-80g", help="device preset")
    pl.add_argument("--nodes", type=positive_int, default=1, help="nodes (usp/usp-upipe across them when > 1)")
    pl.add_argument("--max-seq-len", type=parse_size, default=32 << 20, help="search limit (default 32M)")
    pl.add_argument("--granularity", type=parse_size, default=1 << 20, help="answer exact to this (default 1M)")
    pl.add_argument("--out-dir", default=None,
                    help="where plan_<model>_<gpus>x<device>.md/.png go (default runs/plans)")
    pl.add_argument("--no-figs", action="store_true", help="print only")
    pl.add_argument("--stack", choices=["paper", "lean", "hf"], default="paper",
                    help="accounting of the simulations (bench.stackmodel.stack; default paper); hf: the methods "
                    "the Hugging Face stack runs (ds-ulysses-hf, torch-cp, upipe) with its levers "
                    "(bench.stackmodel.hfstack) and no ladder")
    pl.add_argument("--allocator-pools", choices=list(choices("allocator_pools")), default=None,
                    help="the paper stack's allocator pools: per-stream (default: as CUDA's caching allocator keys "
                    "its blocks; checked on an H100, results/gpu) or shared (one pool for every stream; the "
                    "committed 16-GPU plans); refused under --stack hf")
    pl.add_argument("--paper-only", action="store_true",
                    help="only the methods in the paper's setup, not the levers beyond it (+...); refused under "
                    "--stack hf")
    pl.add_argument("--cache", default=None,
                    help="simulation cache to read and append to (default runs/plan/sims.ndjson; the committed "
                    "results/plan/sims.ndjson is read too)")
    pl.add_argument("--no-cache", action="store_true", help="simulate everything, read and write no cache")
    pl.add_argument("--jobs", type=positive_int, default=None,
                    help="searches run at once, one process each (default: one per core, at most one per search)")
    add_docs_flags(pl, "parsed as bench run's, then refused: explicit lengths fix the sequence length, which the "
                   "plan varies (use --docs)")
    fi = sub.add_parser("fidelity", help="the paper's memory anchors and fits/OOM boundaries, simulated under the "
                        "paper and lean stacks (bench.stackmodel.fidelity)")
    fi.add_argument("--only", choices=["memory", "boundaries", "all"], default="all")
    fi.add_argument("--anchors", nargs="+", default=None, metavar="NAME",
                    help="only these anchors (names or name prefixes; --list-anchors shows them)")
    fi.add_argument("--quick", action="store_true", help=f"only the {QUICK_ANCHOR} anchor (a wiring check)")
    fi.add_argument("--list-anchors", action="store_true", help="print the anchors and exit")
    fi.add_argument("--jobs", type=positive_int, default=min(4, os.cpu_count() or 1),
                    help="trials in parallel (a process pool; default: the CPUs, at most 4; the full run simulates "
                    "every deciding rank of the ring and mesh anchors, the longest trials first by the committed rows' "
                    "wall times; its time on 2 cores: docs/fidelity.md)")
    fi.add_argument("--allocator-pools", choices=list(choices("allocator_pools")), default=paper_stack.PAPER_POOLS,
                    help="the paper stack's allocator pools: per-stream (default: a pool per CUDA stream, as the "
                    "caching allocator keeps them; checked on an H100, results/gpu) or shared (one pool for every "
                    "stream)")
    fi.add_argument("--from-rows", nargs="+", default=None, metavar="FILE",
                    help="simulate nothing: take every anchor's trials from these rows (e.g. the committed "
                    "results/fidelity/fidelity.jsonl) and write only fidelity.{md,png}")
    fi.add_argument("--hf", action="store_true",
                    help="the Hugging Face stack's section instead: ALST's published lengths (results/hf/"
                    "alst_anchors.csv) under --stack hf, written to hf_fidelity.{jsonl,md} "
                    "(bench.stackmodel.hffidelity)")
    fi.add_argument("--out", default=None, help="directory for fidelity.jsonl (default runs/fidelity)")
    fi.add_argument("--figs-dir", default=None, help="directory for fidelity.{md,png} (default: --out)")
    return parser


def _trial(args, seq_len: int, search: Search | None = None) -> Trial:
    """The resolved trial of the command line (``bench.resolve``): only the flags given reach it."""
    levers = {f.name: getattr(args, f.name) for f in lever_fields() if hasattr(args, f.name)}
    levers.update(scope=args.scope, batch=args.batch, dtype=args.dtype)
    request = Request(args.method, args.model, seq_len, args.world_size, dict(args.opt), mode=args.mode,
                      device=args.device, link=args.link, levers=levers, search=search, warmup=args.warmup,
                      iters=args.iters, smoke=args.smoke, threads=args.threads, docs=args.docs)
    try:
        return resolve(request)
    except ValueError as err:
        raise UsageError(f"python -m bench: error: {err}") from None


def _out_path(args, mode: str) -> Path | None:
    """Where rows go, checked before anything runs (``UsageError`` if it cannot be written)."""
    if args.no_save:
        return None
    out = Path(args.out) if args.out else runs_dir() / "bench" / f"{mode}.jsonl"
    try:
        return check_file(out, "--out")
    except OutputError as err:
        raise UsageError(f"python -m bench {args.command}: error: {err}") from None


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    width = int(spec.split(".")[0])
    return f"{'-':>{width}}" if value is None else format(value / scale, spec)


def table(rows) -> str:
    """A short fixed-width table; every line names its mode and device."""
    head = (f"{'mode':9} {'device':10} {'ws':>3} {'method':10} {'model':16} {'scope':9} {'seq':>6} "
            f"{'status':6} {'peak GiB':>9} {'host GiB':>9} {'step s':>8} {'tok/s/dev':>10} "
            f"{'TFLOP/s':>8} {'max ctx':>8}")
    lines = [head]
    for r in rows:
        f = r.figures
        seq = human(r.seq_len) if r.kind == "trial" else f"<={human(r.seq_len)}"
        lines.append(
            f"{r.mode:9} {r.device:10} {r.world_size:>3} {r.method:10} {r.model[:16]:16} {r.scope:9} "
            f"{seq:>6} {r.status:6} {_fmt(f.peak_bytes, '9.2f', GiB)} {_fmt(f.host_peak_bytes, '9.2f', GiB)} "
            f"{_fmt(f.step_time_s, '8.3f')} {_fmt(f.tokens_per_s_per_device, '10.1f')} "
            f"{_fmt(f.tflops_per_device, '8.3g')} "
            f"{human(f.max_context) if f.max_context is not None else '-':>8}"
        )
        if r.status != "ok":
            lines.append(f"    {r.status}: {r.message}")
    return "\n".join(lines)


def _emit(rows, as_json: bool, out: Path | None) -> None:
    if not is_rank_zero():
        return
    if out is not None:
        append_rows(out, rows)
    if as_json:
        for r in rows:
            print(json.dumps(r.to_dict(), sort_keys=True))
    else:
        print(table(rows))
        if out is not None:
            print(f"rows appended to {out}", file=sys.stderr)


def _list() -> int:
    print("methods:")
    for info in methods.available(detail=True):
        print(f"  {info.name:12} {info.status:20} {info.description}")
    print("models:")
    for c in CONFIGS.values():
        print(f"  {c.name:18} {c.n_params / 1e9:7.2f}B  L={c.n_layers} dim={c.dim} H={c.n_heads} "
              f"G={c.n_kv_heads} d={c.head_dim} ffn={c.ffn_dim} V={c.vocab_size} {c.note}")
    print("devices:")
    for d in DEVICES.values():
        print(f"  {d.name:10} {d.description}")
    print("links:")
    for link in LINKS.values():
        print(f"  {link.name:12} {link.description}")
    return 0


def execute(trial: Trial, out: Path | None, as_json: bool, in_process: bool = False,
            extrapolate: bool = False) -> int:
    """Run a validated trial (one step, or a max-context search) and emit its rows."""
    what = "run" if trial.kind == Kind.TRIAL else "max-context"
    try:
        trial.validate()
    except ValueError as err:
        raise UsageError(f"python -m bench {what}: error: {err}") from None
    if extrapolate and trial.step.ac_group > 1:
        raise UsageError(f"python -m bench {what}: error: --extrapolate-layers extrapolates linearly in the layers, "
                         f"and --ac-group's host peak (about n/K + K - 1 checkpoints) is not; drop one of them")
    if extrapolate and trial.mode != "simulated":
        raise UsageError(f"python -m bench {what}: error: --extrapolate-layers extrapolates simulations; "
                         f"it cannot stand in for a {trial.mode} run: drop it or use --mode simulated")
    if trial.kind == Kind.TRIAL:
        print(f"[{trial.mode} on {trial.world_size} x {trial.device}] {trial.method} {trial.model} "
              f"seq {trial.seq_len}{' (layers extrapolated)' if extrapolate else ''} ...", file=sys.stderr,
              flush=True)
        row = run(trial, runner=layer_extrapolated_runner()) if extrapolate else run(trial)
        if trial.auto_chunk is not None:
            print(row.notes[0], file=sys.stderr, flush=True)
        _emit([row], as_json, out)
        return 0
    zero = is_rank_zero()
    rows: list[Row] = []

    def on_row(row: Row) -> None:
        rows.append(row)
        if zero and out is not None:
            append_rows(out, [row])
        if zero and as_json:
            print(json.dumps(row.to_dict(), sort_keys=True), flush=True)

    try:
        if extrapolate:  # chunk_heads=auto resolved first, as the other runners do (autochunk.run)
            extrapolated = layer_extrapolated_runner()

            def runner(probe: Trial) -> Row:
                return run(probe, runner=extrapolated)
        else:
            runner = default_runner if in_process else isolated_runner
        # progress to whatever stderr is now (a caller may have redirected it), not the one the search's
        # default was bound to when bench.search.maxctx was imported
        final = search(trial, runner=runner, on_row=on_row, progress=sys.stderr)
    except ValueError as err:
        raise UsageError(f"python -m bench max-context: error: {err}") from None
    if not zero:
        return 0
    if out is not None:
        append_rows(out, [final])
    if as_json:
        print(json.dumps(final.to_dict(), sort_keys=True))
    else:
        print(table(rows + [final]))
        if out is not None:
            print(f"rows appended to {out}", file=sys.stderr)
    return 0


def _fidelity_dirs(args, prog: str) -> tuple[Path, Path]:
    """The rows folder and the figures folder of ``bench fidelity``, both checked writable before any work."""
    out = Path(args.out) if args.out else runs_dir() / "fidelity"
    figs = Path(args.figs_dir) if args.figs_dir else out
    try:
        check_dir(out, "--out")
        check_dir(figs, "--figs-dir")
    except OutputError as err:
        raise UsageError(f"{prog}: error: {err}") from None
    return out, figs


def _hf_fidelity(args) -> int:
    """``fidelity --hf``: the HF stack's anchors (``bench.stackmodel.hffidelity``), one at a time."""
    from .stackmodel import hffidelity

    try:
        chosen = hffidelity.load_anchors()
        if args.anchors:
            unknown = [n for n in args.anchors if not any(a.name.startswith(n) for a in chosen)]
            if unknown:
                raise ValueError(f"unknown hf anchor(s) {unknown}; known: {[a.name for a in chosen]}")
            chosen = [a for a in chosen if any(a.name.startswith(n) for n in args.anchors)]
    except (OSError, ValueError) as err:
        raise UsageError(f"python -m bench fidelity --hf: error: {err}") from None
    if args.list_anchors:
        for a in chosen:
            print(f"{a.name:28} {a.expect:5} {human(a.seq_len):>6} x{a.gpus:<3} {a.method}  {a.source}")
        return 0
    out, figs = _fidelity_dirs(args, "python -m bench fidelity --hf")
    results = hffidelity.run_anchors(chosen)
    print(hffidelity.markdown(results))
    for path in hffidelity.write_outputs(results, out, figs):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _fidelity(args) -> int:
    if args.hf:
        return _hf_fidelity(args)
    try:
        anchors = fidelity.load_anchors()
        chosen = fidelity.select(anchors, args.only, [QUICK_ANCHOR] if args.quick else args.anchors)
    except (OSError, ValueError) as err:
        raise UsageError(f"python -m bench fidelity: error: {err}") from None
    if args.list_anchors:
        for a in chosen:
            print(f"{a.name:44} {a.kind:8} {a.paper_value():>10}  {a.impl.describe()}")
        return 0
    if not chosen:
        raise UsageError("python -m bench fidelity: error: no anchor selected")
    out, figs = _fidelity_dirs(args, "python -m bench fidelity")
    try:
        runner = fidelity.rows_runner(args.from_rows) if args.from_rows else None
        results = fidelity.run_anchors(chosen, jobs=1 if runner else args.jobs, pools=args.allocator_pools,
                                       runner=runner)
    except (OSError, LookupError, ValueError) as err:  # a missing or malformed rows file, a trial without a row
        raise UsageError(f"python -m bench fidelity: error: {err}") from None
    from analysis import fidelity_report

    print(fidelity_report.text_table(results))
    for path in fidelity_report.write_outputs(results, out, figs, write_rows=runner is None):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["steptime"]:  # its own parser (bench.stackmodel.steptime_fit)
        from .steptime_command import main as steptime_main
        return steptime_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        if args.command == "list":
            return _list()
        if args.command == "fidelity":
            return _fidelity(args)
        if args.command == "plan":
            out_dir = None if args.no_figs else Path(args.out_dir) if args.out_dir else runs_dir() / "plans"
            try:
                if out_dir is not None:
                    check_dir(out_dir, "--out-dir")
                default_cache = runs_dir() / "plan" / "sims.ndjson"
                cache = None if args.no_cache else Path(args.cache) if args.cache else default_cache
                if cache is not None:
                    check_file(cache, "--cache")
                res = plan(args.model, args.gpus, args.device, args.nodes, args.max_seq_len, args.granularity,
                           stack=args.stack, beyond=not args.paper_only, cache=cache,
                           workers=args.jobs, use_cache=not args.no_cache, pools=args.allocator_pools,
                           docs=args.docs)
            except ValueError as err:
                raise UsageError(f"python -m bench plan: error: {err}") from None
            from analysis import plan_report  # the one writer of tables and figures

            print(plan_report.render(res))
            for path in plan_report.write_plan(res, out_dir) if out_dir is not None else []:
                print(f"wrote {path}", file=sys.stderr)
            return 0
        if args.command == "trial":
            try:
                trial = Trial.from_json(args.trial)
            except ValueError as err:
                raise UsageError(f"python -m bench trial: error: {err}") from None
            return execute(trial, _out_path(args, trial.mode), args.json, args.in_process,
                           args.extrapolate_layers)
        out = _out_path(args, args.mode)
        if args.command == "run":
            return execute(_trial(args, args.seq_len), out, args.json, extrapolate=args.extrapolate_layers)
        try:
            search_params = Search(args.granularity, args.max_seq_len, args.start)
        except ValueError as err:
            raise UsageError(f"python -m bench max-context: error: {err}") from None
        return execute(_trial(args, args.granularity, search_params), out, args.json, args.in_process,
                       args.extrapolate_layers)
    except UsageError as err:
        print(str(err).splitlines()[0] if str(err) else "error", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
