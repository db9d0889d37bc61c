"""``python -m sweeps``: run or watch a sweep spec (YAML) locally or on Slurm.

    python -m sweeps run sweeps/configs/table3-llama3-8b-cpu.yaml --executor local
    python -m sweeps run sweeps/configs/table3-llama3-8b.yaml --executor slurm --set slurm.partition=h100
    python -m sweeps status sweeps/configs/table3-llama3-8b-cpu.yaml
"""
from __future__ import annotations

import argparse
import sys

import yaml

from records.sizes import positive_int

from .runner import LOCAL_EXECUTORS, _bar, run_sweep, status_counts
from .spec import SpecError, load_spec


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SpecError(f"--set {pair!r}: expected KEY=VALUE (e.g. slurm.partition=gpu)")
        key, value = pair.split("=", 1)
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise SpecError(f"--set {pair!r}: {value!r} is not a YAML value") from None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m sweeps", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    run = sub.add_parser("run", help="submit the trials of SPEC that have no row yet")
    run.add_argument("spec")
    run.add_argument("--executor", choices=("local", "slurm", "debug"), default="local")
    run.add_argument("--dry-run", action="store_true", help="check the spec, print the bench commands, submit nothing")
    run.add_argument("--max-parallel", type=positive_int, default=None, help="jobs in flight at once (>= 1)")
    run.add_argument("--retry-errors", action="store_true", help="run trials whose row is an error again")
    run.add_argument("--rerun", action="store_true",
                     help="run every trial again, rows or not (e.g. after changing a method); the newest row wins")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a spec key, e.g. --set slurm.partition=gpu --set mode=simulated")
    st = sub.add_parser("status", help="done / running / failed / pending counts of SPEC")
    st.add_argument("spec")
    st.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec, _overrides(args.set))
        if args.command == "status":
            counts = status_counts(spec)
            total = sum(counts.values())
            print(f"{spec.name}: {_bar(counts['done'] + counts['failed'], total)}  "
                  + "  ".join(f"{k} {counts[k]}" for k in ("done", "running", "failed", "pending"))
                  + f"  (rows: {spec.rows_path})")
            return 0
        problems = spec.problems(libraries=args.executor in LOCAL_EXECUTORS)  # elsewhere: the compute node's
        if problems:
            for line in problems:
                print(f"error: {line}", file=sys.stderr)
            print(f"error: {spec.source}: {len(problems)} problem(s); nothing was submitted", file=sys.stderr)
            return 2
        summary = run_sweep(spec, args.executor, args.dry_run, args.max_parallel, args.retry_errors,
                            rerun=args.rerun)
    except (SpecError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: finished rows are kept; run the same command again to resume", file=sys.stderr)
        return 130
    print(f"{spec.name}: {summary.submitted} run ({summary.ok} ok, {summary.failed} failed), "
          f"{summary.skipped} skipped (already done); rows in {spec.rows_path}")
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
