"""Layer extrapolation of simulated trials (``bench.search.extrapolate``) against full simulations.

A 7-layer variant of ``tiny-llama`` is simulated whole and through 3- and 4-layer simulations;
the live-bytes peak, its categories and the host peak must agree exactly (identical layers), and
the reserved peak of the paper stack within the allocator's slack, and at a capacity the
whole model meets only by releasing the allocator's cache, the same fit. Also: the rule itself
on hand-made results, and the CLI refusing it outside simulated mode.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from bench.cli import main
from bench.measure.config import StepConfig
from bench.measure.result import AllocatorReplay, Measurement
from bench.measure.run import guarded, measure_simulated, run_trial
from bench.measure.trial import Trial
from bench.model.config import get_config
from bench.search import extrapolate as extrapolate_mod
from bench.search import plan
from bench.search.extrapolate import extrapolate, layer_extrapolated_runner
from bench.stackmodel import hardware, stack
from bench.stackmodel.counts import Collective, HostCopy, StepCounts, Traffic


@pytest.fixture(scope="module")
def seven_layers(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "tiny7.json"
    path.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": 7}))
    return str(path)


@pytest.mark.parametrize("stack", ["lean", "paper"])
def test_extrapolated_equals_full_simulation(seven_layers, stack):
    trial = Trial.make("upipe", seven_layers, 32 << 10, 4, mode="simulated", device="h100-80g",
                       step=StepConfig(stack=stack))
    full = run_trial(trial)
    extra = layer_extrapolated_runner()(trial)
    assert full.status == extra.status == "ok", (full.message, extra.message)
    assert extra.figures.peak_bytes == full.figures.peak_bytes
    assert extra.figures.host_peak_bytes == full.figures.host_peak_bytes
    assert extra.figures.peak_by_category == full.figures.peak_by_category
    # the step-time counts (FLOPs, collectives, host copies) are linear in the layers too
    full_counts, extra_counts = (r.figures.step_time_model["counts"] for r in (full, extra))
    assert extra_counts.keys() == full_counts.keys()
    assert all(extra_counts[k] == pytest.approx(full_counts[k], rel=1e-9) for k in full_counts)
    assert extra.figures.step_time_s == pytest.approx(full.figures.step_time_s, rel=1e-9)
    assert any("extrapolated over layers" in n for n in extra.notes)
    if stack == "paper":  # the slack is the 4-layer one: equal to within the allocator's pages
        # (20 MiB in the large pool, which dominate a model this small; at GiB scale they are noise)
        page = 20 << 20
        assert extra.figures.peak_reserved_bytes >= full.figures.peak_bytes
        assert abs(extra.figures.peak_reserved_bytes - full.figures.peak_reserved_bytes) <= 2 * page


def test_extrapolation_under_pressure_agrees_with_full_simulation(tmp_path, monkeypatch):
    """A device between the model's allocated peak and its unconstrained reserved peak: the whole
    model fits only because the allocator releases its cache (per-stream pools keep FSDP2's
    buffers cached on its streams) and retries. The extrapolated row must fit too, with about
    the same reserved peak; the slack rule alone (4-layer slack added to the extrapolated peak)
    puts it past the capacity. The planner's extrapolation judges it the same way."""
    path = tmp_path / "mid7.json"  # Llama3-8B-sized layers, few tokens: FSDP's buffers make the slack
    path.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "name": "mid7", "n_layers": 7, "dim": 4096,
                                "n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "ffn_dim": 14336}))
    step = StepConfig(stack="paper", allocator_pools="per-stream", mlp_tiles=4, loss_chunk=16384)

    def trial(device: str) -> Trial:  # UPipe in 2 head stages of 16 (U = C = 2 would be 16 stages): the
        # allocator under pressure is the point, and each stage is one more pass of ops to simulate
        return Trial.make("upipe", str(path), 32 << 10, 2, {"chunk_heads": 16}, mode="simulated", device=device,
                          step=step)

    free = guarded(measure_simulated, trial("h100-80g"))
    allocated, reserved = free.peak_bytes, free.peak_reserved_bytes
    assert reserved - allocated > 1 << 30, "the per-stream slack this test needs is gone"
    h100 = hardware.DEVICES["h100-80g"]
    outside = stack.CUDA_CONTEXT_BYTES + stack.nccl_buffer_bytes(free.step_counts)  # not the allocator's
    usable = (allocated + reserved) // 2
    monkeypatch.setitem(hardware.DEVICES, "tight", dataclasses.replace(h100, name="tight",
                                                                       capacity_bytes=usable + outside))
    full = guarded(measure_simulated, trial("tight"))
    assert full.status == "ok" and not full.allocator.oom and full.allocator.cache_releases > 0
    assert full.peak_reserved_bytes <= usable
    extra = layer_extrapolated_runner()(trial("tight"))
    assert extra.status == "ok", extra.message
    assert extra.figures.peak_bytes == full.peak_bytes
    page = 20 << 20
    assert abs(extra.figures.peak_reserved_bytes - full.peak_reserved_bytes) <= 2 * page
    assert any("further layers held" in n and "cache releases" in n for n in extra.notes)
    # the planner replays the pair it has just simulated (their traces kept for it), and caches the
    # outcome: a second plan over the same cache simulates nothing
    replays = []
    monkeypatch.setattr(plan, "under_pressure", lambda *a: replays.append(extrapolate_mod.under_pressure(*a))
                        or replays[-1])
    monkeypatch.setattr(plan, "simulated_pair", lambda *a: pytest.fail("simulated the pair again"))
    monkeypatch.setattr(plan, "_CACHE", plan.SimCache(tmp_path / "sims.ndjson"))
    point = plan.extrapolated(trial("tight"), str(tmp_path))
    assert point.status == "ok", point.message
    assert point.row.figures.peak_reserved_bytes == extra.figures.peak_reserved_bytes
    assert len(replays) == 1 and point.row.figures.peak_reserved_bytes == replays[0].peak_reserved_bytes
    misses = plan._CACHE.misses
    monkeypatch.setattr(plan, "_CACHE", plan.SimCache(tmp_path / "sims.ndjson"))
    again = plan.extrapolated(trial("tight"), str(tmp_path))
    assert plan._CACHE.misses == 0 and plan._CACHE.hits == 3 and misses == 3
    assert again.status == "ok" and again.row.figures.peak_reserved_bytes == point.row.figures.peak_reserved_bytes
    # the shallow simulations from the cache (no traces) but not the replay's outcome: the pair is simulated
    # again for the replay (``simulated_pair``, which the runner above ran: here its outcome stands in, as
    # simulating it twice more would give the same), and the outcome is cached
    cached = tmp_path / "sims.ndjson"
    cached.write_text("".join(line + "\n" for line in cached.read_text().splitlines()
                              if not json.loads(line)["key"].endswith(plan.PRESSURE_KEY)))
    pairs = []

    def pair(t, how, workdir, rank=0):  # upipe's ranks are symmetric: rank 0's pair
        pairs.append((t, how, rank))
        return [Measurement(), Measurement()], replays[0]

    monkeypatch.setattr(plan, "simulated_pair", pair)
    monkeypatch.setattr(plan, "_CACHE", plan.SimCache(cached))
    third = plan.extrapolated(trial("tight"), str(tmp_path))
    assert [(t, rank) for t, _, rank in pairs] == [(dataclasses.replace(trial("tight"), mode="simulated"), 0)]
    assert pairs[0][1] == plan.sim_scheme(trial("tight"))
    assert plan._CACHE.hits == 2 and plan._CACHE.misses == 1
    assert third.status == "ok" and third.row.figures.peak_reserved_bytes == point.row.figures.peak_reserved_bytes


