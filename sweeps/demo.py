"""``make demo``: the suite's main job on its embedded default, end to end on this machine.

1. A local sweep of real CPU trials (``table3-llama3-8b-cpu``: the methods its spec lists, on 2
   gloo ranks, tiny model, the paper's training levers) and a simulated paper-scale max-context
   search for each method ``demo-maxctx-llama3-8b`` lists (Llama3-8B on 8 x H100-80GB), both
   through submitit's local executor; every trial and every search probe is reported as it ends.
   Then one workload, packed documents: ring, Ulysses and UPipe at 1M tokens of documents drawn
   from ``prolong64k`` (``DOCS_SETUP``), each the search's 1M probe with the documents added, simulated
   one process per core from 3- and 4-layer simulations extrapolated over the layers
   (``bench.search.extrapolate.layer_extrapolated_runner``).
2. ``analysis`` draws every table and figure from the committed rows and the demo's (labelled
   ``yours``) into ``runs/demo/figs/``.
3. A summary in a fixed order: our figures beside the paper's, each saying how it was obtained
   and, where it differs from the paper, what differs; the documents' modelled tokens/s and
   imbalance beside the same methods' one-sequence figure at that length (the search's probe).

Everything is written under ``runs/demo/`` (gitignored; ``$CPAB_RUNS`` replaces ``runs/``):
the committed ``results/`` and ``paper_figs/`` are never touched. Finished trials are skipped,
so a second ``make demo`` only redraws the figures.
"""
from __future__ import annotations

import concurrent.futures as futures
import csv
import dataclasses
import os
import sys
import time
from pathlib import Path

import bench  # noqa: F401  # first: the simulated CUDA device loads before torch (the documents' simulations run here)
import methods
from analysis.report import make_all
from bench.measure.trial import Trial
from bench.search.extrapolate import layer_extrapolated_runner
from bench.search.maxctx import isolation_context
from records import append_rows, human, read_rows, trial_key
from records.facts import TABLE3_COLUMNS
from records.outputs import runs_dir
from records.workloads import DocsSpec

from .runner import run_sweep
from .spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SPECS = ("table3-llama3-8b-cpu", "demo-maxctx-llama3-8b")
OUT = runs_dir() / "demo"  # relative to the repository: main() works from there
# the paper's setup of the max-context summary (results/paper/max_context.csv)
PAPER_SETUP = ("llama3-8b", 8)
# the packed-documents workload: (distribution, length, methods), each method's trial the max-context
# search's probe at that length (SPECS[1]) with the documents added
DOCS_SETUP = ("prolong64k", 1 << 20, ("ring", "ulysses", "upipe"))
DOCS_ROWS = "demo-docs-llama3-8b.jsonl"


def column_order(method: str) -> tuple[int, str]:
    """A method's place in the summary: by its paper column in Table 3's order (``MethodFacts.column``),
    then by name (methods of no Table 3 column last)."""
    column = methods.get_info(method).facts.column
    return (TABLE3_COLUMNS.index(column) if column in TABLE3_COLUMNS else len(TABLE3_COLUMNS), method)


# our own implementations of Table 3's columns without a mesh (``MethodFacts.reference``), in the
# paper's order: what the demo's CPU sweep runs (PyTorch's CP, the paper's Native PyTorch, is CUDA only)
CPU_ORDER = tuple(sorted((info.name for info in methods.all_infos()
                          if info.facts.reference and not info.facts.mesh and info.facts.column in TABLE3_COLUMNS),
                         key=column_order))
# keeps the whole demo within 5 minutes on 2 cores (the full specs are one command away): the spec's own
# table is 8 methods at 2 and 4 ranks; the demo runs the paper's four at 2 ranks, at 1K tokens (a bf16 step
# is slow on a CPU without bf16 arithmetic, and its time grows with the length: docs/commands.md)
DEMO_OVERRIDES = {"table3-llama3-8b-cpu": {"seq_lens": ["1K"], "world_sizes": [2], "methods": list(CPU_ORDER)}}


def paper_max_context(method: str) -> str:
    """The paper's max context of ``method``'s column on the summary's setup (``results/paper/max_context.csv``)."""
    column = methods.get_info(method).facts.column
    with open(REPO / "results" / "paper" / "max_context.csv", newline="") as f:
        for r in csv.DictReader(f):
            if (r["model"], int(r["gpus"]), r["method"]) == (*PAPER_SETUP, column):
                return human(int(r["max_seq_len"]))
    return "not in paper"
