"""python -m bench plan (bench.search.plan): layer extrapolation is exact; a tiny plan finishes.

The tiny plan runs once per module, end to end (``planned``); its simulation cache then answers the
3- and 4-layer simulations of the same trials (same ``SimCache`` keys) that the extrapolation and
search tests below ask for, and each whole 6-layer simulation runs once (``full_simulation``)."""
import dataclasses
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from bench import cli
from bench.measure.config import StepConfig
from bench.measure.run import measure_simulated
from bench.measure.trial import Trial
from bench.search import plan as plan_mod
from bench.search.extrapolate import scheme
from bench.search.plan import (
    DOC_LAYOUTS,
    Entry,
    SimCache,
    entries,
    extrapolated,
    measured_time,
    pareto_front,
    real_rows,
    recommend,
    runs,
    search_max,
    sim_scheme,
)
from bench.stackmodel.counts import COUNTS_VERSION
from records.workloads import DocsSpec

TINY = {"dim": 128, "n_layers": 6, "n_heads": 8, "n_kv_heads": 4, "head_dim": 16, "ffn_dim": 384,
        "vocab_size": 1024, "rope_theta": 500000.0}


PLANNED = 1 << 20  # the tiny plan's search limit: every configuration fits there (its table says >=1M)


def plan_argv(model: str, cache: Path, figs: Path) -> list[str]:
    """``python -m bench plan``'s arguments for the tiny plan: 4 GPUs, lean stack, up to 1M in steps of 1M (one
    probe per configuration, which fits: the searches' doubling and bisection are checked by
    ``test_search_brackets_exactly`` and ``test_search_stops_at_the_host_memory_budget``)."""
    return ["plan", "--model", model, "--gpus", "4", "--device", "h100-80g", "--max-seq-len", "1M",
            "--granularity", "1M", "--stack", "lean", "--cache", str(cache), "--out-dir", str(figs)]


class Planned(NamedTuple):
    root: Path  # the plan's working directory
    model: str  # the 6-layer model file (tiny6.json)
    cache: Path  # the simulation cache the plan wrote (read only after it: tests copy it or read it)
    out: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Planned:
    """The tiny plan, once per module, end to end through ``python -m bench plan`` (its search processes,
    its table, its figures). Its cache holds the 3- and 4-layer simulations of upipe, ring and offload at
    1M (``Trial.make(method, model, 1M, 4)``, the plan's trials), which the tests below read back."""
    root = tmp_path_factory.mktemp("plan")
    model = root / "tiny6.json"
    model.write_text(json.dumps(TINY))
    cache = root / "sims.ndjson"
    out = subprocess.run([sys.executable, "-m", "bench", *plan_argv(str(model), cache, root / "figs")],
                         capture_output=True, text=True, timeout=900, cwd=root)
    return Planned(root, str(model), cache, out)


@pytest.fixture(scope="module")
def full_simulation():
    """``measure_simulated`` of a trial, once per module (a whole simulation several tests compare with)."""
    done: dict[Trial, object] = {}

    def full(trial: Trial):
        if trial not in done:
            done[trial] = measure_simulated(trial)
        return done[trial]
    return full


def from_plan(planned: Planned, tmp_path: Path, monkeypatch) -> SimCache:
    """The planner's cache for this test: reads the tiny plan's simulations, writes new ones under ``tmp_path``."""
    assert planned.out.returncode == 0, planned.out.stderr
    cache = SimCache(tmp_path / "sims.ndjson", (planned.cache,))
    monkeypatch.setattr(plan_mod, "_CACHE", cache)
    return cache


@pytest.mark.parametrize("method", ["upipe", "ring", "offload"])
def test_layer_extrapolation_matches_full_simulation(planned, full_simulation, tmp_path, monkeypatch, method):
    """The 3- and 4-layer simulations extrapolated to 6 layers equal the whole model's simulation (the
    shallow ones are the tiny plan's, read from its cache as the planner reads them)."""
    from_plan(planned, tmp_path, monkeypatch)
    trial = Trial.make(method, planned.model, PLANNED, 4)
    full = full_simulation(trial)
    point = extrapolated(trial, str(tmp_path))
    assert point.exact
    assert abs(point.peak_bytes - full.peak_bytes) <= 0.01 * full.peak_bytes
    assert abs(point.host_peak_bytes - full.host_peak_bytes) <= 0.01 * max(1, full.host_peak_bytes)
    # the step-time counts the plan's modelled step time uses are extrapolated exactly as well
    got, want = point.step_counts.to_flat(), full.step_counts.to_flat()
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(v, rel=1e-9) for k, v in want.items())


