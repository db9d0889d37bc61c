"""bench.measure.run._set_aside_the_heap: a process's first simulated trial freezes its heap without a full
collection; every later one collects the trials' garbage first, so that none of it is frozen for good."""
from __future__ import annotations

from bench.measure import run


def test_the_first_trial_freezes_and_later_ones_collect_first(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(run.gc, "collect", lambda: calls.append("collect") or 0)
    monkeypatch.setattr(run.gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(run, "_heap_set_aside", False)
    run._set_aside_the_heap()
    assert calls == ["freeze"]
    run._set_aside_the_heap()
    run._set_aside_the_heap()
    assert calls == ["freeze", "collect", "freeze", "collect", "freeze"]