def test_two_level_checkpoints_extrapolate_over_groups(tmp_path, monkeypatch):
    """Under ac_group=2 the runner takes the planner's rule (``scheme``): 10 layers are 5 groups of
    2, extrapolated from 2 and 3 groups (offload_keep none), equal to the whole model's simulation,
    and so is the planner's own extrapolation of the same trial (``bench.search.plan.extrapolated``,
    in every figure it carries: peaks, categories, step counts; the same check under offload_keep
    first_last is ``tests/bench/search/test_plan.py::test_group_extrapolation_matches_full_simulation``);
    a model whose last group is shorter (3 layers: groups of 2 and 1) is simulated whole."""
    path = tmp_path / "tiny10.json"
    path.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": 10}))
    step = StepConfig(ac_group=2, offload_keep="none")
    trial = Trial.make("upipe", str(path), 32 << 10, 4, mode="simulated", device="h100-80g", step=step)
    full = run_trial(trial)
    extra = layer_extrapolated_runner()(trial)
    assert full.status == extra.status == "ok", (full.message, extra.message)
    assert extra.figures.peak_bytes == full.figures.peak_bytes
    assert extra.figures.host_peak_bytes == full.figures.host_peak_bytes
    assert any("two-level checkpoint groups" in n and "from 2 and 3 groups" in n for n in extra.notes)
    monkeypatch.setattr(plan, "_CACHE", None)  # the planner's simulations of its own, none cached
    how = plan.sim_scheme(trial)
    assert not how.whole and how.units == 5 and how.layers == (4, 6)
    point = plan.extrapolated(trial, str(tmp_path))
    assert point.exact and point.status == "ok"
    assert point.peak_bytes == full.figures.peak_bytes and point.host_peak_bytes == full.figures.host_peak_bytes
    assert point.row.figures.peak_by_category == full.figures.peak_by_category
    got, want = point.step_counts.to_flat(), full.figures.step_time_model["counts"]
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(v, rel=1e-9) for k, v in want.items())
    odd = Trial.make("upipe", layers_path(tmp_path, 3), 32 << 10, 4, mode="simulated", device="h100-80g",
                     step=step)
    row = layer_extrapolated_runner()(odd)
    assert row.status == "ok" and any("whole model simulated" in n and "not a multiple" in n for n in row.notes)


