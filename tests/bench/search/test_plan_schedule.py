"""The plan's search schedule (bench.search.plan.run_searches): which searches wait for another, where each
starts, and that every entry's search runs once. The searches themselves are replaced by a stand-in that
records its arguments (a real plan: tests/bench/search/test_plan.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.search import plan as plan_mod
from bench.search.plan import FIRST, entries, run_searches, search_cost

QWEN3_8B = str(Path(__file__).resolve().parents[3] / "bench" / "model_configs" / "hf" / "Qwen3-8B" / "config.json")
GRANULARITY = 1 << 20
ANSWERS = {"upipe U=8 +fused norm": 6 << 20}  # what the stand-in finds; 3M for every other entry


@pytest.fixture
def started(monkeypatch) -> list[tuple[str, int, set[str]]]:
    """(label, first length, the labels already finished) per search, in the order they start."""
    log: list[tuple[str, int, set[str]]] = []
    finished: set[str] = set()

    def stand_in(args):
        entry, granularity, max_seq_len, workdir, first = args
        assert (granularity, max_seq_len, workdir) == (GRANULARITY, 32 << 20, "/nowhere")
        log.append((entry.label, first, set(finished)))
        finished.add(entry.label)
        entry.max_context = ANSWERS.get(entry.label, 3 << 20)
        return entry

    monkeypatch.setattr(plan_mod, "_search_entry", stand_in)
    return log


def test_the_costlier_rungs_start_past_the_rung_they_keep_and_the_rest_at_once(started):
    todo = [e for e in entries(QWEN3_8B, 8, 1, "h100-80g", GRANULARITY) if not e.auto]
    done = list(run_searches(todo, None, 1, (GRANULARITY, 32 << 20, "/nowhere")))
    assert sorted(e.label for e in done) == sorted(e.label for e in todo)  # every search once
    first = {label: f for label, f, _ in started}
    before = {label: seen for label, _, seen in started}
    groups = [e for e in todo if "2-level AC" in e.label and e.method == "upipe"]
    assert len(groups) == 2 and all(search_cost(e)[0] > 7 for e in groups)  # 8 to 16 layers a simulation
    for e in groups:  # both wait for the fused-norm rung (groups of 2 replace the lever of groups of 4)
        assert e.after == "upipe U=8 +fused norm" and e.after in before[e.label]
        assert first[e.label] == ANSWERS[e.after] + GRANULARITY
    for e in todo:
        if e not in groups:
            assert first[e.label] == FIRST, e.label
    # the fused-norm rung, on which the costliest chain hangs, is among the first to start
    assert [label for label, _, _ in started].index("upipe U=8 +fused norm") == 0


def test_a_rung_below_that_found_nothing_leaves_the_waiting_rungs_at_first(started, monkeypatch):
    """Where the rung a costlier one waits for found no length (skipped, or nothing fits), the waiting rung
    starts where that one's own rung below ended, and the fused-norm rung waits for none: at FIRST."""
    monkeypatch.setitem(ANSWERS, "upipe U=8 +fused norm", 0)
    todo = [e for e in entries(QWEN3_8B, 8, 1, "h100-80g", GRANULARITY) if not e.auto]
    list(run_searches(todo, None, 1, (GRANULARITY, 32 << 20, "/nowhere")))
    first = {label: f for label, f, _ in started}
    assert first["upipe U=8 +2-level AC"] == first["upipe U=8 +2-level AC g=2"] == FIRST