@pytest.mark.parametrize("keep,seq", [("first_last", 65536)])
def test_group_extrapolation_matches_full_simulation(tmp_path, keep, seq):
    """Two-level checkpoints (ac_group=2) of a 10-layer model: 5 identical groups, extrapolated
    from 3 and 4 groups (first_last: the first and last group keep their inputs on the device from
    3 groups on), equal to the whole model's simulation. From 2 and 3 groups (offload_keep none):
    ``tests/bench/search/test_extrapolate.py::test_two_level_checkpoints_extrapolate_over_groups``, which
    compares the planner's extrapolation with the whole model's simulation it runs for the runner.

    first_last at 65536 tokens: at 32768 this tiny model's peak moves between 8 and 10 layers
    from the last group's backward to the first's, whose gradients of every block outgrow the
    activations; the extrapolation assumes one moment (bench.search.extrapolate, "Limits")."""
    path = tmp_path / "tiny10.json"
    path.write_text(json.dumps({**TINY, "n_layers": 10}))
    trial = Trial.make("upipe", str(path), seq, 4, step=StepConfig(ac_group=2, offload_keep=keep))
    how = sim_scheme(trial)
    assert not how.whole and how.units == 5 and how.layers == ((4, 6) if keep == "none" else (6, 8))
    full = measure_simulated(trial)
    point = extrapolated(trial, str(tmp_path))
    assert point.exact and point.status == "ok"
    assert point.peak_bytes == full.peak_bytes and point.host_peak_bytes == full.host_peak_bytes
    assert point.row.figures.peak_by_category == full.peak_by_category
    got, want = point.step_counts.to_flat(), full.step_counts.to_flat()
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(v, rel=1e-9) for k, v in want.items())


def test_group_extrapolation_falls_back_to_the_whole_model():
    assert scheme(10, 4).whole and "not a multiple of ac_group=4" in scheme(10, 4).why  # a shorter last group
    assert scheme(8, 2, "first_last").whole and not scheme(8, 2, "none").whole  # 4 groups: too few for 3 and 4
    assert scheme(32, 4, "none").layers == (8, 12) and scheme(64, 4, "first_last").layers == (12, 16)
    assert scheme(32).layers == (3, 4) and scheme(4).whole


def test_ladder_goes_on_past_a_lever_the_method_refuses():
    """Across nodes the ladder is usp-upipe's, which has no fused attention norm: that rung is
    listed (and reported skipped), the two-level checkpoint rung keeps the levers that run."""
    rungs = {e.label: e for e in entries("llama3-8b", 16, 2, "h100-80g", 1 << 20)}
    assert not runs(rungs["usp-upipe u=8 U=8 +fused norm"])
    step = rungs["usp-upipe u=8 U=8 +2-level AC"].trial.step
    assert runs(rungs["usp-upipe u=8 U=8 +2-level AC"])
    assert step.ac_group == 4 and step.fsdp_offload and step.offload_keep == "none" and not step.fused_attn_norm
    one = {e.label: e for e in entries("llama3-8b", 8, 1, "h100-80g", 1 << 20)}
    assert one["upipe U=8 +2-level AC"].trial.step.fused_attn_norm  # upipe runs every lever
    last = one["upipe U=8 +2-level AC g=2"].trial.step  # groups of 2 replace groups of 4, the rest kept
    assert last.ac_group == 2 and last.fsdp_offload and last.fused_attn_norm and last.offload_keep == "none"


def test_sequence_chunked_entry_takes_every_lever_fpdt_runs():
    """The last entry: FPDT's chunk pipeline in chunks of the granularity (every probed length a whole
    number of chunks) with every lever of the ladder, fpdt accepting each (the fused norm since it norms
    each chunk as it projects it)."""
    for gpus, nodes, gran in ((8, 1, 1 << 20), (16, 2, 1 << 20), (4, 1, 256 << 10)):
        last = entries("llama3-8b", gpus, nodes, "h100-80g", gran)[-1]
        step = last.trial.step
        assert last.method == "fpdt" and last.trial.options.chunk_tokens == gran and runs(last)
        assert step.ac_group == 2 and step.fsdp_offload and step.offload_keep == "none" and step.rope_table == "none"
        assert step.fused_attn_norm
        assert last.label.endswith("+our RoPE +offload all +FSDP offload +fused norm +2-level AC g=2"), last.label
    assert not any(e.method == "fpdt" and e.trial.options.chunk_tokens
                   for e in entries("llama3-8b", 8, 1, "h100-80g", 1 << 20, beyond=False))


def test_search_brackets_exactly(planned, tmp_path, monkeypatch):
    """A device whose usable memory is the whole model's peak at 96K: the search, in steps of 16K from
    16K, answers 96K, and the whole model one step longer does not fit."""
    from bench.stackmodel import hardware

    trial = Trial.make("upipe", planned.model, 65536, 4)
    usable = measure_simulated(trial.with_seq_len(96 << 10)).peak_bytes
    monkeypatch.setitem(hardware.DEVICES, "t", hardware.DevicePreset("t", "cuda", int(usable / 0.9) + 8, 0.9,
                                                                      "nvlink-h100", "test"))
    trial = Trial.make("upipe", planned.model, 65536, 4, device="t")
    found, best, _, step, err = search_max(trial, 16 << 10, 1 << 20, str(tmp_path), first=16 << 10)
    assert err is None and found == 96 << 10 and step == 16 << 10
    assert measure_simulated(trial.with_seq_len(found + step)).peak_bytes > trial.preset().usable()