# Where our simulated search and the paper's measurement differ, and why (docs/paper.md).
WHY_DIFFERENT = {
    "ring": "ours: own zigzag ring, simulated under the paper stack (modelled allocator reserve, CUDA context and "
            "NCCL buffers); paper: yunchang's ring, measured peak reserved",
    "ulysses": "ours: own Ulysses, simulated under the paper stack; paper: yunchang's Ulysses, measured (OOM at 4M)",
    "fpdt": "ours: own FPDT-style method at its default 2 chunks per rank, simulated under the paper stack; paper: "
            "DeepSpeed's FPDT in chunks of 64K tokens (python -m bench fidelity checks that one at 4M)",
    "upipe": "paper: the longest it ran (5M fits; a lower bound); ours: simulated under the paper stack",
    "offload": "Ulysses with every saved activation offloaded: not a method of the paper",
}


def _human(n: int | None) -> str:
    return human(n) if n else "—"


def docs_trials() -> list[Trial]:
    """The documents workload's trials (``DOCS_SETUP``): the search's probe at that length, documents added."""
    distribution, seq_len, chosen = DOCS_SETUP
    searches = {t.method: t for t in load_spec(REPO / "sweeps" / "configs" / f"{SPECS[1]}.yaml").trials()}
    return [dataclasses.replace(searches[m].probe(seq_len), docs=DocsSpec(distribution)) for m in chosen]


def _docs_row(trial: Trial):
    """One documents trial, over 3 and 4 layers extrapolated (in a worker of ``run_docs``)."""
    return layer_extrapolated_runner()(trial)


def run_docs(path: Path) -> int:
    """The documents workload's trials without a row in ``path``, simulated over 3 and 4 layers and
    extrapolated, all at once (forked from a server that imported the package once:
    ``bench.search.maxctx.isolation_context``), each row appended as it ends; how many failed. All at once,
    not one per core: their costs differ (UPipe's head stages make its simulation the longest), and three
    on two cores end together where two and then one leave a core idle."""
    have = {trial_key(r) for r in read_rows(path, on_error="warn")} if path.exists() else set()
    todo = [t for t in docs_trials() if t.key() not in have]
    workers = max(1, len(todo))
    print(f"documents: {len(DOCS_SETUP[2])} trials, {len(DOCS_SETUP[2]) - len(todo)} already have rows in {path}, "
          f"{len(todo)} to run ({workers} at a time)", flush=True)
    for trial in todo:
        trial.validate()
    failed = 0
    if not todo:
        return failed
    t0 = time.time()
    with futures.ProcessPoolExecutor(workers, mp_context=isolation_context(todo[0])) as pool:
        running = {pool.submit(_docs_row, trial): trial for trial in todo}
        for done in futures.as_completed(running):
            row = done.result()
            append_rows(path, [row])
            failed += row.status == "error"
            print(f"  {running[done].label}: {row.status} (after {time.time() - t0:.0f} s)", flush=True)
    return failed


def docs_summary() -> None:
    """The documents workload beside the same methods' one sequence of that length (the search's probe):
    modelled tokens/s per GPU, and the imbalance of the ranks' attention work (``figures.doc_work``)."""
    distribution, seq_len, chosen = DOCS_SETUP
    docs_path, search_path = OUT / DOCS_ROWS, OUT / f"{SPECS[1]}.jsonl"
    docs = {r.method: r for r in read_rows(docs_path, on_error="warn")
            if r.seq_len == seq_len and r.docs is not None} if docs_path.exists() else {}
    single = {r.method: r for r in read_rows(search_path, on_error="warn")
              if r.kind == "trial" and r.seq_len == seq_len and r.docs is None} if search_path.exists() else {}
    print(f"[simulated, Llama3-8B, 8 x h100-80g, paper's levers] {human(seq_len)} tokens of "
          f"{DocsSpec(distribution).label} documents: modelled tokens/s per GPU (one sequence of {human(seq_len)}: "
          f"the search's probe), imbalance = the slowest rank's attention work / the mean")
    cells = []
    for m in chosen:
        r, one = docs.get(m), single.get(m)
        imbalance = (r.figures.doc_work or {}).get("imbalance") if r is not None else None
        cells.append(f"{m} {_rate(r)} ({_rate(one)})" + (f", imbalance {imbalance:.2f}" if imbalance else ""))
    print("  " + "   ".join(cells))


def _rate(row) -> str:
    """A row's modelled tokens/s per GPU, or why there is none."""
    if row is None:
        return "—"
    if row.status != "ok":
        return row.status
    tps = row.figures.tokens_per_s_per_device
    return f"{tps:.0f}" if tps else "—"


