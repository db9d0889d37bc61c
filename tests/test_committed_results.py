"""The committed result rows are valid under today's schema and say how they were made.

A schema change that old rows no longer satisfy, or a row appended by hand, would otherwise
surface only when a table is regenerated."""
from __future__ import annotations

from pathlib import Path

import pytest

from records import read_rows

RESULTS = Path(__file__).resolve().parents[1] / "results"
FILES = sorted(p for p in RESULTS.rglob("*.jsonl") if "demo" not in p.relative_to(RESULTS).parts)


def test_there_are_committed_rows():
    names = {str(p.relative_to(RESULTS)) for p in FILES}
    assert {"bench/simulated.jsonl", "table3-llama3-8b-cpu.jsonl"} <= names


def test_real_cpu_rows_carry_their_spread_and_host_load():
    """The per-method CPU table was re-run with >= 5 timed steps (results/bench/README.md, (b))."""
    rows = [r for r in read_rows(RESULTS / "table3-llama3-8b-cpu.jsonl", on_error="raise") if r.status == "ok"]
    assert {r.world_size for r in rows} == {2, 4}
    for r in rows:
        f = r.figures
        assert len(f.step_times_s) >= 5 and f.step_time_min_s <= f.step_time_s <= f.step_time_max_s
        assert f.host_load_before is not None and f.host_shared is not None


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_rows_validate_and_carry_their_provenance(path):
    rows = read_rows(path, on_error="raise")
    assert rows
    for row in rows:
        assert row.mode in ("real", "emulated", "simulated")
        assert row.env.git_commit and row.env.time and row.env.torch
        if row.status == "ok" and row.kind == "trial" and row.mode == "real":
            assert row.figures.step_time_s and row.figures.step_time_s > 0