def test_plan_on_a_config_file(planned, tmp_path, capsys, monkeypatch):
    """The whole plan of a model file: once end to end through ``python -m bench plan`` (``planned``: its
    search processes, its table, its figures); then, in this process through the same entry point with one
    search process, the same plan over its own cache (a copy: no new simulation, the same recommendation),
    and over a cache where one configuration's simulations predate the step-time counts of v3
    (exactly those simulated anew, the same answers)."""
    out = planned.out
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "longest context:" in text and "recommendation: " in text and "lean stack" in text
    assert "layer extrapolation" in text
    # the beyond-the-paper rungs, each keeping the levers before it, and the Pareto marks
    assert "upipe U=4 +our RoPE" in text and "upipe U=4 +2-level AC" in text
    assert any(line.startswith("P ") for line in text.splitlines())
    assert (planned.root / "figs" / "plan_tiny6_4xh100-80g.md").exists()
    assert (planned.root / "figs" / "plan_tiny6_4xh100-80g.png").exists()
    simulated = len(planned.cache.read_text().splitlines())
    assert simulated > 0 and f"{simulated} new simulations" in text
    assert f"on counts of v{COUNTS_VERSION}" in text
    assert not (planned.root / "results").exists()  # a user's plan writes no committed data
    cache = tmp_path / "sims.ndjson"  # the runs below rewrite and append to it: the module's plan keeps its own
    shutil.copyfile(planned.cache, cache)
    argv = plan_argv(planned.model, cache, tmp_path / "figs")

    def plan_here() -> str:  # the same plan in this process (one search process: no spawned workers)
        assert cli.main([*argv, "--jobs", "1"]) == 0
        return capsys.readouterr().out

    def lines(text: str, start: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.startswith(start)]

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan_mod, "_CACHE", None)  # plan() sets it; restored after the test
    again = plan_here()
    assert ": 0 new simulations" in again and len(cache.read_text().splitlines()) == simulated
    assert lines(again, "recommendation") == lines(text, "recommendation")
    # simulations made before the step-time counts of this version (v3: no counts_version key), here those of
    # ring (the recommended configuration): the searches answer from the cache, and the counts at ring's
    # answer are simulated anew (no mix of model versions), nothing else
    entries_ = [json.loads(line) for line in cache.read_text().splitlines()]
    stale = [d for d in entries_ if json.loads(d["key"])["method"] == "ring"]
    for d in stale:
        d["result"]["step_counts"].pop("counts_version")
    cache.write_text("".join(json.dumps(d) + "\n" for d in entries_))
    assert stale and lines(text, "recommendation: ring:")
    old = plan_here()
    assert f"on counts of v{COUNTS_VERSION}" in old and f": {len(stale)} new simulations" in old
    assert lines(old, "longest context") == lines(text, "longest context")
    assert lines(old, "recommendation") == lines(text, "recommendation")
    assert not (tmp_path / "results").exists()  # a user's plan writes no committed data


def test_measured_time_is_the_fastest_real_row_of_the_trial(tmp_path, monkeypatch):
    """A plan's measured step time: the fastest real, model-scope row that ran with the trial's method,
    options, model, world size, device and length; rows read once (``real_rows``) answer the same."""
    from tests.rowfactory import make_row, write

    def row(tps, **kw):
        return make_row(**{"method": "ulysses", "model": "tiny-llama", "seq_len": 4096, "world_size": 2,
                           "device": "cpu", "tps": tps, **kw})

    write(tmp_path / "a" / "rows.jsonl", [row(100.0), row(400.0, mode="simulated"), row(500.0, scope="attention"),
                                         row(600.0, seq_len=8192), row(700.0, options={"kernel": "math"})])
    write(tmp_path / "b.jsonl", [row(200.0), row(900.0, status="error")])
    monkeypatch.setattr(plan_mod, "RESULTS_DIR", tmp_path)
    trial = Trial.make("ulysses", "tiny-llama", 4096, 2, device="cpu")
    assert measured_time(trial) == pytest.approx(2048 / 200.0)
    assert measured_time(trial, real_rows()) == measured_time(trial)
    assert measured_time(trial.with_seq_len(8192)) == pytest.approx(4096 / 600.0)
    assert measured_time(Trial.make("ulysses", "tiny-llama", 4096, 2, {"kernel": "math"}, device="cpu")) == \
        pytest.approx(2048 / 700.0)
    assert measured_time(Trial.make("ulysses", "tiny-llama", 4096, 4, device="cpu")) is None


def _entry(label, max_context, step_time):
    e = Entry(label, Trial.make("upipe", "tiny-llama", 1 << 20, 2))
    e.max_context, e.step_time_s = max_context, step_time
    return e


def test_pareto_front_and_recommendation():
    base = _entry("paper", 4 << 20, 10.0)
    longer = _entry("longer", 8 << 20, 12.0)
    dominated = _entry("dominated", 6 << 20, 13.0)
    too_slow = _entry("too slow", 16 << 20, 25.0)
    faster = _entry("faster", 2 << 20, 5.0)
    front = pareto_front([base, longer, dominated, too_slow, faster])
    assert [e.label for e in front] == ["paper", "longer", "too slow", "faster"]
    assert recommend([base, longer, dominated, too_slow, faster], base).label == "longer"  # 25 s > 2 x 10 s
    assert recommend([base, too_slow], None).label == "too slow"


