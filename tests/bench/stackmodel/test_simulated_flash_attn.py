"""Simulated trials of the methods that call flash-attn through a library, on the simulated
flash-attn (bench.stackmodel.fake_flash_attn), each in a fresh process (``bench.cli.main``, the
entry point of ``python -m bench``): the tests' own process has the plain-torch stand-in in
``sys.modules`` (tests/conftest.py), and the libraries bind flash-attn's functions when first
imported. The fresh processes are forked from one that imported torch and the package once
(``fresh``): that import is most of a process's time. A method on the suite's own kernels
(``ulysses``, which calls no flash-attn) is simulated here through the same entry point."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import methods
from bench import cli

ROOT = Path(__file__).resolve().parents[3]
WRAPPERS = ("yc-ulysses", "rfa-zigzag", "yc-ring", "yc-usp", "ds-fpdt")


def simulate(tmp_path: Path, method: str, *args: str) -> dict:
    """The row of ``python -m bench run --mode simulated`` through ``bench.cli.main`` in this process:
    only for a method that calls no flash-attn (the others: ``fresh``)."""
    out = tmp_path / "rows.jsonl"
    before = out.read_text().count("\n") if out.exists() else 0
    assert not methods.get_info(method).requires, f"{method} needs a library: simulate it in a fresh process"
    assert cli.main(_run_argv(method, out, *args)) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == before + 1
    return rows[-1]


def _run_argv(method: str, out: Path, *args: str) -> list[str]:
    return ["run", "--method", method, "--mode", "simulated", "--out", str(out), *args]


WRAPPER_ARGS = ("--model", "tiny-llama", "--seq-len", "4K", "--world-size", "4")
# Llama3-8B on 8 ranks, kernels only (no paper-stack terms): test_yc_ulysses_peak_matches_ulysses_with_the_fa2_workspace
YC_8B_ARGS = ("--model", "llama3-8b", "--seq-len", "512K", "--world-size", "8", "--scope", "attention",
              "--stack", "lean")

# Each job in a fresh process of its own, forked from one that imported ``bench`` (first, as ``python -m bench``
# does: the simulated CUDA device before torch) and ``bench.cli`` but no library: a job imports its libraries
# itself (a trial, ``bench.cli.main`` on an argv, installs the simulated flash-attn for itself and removes it
# after, as a ``python -m bench run`` would), without importing torch and the package again. A job is an argv,
# or a script to run as ``python -c`` would (``{"code": ..., "argv": [...]}``). The exit codes on the last line.
FRESH_RUNS = """
import bench  # noqa: F401 - first: the simulated CUDA device before torch
import json
import os
import sys
import traceback

from bench import cli

codes = []
for job in json.loads(sys.argv[1]):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if isinstance(job, list):
                code = cli.main(job)
            else:
                sys.argv = ["-c", *job["argv"]]
                exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__"})
                code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes), flush=True)
