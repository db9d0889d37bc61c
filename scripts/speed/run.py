"""Speed of simulated trials: a base commit's code and this tree's, side by side in one run.

For each case (a model, a length, a world size, a method) and accounting stack, one simulated trial
(``bench.measure.run.measure_simulated``) runs in a fresh Python process on each code: the base
commit's (a detached ``git worktree`` of it, made here and removed afterwards) and this tree's,
alternately, so that every speed-up is a ratio of two runs on the same machine at the same time.
Each run reports its wall time, its CPU time (every thread of the process: the autograd engine runs
the backward on a thread of its own), the operators dispatched to the fake-tensor mode (the
simulator's unit of work), the time per operator, and the host's 1-minute load average before and
after. Both runs' figures (the whole measurement, the replay's wall time aside) are compared: a
speed-up that changed one is reported as such and the script exits non-zero.

    python scripts/speed/run.py                        # tiny and 1M, both stacks, base = merge-base with main
    python scripts/speed/run.py --cases tiny,1m,4m --base <commit> --out results/speed/speed.ndjson
    python scripts/speed/run.py --cases none --commands search,plan --base <commit> --out ...

``--commands`` times whole user commands the same way (``COMMANDS``: the paper-scale max-context search,
a plan of a model with no cache, the fidelity run, the demo), each in a fresh process on each tree,
with the CPU time of the process and every child it waited for, and the answer each gave (the search's
max context, the plan's per configuration, the fidelity table, the demo's exit status) compared.

Rows go to ``--out`` (JSON Lines, one per run), a table to stdout. What was measured and on which
machine: ``results/speed/README.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    seq_len: int
    world_size: int
    method: str = "upipe"


CASES = {c.name: c for c in (
    Case("tiny", "tiny-llama", 16 << 10, 8),
    Case("1m", "llama3-8b", 1 << 20, 8),
    Case("4m", "llama3-8b", 4 << 20, 8),
)}
STACKS = ("paper", "lean")


@dataclass(frozen=True)
class Command:
    """A whole command a user waits for: ``argv`` after ``python``, with ``{out}`` a fresh directory;
    ``answer(out, stdout, stderr)`` is what it found, compared between the two trees."""

    name: str
    argv: tuple[str, ...]
    answer: Callable[[Path, str, str], Any]
    env: tuple[tuple[str, str], ...] = ()


def _search_answer(out: Path, stdout: str, stderr: str) -> Any:
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines() if line.strip()]
    return [r["figures"]["max_context"] for r in rows if r["kind"] == "max_context"]


def _plan_answer(out: Path, stdout: str, stderr: str) -> Any:
    return sorted(line.split("] ", 1)[1].split(" (")[0] for line in stderr.splitlines()
                  if line.startswith("[plan] ") and ": " in line and "searches on" not in line)


def _fidelity_answer(out: Path, stdout: str, stderr: str) -> Any:
    rows = [json.loads(line) for line in (out / "fidelity.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r["method"], r["model"], r["seq_len"], r["world_size"], json.dumps(r.get("levers"), sort_keys=True),
                   r["status"], r["figures"].get("peak_reserved_bytes") or r["figures"].get("peak_bytes"))
                  for r in rows)


def _demo_answer(out: Path, stdout: str, stderr: str) -> Any:
    return [line for line in stdout.splitlines() if "max context" in line.lower()]


COMMANDS = {c.name: c for c in (
    Command("search", ("-m", "bench", "max-context", "--method", "upipe", "--model", "llama3-8b", "--world-size", "8",
                       "--mode", "simulated", "--granularity", "256K", "--max-seq-len", "16M", "--start", "2M",
                       "--extrapolate-layers", "--stack", "paper", "--out", "{out}/rows.jsonl"), _search_answer),
    Command("plan", ("-m", "bench", "plan", "--model", "bench/model_configs/hf/Qwen3-8B/config.json", "--gpus", "8",
                     "--device", "h100-80g", "--no-cache", "--out-dir", "{out}"), _plan_answer),
    Command("fidelity", ("-m", "bench", "fidelity", "--out", "{out}"), _fidelity_answer),
    Command("demo", ("-m", "sweeps.demo",), _demo_answer, (("CPAB_RUNS", "{out}"),)),
)}

# run in a child process with PYTHONPATH at one tree: one trial, timed, its operators counted
CHILD = r"""
import bench  # first: the simulated CUDA device loads before torch
import itertools, json, os, resource, sys, time
from torch._subclasses.fake_tensor import FakeTensorMode
from bench.measure.run import measure_simulated
from bench.measure.trial import Trial
try:
    from bench.measure.config import StepConfig
