"""The committed real-GPU results (results/gpu) hold together: every real row says where it ran,
the per-stream segments add up to the reserved peak the allocator reported, and the comparison
table covers every real trial beside its simulated twin. (The rows come from a lent H100;
nothing here needs a GPU.)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from analysis.gpu_report import segments_markdown
from records import read_rows

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "results" / "gpu" / "h100-ws1"
# (folder, its rows' file, their mode): the emulated rows are .ndjson, out of the analysis' reach
FOLDERS = [(FOLDER, "real.jsonl", "real"), (ROOT / "results" / "gpu" / "h100-emulated", "real.ndjson", "emulated"),
           (ROOT / "results" / "gpu" / "h200-skipmath", "real.ndjson", "emulated")]
H100 = "NVIDIA H100 80GB HBM3"
DEVICES = {"h100-ws1": H100, "h100-emulated": H100, "h200-skipmath": "NVIDIA H200"}


@pytest.mark.parametrize("folder,name,mode", FOLDERS, ids=lambda v: getattr(v, "name", None))
def test_real_rows_say_where_they_ran(folder, name, mode):
    rows = read_rows(folder / name, on_error="raise")
    assert rows and all(r.mode == mode and r.status == "ok" for r in rows)
    assert {r.env.device_name for r in rows} == {DEVICES[folder.name]}
    assert all(r.figures.peak_reserved_bytes >= r.figures.peak_bytes > 0 for r in rows)


@pytest.mark.parametrize("folder", [f for f, _, _ in FOLDERS], ids=lambda f: f.name)
def test_segments_add_up_to_the_reserved_peak(folder):
    for line in (folder / "segments.ndjson").read_text().splitlines():
        d = json.loads(line)
        mapped = sum(s["total_size"] for s in d["segments"])
        peak = d["stats"]["reserved_bytes.all.peak"]
        if d["stats"]["num_alloc_retries"] == 0:  # nothing was unmapped: every segment is at its largest
            assert mapped == pytest.approx(peak, rel=1e-3), d["method"]
        else:  # a retry released cached blocks (fpdt): what is mapped at the end is less than the peak
            assert mapped < peak, d["method"]


def test_segments_table_renders(tmp_path):
    (tmp_path / "segments.ndjson").write_text((FOLDER / "segments.ndjson").read_text())
    text = segments_markdown(tmp_path)
    assert "| ulysses | 128K | default |" in text and "**46.47**" in text


@pytest.mark.parametrize("folder,name,mode", FOLDERS, ids=lambda v: getattr(v, "name", None))
def test_comparison_covers_every_real_trial(folder, name, mode):
    real = {(r.method, r.seq_len, r.world_size, r.model) for r in read_rows(folder / name, on_error="raise")}
    sims = [json.loads(line) for line in (folder / name.replace("real", "simulated")).read_text().splitlines()]
    for method, seq, ws, _ in real:
        pools = {s["levers"].get("allocator_pools", "shared") for s in sims
                 if s["method"] == method and s["seq_len"] == seq and s["world_size"] == ws}
        assert pools == {"shared", "per-stream"}, (method, seq, ws)
    lines = (folder / "compare.md").read_text().splitlines()
    for method, seq, ws, model in real:
        cells = f" | {mode} | {ws} | {Path(model).stem} | {seq // 1024}K |"
        assert any(line.startswith(f"| {method}") and cells in line for line in lines), (method, seq, ws)


def compare(argv: list[str], capsys) -> tuple[int, str]:
    """``scripts/gpu/compare.py`` with ``argv``, in this process (its simulations stay subprocesses):
    the exit status and what it wrote to stderr. A refusal is ``sys.exit(message)``: status 1, the
    message on stderr and no traceback, as the command line shows it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_compare", ROOT / "scripts" / "gpu" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    old_argv, sys.argv = sys.argv, ["compare.py", *argv]
    capsys.readouterr()
    try:
        module.main()
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    finally:
        sys.argv = old_argv
    return status, capsys.readouterr().err


