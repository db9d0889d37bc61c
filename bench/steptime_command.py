"""``python -m bench steptime``: the command around the step-time fit (``bench.stackmodel.steptime_fit``).

It checks its outputs, collects counts when asked, fits and models Table 3, and hands the result
to analysis, the one writer of tables (``analysis.steptime_report``). Kept apart from the fit so
that the fit imports no writer and analysis can import the fit.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from analysis.steptime_report import render, write_table3_model
from records.outputs import OutputError, check_dir, check_file, runs_dir

from .stackmodel.steptime_fit import (
    COUNT_LENGTHS,
    COUNTS,
    LABEL,
    SETUPS,
    TABLE3_METHODS,
    collect,
    load_counts,
    model_table3,
    paper_cells,
    refresh_rows,
)
from .stackmodel.steptime_fit import __doc__ as FIT_DOC


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench steptime", description=FIT_DOC.splitlines()[0])
    p.add_argument("--counts", default=str(COUNTS), help="counts rows (default: the committed ones)")
    p.add_argument("--collect", action="store_true", help="simulate the counts first (minutes), appending to --counts")
    p.add_argument("--models", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--methods", nargs="+", default=list(TABLE3_METHODS), choices=list(TABLE3_METHODS))
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="default: COUNT_LENGTHS per model")
    p.add_argument("--only-collect", action="store_true", help="with --collect: stop after collecting")
    p.add_argument("--no-fit", action="store_true", help="use FITTED instead of refitting")
    p.add_argument("--refresh", action="store_true", help="recompute the counts rows' step-time figures with FITTED "
                   "(after FITTED changed), then go on")
    p.add_argument("--figs", default=None, help="write table3_model.md/.csv into this folder (paper_figs: on purpose)")
    p.add_argument("--out", default=None, help="per-cell records (JSON Lines: paper, modelled, residual, terms, "
                   "constants); default <runs>/steptime/table3_model.jsonl")
    args = p.parse_args(argv)
    counts_path = Path(args.counts)
    out = Path(args.out) if args.out else runs_dir() / "steptime" / "table3_model.jsonl"
    try:  # every output checked before any work: one line, not a traceback after the table
        check_file(out, "--out")
        if args.figs:
            check_dir(args.figs, "--figs")
        if args.collect or args.refresh:
            check_file(counts_path, "--counts")
    except OutputError as err:
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    if args.collect:
        collect(counts_path, tuple(args.models), tuple(args.methods), tuple(args.lengths) if args.lengths else None)
        if args.only_collect:
            return 0
    if not counts_path.exists():
        print(f"error: no counts at {counts_path}; run with --collect first", file=sys.stderr)
        return 2
    if args.refresh:
        print(f"refreshed {refresh_rows(counts_path)} rows of {counts_path} with FITTED", file=sys.stderr)
    all_counts = load_counts(counts_path)
    missing = sorted({(c["model"], c["method"]) for c in paper_cells()
                      if any((c["model"], c["method"], s) not in all_counts for s in COUNT_LENGTHS[c["model"]])})
    if missing:
        print(f"error: {counts_path} lacks counts at COUNT_LENGTHS for {missing}; "
              "run --collect for them", file=sys.stderr)
        return 2
    records, constants = model_table3(all_counts, fit_now=not args.no_fit)
    text = render(records, constants, not args.no_fit)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as handle:
        for r in records:
            handle.write(json.dumps({**r, "mode": LABEL, "constants": dataclasses.asdict(constants),
                                     "counts_from": str(counts_path)}) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    if args.figs:
        for f in write_table3_model(records, Path(args.figs), text):
            print(f"wrote {f}", file=sys.stderr)
    return 0
