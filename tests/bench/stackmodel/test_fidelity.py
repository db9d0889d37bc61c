"""``bench.stackmodel.fidelity`` and ``python -m bench fidelity``: the machinery, on tiny models.

The anchors are checked against the paper's tables they are read from (counts per kind); the
runs use hand-made anchors on ``tiny-llama`` so the file stays fast. No paper number is tested.
"""
from __future__ import annotations

import csv
import dataclasses
import json

import pytest

from analysis import fidelity_report
from bench.cli import main
from bench.measure.run import SIM_RANKS_ENV, deciding_ranks
from bench.stackmodel import fidelity
from bench.stackmodel.fidelity import PAPER_DIR, Anchor, Impl
from records import FIDELITY_ANCHOR_NOTE
from tests.rowfactory import make_row, write

TINY = "tiny-llama"


def _rows(name):
    with open(PAPER_DIR / f"{name}.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_anchors_read_from_the_paper_tables():
    anchors = fidelity.load_anchors()
    by_source = {}
    for a in anchors:
        by_source.setdefault((a.source, a.kind), []).append(a)
    assert len(by_source[("memory_anchors", "memory")]) == len(_rows("memory_anchors"))
    fig1 = [r for r in _rows("fig1_memory_breakdown") if r["config"] in ("alst", "upipe")]
    assert len(by_source[("fig1_memory_breakdown", "memory")]) == len(fig1)
    points = [r for r in _rows("fig5_multinode") if r["kind"] == "point"]
    assert len(by_source[("fig5_multinode", "memory")]) == sum(r["status"] == "ok" for r in points)
    assert len(by_source[("fig5_multinode", "boundary")]) == sum(r["status"] == "oom" for r in points)
    table3 = _rows("table3_throughput")
    cells = {(r["model"], r["method"]) for r in table3}
    with_oom = {(r["model"], r["method"]) for r in table3 if r["status"] == "oom"}
    t3 = by_source[("table3_throughput", "boundary")]
    assert sum(a.expect == "fits" for a in t3) == len(cells)
    assert sum(a.expect == "oom" for a in t3) == len(with_oom)
    # the values come from the files: the 128K anchors carry the file's numbers
    assert sorted(a.paper_gib for a in by_source[("memory_anchors", "memory")]) == sorted(
        float(r["peak_mem_gib"]) for r in _rows("memory_anchors"))
    # each boundary pair: the fitting length is below the OOM one
    for a in t3:
        if a.expect == "oom":
            fit = next(b for b in t3 if b.model == a.model and b.paper_method == a.paper_method and b.expect == "fits")
            assert fit.seq_len < a.seq_len
    assert len({a.name for a in anchors}) == len(anchors)


def test_anchors_follow_a_changed_table(tmp_path):
    for path in PAPER_DIR.glob("*.csv"):
        (tmp_path / path.name).write_text(path.read_text())
    rows = _rows("memory_anchors")
    with open(tmp_path / "memory_anchors.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerow({**rows[0], "peak_mem_gib": "12.5"})
    mem = [a for a in fidelity.load_anchors(tmp_path) if a.source == "memory_anchors"]
    assert [a.paper_gib for a in mem] == [12.5]


def test_implementations_and_selection():
    assert fidelity.implementation("ring", 8) == Impl("yc-usp", {"ulysses_degree": 1, "attn_type": "fa3"})
    assert fidelity.implementation("upipe", 8).method == "upipe"
    assert fidelity.implementation("upipe", 16).method == "usp-upipe"
    assert fidelity.implementation("torch-cp", 8).levers == {"tiled_mlp": False, "tiled_norm": False}
    with pytest.raises(ValueError):
        fidelity.implementation("nope", 8)
    anchors = fidelity.load_anchors()
    assert all(a.kind == "memory" for a in fidelity.select(anchors, "memory"))
    assert all(a.kind == "boundary" for a in fidelity.select(anchors, "boundaries"))
    assert [a.name for a in fidelity.select(anchors, "all", ["fig5-usp-8M"])] == ["fig5-usp-8M-oom"]
    with pytest.raises(ValueError, match="unknown anchor"):
        fidelity.select(anchors, "all", ["no-such-anchor"])


def test_residual_and_pass():
    assert fidelity.residual_pct(22.0, 20.0) == pytest.approx(10.0)
    assert fidelity.residual_pct(18.0, 20.0) == pytest.approx(-10.0)
    assert fidelity.residual_pct(None, 20.0) is None
    a = Anchor("a", "memory", "x", "upipe", TINY, 4, 8192, Impl("upipe"), paper_gib=20.0)
    assert fidelity.memory_passes(a, "ok", 21.9)
    assert not fidelity.memory_passes(a, "ok", 22.1)
    assert not fidelity.memory_passes(a, "ok", 17.9)
    assert not fidelity.memory_passes(a, "oom", 20.0)  # the paper's run fitted
    eye = dataclasses.replace(a, abs_tol_gib=1.0)
    assert fidelity.memory_passes(eye, "ok", 22.9) and not fidelity.memory_passes(eye, "ok", 23.1)


@pytest.mark.parametrize("expect,status,ok", [("fits", "ok", True), ("fits", "oom", False),
                                              ("oom", "oom", True), ("oom", "ok", False),
                                              ("fits", "error", False), ("oom", "error", False)])
def test_boundary_logic(expect, status, ok):
    assert fidelity.boundary_passes(expect, status) is ok


def test_host_only_oom_is_judged_on_the_device(tiny_results):
    """The paper measured device memory: offloads over the preset's assumed host memory are shown
    in the cell but do not make a fitting run fail (nor an OOM boundary pass)."""
    results, _ = tiny_results
    _, fits, oom = results
    row = fits.rows["paper"]
    figures = dataclasses.replace(row.figures, host_peak_bytes=300 * 2**30, host_usable_bytes=230 * 2**30)
    host = dataclasses.replace(row, status="oom", message="host memory: offloads of 300 GiB ...", figures=figures)
    assert fidelity.host_only_oom(host) and fidelity.device_status(host) == "ok"
    for anchor, expected in ((fits.anchor, True), (oom.anchor, False)):
        judged = fidelity.Result(anchor, {"paper": host, "lean": host})
        assert judged.passes() is expected
        assert "host 300 > 230 GiB assumed" in judged.ours("paper")
    device = dataclasses.replace(row, status="oom", message="reserved peak 90 GiB exceeds the usable ...")
    assert not fidelity.host_only_oom(device) and fidelity.device_status(device) == "oom"


def _tiny_anchors():
    impl = Impl("upipe")
    return [
        Anchor("tiny-mem", "memory", "hand-made", "upipe", TINY, 4, 8 << 10, impl, paper_gib=0.02),
        Anchor("tiny-fits", "boundary", "hand-made", "upipe", TINY, 4, 8 << 10, impl, expect="fits"),
        Anchor("tiny-oom", "boundary", "hand-made", "upipe", TINY, 4, 8 << 10, impl, expect="oom"),
    ]


@pytest.fixture(scope="module")
def tiny_results():
    lines = []
    results = fidelity.run_anchors(_tiny_anchors(), log=lines.append)
    return results, lines


def test_run_judges_and_shares_trials(tiny_results):
    results, lines = tiny_results
    assert len(lines) == 3 and "2 trials in" in lines[2] and "s CPU" in lines[2]  # 3 anchors share a trial per stack
    assert lines[0].startswith("[1/2] tiny-mem, tiny-fits, tiny-oom") and lines[0].endswith("s]")
    mem, fits, oom = results
    assert all(r.rows["paper"].status == r.rows["lean"].status == "ok" for r in results)
    assert mem.rows["paper"].levers["stack"] == "paper" and mem.rows["lean"].levers.get("stack", "lean") == "lean"
    assert mem.gib("paper") == mem.rows["paper"].figures.peak_reserved_bytes / 2**30
    assert mem.gib("lean") == mem.rows["lean"].figures.peak_bytes / 2**30
    assert mem.residual == pytest.approx((mem.gib("paper") - 0.02) / 0.02 * 100)
    assert mem.passes() is (abs(mem.gib("paper") - 0.02) <= 0.002)
    assert fits.passes() and not oom.passes() and fits.residual is None
    text = fidelity_report.text_table(results)
    assert "tiny-oom" in text and "FAIL" in text and f"FITTED = {fidelity.paper_stack.FITTED}" in text


def test_outputs_written(tiny_results, tmp_path):
    results, _ = tiny_results
    out, figs = tmp_path / "out", tmp_path / "figs"
    paths = fidelity_report.write_outputs(results, out, figs)
    assert paths == [out / "fidelity.jsonl", figs / "fidelity.md", figs / "fidelity.png"]
    rows = [json.loads(line) for line in (out / "fidelity.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and {r["levers"].get("stack", "lean") for r in rows} == {"paper", "lean"}
    assert all(any(FIDELITY_ANCHOR_NOTE in n for n in r["notes"]) for r in rows)
    md = (figs / "fidelity.md").read_text()
    assert "| tiny-mem |" in md and "simulated" in md and "FITTED" in md and "h100-80g" in md
    assert (figs / "fidelity.png").stat().st_size > 1000
    fidelity_report.write_outputs(results, out, figs)  # appended, not replaced
    assert len((out / "fidelity.jsonl").read_text().splitlines()) == 4


def test_cli_runs_selected_anchors(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(fidelity, "load_anchors", lambda paper_dir=PAPER_DIR: _tiny_anchors())
    assert main(["fidelity", "--anchors", "tiny-mem", "--jobs", "1", "--out", str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert "tiny-mem" in captured.out and "tiny-oom" not in captured.out
    assert "[1/2]" in captured.err and "[2/2]" in captured.err
    assert (tmp_path / "o" / "fidelity.md").exists() and (tmp_path / "o" / "fidelity.png").exists()
    assert main(["fidelity", "--only", "memory", "--list-anchors"]) == 0
    assert capsys.readouterr().out.split()[0] == "tiny-mem"


@pytest.mark.parametrize("argv,needle", [
    (["--out", "{file}"], "--out"),
    (["--figs-dir", "{file}"], "--figs-dir"),
    (["--anchors", "no-such"], "unknown anchor"),
    (["--jobs", "0"], "--jobs"),
])
def test_cli_bad_arguments_one_line(tmp_path, capsys, argv, needle):
    file = tmp_path / "a-file"
    file.write_text("x")
    argv = [a.replace("{file}", str(file)) for a in argv]
    assert main(["fidelity", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_fig1_ladder_is_one_anchor_per_bar():
    """Every bar of Fig. 1 with a rung of ours is an anchor with that rung's levers: the fitting
    bars memory anchors, the OOM bars boundaries labelled with the paper's needed GiB."""
    ladder = {a.paper_method: a for a in fidelity.load_anchors() if a.source == "fig1_memory_breakdown"}
    paper = {r["config"]: r for r in _rows("fig1_memory_breakdown")}
    assert set(ladder) == set(fidelity.FIG1_RUNGS) == set(paper) - {"default"}
    for config, a in ladder.items():
        assert (a.kind, a.expect) == (("memory", "fits") if paper[config]["status"] == "ok" else ("boundary", "oom"))
        for lever, value in fidelity.FIG1_RUNGS[config][1].items():
            assert getattr(a.trial("paper").step, lever) == value
    assert ladder["fsdp"].impl.method == "no-cp" and ladder["fsdp"].paper_value() == "oom (7680 GiB)"
    assert ladder["alst"].impl == fidelity.implementation("ulysses", 8)  # the Table 3 Ulysses configuration
    ao = ladder["+ao"].trial("lean").step
    assert ao.ac and ao.ac_offload and not ao.tiled_mlp and not ao.chunked_loss
    with pytest.raises(ValueError, match="no rung of ours for 'default'"):
        fidelity.fig1_rung("default", 8)


def test_pool_order_puts_costly_trials_first(monkeypatch):
    """Ordering changes when a trial starts, never what it computes: the trial simulating more ranks (a ring's
    every rank), then the paper stack, then the longer sequence (per rank) come first."""
    monkeypatch.setenv(SIM_RANKS_ENV, "deciding")  # as a user runs it (the tests simulate rank 0 alone)
    short, long = _tiny_anchors()[0], dataclasses.replace(_tiny_anchors()[0], seq_len=16 << 10)
    ring = dataclasses.replace(short, impl=Impl("yc-usp", {"ulysses_degree": 1}))  # every rank of its ring
    trials = [short.trial("lean"), long.trial("lean"), short.trial("paper"), ring.trial("lean")]
    assert len(deciding_ranks(trials[3])) > 1 == len(deciding_ranks(trials[2]))
    assert sorted(trials, key=fidelity.cost, reverse=True) == [trials[3], trials[2], trials[1], trials[0]]
    assert fidelity.cpu_seconds() > 0
    # with the committed rows' wall times: the longest first, a trial without a row before them all
    keyed = {t.key(): t for t in trials}
    seconds = {trials[0].key(): 9.0, trials[3].key(): 2.0, trials[1].key(): 5.0}
    assert fidelity.pool_order(keyed, seconds) == [t.key() for t in (trials[2], trials[0], trials[1], trials[3])]
    assert fidelity.pool_order(keyed, {}) == [t.key() for t in sorted(trials, key=fidelity.cost, reverse=True)]


def test_the_committed_rows_give_every_anchors_trial_its_wall_time(tmp_path):
    """``committed_seconds`` reads results/fidelity's rows: every trial of the full run has one (a pool ordered
    by them); a missing or unreadable file gives none, and the pool falls back on ``cost``."""
    seconds = fidelity.committed_seconds()
    trials = {a.trial(stack).key() for a in fidelity.load_anchors() for stack in fidelity.STACKS}
    assert trials <= set(seconds) and all(seconds[k] > 0 for k in trials)
    assert fidelity.committed_seconds(tmp_path / "none.jsonl") == {}
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert fidelity.committed_seconds(tmp_path / "bad.jsonl") == {}


def test_the_paper_stack_keeps_a_pool_per_stream_by_default(tiny_results):
    """Since the H100 check (results/gpu), fidelity's paper-stack trials replay a pool per stream
    and say so in their levers; the lean ones have no allocator model to key."""
    results, _ = tiny_results
    mem = results[0]
    assert mem.rows["paper"].levers["allocator_pools"] == "per-stream"
    assert mem.rows["lean"].levers["allocator_pools"] == "shared"  # schema 2 rows record the default too


def test_from_rows_renders_without_simulating(tiny_results, tmp_path, monkeypatch, capsys):
    """--from-rows takes every anchor's trials from row files: nothing is simulated, no rows are
    appended, and a trial without a row is a one-line error naming it."""
    results, _ = tiny_results
    rows_file = tmp_path / "rows" / "fidelity.jsonl"
    fidelity_report.write_outputs(results, rows_file.parent, tmp_path / "first")
    monkeypatch.setattr(fidelity, "load_anchors", lambda paper_dir=PAPER_DIR: _tiny_anchors())
    monkeypatch.setattr(fidelity, "run_one", lambda trial: pytest.fail("simulated under --from-rows"))
    out = tmp_path / "out"
    assert main(["fidelity", "--from-rows", str(rows_file), "--out", str(out)]) == 0
    assert (out / "fidelity.md").read_text() == (tmp_path / "first" / "fidelity.md").read_text()
    assert not (out / "fidelity.jsonl").exists()
    capsys.readouterr()
    assert main(["fidelity", "--from-rows", str(rows_file), "--allocator-pools", "shared", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no row in" in err and "shared pools" in err


def test_a_memory_anchor_run_on_a_real_gpu_is_shown_beside_it(tiny_results, tmp_path):
    """A memory anchor whose trial (method, options, model, ranks, length) has an ok row under
    results/gpu gets that run's allocated and reserved peaks beside the paper and ours; other
    rows and boundary anchors do not."""
    results, _ = tiny_results
    gpu = tmp_path / "results" / "gpu"
    (gpu / "h100-x").mkdir(parents=True)
    match = make_row("upipe", TINY, 8 << 10, 4, mode="emulated", peak_gib=0.01, reserved_gib=0.03)
    longer = make_row("upipe", TINY, 16 << 10, 4, mode="emulated", peak_gib=0.5, reserved_gib=0.6)
    other_opts = make_row("upipe", TINY, 8 << 10, 4, mode="emulated", peak_gib=0.7, reserved_gib=0.8,
                          options={"ulysses_degree": 2})
    write(gpu / "h100-x" / "real.ndjson", [longer, other_opts, match])
    checks = fidelity.real_checks(results, gpu)
    assert [c.anchor.name for c in checks] == ["tiny-mem"]
    assert checks[0].source == "results/gpu/h100-x/real.ndjson"
    md = fidelity_report.markdown(results, checks)
    assert "## The same trials on a real GPU" in md
    assert "| tiny-mem | 0.02 GiB | 0.01 GiB | 0.03 GiB |" in md and "emulated, NVIDIA H100" in md
    assert "on a real GPU" not in fidelity_report.markdown(results)


def test_a_real_runs_simulated_twin_and_its_levers_are_shown(tiny_results, tmp_path):
    """A real row's simulated twin (compare.py's per-stream row of the same trial beside it) gives
    the "ours, same step" column with its residual against the real reserved peak; the run column
    names the run's levers away from the defaults."""
    results, _ = tiny_results
    folder = tmp_path / "results" / "gpu" / "h200-x"
    folder.mkdir(parents=True)
    levers = {**make_row().levers, "attention_math": "skip", "rope_table": "none"}
    real = make_row("upipe", TINY, 8 << 10, 4, mode="emulated", peak_gib=0.01, reserved_gib=0.04, levers=levers)
    twin = make_row("upipe", TINY, 8 << 10, 4, mode="simulated", peak_gib=0.01, reserved_gib=0.03,
                    levers={**levers, "allocator_pools": "per-stream"})
    shared = make_row("upipe", TINY, 8 << 10, 4, mode="simulated", peak_gib=0.01, reserved_gib=0.5,
                      levers={**levers, "allocator_pools": "shared"})
    write(folder / "real.ndjson", [real])
    write(folder / "simulated.ndjson", [shared, twin])
    checks = fidelity.real_checks(results, tmp_path / "results" / "gpu")
    assert checks[0].twin is not None and checks[0].twin.levers["allocator_pools"] == "per-stream"
    md = fidelity_report.markdown(results, checks)
    assert "| 0.04 GiB | 0.03 GiB (-25.0%) |" in md
    assert "emulated (attention_math=skip, rope_table=none)" in md