"""


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict[str, dict]:
    """What this module runs in fresh processes (``FRESH_RUNS``), by name: the row of each library trial
    (each wrapper on tiny-llama, and ``yc-ulysses-8b``: yc-ulysses on Llama3-8B as ``YC_8B_ARGS``),
    ``fa3-probe``: ``FA3_PROBE``'s answer, and ``routes-probe``: ``ROUTES_PROBE``'s; what needs a library
    missing here is left out (its test skips)."""
    out_dir = tmp_path_factory.mktemp("fresh")
    runs = {m: (m, *WRAPPER_ARGS) for m in WRAPPERS if libraries_present(m)}
    if libraries_present("yc-ulysses"):
        runs["yc-ulysses-8b"] = ("yc-ulysses", *YC_8B_ARGS)
    jobs: list = [_run_argv(method, out_dir / f"{name}.jsonl", *args) for name, (method, *args) in runs.items()]
    probe, routes = out_dir / "fa3-probe.json", out_dir / "routes-probe.json"
    if libraries_present("yc-usp"):
        jobs.append({"code": FA3_PROBE, "argv": [json.dumps(FA3_CASES), str(probe)]})
        jobs.append({"code": ROUTES_PROBE, "argv": [str(routes)]})
    if not jobs:
        return {}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", FRESH_RUNS, json.dumps(jobs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0] * len(jobs), proc.stderr[-2000:]
    got = {}
    for name in runs:
        lines = (out_dir / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) == 1, name
        got[name] = json.loads(lines[0])
    if probe.exists():
        got["fa3-probe"] = json.loads(probe.read_text())
    if routes.exists():
        got["routes-probe"] = json.loads(routes.read_text())
    return got


def libraries_present(method: str) -> bool:
    return not methods.get_info(method).missing(provided=("flash_attn", "flash_attn_interface"))


@pytest.mark.parametrize("method", WRAPPERS)
def test_wrapped_flash_attn_methods_simulate(fresh, method):
    if not libraries_present(method):
        pytest.skip(f"{method}: {methods.get_info(method).status}")
    row = fresh[method]
    assert row["status"] == "ok", row.get("message")
    assert row["figures"]["peak_bytes"] > 0
    if methods.get_info(method).missing():  # no flash-attn installed here: ours served
        assert any("fake_flash_attn" in note for note in row["notes"])


def test_yc_ulysses_peak_matches_ulysses_with_the_fa2_workspace(fresh, tmp_path):
    """Llama3-8B on 8 ranks: both methods run the same all-to-all layout with one KV head per rank
    (G = C = 8: ``ulysses`` replicates nothing), so they differ only in the kernel. ``ulysses``'s
    torch kernel with ``kernel_workspace=fa2`` adds bench.stackmodel.workspace's flash-attn 2
    backward scratch; yc-ulysses's simulated flash-attn allocates mha_bwd's own (the same buffers),
    so the attention-scope peaks agree to well within 1%, and without the workspace model
    ``ulysses`` is lower by about that scratch (dq_accum fp32 + expanded dK/dV)."""
    if not libraries_present("yc-ulysses"):
        pytest.skip(methods.get_info("yc-ulysses").status)
    yc = fresh["yc-ulysses-8b"]["figures"]["peak_bytes"]
    plain = simulate(tmp_path, "ulysses", *YC_8B_ARGS)["figures"]["peak_bytes"]
    modelled = simulate(tmp_path, "ulysses", *YC_8B_ARGS, "--kernel-workspace", "fa2")["figures"]["peak_bytes"]
    assert abs(yc - modelled) <= 0.01 * modelled, (yc, modelled)
    s, h = 512 << 10, 32 // 8  # rank-local sequence and query heads during attention
    scratch = s * h * 128 * 4 + 2 * s * h * 128 * 2
    assert 0.75 * scratch <= yc - plain <= 1.1 * scratch, (yc, plain, scratch)


# In one fresh process (a job of ``FRESH_RUNS``): the simulated flash-attn with recorders around its FA3 entry
# points (before yunchang binds them), then one attention block (forward + backward) of each case on rank 0;
# the answer written to the file ``sys.argv[2]``.
FA3_PROBE = """
import bench  # noqa: F401 - first: the simulated CUDA device before torch
import json
import os
import sys

from bench.stackmodel import fake_flash_attn as ffa
from bench.measure.run import guarded, measure_simulated
from bench.measure.trial import Trial
from bench.measure.config import StepConfig

ffa.install()
iface = sys.modules["flash_attn_interface"]
calls = []


def recorder(kind, fn):
    def wrapped(*args, **kwargs):
        calls.append([kind, bool(kwargs.get("causal"))])
        return fn(*args, **kwargs)
    return wrapped