except ImportError:  # a base from before the module moved (57cd16c, the base of issue 38)
    from bench.training.config import StepConfig

method, model, seq_len, world, stack = sys.argv[1:6]
ops = itertools.count()
dispatch = FakeTensorMode.__torch_dispatch__

def counted(self, *args, **kwargs):
    next(ops)
    return dispatch(self, *args, **kwargs)

FakeTensorMode.__torch_dispatch__ = counted
trial = Trial.make(method, model, int(seq_len), int(world), step=StepConfig(stack=stack))
trial.validate()
load_before = os.getloadavg()[0]
usage0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
result = measure_simulated(trial)
wall = time.perf_counter() - t0
usage1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
figures = result.to_dict()
if "allocator" in figures:
    figures["allocator"].pop("replay_s")
print("SPEED " + json.dumps({"wall_s": wall, "cpu_s": cpu, "ops": next(ops), "load_before": load_before,
                             "load_after": os.getloadavg()[0], "figures": figures}))
"""


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_one(tree: Path, case: Case, stack: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", CHILD, case.method, case.model, str(case.seq_len),
                           str(case.world_size), stack], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("SPEED "):
            return json.loads(line[len("SPEED "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    raise RuntimeError(f"{case.name}/{stack} in {tree} failed (exit {proc.returncode}): " + " | ".join(tail))


def run_command(tree: Path, command: Command, timeout: float) -> dict:
    """``command`` in a fresh process at ``tree``: wall and CPU seconds (its own and every child's it waited
    for, as ``os.wait4`` reports them) and its answer."""
    out = Path(tempfile.mkdtemp(prefix=f"speed-{command.name}-"))
    try:
        env = {**os.environ, "PYTHONPATH": str(tree), **{k: v.format(out=out) for k, v in command.env}}
        argv = [sys.executable, *(a.format(out=out) for a in command.argv)]
        load_before = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise RuntimeError(f"{command.name} in {tree} ran past {timeout:.0f} s") from None
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0 and command.name != "demo":
            tail = stderr.strip().splitlines()[-5:]
            raise RuntimeError(f"{command.name} in {tree} failed (exit {proc.returncode}): " + " | ".join(tail))
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {"wall_s": wall, "cpu_s": cpu, "load_before": load_before, "load_after": os.getloadavg()[0],
                "exit": proc.returncode, "answer": command.answer(out, stdout, stderr),
                "progress_lines": sum(line.startswith("[") for line in stderr.splitlines())}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=None, help="commit of the code to compare with (default: merge-base of HEAD "
                   "and main)")
    p.add_argument("--cases", default="tiny,1m", help=f"comma-separated, of {sorted(CASES)}, or none "
                   "(default: tiny,1m)")
    p.add_argument("--commands", default="", help=f"comma-separated whole commands, of {sorted(COMMANDS)} "
                   "(default: none)")
    p.add_argument("--stacks", default=",".join(STACKS), help="comma-separated, of paper,lean (default: both)")
    p.add_argument("--out", default=None, help="JSON Lines file to append the rows to (default: none)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one trial may take (default: 3600)")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip() and c.strip() != "none"]
    args.stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    args.commands = [c.strip() for c in args.commands.split(",") if c.strip()]
    unknown = ([c for c in args.cases if c not in CASES] + [s for s in args.stacks if s not in STACKS]
               + [c for c in args.commands if c not in COMMANDS])
    if unknown or not (args.cases or args.commands) or not args.stacks:
        p.error(f"unknown or no cases/stacks/commands {unknown}: cases are {sorted(CASES)}, stacks {list(STACKS)}, "
                f"commands {sorted(COMMANDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = git("rev-parse", args.base or git("merge-base", "HEAD", "main"))
    head = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    machine = {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "python": platform.python_version(),
               "host": platform.node()}
    print(f"base {base[:10]} vs HEAD {head[:10]}{' (+ uncommitted changes)' if dirty else ''}; "
          f"{machine['cpus']} CPUs ({machine['cpu_model']})", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="speed-base-"))
    tree = workdir / "base"
    git("worktree", "add", "--detach", str(tree), base)
    rows, changed = [], []
    try:
        for name in args.cases:
            for stack in args.stacks:
                case = CASES[name]
                runs = {}
                for code, where in (("base", tree), ("new", ROOT)):
                    r = run_one(where, case, stack, args.timeout)
                    runs[code] = r
                    row = {"case": name, "model": case.model, "seq_len": case.seq_len, "world_size": case.world_size,
                           "method": case.method, "stack": stack, "code": code, "commit": base if code == "base"
                           else head, "uncommitted": dirty if code == "new" else False, **machine,
                           **{k: r[k] for k in ("wall_s", "cpu_s", "ops", "load_before", "load_after")},
                           "us_per_op": 1e6 * r["wall_s"] / max(1, r["ops"]),
                           "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
                    rows.append(row)
                    print(f"  {name:5s} {stack:5s} {code:4s} {r['wall_s']:8.1f} s wall {r['cpu_s']:8.1f} s CPU "
                          f"{r['ops']:8d} ops {row['us_per_op']:7.0f} us/op  load {r['load_before']:.2f}"
                          f"->{r['load_after']:.2f}", flush=True)
                same = runs["base"]["figures"] == runs["new"]["figures"]
                if not same:
                    changed.append(f"{name}/{stack}")
                for row in rows[-2:]:
                    row["figures_equal"] = same
                print(f"  {name:5s} {stack:5s} speed-up {runs['base']['wall_s'] / runs['new']['wall_s']:.2f}x wall, "
                      f"{runs['base']['cpu_s'] / runs['new']['cpu_s']:.2f}x CPU; figures "
                      f"{'identical' if same else 'DIFFER'}", flush=True)
        for name in args.commands:
            command = COMMANDS[name]
            runs = {}
            for code, where in (("base", tree), ("new", ROOT)):
                r = runs[code] = run_command(where, command, args.timeout)
                rows.append({"command": name, "code": code, "commit": base if code == "base" else head,
                             "uncommitted": dirty if code == "new" else False, **machine,
                             **{k: r[k] for k in ("wall_s", "cpu_s", "load_before", "load_after", "exit", "answer",
                                                  "progress_lines")},
                             "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
                print(f"  {name:8s} {code:4s} {r['wall_s']:8.1f} s wall {r['cpu_s']:8.1f} s CPU  exit {r['exit']}  "
                      f"load {r['load_before']:.2f}->{r['load_after']:.2f}  answer {json.dumps(r['answer'])[:160]}",
                      flush=True)
            same = runs["base"]["answer"] == runs["new"]["answer"]
            if not same:
                changed.append(name)
            for row in rows[-2:]:
                row["answers_equal"] = same
            print(f"  {name:8s} speed-up {runs['base']['wall_s'] / runs['new']['wall_s']:.2f}x wall, "
                  f"{runs['base']['cpu_s'] / runs['new']['cpu_s']:.2f}x CPU; answers "
                  f"{'identical' if same else 'DIFFER'}", flush=True)
    finally:
        git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=True) + "\n")
    if changed:
        print(f"figures or answers changed in {changed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
