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
    probe = dict(kind="trial", model="llama3-8b", world_size=8, device="h100-80g", options={})
    host = "host memory: offloads of 232.65 GiB per rank exceed the usable 230.40 GiB of host memory per GPU"
    append_rows(tmp_path / "demo-maxctx-llama3-8b.jsonl", [
        make_row(method="upipe", status="oom", message="device: out of memory", seq_len=8 << 20, **probe),
        make_row(method="upipe", status="oom", message=host, seq_len=7 << 20, **probe),
        make_row(method="upipe", status="oom", message="an earlier search's", seq_len=5 << 20, **probe),
    ])
    demo.summary()
    out = capsys.readouterr().out
    assert "2K: ulysses 0.500  upipe 0.550   upipe/ulysses 1.10" in out
    assert "upipe        6M  (5M)" in out
    assert f"stops at 7M: {host}" in out  # the shortest failing probe above the answer says why
    assert "offload     <1M  (not in paper)" in out  # nothing fits at the first step: below it, not "none"