def summary() -> None:
    print("\n=== summary ===")
    rows = read_rows(OUT / "table3-llama3-8b-cpu.jsonl", on_error="warn")
    times = {(r.method, r.seq_len): r.figures.step_time_s for r in rows if r.status == "ok"}
    print("[real, 2 gloo ranks on this CPU, tiny-llama] step time (s); paper: UPipe/Ulysses 0.98-1.02 on H100")
    for seq in sorted({s for _, s in times}):
        shown = [m for m in CPU_ORDER if (m, seq) in times]
        cells = "  ".join(f"{m} {times[(m, seq)]:.3f}" for m in shown)
        ratio = times.get(("upipe", seq), 0) / times[("ulysses", seq)] if ("ulysses", seq) in times else float("nan")
        print(f"  {_human(seq):>5}: {cells}   upipe/ulysses {ratio:.2f}")
    print("  (each the median of the timed steps of one run on a shared 2-core host; the rows keep every step and the"
          " host's load. A CPU step this short weighs each method's fixed per-call costs more than the paper's"
          " lengths do (UPipe's stages each add their calls): not a ranking)")
    searched = read_rows(OUT / "demo-maxctx-llama3-8b.jsonl", on_error="warn")
    rows = [r for r in searched if r.kind == "max_context"]
    failed = [r for r in searched if r.kind == "trial" and r.status != "ok"]
    steps = sorted({(r.search or {}).get("step") for r in rows} - {None})
    print(f"[simulated, Llama3-8B, 8 x h100-80g, paper's levers] max context: ours (paper); search step "
          f"{', '.join(human(s) for s in steps) or '—'} (the committed paper-stack searches use 256K)")
    newest = {r.method: r for r in sorted(rows, key=lambda r: r.env.time)}
    for method in sorted(newest, key=column_order):
        r = newest[method]
        found = r.figures.max_context
        step = (r.search or {}).get("step")
        # a search whose first step already fails found nothing at this granularity
        ours = f"<{_human(step)}" if found == 0 and r.status == "ok" and step else _human(found)
        print(f"  {r.method:<8} {ours:>6}  ({paper_max_context(r.method)})"
              + ("" if r.status == "ok" else f"  [{r.status}: {r.message.splitlines()[0][:80]}]"))
        stop = _first_failure(failed, r.method, found or 0)
        if stop is not None:  # what ended the search: the device, the host memory, an error
            print(f"           stops at {_human(stop.seq_len)}: {_one_line(stop.message)}")
        if r.method in WHY_DIFFERENT:
            print(f"           {WHY_DIFFERENT[r.method]}")
    docs_summary()


def _first_failure(failed: list, method: str, found: int):
    """The search's probe that failed at the shortest length above what it found, if any."""
    above = [r for r in failed if r.method == method and r.seq_len > found]
    return min(above, key=lambda r: r.seq_len) if above else None


def _one_line(message: str, width: int = 150) -> str:
    line = message.splitlines()[0] if message else "(no message)"
    return line if len(line) <= width else line[: width - 3] + "..."


def main() -> int:
    os.chdir(REPO)
    os.environ.setdefault("MPLBACKEND", "Agg")
    # the demo simulates rank 0 alone to fit its time: a ring's worst rank would cost C simulations a probe
    # (bench.measure.run.SIM_RANKS_ENV; docs/modes.md); set CPAB_SIM_RANKS=deciding for the worst rank
    os.environ.setdefault("CPAB_SIM_RANKS", "0")
    if os.environ["CPAB_SIM_RANKS"] == "0":
        print("simulations measure rank 0 alone (CPAB_SIM_RANKS=0, to fit the demo's time): the ring's figures are "
              "its rank 0's, not its worst rank's; CPAB_SIM_RANKS=deciding simulates every rank", flush=True)

    start = time.time()
    failed = 0
    for i, name in enumerate(SPECS, 1):
        overrides = {"out": str(OUT / f"{name}.jsonl"), **DEMO_OVERRIDES.get(name, {})}
        spec = load_spec(REPO / "sweeps" / "configs" / f"{name}.yaml", overrides)
        print(f"\n=== [{i}/{len(SPECS)}] sweep {name} ({spec.mode}) ===", flush=True)
        failed += run_sweep(spec, "local", max_parallel=1 if spec.mode == "real" else 2).failed
    print(f"\n=== [documents] {DOCS_SETUP[0]} at {human(DOCS_SETUP[1])}: {', '.join(DOCS_SETUP[2])} (simulated) ===",
          flush=True)
    failed += run_docs(OUT / DOCS_ROWS)
    figs = OUT / "figs"
    print(f"\n=== [figures] committed rows + yours ({OUT}) -> {figs} ===", flush=True)
    make_all(REPO / "results", figs, verbose=False, user_dirs=(OUT,))
    summary()
    print(f"\ndemo finished in {time.time() - start:.0f}s: rows in {OUT}/, figures and tables in {figs}/ "
          f"(its index is the README.md there); results/ and paper_figs/ untouched"
          + (f"; {failed} trial(s) failed, see their error rows" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