iface._flash_attn_forward = recorder("fwd", ffa.fa3_forward)
iface._flash_attn_backward = recorder("bwd", ffa.fa3_backward)
out = {}
for name, method, options in json.loads(sys.argv[1]):
    del calls[:]
    trial = Trial.make(method, "tiny-llama", 4096, 4, options, mode="simulated", device="h100-80g",
                       step=StepConfig(scope="attention"))
    r = guarded(measure_simulated, trial)
    out[name] = {"status": r.status, "message": r.message, "calls": list(calls),
                 "flops": r.step_counts.flops_attention if r.step_counts else None}
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
os._exit(0)  # the interpreter's teardown sometimes aborts after several fake process groups (seen without yc_fa3 too)
"""
FA3_CASES = [("ring-fa", "yc-ring", {"attn_type": "fa"}), ("ring-fa3", "yc-ring", {"attn_type": "fa3"}),
             ("usp-fa3", "yc-usp", {"attn_type": "fa3", "ulysses_degree": 2})]


def test_yunchang_fa3_ring_blocks_get_their_causal_flag(fresh):
    """pip yunchang 0.6.4 hands flash-attn 3 causal=False on every zigzag-ring block (see
    methods.core.yc_fa3); the wrappers pass the ring's flag on, as the paper's vendored copy did.
    Rank 0 of a ring of R computes its diagonal block first, causal, then R-1 unmasked ones, in
    forward and in backward: so the FA3 stand-in receives exactly that, and yc-ring's counted
    attention FLOPs equal those of its flash-attn 2 path (which always passed the flag)."""
    if not libraries_present("yc-usp"):
        pytest.skip(methods.get_info("yc-usp").status)
    got = fresh["fa3-probe"]
    assert all(r["status"] == "ok" for r in got.values()), got
    for name, ring in (("ring-fa3", 4), ("usp-fa3", 2)):  # yc-usp 2x2: a ring of 2
        flags = [False] * ring
        flags[0] = True
        assert got[name]["calls"] == [["fwd", f] for f in flags] + [["bwd", f] for f in flags], name
    assert got["ring-fa"]["calls"] == []  # flash-attn 2's path
    assert got["ring-fa3"]["flops"] == got["ring-fa"]["flops"] > 0
    assert got["usp-fa3"]["flops"] == got["ring-fa"]["flops"]  # the same causal work per rank


# In one fresh process (a job of ``FRESH_RUNS``): yunchang's ring with flash-attn 3 on 4 ranks (two-layer tiny
# model, paper stack) simulated twice, with ``bench.measure.fakeroute``'s routes for the simulated kernels
# (``_own_kernel``) and barriers (``_WORK_ONLY``) watched, then with both turned off; the answer written to the
# file ``sys.argv[1]``. (The arguments' ids are kept, not the arguments: holding the barrier's tensor would move
# the host peak.)
ROUTES_PROBE = """
import bench  # noqa: F401 - first: the simulated CUDA device before torch
import json
import os
import sys

import torch

from bench.measure import fakeroute, run
from bench.measure.config import StepConfig
from bench.measure.trial import Trial

trial = Trial.make("yc-usp", "tiny-llama", 4096, 4, {"attn_type": "fa3", "ulysses_degree": 1},
                   step=StepConfig(stack="paper"))


def figures():
    out = run.measure_simulated(trial).to_dict()
    out.get("allocator", {}).pop("replay_s", None)  # the replay's own wall time
    return out


own, barriers, made = [], [], []
own_kernel, make = fakeroute._own_kernel, fakeroute.create_fakework
barrier = torch.ops.c10d.barrier.default
tensors = fakeroute._WORK_ONLY[barrier]
fakeroute._own_kernel = lambda *a: own.append(own_kernel(*a)) or own[-1]
fakeroute._WORK_ONLY[barrier] = lambda args: barriers.append(id(args)) or tensors(args)
fakeroute.create_fakework = lambda args, **k: made.append(id(args)) or make(args, **k)
fast = figures()
answer = {"kernels": len(own), "all_direct": all(own), "barriers": len(barriers),
          "barriers_direct": set(barriers) <= set(made)}
fakeroute._own_kernel = lambda *a: False
del fakeroute._WORK_ONLY[barrier]
answer["same_figures"] = figures() == fast
with open(sys.argv[1], "w") as f:
    json.dump(answer, f)
os._exit(0)  # as FA3_PROBE: no teardown of the fake process groups
"""


def test_simulated_flash_kernels_and_barriers_are_answered_directly_and_measure_the_same(fresh):
    """``ROUTES_PROBE``: every simulated flash-attn 3 kernel call (``cpab_sim::fa3_fwd``/``fa3_bwd``) of
    yunchang's ring runs its fake implementation through ``fakeroute.call``, every barrier after a ring step
    gets its work handle directly, and every figure is what ``FakeTensorMode``'s own dispatch of them gives."""
    if not libraries_present("yc-usp"):
        pytest.skip(methods.get_info("yc-usp").status)
    got = fresh["routes-probe"]
    assert got["kernels"] and got["all_direct"], f"a simulated kernel went to FakeTensorMode: {got}"
    assert got["barriers"] and got["barriers_direct"], f"a barrier went to FakeTensorMode: {got}"
    assert got["same_figures"], got
