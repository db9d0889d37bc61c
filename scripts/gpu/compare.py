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

Both tables are rendered by ``analysis.gpu_report`` (the suite's one writer of tables); this
script simulates and hands it the rows.

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
from analysis.gpu_report import docs_args, lever_args, model_arg, opt_args, trial_key, write_gpu_report  # noqa: E402

POOLS = ("shared", "per-stream")


def simulate(row: dict, pools: str) -> dict:
    """The simulated twin of a real or emulated row (same method, options, model, world size,
    length, levers, documents, device preset)."""
    cmd = [sys.executable, "-m", "bench", "run", "--mode", "simulated", "--device", row["device"],
           "--world-size", str(row["world_size"]), "--model", model_arg(row), "--method", row["method"],
           "--seq-len", str(row["seq_len"]), *opt_args(row), *lever_args(row),
           *docs_args(row), "--stack", "lean", "--allocator-model", "expandable", "--allocator-pools", pools,
           "--kernel-workspace", "fa2", "--no-save", "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    for path in write_gpu_report(args.dir, real_rows, by_trial, sims, args.pools):
        print(f"wrote {path}", file=sys.stderr)
    print((args.dir / "compare.md").read_text(), end="")


if __name__ == "__main__":
    main()
