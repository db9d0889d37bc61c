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


def test_compare_from_rows_rerenders_the_committed_table_and_refuses_a_mismatch(tmp_path):
    """``compare.py --from-rows`` gives the committed table from the stored simulated rows, and a
    one-line error (not a StopIteration, not a mispairing) when they are not one per trial and pool."""
    import shutil
    import subprocess

    for name in ("real.jsonl", "simulated.jsonl", "kernels.ndjson"):
        shutil.copy(FOLDER / name, tmp_path / name)
    script = [sys.executable, str(ROOT / "scripts" / "gpu" / "compare.py"), str(tmp_path), "--from-rows"]
    out = subprocess.run(script, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "compare.md").read_text() == (FOLDER / "compare.md").read_text()
    out = subprocess.run(script + ["--pools", "shared"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "not one per real trial and pool" in out.stderr
    assert "Traceback" not in out.stderr
    (tmp_path / "simulated.jsonl").unlink()
    out = subprocess.run(script, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "--from-rows needs" in out.stderr and "Traceback" not in out.stderr
