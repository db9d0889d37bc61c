"""The committed real-GPU results (results/gpu) hold together: every real row says where it ran,
the per-stream segments add up to the reserved peak the allocator reported, and the comparison
table covers every real trial beside its simulated twin. (The rows come from a lent H100;
nothing here needs a GPU.)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from records import read_rows

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "results" / "gpu" / "h100-ws1"
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
import compare  # noqa: E402


def test_real_rows_say_where_they_ran():
    rows = read_rows(FOLDER / "real.jsonl", on_error="raise")
    assert rows and all(r.mode == "real" and r.status == "ok" for r in rows)
    assert {r.env.device_name for r in rows} == {"NVIDIA H100 80GB HBM3"}
    assert all(r.figures.peak_reserved_bytes >= r.figures.peak_bytes > 0 for r in rows)


def test_segments_add_up_to_the_reserved_peak():
    for line in (FOLDER / "segments.ndjson").read_text().splitlines():
        d = json.loads(line)
        mapped = sum(s["total_size"] for s in d["segments"])
        peak = d["stats"]["reserved_bytes.all.peak"]
        if d["stats"]["num_alloc_retries"] == 0:  # nothing was unmapped: every segment is at its largest
            assert mapped == pytest.approx(peak, rel=1e-3), d["method"]
        else:  # a retry released cached blocks (fpdt): what is mapped at the end is less than the peak
            assert mapped < peak, d["method"]


def test_segments_table_renders(tmp_path):
    (tmp_path / "segments.ndjson").write_text((FOLDER / "segments.ndjson").read_text())
    compare.segments_md(tmp_path)
    text = (tmp_path / "segments.md").read_text()
    assert "| ulysses | 128K | default |" in text and "**46.47**" in text


def test_comparison_covers_every_real_trial():
    real = {(r.method, r.seq_len) for r in read_rows(FOLDER / "real.jsonl", on_error="raise")}
    sims = [json.loads(line) for line in (FOLDER / "simulated.jsonl").read_text().splitlines()]
    for method, seq in real:
        pools = {s["levers"].get("allocator_pools", "shared") for s in sims
                 if s["method"] == method and s["seq_len"] == seq}
        assert pools == {"shared", "per-stream"}, (method, seq)
    table = (FOLDER / "compare.md").read_text()
    assert all(f"| {m} | {s // 1024}K |" in table for m, s in real)