def test_simulation_cache_reads_committed_and_writes_only_the_users(tmp_path):
    committed, user = tmp_path / "committed.jsonl", tmp_path / "runs" / "sims.ndjson"
    committed.write_text(json.dumps({"key": "a", "result": {"status": "ok", "peak_bytes": 1}}) + "\n")
    cache = SimCache(user, (committed,))
    assert cache.get("a") == {"status": "ok", "peak_bytes": 1} and cache.get("b") is None
    cache.put("b", {"status": "ok", "peak_bytes": 2})
    cache.put("c", {"status": "error", "message": "x"})  # errors are not kept across runs
    assert len(committed.read_text().splitlines()) == 1
    assert [json.loads(line)["key"] for line in user.read_text().splitlines()] == ["b"]
    assert SimCache(user, (committed,)).get("b") == {"status": "ok", "peak_bytes": 2}
    trial = Trial.make("upipe", "tiny-llama", 1 << 20, 2)
    assert SimCache.key(trial, "tiny-llama", 3) == SimCache.key(
        dataclasses.replace(trial, model="tiny-llama"), "tiny-llama", 3)
    assert SimCache.key(trial, "tiny-llama", 3) != SimCache.key(trial, "tiny-llama", 4)
    # a line written with a later lever at its default, and one written before the lever existed, name the
    # same simulation as the key of today (records.identity.V1_OMITTED_LEVERS, the rows' table of such levers)
    today = SimCache.key(trial, "tiny-llama", 3)
    older = json.loads(today)
    newer = json.loads(today)
    newer["step"].update(ac_keep_attn=False, ring_barrier=False)
    written = tmp_path / "written.ndjson"
    written.write_text(json.dumps({"key": json.dumps(newer) + plan_mod.PRESSURE_KEY, "result": {"status": "ok"}})
                       + "\n" + json.dumps({"key": json.dumps(older), "result": {"status": "oom"}}) + "\n")
    read = SimCache(None, (written,))
    assert read.get(today) == {"status": "oom"} and read.get(today + plan_mod.PRESSURE_KEY) == {"status": "ok"}
    away = dataclasses.replace(trial, step=dataclasses.replace(trial.step, ac_keep_attn=True))
    assert json.loads(SimCache.key(away, "tiny-llama", 3))["step"]["ac_keep_attn"] is True


@pytest.mark.parametrize("bad,problem", [
    ('{"key": "b", "result": {"status": "ok", "peak_by', "not JSON: Unterminated string starting at column 41"),
    ("[1, 2]", 'not {"key": "...", "result": {...}}'),
    ('{"key": "b"}', 'not {"key": "...", "result": {...}}'),
])
def test_a_corrupt_cache_line_is_named_by_file_and_line_before_any_simulation(bad, problem, tmp_path, capsys,
                                                                               monkeypatch):
    from bench.search import plan as plan_mod

    cache = tmp_path / "sims.ndjson"
    cache.write_text(json.dumps({"key": "a", "result": {"status": "ok"}}) + "\n\n" + bad + "\n")
    with pytest.raises(ValueError) as err:
        SimCache(cache)
    assert str(err.value) == (f"simulation cache {cache}, line 3: {problem}; delete that line, or the whole file "
                              f"(its simulations run again), or use --no-cache")
    monkeypatch.setattr(plan_mod, "_sim", lambda *a: pytest.fail("simulated before reading the cache"))
    assert cli.main(["plan", "--model", "tiny-llama", "--gpus", "2", "--jobs", "1", "--no-figs",
                     "--cache", str(cache)]) == 2
    assert capsys.readouterr().err == f"python -m bench plan: error: {err.value}\n"


def test_the_committed_plan_cache_still_answers_the_committed_plans_trials():
    """A step field added later must not change the keys of the committed cache (every trial would miss,
    and the committed plans would take an hour again): the 8-GPU plan's UPipe base trial at 3 layers, 4M,
    is in it (a pool per stream), and the 16-GPU plan's USP x UPipe base trial (one shared pool)."""
    committed = Path(__file__).resolve().parents[3] / "results" / "plan" / "sims.ndjson"
    cache = SimCache(None, (committed,))
    trial = Trial.make("upipe", "llama3-8b", 4 << 20, 8, device="h100-80g", mode="simulated",
                       step=StepConfig(stack="paper"))
    per_stream = dataclasses.replace(trial, step=dataclasses.replace(trial.step, allocator_pools="per-stream"))
    assert SimCache.key(per_stream, "llama3-8b", 3) != SimCache.key(trial, "llama3-8b", 3)
    assert cache.get(SimCache.key(per_stream, "llama3-8b", 3)) is not None  # the 8-GPU plan's default
    shared = Trial.make("usp-upipe", "llama3-8b", 4 << 20, 16, {"ulysses_degree": 8}, device="h100-80g",
                        mode="simulated", step=StepConfig(stack="paper"))
    assert cache.get(SimCache.key(shared, "llama3-8b", 3)) is not None  # shared pool (the 16-GPU plans' kind)


def test_plan_pools_reach_every_paper_stack_trial():
    """`bench plan` keys every paper-stack trial with its pools (per-stream by default; shared, as
    the committed 16-GPU plans, on request); the lean stack has no allocator model to key."""
    from bench.search.plan import entries

    for e in entries("llama3-8b", 8, 1, "h100-80g", 1 << 20):  # the default
        assert e.trial.step.allocator_pools == "per-stream", e.label
    shared = entries("llama3-8b", 8, 1, "h100-80g", 1 << 20, pools="shared")
    assert {e.trial.step.allocator_pools for e in shared} == {"shared"}
    assert {e.trial.step.allocator_pools
            for e in entries("llama3-8b", 8, 1, "h100-80g", 1 << 20, stack="lean", pools="per-stream")} == {"shared"}


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


