"""``python -m analysis figs [--results DIR] [--mine DIR ...] [--out DIR] [--plans] [--max-context-docs D]``: every
table and figure.

Reads every row under ``--results`` (default: the repository's committed ``results/``) and,
with ``--mine``, the user's own rows (e.g. ``runs/``, labelled ``yours`` in every series), and
writes the paper's tables (Markdown + CSV) and figures (PNG + SVG), paper and ours side by
side, with an index ``README.md``, into ``--out`` (default: ``runs/figs``; the maintainers
regenerate the committed ``paper_figs/`` with ``make figs``). Works with no rows at all. Then
the outputs ``bench`` computes, from the committed data under ``--results``
(``analysis.derived``): the fidelity table and figure, the modelled Table 3 and, with
``--plans`` (``make figs-plans``), the committed plans from the committed simulation cache.
The paper's tables and figures draw the rows of one sequence; ``--max-context-docs NAME[:SEED]``
has the max-context table and figure draw the rows with those packed documents instead (the
documents' own tables, ``docs_*``, draw every case).
"""
from __future__ import annotations

import argparse
import os
import sys

from records.outputs import OutputError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    figs = sub.add_parser("figs", help="regenerate every table and figure of the paper")
    figs.add_argument("--results", default=None, help="folder of result rows (*.jsonl); default: results/")
    figs.add_argument("--mine", action="append", default=[], metavar="DIR",
                      help="a folder of your own rows to show beside the committed ones (repeatable), e.g. runs")
    figs.add_argument("--out", default=None, help="output folder; default: runs/figs (make figs: paper_figs/)")
    figs.add_argument("--plans", action="store_true",
                      help="also re-render the committed plans from the committed simulation cache "
                      "(results/plan/sims.ndjson; no simulation, tens of seconds; make figs-plans)")
    figs.add_argument("--max-context-docs", default="none", metavar="NAME[:SEED]",
                      help="the packed documents whose rows the max-context table and figure draw "
                      "(default: none, one sequence, as the paper ran; e.g. prolong64k:0)")
    figs.add_argument("--quiet", action="store_true", help="print nothing but errors")
    args = parser.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    from .report import make_all
    from .select import docs_choice

    try:
        max_context_docs = docs_choice(args.max_context_docs)
    except ValueError as err:
        print(f"python -m analysis figs: error: --max-context-docs: {err}", file=sys.stderr)
        return 2

    if args.results is not None and not os.path.isdir(args.results):
        print(f"note: {args.results} does not exist: paper-only tables and figures", file=sys.stderr)
    for mine in args.mine:
        if not os.path.isdir(mine):
            print(f"python -m analysis figs: error: --mine {mine} is not a folder of rows", file=sys.stderr)
            return 2
    try:
        make_all(args.results, args.out, verbose=not args.quiet, user_dirs=tuple(args.mine), plans=args.plans,
                 max_context_docs=max_context_docs)
    except (OutputError, LookupError) as err:  # LookupError: committed data short of a derived output
        print(f"python -m analysis figs: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
