"""python -m bench plan (bench.search.plan): layer extrapolation is exact; a tiny plan finishes."""
import json
import subprocess
import sys

import pytest

from bench import cli
from bench.measure.run import measure_simulated
from bench.measure.trial import Trial
from bench.search.plan import extrapolated, search_max

TINY = {"dim": 128, "n_layers": 6, "n_heads": 8, "n_kv_heads": 4, "head_dim": 16, "ffn_dim": 384,
        "vocab_size": 1024, "rope_theta": 500000.0}


@pytest.fixture
def tiny_file(tmp_path):
    path = tmp_path / "tiny6.json"
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.mark.parametrize("method", ["upipe", "ring", "offload"])
def test_layer_extrapolation_matches_full_simulation(tiny_file, tmp_path, method):
    trial = Trial.make(method, tiny_file, 65536, 4)
    full = measure_simulated(trial)
    point = extrapolated(trial, str(tmp_path))
    assert point.exact
    assert abs(point.peak_bytes - full["peak_bytes"]) <= 0.01 * full["peak_bytes"]
    assert abs(point.host_peak_bytes - full["host_peak_bytes"]) <= 0.01 * max(1, full["host_peak_bytes"])
    # the step-time counts the plan's modelled step time uses are extrapolated exactly as well
    assert point.step_counts.keys() == full["step_counts"].keys()
    assert all(point.step_counts[k] == pytest.approx(v, rel=1e-9) for k, v in full["step_counts"].items())


def test_search_brackets_exactly(tiny_file, tmp_path, monkeypatch):
    from bench.measure import hardware

    trial = Trial.make("upipe", tiny_file, 65536, 4)
    usable = measure_simulated(trial.with_seq_len(96 << 10))["peak_bytes"]
    monkeypatch.setitem(hardware.DEVICES, "t", hardware.DevicePreset("t", "cuda", int(usable / 0.9) + 8, 0.9,
                                                                      "nvlink-h100", "test"))
    trial = Trial.make("upipe", tiny_file, 65536, 4, device="t")
    found, best, _, step, err = search_max(trial, 16 << 10, 1 << 20, str(tmp_path), first=16 << 10)
    assert err is None and found == 96 << 10 and step == 16 << 10
    assert measure_simulated(trial.with_seq_len(found + step))["peak_bytes"] > trial.preset().usable()


def test_plan_on_a_config_file(tiny_file, tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench", "plan", "--model", tiny_file, "--gpus", "4",
                          "--device", "h100-80g", "--max-seq-len", "1M", "--granularity", "256K",
                          "--out-dir", str(tmp_path / "figs")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "recommendation: longest context:" in out.stdout
    assert "layer extrapolation" in out.stdout
    assert (tmp_path / "figs" / "plan_tiny6_4xh100-80g.md").exists()
    assert (tmp_path / "figs" / "plan_tiny6_4xh100-80g.png").exists()


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "nope", "--gpus", "8"],
    ["plan", "--model", "llama3-8b", "--gpus", "0"],
    ["plan", "--model", "llama3-8b", "--gpus", "8", "--device", "tpu"],
    ["plan", "--model", "llama3-8b", "--gpus", "8", "--nodes", "3"],
    ["plan", "--model", "llama3-8b"],
])
def test_bad_arguments(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and len(err.splitlines()) == 1


def test_search_stops_at_the_host_memory_budget(tiny_file, tmp_path, monkeypatch):
    """With ample device memory, offloads beyond the preset's host bytes per GPU end the search:
    the answer is the longest length whose extrapolated host peak fits, and one step more fails."""
    from bench.measure import hardware

    trial = Trial.make("offload", tiny_file, 65536, 4)
    host = extrapolated(trial.with_seq_len(96 << 10), str(tmp_path)).host_peak_bytes
    assert host > 0
    monkeypatch.setitem(hardware.DEVICES, "h", hardware.DevicePreset(
        "h", "cuda", 1 << 50, 0.9, "nvlink-h100", "test", host_bytes=int(host / 0.9) + 8))
    trial = Trial.make("offload", tiny_file, 65536, 4, device="h")
    found, best, _, step, err = search_max(trial, 16 << 10, 1 << 20, str(tmp_path), first=16 << 10)
    assert err is None and found == 96 << 10 and best.peak_bytes < trial.preset().usable()
    over = extrapolated(trial.with_seq_len(found + step), str(tmp_path))
    assert over.status == "oom" and over.host_peak_bytes > trial.preset().host_usable()
