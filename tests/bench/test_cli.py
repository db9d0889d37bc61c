"""``python -m bench``: both commands, real ranks (spawned and torchrun), JSON output, rows
appended; every bad argument is one line on stderr and exit code 2.

A subprocess where the process is the point (the command's wiring and its table; torchrun; a
fresh interpreter without the flash-attn stand-in; one bad argument end to end); elsewhere the
command's ``main`` in this process, which parses, prints and returns the same, without a Python
start-up (seconds) per command."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import methods
from bench.cli import main, parse_size
from records import read_rows

REPO = Path(__file__).resolve().parents[2]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_run_simulated_table_and_rows(tmp_path):
    out = tmp_path / "rows.jsonl"
    p = bench("run", "--method", "upipe", "--model", "tiny-llama", "--seq-len", "4K", "--world-size", "4",
              "--mode", "simulated", "--device", "h100-80g", "--opt", "chunk_heads=4", "--out", str(out))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["mode", "device"]
    assert lines[1].split()[:3] == ["simulated", "h100-80g", "4"] and " 4K " in lines[1] and " ok " in lines[1]
    assert "[simulated on 4 x h100-80g]" in p.stderr
    (row,) = read_rows(out, on_error="raise")
    assert row.options == {"chunk_heads": 4} and row.seq_len == 4096 and row.mode == "simulated"


def test_simulated_runs_replay_a_pool_per_stream_unless_asked(tmp_path, capsys):
    """`bench run` in simulated mode runs the paper stack with a pool per stream (the row records
    it); `--allocator-pools shared` and `--stack lean` are kept as asked (all three through the
    command's ``main`` in this process: the subprocess's wiring is test_run_simulated_table_and_rows')."""
    argv = ("run", "--method", "ulysses", "--model", "tiny-llama", "--seq-len", "2K", "--world-size", "2",
            "--mode", "simulated", "--json", "--no-save")
    levers = {}
    for name, extra in (("default", ()), ("shared", ("--allocator-pools", "shared")), ("lean", ("--stack", "lean"))):
        assert main([*argv, *extra]) == 0
        levers[name] = json.loads(capsys.readouterr().out)["levers"]
    assert levers["default"]["stack"] == "paper" and levers["default"]["allocator_pools"] == "per-stream"
    # schema 2 rows record every lever, defaults included (schema 1 left these out at their default)
    assert levers["shared"]["stack"] == "paper" and levers["shared"]["allocator_pools"] == "shared"
    assert levers["lean"]["stack"] == "lean" and levers["lean"]["allocator_pools"] == "shared"


def in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``python -m bench ARGS`` through ``main`` in this process, reported as ``bench`` reports the
    subprocess: exit status, stdout, stderr."""
    capsys.readouterr()  # drop what came before
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["bench", *args], code, out, err)


def test_run_json_attention_scope(tmp_path, capsys):
    p = in_process(capsys, "run", "--method", "ulysses", "--model", "llama3-8b", "--seq-len", "1.5M",
                   "--world-size", "8", "--scope", "attention", "--json", "--no-save")
    assert p.returncode == 0, p.stderr
    row = json.loads(p.stdout)
    assert row["seq_len"] == 1572864 and row["scope"] == "attention" and row["mode"] == "simulated"
    assert row["device"] == "h100-80g" and row["figures"]["peak_bytes"] > 0


def test_max_context_json(tmp_path, capsys):
    out = tmp_path / "mc.jsonl"
    p = in_process(capsys, "max-context", "--method", "upipe", "--model", "llama3-8b", "--world-size", "8", "--scope",
              "attention", "--granularity", "2M", "--start", "4M", "--max-seq-len", "64M", "--json", "--in-process",
              "--out", str(out))
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in p.stdout.strip().splitlines()]
    final = rows[-1]
    assert final["kind"] == "max_context" and all(r["kind"] == "trial" for r in rows[:-1])
    assert final["figures"]["max_context"] % (2 << 20) == 0 and final["figures"]["max_context"] >= 4 << 20
    assert "trial 1: 4M -> ok" in p.stderr
    assert len(read_rows(out, on_error="raise")) == len(rows)


def test_real_mode_spawns_gloo_ranks(tmp_path, capsys):
    """From ``main`` in this process, which spawns the trial's two ranks as the command does."""
    out = tmp_path / "real.jsonl"
    p = in_process(capsys, "run", "--method", "ulysses", "--model", "tiny-mha", "--seq-len", "512", "--world-size", "2",
              "--mode", "real", "--device", "cpu", "--iters", "1", "--smoke", "--out", str(out))
    assert p.returncode == 0, p.stderr
    (row,) = read_rows(out, on_error="raise")
    assert row.status == "ok" and row.mode == "real" and row.world_size == 2
    assert row.figures.step_time_s > 0 and row.figures.tokens_per_s_per_device > 0 and row.figures.loss > 0
    assert "real      cpu" in p.stdout


def test_real_mode_under_torchrun(tmp_path):
    out = tmp_path / "torchrun.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bench",
         "run", "--method", "upipe", "--model", "tiny-mha", "--seq-len", "512", "--world-size", "2", "--mode",
         "real", "--device", "cpu", "--iters", "1", "--smoke", "--out", str(out), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    printed = [json.loads(line) for line in p.stdout.strip().splitlines() if line.startswith("{")]
    assert len(printed) == 1  # rank 0 prints and writes, the other rank does not
    (row,) = read_rows(out, on_error="raise")
    assert row.status == "ok" and row.world_size == 2 and row.figures.step_time_s > 0


BAD = [
    (["--method", "nope"], "unknown method 'nope'"),
    (["--model", "llama9"], "unknown model 'llama9'"),
    (["--device", "tpu"], "unknown device preset 'tpu'"),
    (["--opt", "chunks=3"], "unknown option(s) ['chunks']"),
    (["--seq-len", "1001"], "sequence length 1001 is not divisible by 8"),
    (["--opt", "chunk_heads=12"], "chunk_heads=12 is not a multiple of the world size 8"),
    (["--seq-len", "12Q"], "expected a size like 4096, 128K, 1.5M, got '12Q'"),
    (["--mode", "emulated"], "needs CUDA"),
    (["--link", "carrier-pigeon"], "unknown link model"),
    (["--world-size", "0"], "must be >= 1"),
]
BASE = {"--method": "upipe", "--model": "llama3-8b", "--seq-len": "1M", "--world-size": "8"}


def _argv(override: list[str]) -> list[str]:
    args = dict(BASE)
    extra = []
    it = iter(override)
    for flag in it:
        value = next(it)
        if flag in args:
            args[flag] = value
        else:
            extra += [flag, value]
    return ["run"] + [x for kv in args.items() for x in kv] + extra


@pytest.mark.parametrize("override,needle", BAD[:1], ids=[b[1][:24] for b in BAD[:1]])
def test_bad_arguments_subprocess(override, needle):
    """One bad argument through ``python -m bench`` (its exit status and stderr as a process);
    the others through ``main`` (test_bad_arguments_in_process), which returns and prints the same."""
    p = bench(*_argv(override))
    assert p.returncode == 2
    assert needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stdout == ""


@pytest.mark.parametrize("override,needle", BAD[1:], ids=[b[1][:24] for b in BAD[1:]])
def test_bad_arguments_in_process(capsys, override, needle):
    if "needs CUDA" in needle:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA: emulated mode on h100-80g is valid here")
    assert main(_argv(override)) == 2
    out, err = capsys.readouterr()
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert out == "", out


DOCS_BAD = [
    (["--docs", "prolong9k"], "unknown document-length distribution 'prolong9k'; choose one of"),
    (["--docs", "prolong64k:one"], "the seed after ':' must be an integer, got 'one'"),
    (["--docs-lengths", "512K,x"], "entry 2 ('x') is not a positive token count"),
    (["--docs-lengths", "512K,256K"], "sum to 786432 but the sequence has 1048576 tokens"),
    (["--docs", "pile", "--method", "torch-cp"], "method 'torch-cp' refuses packed documents"),
    (["--docs", "pile", "--docs-lengths", "1M"], "not allowed with argument"),
]


@pytest.mark.parametrize("override,needle", DOCS_BAD, ids=[f"docs-{b[1][:24]}" for b in DOCS_BAD])
def test_bad_docs_arguments_in_process(capsys, override, needle):
    assert main(_argv(override)) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_bad_docs_lengths_file_in_process(capsys, tmp_path):
    bad = tmp_path / "lengths.txt"
    bad.write_text("512K\nhalf a million\n")
    assert main(_argv(["--docs-lengths", str(bad)])) == 2
    err = capsys.readouterr().err
    assert f"lengths file {bad}: entry 2 ('half')" in err and len(err.strip().splitlines()) == 1, err


def test_missing_library_is_a_usage_error():
    """A registered wrapper whose library is absent (flash_attn on CPU machines); checked in a
    fresh interpreter, since the test session installs a flash-attn stand-in. In real mode:
    simulated mode supplies flash-attn itself (bench.stackmodel.fake_flash_attn)."""

    wrapper = next((m for m in ("rfa-zigzag", "ds-fpdt") if m in [i.name for i in methods.available(detail=True)]),
                   None)
    probe = subprocess.run([sys.executable, "-c", "import importlib.util,sys; "
                            "sys.exit(importlib.util.find_spec('flash_attn') is not None)"], capture_output=True)
    if wrapper is None or probe.returncode != 0:
        pytest.skip("no wrapper needing flash_attn, or flash_attn is installed here")
    p = bench(*_argv(["--method", wrapper, "--mode", "real", "--device", "cpu", "--model", "tiny-llama",
                      "--seq-len", "1K", "--world-size", "2"]))
    assert p.returncode == 2 and "which is not importable here" in p.stderr and "flash_attn" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_max_context_bad_arguments(capsys):
    p = in_process(capsys, "max-context", "--method", "ring", "--model", "llama3-8b", "--world-size", "8",
              "--max-seq-len", "8")
    assert p.returncode == 2 and "below one step" in p.stderr and "Traceback" not in p.stderr


def test_parse_size():
    assert [parse_size(s) for s in ("4096", "128K", "1M", "1.5M", "2g")] == [4096, 131072, 1 << 20, 3 << 19, 2 << 30]
    import argparse

    for bad in ("1.3K", "-1", "0", "K"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