def layers_path(tmp_path, n_layers: int) -> str:
    """``tiny-llama`` with ``n_layers`` blocks, as a model file."""
    path = tmp_path / f"tiny{n_layers}.json"
    path.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": n_layers}))
    return str(path)


def test_the_rule_on_hand_made_results():
    r3 = Measurement(peak_bytes=100, peak_reserved_bytes=110, host_peak_bytes=10, comm_bytes=5, comm_time_s=1.0,
                     peak_by_category={"parameter": 30, "activation": 70})
    r4 = dataclasses.replace(r3, peak_bytes=120, peak_reserved_bytes=125, host_peak_bytes=14, comm_bytes=5,
                             comm_time_s=1.5, peak_by_category={"parameter": 40, "activation": 80})
    out = extrapolate(r3, r4, layers=10)
    assert out.peak_bytes == 100 + 20 * 7 and out.host_peak_bytes == 10 + 4 * 7
    assert out.peak_reserved_bytes == out.peak_bytes + 5  # the 4-layer slack, not extrapolated
    assert out.comm_time_s == pytest.approx(1.0 + 0.5 * 7)
    assert out.peak_by_category == {"parameter": 100, "activation": 140}


def test_the_rule_on_hand_made_counts_and_allocator():
    """Every count is linear in the layers, a kind of collective or copy one simulation lacks counting
    0 there; the memory-bound traffic stays absent where both lack it; the allocator keeps the larger
    simulation's replay with the extrapolated allocated peak and either simulation's OOM."""
    a2a, gather = Collective("all_to_all", 4, 4), Collective("all_gather", 4, 4, attention=True)
    c3 = StepCounts(flops_matmul=30, flops_attention=300, host_copies={HostCopy("offload", "d2h"): Traffic(2, 20)},
                    collectives={a2a: Traffic(12, 1200)}, events={"pipeline.chunk_passes": 3})
    c4 = StepCounts(flops_matmul=40, flops_attention=400, host_copies={HostCopy("offload", "d2h"): Traffic(3, 30)},
                    collectives={a2a: Traffic(16, 1600), gather: Traffic(1, 10)}, events={"pipeline.chunk_passes": 4})
    replay = AllocatorReplay("expandable", "shared", 0, 7, 0.1, 0, None)
    r3 = Measurement(peak_bytes=100, step_counts=c3, allocator=dataclasses.replace(replay, oom="out at layer 3"))
    r4 = Measurement(peak_bytes=120, step_counts=c4, allocator=replay)
    out = extrapolate(r3, r4, layers=10)
    assert out.step_counts == StepCounts(
        flops_matmul=100, flops_attention=1000, host_copies={HostCopy("offload", "d2h"): Traffic(9, 90)},
        collectives={a2a: Traffic(40, 4000), gather: Traffic(7, 70)}, events={"pipeline.chunk_passes": 10})
    assert out.step_counts.memory_bound is None
    assert out.allocator == dataclasses.replace(replay, peak_allocated_bytes=240, oom="out at layer 3")