def test_search_stops_at_the_host_memory_budget(planned, tmp_path, monkeypatch):
    """With ample device memory, offloads beyond the preset's host bytes per GPU end the search:
    the answer is the longest length whose extrapolated host peak fits, and one step more fails
    (exactly extrapolated again, from the simulations the search cached: ``SimCache``). The budget is
    set from the tiny plan's 1M host peak (read from its cache); the search runs on this test's own
    device preset, which is part of a simulation's key, so it simulates its probes itself: it starts
    at 1M, doubles to 2M (over the budget) and bisects down to 1M in steps of 256K."""
    from bench.stackmodel import hardware

    from_plan(planned, tmp_path, monkeypatch)
    trial = Trial.make("offload", planned.model, PLANNED, 4)
    host = extrapolated(trial, str(tmp_path)).host_peak_bytes
    assert host > 0
    monkeypatch.setitem(hardware.DEVICES, "h", hardware.DevicePreset(
        "h", "cuda", 1 << 50, 0.9, "nvlink-h100", "test", host_bytes=int(host / 0.9) + 8))
    trial = Trial.make("offload", planned.model, PLANNED, 4, device="h")
    found, best, _, step, err = search_max(trial, 256 << 10, 4 << 20, str(tmp_path), first=PLANNED)
    assert err is None and found == PLANNED and best.peak_bytes < trial.preset().usable()
    over = extrapolated(trial.with_seq_len(found + step), str(tmp_path))
    assert over.status == "oom" and over.host_peak_bytes > trial.preset().host_usable()


# --------------------------------------------------------------------------- packed documents (--docs)

PROLONG = DocsSpec("prolong64k")


def test_documents_reach_every_trial_and_the_ring_family_gets_its_layouts():
    """With documents every configuration's trial carries them (its probes draw per length), and each
    ring-family method (a layout option) is a configuration per layout; without, the plan is as it was."""
    plain = entries("llama3-8b", 16, 2, "h100-80g", 1 << 20)
    docs = entries("llama3-8b", 16, 2, "h100-80g", 1 << 20, docs=PROLONG)
    assert all(e.trial.docs is None for e in plain) and all(e.trial.docs == PROLONG for e in docs)
    labels = [e.label for e in docs]
    for base in ("ring", "usp u=8", "usp-upipe u=8 U=8", "usp-upipe u=8 U=auto"):
        assert base in [e.label for e in plain] and base not in labels
        zigzag, per_doc = (next(e for e in docs if e.label == f"{base} {layout}") for layout in DOC_LAYOUTS)
        assert zigzag.trial.options.layout == "zigzag" and per_doc.trial.options.layout == "doc-zigzag"
        assert zigzag.trial == dataclasses.replace(next(e for e in plain if e.label == base).trial, docs=PROLONG)
    assert len(docs) == len(plain) + 4
    # each probed length packs its own draw, summing to that length
    trial = next(e for e in docs if e.label == "ring doc-zigzag").trial
    for n in (1 << 20, 3 << 20):
        assert sum(trial.with_seq_len(n).documents().lengths) == n


def test_the_cache_key_holds_the_documents():
    """A simulation under documents is cached under its own key; one without keeps the committed key."""
    trial = Trial.make("ring", "llama3-8b", 1 << 20, 8, step=StepConfig(stack="paper"))
    plain = SimCache.key(trial, "llama3-8b", 3)
    docs = SimCache.key(dataclasses.replace(trial, docs=PROLONG), "llama3-8b", 3)
    other = SimCache.key(dataclasses.replace(trial, docs=DocsSpec("prolong64k", 1)), "llama3-8b", 3)
    assert len({plain, docs, other}) == 3 and "docs" not in json.loads(plain)
    assert json.loads(docs)["docs"] == {"distribution": "prolong64k", "seed": 0}


