"""``bench.measure.result.Measurement``: its JSON form is the planner's cache (``results/plan/sims.ndjson``),
read and written back unchanged; a rank's measurement crosses a process boundary whole; a key it does
not know is refused."""
from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest

from bench.measure.result import AllocatorReplay, KeptTrace, LoadAround, Measurement, failed
from bench.stackmodel.counts import StepCounts

CACHE = Path(__file__).resolve().parents[3] / "results" / "plan" / "sims.ndjson"


def test_the_committed_plan_cache_round_trips():
    results = [json.loads(line)["result"] for line in CACHE.read_text().splitlines() if line.strip()]
    assert len(results) > 300
    older = 0
    for d in results:
        m = Measurement.from_dict(d)
        assert isinstance(m.step_counts, StepCounts) and m.status == "ok"
        older += m.allocator is not None and m.allocator.pools is None  # cached before the pools existed
        again = m.to_dict()
        assert list(again) == list(d)  # the same keys in the same order
        assert json.dumps(again, sort_keys=True) == json.dumps(d, sort_keys=True)  # the same values (counts sorted)
    assert older > 0


def test_a_real_ranks_measurement_crosses_processes_and_json_whole():
    m = Measurement(peak_bytes=10, peak_by_category={"parameter": 4}, comm_calls=[("all_to_all", 64, 2)],
                    compute_time_s=1.5, step_times_s=[1.0, 2.0], host="h", host_load=LoadAround(0.2, 0.4, 2),
                    loss=3.25, device_name="cpu", threads=1)
    assert pickle.loads(pickle.dumps(m)) == m
    assert Measurement.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_the_trace_stays_out_of_the_json_form():
    m = Measurement(peak_bytes=1, allocator=AllocatorReplay("expandable", "shared", 1, 2, 0.1, 0, None),
                    trace=KeptTrace(trace=None, device_key="cuda:0", trial=None))
    d = m.to_dict()
    assert "trace" not in d and d["allocator"] == {"model": "expandable", "pools": "shared",
                                                    "peak_allocated_bytes": 1, "events": 2, "replay_s": 0.1,
                                                    "cache_releases": 0, "oom": None}
    assert Measurement.from_dict(d) == dataclasses.replace(m, trace=None)


def test_a_failure_carries_its_status_and_message_only():
    assert failed("oom", "too long").to_dict() == {"status": "oom", "message": "too long"}


def test_an_unknown_key_is_refused_naming_it():
    with pytest.raises(ValueError, match="'peak_gib'") as err:
        Measurement.from_dict({"status": "ok", "peak_gib": 1.0})
    assert "\n" not in str(err.value)