def test_extrapolation_is_refused_outside_simulation(capsys):
    code = main(["max-context", "--method", "ulysses", "--model", "tiny-llama", "--world-size", "2",
                 "--mode", "real", "--device", "cpu", "--extrapolate-layers", "--no-save"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "--extrapolate-layers extrapolates simulations" in err and "\n" not in err


def test_shallow_models_are_simulated_whole():
    trial = Trial.make("ulysses", "tiny-llama", 8192, 2, mode="simulated", device="h100-80g")
    row = layer_extrapolated_runner()(trial)
    assert row.status == "ok" and not any("extrapolated" in n for n in row.notes)
    assert dataclasses.asdict(row.figures)["peak_bytes"] == run_trial(trial).figures.peak_bytes


def test_run_and_the_trial_command_extrapolate_a_single_trial(seven_layers, capsys):
    """``run --extrapolate-layers`` and ``trial ... --extrapolate-layers`` (what a spec's ``layers: extrapolate``
    sends): the row is the layer-extrapolated runner's, and says so."""
    trial = Trial.make("ulysses", seven_layers, 2048, 2, mode="simulated", device="h100-80g")
    want = layer_extrapolated_runner()(trial)
    assert main(["trial", trial.to_json(), "--extrapolate-layers", "--no-save", "--json"]) == 0
    assert main(["run", "--method", "ulysses", "--model", seven_layers, "--world-size", "2", "--seq-len", "2K",
                 "--mode", "simulated", "--device", "h100-80g", "--stack", "lean", "--extrapolate-layers",
                 "--no-save", "--json"]) == 0
    out = capsys.readouterr()
    rows = [json.loads(line) for line in out.out.splitlines()]
    assert len(rows) == 2 and "(layers extrapolated)" in out.err
    for row in rows:
        assert row["figures"]["peak_bytes"] == want.figures.peak_bytes
        assert row["figures"]["host_peak_bytes"] == want.figures.host_peak_bytes
        assert any("extrapolated over layers" in n for n in row["notes"])


def test_auto_chunk_is_resolved_before_extrapolating(capsys):
    # as every other runner does (bench.search.autochunk.run): the probes run the chosen U
    code = main(["max-context", "--method", "upipe", "--opt", "chunk_heads=auto", "--model", "tiny-llama",
                 "--world-size", "2", "--mode", "simulated", "--device", "h100-80g", "--granularity", "8K",
                 "--max-seq-len", "8K", "--extrapolate-layers", "--no-save", "--json"])
    assert code == 0
    *probes, final = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert probes and all(p["options"]["chunk_heads_requested"] == "auto" for p in probes)
    assert all(isinstance(p["options"]["chunk_heads"], int) for p in probes)
    assert final["options"] == {"chunk_heads": "auto"} and "chunk_heads=auto -> " in final["notes"][0]
