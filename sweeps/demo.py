"""``make demo``: the suite's main job on its embedded default, end to end on this machine.

1. A local sweep of real CPU trials (``table3-llama3-8b-cpu``: every own method on 2 gloo
   ranks, tiny model, the paper's training levers) and a simulated paper-scale max-context
   search for every method (``demo-maxctx-llama3-8b``: Llama3-8B on 8 x H100-80GB), both
   through submitit's local executor, rows appended to ``results/demo/``.
2. ``analysis`` regenerates every table and figure into ``paper_figs/`` from all rows.
3. A short summary: our figures beside the paper's, each with its mode and device.

Finished trials are skipped, so a second ``make demo`` only redraws the figures.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from analysis.report import make_all
from records import human, read_rows

from .runner import run_sweep
from .spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SPECS = ("table3-llama3-8b-cpu", "demo-maxctx-llama3-8b")
OUT = REPO / "results" / "demo"
# keeps the whole demo within about 10 minutes on 2 cores (the full specs are one command away)
DEMO_OVERRIDES = {"table3-llama3-8b-cpu": {"seq_lens": ["2K"]}}
PAPER_MAX_CONTEXT = {"ring": "3M", "ulysses": "3M", "fpdt": "4M", "upipe": "5M", "offload": "not in paper"}


def _human(n: int | None) -> str:
    return human(n) if n else "—"


def summary() -> None:
    print("\n=== summary ===")
    rows = read_rows(OUT / "table3-llama3-8b-cpu.jsonl", on_error="warn")
    times = {(r.method, r.seq_len): r.figures.step_time_s for r in rows if r.status == "ok"}
    print("[real, 2 gloo ranks on this CPU, tiny-llama] step time (s); paper: UPipe/Ulysses 0.98-1.02 on H100")
    for seq in sorted({s for _, s in times}):
        shown = [m for m in ("ring", "ulysses", "fpdt", "upipe") if (m, seq) in times]
        cells = "  ".join(f"{m} {times[(m, seq)]:.3f}" for m in shown)
        ratio = times.get(("upipe", seq), 0) / times[("ulysses", seq)] if ("ulysses", seq) in times else float("nan")
        print(f"  {_human(seq):>5}: {cells}   upipe/ulysses {ratio:.2f}")
    rows = read_rows(OUT / "demo-maxctx-llama3-8b.jsonl", on_error="warn")
    print("[simulated, Llama3-8B, 8 x h100-80g, paper's levers] max context: ours (paper)")
    for r in rows:
        if r.kind == "max_context":
            found = r.figures.max_context
            step = (r.search or {}).get("step")
            # a search whose first step already fails found nothing at this granularity
            ours = f"<{_human(step)}" if found == 0 and r.status == "ok" and step else _human(found)
            print(f"  {r.method:<8} {ours:>6}  ({PAPER_MAX_CONTEXT.get(r.method, '—')})"
                  + ("" if r.status == "ok" else f"  [{r.status}: {r.message.splitlines()[0][:80]}]"))


def main() -> int:
    os.chdir(REPO)
    os.environ.setdefault("MPLBACKEND", "Agg")

    start = time.time()
    failed = 0
    for i, name in enumerate(SPECS, 1):
        overrides = {"out": str(OUT / f"{name}.jsonl"), **DEMO_OVERRIDES.get(name, {})}
        spec = load_spec(REPO / "sweeps" / "configs" / f"{name}.yaml", overrides)
        print(f"\n=== [{i}/{len(SPECS)}] sweep {name} ({spec.mode}) ===", flush=True)
        failed += run_sweep(spec, "local", max_parallel=1 if spec.mode == "real" else 2).failed
    print("\n=== [figures] python -m analysis figs -> paper_figs/ ===", flush=True)

    make_all(REPO / "results", REPO / "paper_figs", verbose=False)
    summary()
    print(f"\ndemo finished in {time.time() - start:.0f}s: rows in {OUT.relative_to(REPO)}/, "
          f"figures and tables in paper_figs/ (index: paper_figs/README.md)"
          + (f"; {failed} trial(s) failed, see their error rows" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