def test_compare_from_rows_rerenders_the_committed_table_and_refuses_a_mismatch(tmp_path, capsys):
    """``compare.py --from-rows`` gives the committed table from the stored simulated rows, and a
    one-line error (not a StopIteration, not a mispairing) when they are not one per trial and pool."""
    import shutil

    for name in ("real.jsonl", "simulated.jsonl", "kernels.ndjson"):
        shutil.copy(FOLDER / name, tmp_path / name)
    status, err = compare([str(tmp_path), "--from-rows"], capsys)
    assert status == 0, err
    assert (tmp_path / "compare.md").read_text() == (FOLDER / "compare.md").read_text()
    status, err = compare([str(tmp_path), "--from-rows", "--pools", "shared"], capsys)
    assert status != 0 and "not one per real trial and pool" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "simulated.jsonl").unlink()
    status, err = compare([str(tmp_path), "--from-rows"], capsys)
    assert status != 0 and "--from-rows needs" in err and len(err.strip().splitlines()) == 1


def _emulated_ring_row() -> dict:
    """A hand-made emulated row of a zigzag ring that measured both of its ranks (what
    ``bench.measure.run._emulated`` writes on a GPU), with the fields compare.py reads; its bytes
    are made up (rank 1 the worst)."""
    argv = ["bench", "run", "--mode", "emulated", "--device", "h100-80g", "--world-size", "2", "--model", "tiny-llama",
            "--method", "ring", "--seq-len", "1024", "--attention-math", "skip", "--offload-keep", "first"]
    mib = 1 << 20
    return {"method": "ring", "seq_len": 1024, "world_size": 2, "device": "h100-80g", "mode": "emulated",
            "status": "ok", "model": "tiny-llama", "options": {},
            "levers": {"attention_math": "skip", "offload_keep": "first"},
            "env": {"argv": argv, "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130"},
            "figures": {"peak_bytes": 12 * mib, "peak_reserved_bytes": 30 * mib, "step_times_s": [0.5],
                        "comm_time_s": 0.01, "worst_rank": 1, "rank_peaks": [[0, 11 * mib], [1, 12 * mib]],
                        "rank_reserved_peaks": [[0, 28 * mib], [1, 30 * mib]]}}


@pytest.mark.slow  # two simulations, each a subprocess
def test_compare_sets_each_emulated_rank_beside_its_simulation(tmp_path, capsys):
    """An emulated row with ``rank_peaks``: compare.py simulates each of its ranks alone
    (``simulated_ranks``), takes the twin of the row's own worst rank, renders a per-rank table with
    the real and simulated bytes, re-renders it from the stored rows, and refuses a short file."""
    row = _emulated_ring_row()
    (tmp_path / "real.ndjson").write_text(json.dumps(row) + "\n")
    argv = [str(tmp_path), "--pools", "per-stream"]
    status, err = compare(argv, capsys)
    assert status == 0, err[-2000:]
    ranks = [json.loads(line) for line in (tmp_path / "simulated_ranks.ndjson").read_text().splitlines()]
    twins = [json.loads(line) for line in (tmp_path / "simulated.ndjson").read_text().splitlines()]
    assert [r["figures"]["worst_rank"] for r in ranks] == [0, 1]
    assert all(r["mode"] == "simulated" and r["figures"].get("rank_peaks") is None for r in ranks)
    assert twins == [ranks[1]]  # the twin is the real row's worst rank simulated
    text = (tmp_path / "compare.md").read_text()
    assert "## Each rank" in text and "each deciding rank of a `ws`-rank job in turn" in text
    for rank, star in ((0, ""), (1, "*")):
        allocated, reserved = row["figures"]["rank_peaks"][rank][1], row["figures"]["rank_reserved_peaks"][rank][1]
        sim = ranks[rank]["figures"]
        assert (f"| ring | 2 | 1K | {rank}{star} | {allocated / 2**30:.2f} | {sim['peak_bytes'] / 2**30:.2f} | "
                f"{100 * (sim['peak_bytes'] - allocated) / allocated:+.1f}% | {reserved / 2**30:.2f} | "
                f"{sim['peak_reserved_bytes'] / 2**30:.2f} |") in text, text
    assert "- ring, 2 ranks, 1K: the worst rank over rank 0: allocated real rank 1 +0.00 GiB" in text
    rendered = text
    status, err = compare(argv + ["--from-rows"], capsys)
    assert status == 0, err
    assert (tmp_path / "compare.md").read_text() == rendered
    (tmp_path / "simulated_ranks.ndjson").write_text(json.dumps(ranks[0]) + "\n")
    status, err = compare(argv + ["--from-rows"], capsys)
    assert status != 0 and "not one per rank of the real rows' rank_peaks" in err
    assert len(err.strip().splitlines()) == 1
