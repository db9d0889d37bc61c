"""A spec whose trials the committed rows hold finds every one of them done: trial identity
survives the row schema (schema 1 rows read beside schema 2 trials, records.identity)."""
from __future__ import annotations

from pathlib import Path

import pytest

from records import read_rows, trial_key
from sweeps.spec import load_spec

ROOT = Path(__file__).resolve().parents[2]
# spec -> the committed rows it was run into (--set out=...)
COMMITTED = {
    "maxctx-llama3-8b.yaml": "results/bench/simulated.jsonl",
    "maxctx-qwen3-32b.yaml": "results/bench/simulated.jsonl",
    "table3-llama3-8b-cpu.yaml": "results/table3-llama3-8b-cpu.jsonl",
}


@pytest.mark.parametrize("spec", sorted(COMMITTED))
def test_every_trial_of_a_committed_sweep_is_done(spec):
    rows = list(read_rows(ROOT / COMMITTED[spec], on_error="raise"))
    assert {r.schema for r in rows} == {1}, "rows of schema 2 here would not test reading schema 1"
    done = {trial_key(r) for r in rows}
    trials = load_spec(ROOT / "sweeps" / "configs" / spec).trials()
    missing = [t.label for t in trials if t.key() not in done]
    assert trials and not missing, missing
