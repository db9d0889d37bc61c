"""make demo's closing summary (sweeps.demo.summary) reads the demo's rows and says what they show."""
from __future__ import annotations

import dataclasses

import pytest

from bench.measure.trial import Trial
from records import Figures, Row, append_rows, cpu_name, environment, read_rows, trial_key
from records.workloads import DocsSpec
from sweeps import demo
from tests.rowfactory import make_row


def test_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "OUT", tmp_path)
    real = dict(mode="real", device="cpu", world_size=2, seq_len=1024, options={})
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
    assert "1K: ulysses 0.500  upipe 0.550   upipe/ulysses 1.10" in out
    assert "upipe        6M  (5M)" in out
    assert f"stops at 7M: {host}" in out  # the shortest failing probe above the answer says why
    assert "offload     <1M  (not in paper)" in out  # nothing fits at the first step: below it, not "none"


def _row(trial, **figures):
    """A row of ``trial`` with these figures, as its run would write it (the figures made up)."""
    return Row(**trial.row_fields(), status="ok", message="", figures=Figures(**figures),
               env=environment(trial.kernel_name(), cpu_name()), model_arch=trial.config().to_dict())


def test_docs_trials_are_the_search_probes_with_documents():
    """The documents line's trials are the demo search's probes at that length, prolong64k added."""
    from records.workloads import DocsSpec
    from sweeps.spec import load_spec

    distribution, seq_len, chosen = demo.DOCS_SETUP
    searches = {t.method: t for t in load_spec(demo.REPO / "sweeps" / "configs" / f"{demo.SPECS[1]}.yaml").trials()}
    trials = demo.docs_trials()
    assert [t.method for t in trials] == ["ring", "ulysses", "upipe"] == list(chosen)
    for t in trials:
        assert t.docs == DocsSpec("prolong64k") and t.seq_len == seq_len == 1 << 20 and t.world_size == 8
        assert dataclasses.replace(t, docs=None).key() == searches[t.method].probe(seq_len).key()
        assert t.key() != searches[t.method].probe(seq_len).key()  # the documents are part of the identity


def test_docs_line_beside_the_one_sequence_probe(tmp_path, monkeypatch, capsys):
    """The summary's documents line: each method's modelled tokens/s per GPU under the documents, its
    one-sequence probe's in brackets, and the imbalance its row's doc_work records."""
    monkeypatch.setattr(demo, "OUT", tmp_path)
    trials = {t.method: t for t in demo.docs_trials()}
    append_rows(tmp_path / demo.DOCS_ROWS, [
        _row(trials["ring"], tokens_per_s_per_device=900.0, doc_work={"imbalance": 1.2345}),
        _row(trials["upipe"], tokens_per_s_per_device=1100.0, doc_work={"imbalance": 1.0}),
    ])
    append_rows(tmp_path / f"{demo.SPECS[1]}.jsonl", [
        _row(dataclasses.replace(trials["ring"], docs=None), tokens_per_s_per_device=1000.0),
        _row(dataclasses.replace(trials["ulysses"], docs=None), tokens_per_s_per_device=1200.0),
    ])
    demo.docs_summary()
    out = capsys.readouterr().out
    assert "1M tokens of prolong64k:0 documents" in out
    assert "ring 900 (1000), imbalance 1.23   ulysses — (1200)   upipe 1100 (—), imbalance 1.00" in out


def test_run_docs_skips_trials_that_have_rows(tmp_path, monkeypatch, capsys):
    from sweeps.results import error_row_for

    path = tmp_path / demo.DOCS_ROWS
    for t in demo.docs_trials():
        error_row_for(t, "demo", path, "earlier", "log")
    monkeypatch.setattr(demo, "layer_extrapolated_runner", lambda: lambda t: pytest.fail(f"ran {t.label}"))
    assert demo.run_docs(path) == 0
    assert "3 already have rows" in capsys.readouterr().out


def test_run_docs_runs_each_trial_in_a_worker_and_appends_its_row(tmp_path, monkeypatch, capsys):
    """The workload's trials run in worker processes (the real ones are Llama3-8B at 1M: here a tiny one
    with documents stands in), each row appended to the file as its trial ends."""
    tiny = Trial.make("upipe", "tiny-llama", 4096, 2, mode="simulated", docs=DocsSpec("fixed-1K"))
    monkeypatch.setattr(demo, "docs_trials", lambda: [tiny])
    path = tmp_path / demo.DOCS_ROWS
    assert demo.run_docs(path) == 0
    (row,) = read_rows(path)
    assert row.status == "ok" and trial_key(row) == tiny.key() and row.docs is not None
    assert "1 to run (1 at a time)" in capsys.readouterr().out
