"""make demo's closing summary (sweeps.demo.summary) reads the demo's rows and says what they show."""
from __future__ import annotations

from records import Figures, append_rows
from sweeps import demo
from tests.rowfactory import make_row


def test_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "OUT", tmp_path)
    real = dict(mode="real", device="cpu", world_size=2, seq_len=2048, options={})
    append_rows(tmp_path / "table3-llama3-8b-cpu.jsonl", [
        make_row(method="ulysses", figures=Figures(step_time_s=0.5), **real),
        make_row(method="upipe", figures=Figures(step_time_s=0.55), **real),
    ])
    search = dict(kind="max_context", model="llama3-8b", world_size=8, device="h100-80g", seq_len=16 << 20,
                  options={}, search={"granularity": 1 << 20, "step": 1 << 20, "max_seq_len": 16 << 20,
                                      "start": 1 << 20})
    append_rows(tmp_path / "demo-maxctx-llama3-8b.jsonl", [
        make_row(method="upipe", figures=Figures(max_context=6 << 20), **search),
        make_row(method="offload", figures=Figures(max_context=0), **search),
    ])
    demo.summary()
    out = capsys.readouterr().out
    assert "2K: ulysses 0.500  upipe 0.550   upipe/ulysses 1.10" in out
    assert "upipe        6M  (5M)" in out
    assert "offload     <1M  (not in paper)" in out  # nothing fits at the first step: below it, not "none"