@pytest.mark.parametrize("flags,problem", [
    (["--docs", "nope"], "unknown document-length distribution 'nope'; choose one of ['magiattention-cp'"),
    (["--docs", "prolong64k:x"], "the seed after ':' must be an integer, got 'x'"),
    (["--docs-lengths", "LENGTHS"], "lengths file LENGTHS: entry 2 ('12Q') is not a positive token count"),
    (["--docs-lengths", "4K,4K"], "explicit document lengths fix the sequence length, which the plan varies"),
    (["--docs", "prolong64k", "--docs-lengths", "4K"], "not allowed with argument --docs"),
])
def test_bad_documents_are_one_line_before_any_simulation(flags, problem, tmp_path, capsys, monkeypatch):
    from bench.search import plan as plan_mod

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("4096\n12Q\n")
    flags = [str(lengths) if f == "LENGTHS" else f for f in flags]
    problem = problem.replace("LENGTHS", str(lengths))
    monkeypatch.setattr(plan_mod, "_sim", lambda *a: pytest.fail("simulated before refusing the documents"))
    assert cli.main(["plan", "--model", "llama3-8b", "--gpus", "8", "--jobs", "1", "--no-figs", "--no-cache",
                     *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and problem in err, err


def test_plan_with_documents_reaches_the_rows(tmp_path, capsys, monkeypatch):
    """``bench plan --docs`` on a 2-layer model (simulated whole; lean stack, the paper's configurations,
    each fitting at the search limit of 32K: one simulation each; a few documents per sequence, as
    every document is a call): every simulation is keyed with the documents, the table adds tok/s/GPU
    and the imbalance, a method that refuses documents is skipped with its reason (not an error), and
    each configuration's modelled step at its max context is its simulated row's (the slowest rank's
    attention under the documents, ``build_row``)."""
    import methods
    from bench.search import plan as plan_mod
    from bench.search.plan import modelled_time

    path = tmp_path / "tiny2.json"
    path.write_text(json.dumps({**TINY, "n_layers": 2}))
    monkeypatch.setattr(methods.get_info("offload").cls, "honours_documents", False)
    results = []
    monkeypatch.setattr(cli, "plan", lambda *a, **k: results.append(plan_mod.plan(*a, **k)) or results[-1])
    cache = tmp_path / "sims.ndjson"
    assert cli.main(["plan", "--model", str(path), "--gpus", "4", "--stack", "lean", "--paper-only",
                     "--granularity", "16K", "--max-seq-len", "32K", "--jobs", "1", "--cache", str(cache),
                     "--out-dir", str(tmp_path / "figs"), "--docs", "uniform-1K-16K:1"]) == 0
    out = capsys.readouterr().out
    res = results[0]
    assert res["docs"] == DocsSpec("uniform-1K-16K", 1) and "documents: uniform-1K-16K:1 (records.workloads)" in out
    header = next(line for line in out.splitlines() if line.startswith("configuration"))
    assert "tok/s/GPU" in header and "imbal" in header
    assert "skipped: method 'offload' refuses packed documents (docs=): not yet" in out
    keys = [json.loads(json.loads(line)["key"]) for line in cache.read_text().splitlines()]
    assert keys and all(k["docs"] == {"distribution": "uniform-1K-16K", "seed": 1} for k in keys)
    assert (tmp_path / "figs" / "plan_tiny2_4xh100-80g_docs-uniform-1K-16K-1.md").exists()
    rows = {e.label: e for e in res["entries"] if not e.skipped}
    assert set(rows) == {"upipe U=4", "upipe U=auto", "ulysses", "ring zigzag", "ring doc-zigzag", "fpdt"}
    assert rows["ulysses"].work.imbalance == 1.0  # head-parallel: every rank the whole sequence's area
    assert rows["ring zigzag"].work.imbalance > rows["ring doc-zigzag"].work.imbalance >= 1.0
    for label, e in rows.items():
        line = next(ln for ln in out.splitlines() if ln[2:].startswith(label + " "))
        assert f"{e.work.imbalance:6.3f}" in line, line
        if e.auto:
            continue
        row = extrapolated(e.trial.with_seq_len(e.max_context), str(tmp_path)).row  # from the plan's cache
        assert row.figures.doc_work["imbalance"] == pytest.approx(
            plan_mod.trial_work(e.trial.with_seq_len(e.max_context)).imbalance, abs=1e-6)
        assert modelled_time(e, "h100-80g", e.max_context) == pytest.approx(row.figures.step_time_s, rel=1e-9)


def test_a_plans_row_under_documents_is_the_runners_on_every_deciding_rank(tmp_path, monkeypatch):
    """Every deciding rank simulated (the tests' CPAB_SIM_RANKS=0 lifted): the plan's row for a ring with documents
    is the one the runner builds from the worst rank, its step's attention the slowest rank's, not carried from
    rank 0's pairs by a rank's own counts (rank 3 holds the long document and decides both here)."""
    from bench.measure.run import run_trial
    from bench.search.plan import extrapolated

    monkeypatch.setenv("CPAB_SIM_RANKS", "deciding")
    path = tmp_path / "tiny2.json"
    path.write_text(json.dumps({**TINY, "n_layers": 2}))
    trial = Trial.make("ring", str(path), 32768, 4, mode="simulated", options={"layout": "contiguous"},
                       docs=DocsSpec(lengths=(512,) * 32 + (16384,)), step=StepConfig(stack="lean"))
    runner = run_trial(trial)
    planned = extrapolated(trial, str(tmp_path)).row
    assert runner.figures.worst_rank == planned.figures.worst_rank == runner.figures.doc_work["slowest_rank"] == 3
    assert planned.figures.step_time_s == pytest.approx(runner.figures.step_time_s, rel=1e-12)
    assert planned.figures.step_time_model["counts"] == runner.figures.step_time_model["counts"]


# --------------------------------------------------------------------------- the Hugging Face stack (--stack hf)

HF_LLAMA = "bench/model_configs/hf/Llama-3.1-8B/config.json"


def test_hf_entries_are_exactly_the_methods_the_hf_stack_runs_with_its_levers():
    """Under ``--stack hf``: ALST first (the baseline), then torch-cp and upipe, each keyed with the hf
    stack and resolved with its levers (``hfstack.apply``); no ladder rung, no other method."""
    from bench.stackmodel import hfstack

    hf = entries(HF_LLAMA, 8, 1, "h100-80g", 1 << 20, stack="hf")
    assert [e.method for e in hf] == ["ds-ulysses-hf", "torch-cp", "upipe"]
    assert set(e.method for e in hf) == set(hfstack.METHODS)
    assert not any("+" in e.label for e in hf)
    for e in hf:
        assert e.trial.step.stack == "hf" and e.trial.step.allocator_pools == "per-stream"
        ran = e.trial.resolved()
        assert "hf-stack" in ran.presets
        assert ran.step == hfstack.apply(e.trial.step, e.method)[0]
        for name, value in hfstack.levers(e.method).items():
            if name != "tiled_mlp_impl":  # ours where DeepSpeed is not installed (hfstack.apply)
                assert getattr(ran.step, name) == value, (e.label, name)
        assert runs(e), e.label
    assert hf[1].trial.options.backend == "cudnn" and hf[1].trial.options.repeat_kv is False
    assert hf[0].trial.resolved().step.ac_offload and not hf[1].trial.resolved().step.ac_offload
    # the cache keys hold the stack: an hf trial never answers from a paper-stack line
    paper = next(e for e in entries(HF_LLAMA, 8, 1, "h100-80g", 1 << 20) if e.method == "upipe")
    assert json.loads(SimCache.key(hf[2].trial, "Llama-3.1-8B", 3))["step"]["stack"] == "hf"
    assert SimCache.key(hf[2].trial, "Llama-3.1-8B", 3) != SimCache.key(paper.trial, "Llama-3.1-8B", 3)


@pytest.mark.parametrize("flags,problem", [
    (["--allocator-pools", "shared"], "--allocator-pools shared has no effect under --stack hf"),
    (["--allocator-pools", "per-stream"], "--allocator-pools per-stream has no effect under --stack hf"),
    (["--paper-only"], "--paper-only has no effect under --stack hf"),
    (["--nodes", "2"], "--nodes 2 has no effect under --stack hf"),
])
def test_hf_plan_refuses_options_without_effect_before_any_simulation(flags, problem, capsys, monkeypatch):
    monkeypatch.setattr(plan_mod, "_sim", lambda *a: pytest.fail("simulated before refusing the option"))
    assert cli.main(["plan", "--model", HF_LLAMA, "--gpus", "8", "--stack", "hf", "--jobs", "1", "--no-figs",
                     "--no-cache", *flags]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and problem in err and "use --stack paper" in err, err
    with pytest.raises(ValueError, match="no effect under --stack hf"):
        entries(HF_LLAMA, 8, 1, "h100-80g", 1 << 20, stack="hf", pools="shared")


def test_hf_plan_through_the_cli(tmp_path, capsys, monkeypatch):
    """``bench plan --stack hf`` on a 2-layer model (simulated whole, each configuration fitting at the
    search limit of 32K): the table names the hf stack and its levers' sources, lists exactly its three
    methods, compares with ALST, and each modelled step at its max context is its simulated row's (the hf
    stack's attention rate, ``steptime.stack_constants``); the .md is named for the stack and, without wall
    times, renders the same from the cache again."""
    from analysis import plan_report
    from bench.search.plan import modelled_time

    path = tmp_path / "tiny2.json"
    path.write_text(json.dumps({**TINY, "n_layers": 2}))
    results = []
    monkeypatch.setattr(cli, "plan", lambda *a, **k: results.append(plan_mod.plan(*a, **k)) or results[-1])
    cache = tmp_path / "sims.ndjson"
    argv = ["plan", "--model", str(path), "--gpus", "4", "--stack", "hf", "--granularity", "16K",
            "--max-seq-len", "32K", "--jobs", "1", "--cache", str(cache), "--out-dir", str(tmp_path / "figs")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    res = results[0]
    assert "hf stack (bench.stackmodel.hfstack)" in out and "ALST's recipe" in out and "paper record setup" not in out
    assert "(ALST's recipe); P = on the Pareto front" in out
    labels = [e.label for e in res["entries"]]
    assert labels == [e.label for e in entries(str(path), 4, 1, "h100-80g", 16 << 10, stack="hf")]
    assert res["baseline"] is res["entries"][0] and res["baseline"].method == "ds-ulysses-hf"
    keys = [json.loads(json.loads(line)["key"]) for line in cache.read_text().splitlines()]
    assert keys and {k["step"]["stack"] for k in keys} == {"hf"}
    for e in res["entries"]:
        assert not e.skipped and e.max_context == 32 << 10, (e.label, e.skipped, e.error)
        row = extrapolated(e.trial.with_seq_len(e.max_context), str(tmp_path)).row
        assert modelled_time(e, "h100-80g", e.max_context) == pytest.approx(row.figures.step_time_s, rel=1e-9)
    md = tmp_path / "figs" / "plan_tiny2_4xh100-80g_stack-hf.md"
    assert md.exists() and "[bench/stackmodel/hfstack.py](../bench/stackmodel/hfstack.py)" in md.read_text()
    again = plan_mod.plan(str(path), 4, "h100-80g", max_seq_len=32 << 10, granularity=16 << 10, stack="hf",
                          cache=None, committed=cache, simulate=False, workers=1, progress=io.StringIO())
    first = plan_report.write_plan(again, tmp_path / "a", wall_times=False)[0]
    for e in again["entries"]:  # other wall times: the same .md
        e.seconds += 7.0
    second = plan_report.write_plan({**again, "seconds": 99.0}, tmp_path / "b", wall_times=False)[0]
    assert Path(first).read_bytes() == Path(second).read_bytes()
    assert "plan took" not in Path(first).read_text() and "[plan took" in plan_report.render(again)


@pytest.mark.parametrize("stack,replayed", [("paper", True), ("hf", True), ("lean", False)])
def test_the_pressure_replay_covers_every_stack_judged_on_the_reserved_peak(stack, replayed):
    """A length out of memory only by the slack rule's reserved peak (the allocated peak fits) is replayed
    under pressure on the stacks that judge the reserved peak, the hf stack's included."""
    from types import SimpleNamespace

    from bench.measure.result import Measurement

    trial = Trial.make("upipe", "tiny-llama", 1 << 20, 2, step=StepConfig(stack=stack))
    figures = SimpleNamespace(peak_bytes=70, usable_bytes=75, peak_reserved_bytes=80)
    row = SimpleNamespace(status="oom", figures=figures)
    assert plan_mod._past_capacity_by_slack(trial, row, Measurement(status="ok")) is replayed
    figures.peak_bytes = 76  # the live bytes themselves do not fit: no replay
    assert plan_mod._past_capacity_by_slack(trial, row, Measurement(status="ok")) is False


def test_a_failure_by_the_slack_rule_alone_is_simulated_exactly(monkeypatch, tmp_path):
    """The search's shortest failing length, judged on increments borrowed from another length, is
    taken as exact when the increment re-measured next to it is the one it used, unless it fails only by
    the slack rule's reserved peak: then it is simulated exactly (its own slack, or the pressure replay,
    may fit), and the search goes on from there."""
    from bench.search.plan import Point

    slope = {0: {"peak_bytes": 1}}  # by rank
    calls = []

    def fake(trial, workdir, cache=None, slope_=None, **kw):  # fits up to 5 steps once replayed; 6 never
        k, exact = trial.seq_len // step, slope_ is None
        calls.append((k, exact))
        fits = k <= 4 or (k == 5 and exact)
        p = Point(trial.seq_len, "ok" if fits else "oom", k, 0, 0.0, 10)
        p.load, p.exact, p.slope, p.step_counts = k / 5.5 if fits else 1.1, exact, slope, None
        p.measured, p.complete, p.rank = exact, True, 0  # one deciding rank
        p.by_slack = k == 5 and not exact
        return p

    monkeypatch.setattr(plan_mod, "extrapolated", lambda t, w, c=None, s=None, r=None: fake(t, w, c, s))
    trial = Trial.make("upipe", "tiny-llama", 1 << 20, 2)
    step = trial.seq_multiple() * 1024
    found, best, _, _, err = search_max(trial, step, 16 * step, str(tmp_path), first=2 * step)
    assert err is None and found == 5 * step and (5, True) in calls
    assert (6, True) in calls or (6, False) in calls


def test_a_failure_on_increments_older_than_the_bracket_is_simulated_exactly(monkeypatch, tmp_path):
    """The bracket's failing end is taken as exact only if it failed on the increments its other end has just
    been measured with, not on the search's latest ones: probed earlier on increments measured far away (here
    steeper ones, from the first probe at 24 steps), it fails where the model fits (every length up to 20 steps
    fits; on the steep increments only up to 15)."""
    from bench.search.plan import Point

    steep, shallow = {0: {"peak_bytes": 2}}, {0: {"peak_bytes": 1}}  # per-layer increments measured above / below 20

    def fake(trial, workdir, cache=None, slope=None, ranks=None):
        k, exact = trial.seq_len // step, slope is None
        used = (steep if k > 20 else shallow) if exact else slope
        fits = k <= (15 if used is steep and not exact else 20)
        p = Point(trial.seq_len, "ok" if fits else "oom", k, 0, 0.0, 10)
        p.load, p.exact, p.slope, p.step_counts = k / 20.5 if fits else 1.1, exact, used, None
        p.measured, p.complete, p.rank, p.by_slack = exact, True, 0, False
        return p

    monkeypatch.setattr(plan_mod, "extrapolated", fake)
    trial = Trial.make("upipe", "tiny-llama", 1 << 20, 2)
    step = trial.seq_multiple() * 1024
    found, best, _, _, err = search_max(trial, step, 32 * step, str(tmp_path), first=24 * step)
    assert err is None and found == 20 * step and best.exact


def test_the_committed_hf_plan_renders_again_from_the_committed_cache(tmp_path, monkeypatch):
    """``make figs-plans`` (``analysis.derived.PLANS``) re-renders the committed hf plan from the committed
    cache, simulating nothing, to the same bytes but for the cache's size in its header (which grows when
    other plans append lines); the .md holds no wall seconds."""
    from analysis import derived, plan_report

    repo = Path(__file__).resolve().parents[3]
    [hf] = [p for p in derived.PLANS if p.stack == "hf"]
    assert not hf.wall_times and "--stack hf" in hf.command()
    monkeypatch.setenv("CPAB_SIM_RANKS", hf.sim_ranks)  # as make figs-plans renders it (analysis.derived.plans)
    res = plan_mod.plan(str(repo / hf.model), hf.gpus, hf.device, hf.nodes, pools=hf.pools, cache=None,
                        stack=hf.stack, committed=repo / "results" / "plan" / "sims.ndjson", simulate=False,
                        workers=1, progress=io.StringIO())
    md = Path(plan_report.write_plan(res, tmp_path, hf.wall_times)[0])
    committed = repo / "paper_figs" / md.name

    def stable(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("simulations: ")]

    assert md.name == "plan_Llama-3.1-8B_8xh100-80g_stack-hf.md" and committed.exists()
    assert stable(md.read_text()) == stable(committed.read_text())
    assert "[plan took" not in md.read_text() and "ALST (ds-ulysses-hf)" in md.read_text()
