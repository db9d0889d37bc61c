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
    assert {"bench/simulated.jsonl", "bench/real.jsonl"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_rows_validate_and_carry_their_provenance(path):
    rows = read_rows(path, on_error="raise")
    assert rows
    for row in rows:
        assert row.mode in ("real", "emulated", "simulated")
        assert row.env.git_commit and row.env.time and row.env.torch
        if row.status == "ok" and row.kind == "trial" and row.mode == "real":
            assert row.figures.step_time_s and row.figures.step_time_s > 0
