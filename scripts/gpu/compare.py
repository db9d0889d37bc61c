"""Set the real-GPU rows of scripts/gpu/validate.sh beside the simulation of the same trials.

For every distinct real trial in ``DIR/real.jsonl`` (method, sequence length, levers) this
simulates the same trial (``python -m bench run --mode simulated``: the row's world size, model,
device preset, options and levers, the GPU code path) with the allocator model as the real run
set it (expandable segments) and the kernel the real run called (torch's SDPA flash, so the
FA2 backward scratch model), once with one pool for every stream and once with a pool per
stream, and writes

* ``DIR/simulated.jsonl``: the simulated rows, each of the rank the real row's figures are
  (``figures.worst_rank``, else rank 0: ``$CPAB_SIM_RANKS``), so that real and simulated are the same rank;
* ``DIR/simulated_ranks.jsonl``: for a real row that measured several ranks (an emulated row with
  ``figures.rank_peaks``), each of those ranks simulated alone, in rank order and, per rank, the
  pools' order; ``compare.md`` then sets each rank's real allocated and reserved peaks
  (``rank_peaks``, ``rank_reserved_peaks``) beside its simulation's;
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
import contextlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from analysis.gpu_report import docs_args, lever_args, model_arg, opt_args, trial_key, write_gpu_report  # noqa: E402

POOLS = ("shared", "per-stream")


def simulate(row: dict, pools: str, rank: int) -> dict:
    """The simulated twin of a real or emulated row (same method, options, model, world size,
    length, levers, documents, device preset), on rank ``rank`` alone (``$CPAB_SIM_RANKS``)."""
    cmd = [sys.executable, "-m", "bench", "run", "--mode", "simulated", "--device", row["device"],
           "--world-size", str(row["world_size"]), "--model", model_arg(row), "--method", row["method"],
           "--seq-len", str(row["seq_len"]), *opt_args(row), *lever_args(row),
           *docs_args(row), "--stack", "lean", "--allocator-model", "expandable", "--allocator-pools", pools,
           "--kernel-workspace", "fa2", "--no-save", "--json"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "CPAB_SIM_RANKS": str(rank)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def row_rank(row: dict) -> int:
    """The rank whose figures a real row carries (rank 0 for a row from before ranks were recorded)."""
    return row["figures"].get("worst_rank") or 0


def measured_ranks(row: dict) -> list[int]:
    """The ranks a real row measured one by one (an emulated row's ``rank_peaks``); empty for one rank."""
    return [rank for rank, _ in row["figures"].get("rank_peaks") or []]


def stored(path: Path, expected: int, what: str) -> list[dict]:
    """The simulated rows of ``path`` (``--from-rows``), refused unless there are ``expected`` of them."""
    if not path.exists():
        sys.exit(f"compare.py: --from-rows needs {path}; run without --from-rows to simulate")
    rows = [json.loads(line) for line in path.open()]
    if len(rows) != expected:
        sys.exit(f"compare.py: {path} holds {len(rows)} rows, not {what}; run without --from-rows to simulate")
    return rows


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
    # real rows that measured several ranks: each rank simulated alone, by rank, then by pools
    rank_sims: dict[tuple, dict[int, dict[str, dict]]] = {
        key: {rank: {} for rank in measured_ranks(rows[0])} for key, rows in by_trial.items()
        if measured_ranks(rows[0])}
    sim_path, ranks_path = args.dir / f"simulated{suffix}", args.dir / f"simulated_ranks{suffix}"
    if args.from_rows:  # written trial by trial (sorted), each in args.pools' order
        twins = iter(stored(sim_path, len(by_trial) * len(args.pools),
                            f"one per real trial and pool ({len(by_trial)} x {len(args.pools)})"))
        for key in sorted(by_trial):
            sims[key] = {pools: next(twins) for pools in args.pools}
        if rank_sims:
            n = sum(len(ranks) for ranks in rank_sims.values())
            each = iter(stored(ranks_path, n * len(args.pools),
                               f"one per rank of the real rows' rank_peaks and pool ({n} x {len(args.pools)})"))
            for key in sorted(rank_sims):
                for rank in rank_sims[key]:
                    rank_sims[key][rank] = {pools: next(each) for pools in args.pools}
    else:
        with sim_path.open("w") as f, (ranks_path.open("w") if rank_sims else contextlib.nullcontext()) as g:
            for n, (key, rows) in enumerate(sorted(by_trial.items()), 1):
                sims[key] = {}
                for rank in rank_sims.get(key, {}):  # each measured rank: the twin is the real row's own rank
                    for pools in args.pools:
                        print(f"[{n}/{len(by_trial)}] simulating {key[0]} at {key[1]} tokens, rank {rank} of "
                              f"{key[2]}, {pools} pools", flush=True)
                        rank_sims[key][rank][pools] = sim = simulate(rows[0], pools, rank)
                        g.write(json.dumps(sim) + "\n")
                        g.flush()
                for pools in args.pools:
                    if key in rank_sims:
                        sims[key][pools] = sim = rank_sims[key][row_rank(rows[0])][pools]
                    else:
                        print(f"[{n}/{len(by_trial)}] simulating {key[0]} at {key[1]} tokens, {pools} pools",
                              flush=True)
                        sims[key][pools] = sim = simulate(rows[0], pools, row_rank(rows[0]))
                    f.write(json.dumps(sim) + "\n")
    for path in write_gpu_report(args.dir, real_rows, by_trial, sims, args.pools, rank_sims):
        print(f"wrote {path}", file=sys.stderr)
    print((args.dir / "compare.md").read_text(), end="")


if __name__ == "__main__":
    main()
