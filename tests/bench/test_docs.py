"""A trial's packed documents (``Trial.docs``) through the resolver, the trial's JSON, its key and
row fields, the CLI and sweep specs; every refusal is one line, before any work."""
from __future__ import annotations

import json

import pytest
import yaml

from bench.cli import main
from bench.measure.trial import Search, Trial
from bench.resolve import Request, resolve
from records.workloads import DocsSpec
from sweeps.spec import SpecError, parse_spec

S = 16 << 10


def _trial(docs=None, method="upipe", **kw) -> Trial:
    return resolve(Request(method, "llama3-8b", S, 8, docs=docs, **kw))


def test_a_trial_with_documents_resolves_and_records_them():
    plain, docs = _trial(), _trial(DocsSpec("prolong64k", 3))
    assert plain.docs is None and plain.row_fields()["docs"] is None
    assert docs.documents().seq_len == S
    fields = docs.row_fields()["docs"]
    assert fields["distribution"] == "prolong64k" and fields["seed"] == 3
    assert fields["count"] == len(docs.documents()) and fields["max"] == max(docs.documents().lengths)
    assert docs.key()[:-1] == plain.key() and docs.key() != _trial(DocsSpec("prolong64k", 4)).key()
    assert "docs=prolong64k:3" in docs.label and "docs" not in plain.label


def test_the_trial_json_carries_documents_and_omits_them_for_one_sequence():
    plain, docs = _trial(), _trial(DocsSpec(lengths=(S // 2, S // 4, S // 4)))
    assert "docs" not in json.loads(plain.to_json())
    back = Trial.from_json(docs.to_json())
    assert back.docs == docs.docs and back.key() == docs.key()
    assert Trial.from_json(plain.to_json()).docs is None


@pytest.mark.parametrize("kw,needle", [
    ({"method": "torch-cp", "docs": DocsSpec("pile", 0)}, "method 'torch-cp' refuses packed documents"),
    ({"docs": DocsSpec(lengths=(S, S))}, f"sum to {2 * S} but the sequence has {S} tokens"),
    ({"docs": DocsSpec(lengths=(2 * S,))}, f"a document of {2 * S} tokens is longer than the {S}-token sequence"),
    ({"docs": DocsSpec(lengths=(S,)), "search": Search(S, 4 * S)}, "explicit document lengths fix the sequence"),
])
def test_refusals_at_resolve_time_are_one_line(kw, needle):
    with pytest.raises(ValueError) as err:
        _trial(**kw)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_rfa_zigzag_with_documents_is_refused_in_simulation_only():
    """Its library's varlen function reads cu_seqlens on the host: a simulated trial with documents is refused in
    one line at resolve time; without documents, or in real mode, it resolves."""
    with pytest.raises(ValueError) as err:
        _trial(DocsSpec("pile", 0), method="rfa-zigzag", mode="simulated")
    assert "method 'rfa-zigzag' cannot run packed documents in simulated mode: ring-flash-attn's varlen zigzag" \
        in str(err.value) and "\n" not in str(err.value), str(err.value)
    _trial(method="rfa-zigzag", mode="simulated")
    resolve(Request("rfa-zigzag", "llama3-8b", S, 8, docs=DocsSpec("pile", 0), mode="real"), here=False)


def test_a_max_context_search_takes_a_distribution():
    search = _trial(DocsSpec("pile", 1), search=Search(S, 4 * S))
    assert search.row_fields()["docs"] == {"distribution": "pile", "seed": 1}  # no summary: the length varies
    probe = search.probe(2 * S)
    assert probe.docs == search.docs and probe.documents().seq_len == 2 * S and "count" in probe.row_fields()["docs"]


SPEC = {"name": "docs-test", "mode": "simulated", "device": "h100-80g", "models": ["llama3-8b"],
        "seq_lens": ["16K"], "world_sizes": [8], "methods": ["upipe", "torch-cp"]}


def test_a_spec_crosses_its_documents():
    spec = parse_spec({**SPEC, "docs": ["none", "prolong64k:1", {"lengths": ["8K", "8K"]}]})
    trials = spec.trials()
    assert [t.docs.label if t.docs else None for t in trials[:3]] == [None, "prolong64k:1", "lengths[2]"]
    assert len(trials) == 6 and len({t.key() for t in trials}) == 6
    assert parse_spec(SPEC).docs == [None] and len(parse_spec(SPEC).trials()) == 2
    problems = spec.problems()
    assert len(problems) == 2 and all(p.startswith("torch-cp on llama3-8b x8 with docs ") for p in problems)
    assert all("refuses packed documents" in p for p in problems)


@pytest.mark.parametrize("docs,needle", [
    (["prolong64k:x"], "docs[0]: documents 'prolong64k:x': the seed after ':' must be an integer"),
    (["nope"], "docs[0]: unknown document-length distribution 'nope'; choose one of"),
    ([{"distribution": "pile", "seed": "1"}], "docs[0]: the documents' seed must be an integer"),
    ([{"lengths_file": "no/such.txt"}], "docs[0]: lengths file no/such.txt cannot be read"),
    ([{"lengths": "4K"}], "docs[0]: lengths must be a list"),
    ([], "docs: expected a non-empty list"),
    (["pile", "pile:0"], "an entry is repeated"),
])
def test_bad_spec_documents_are_one_line(docs, needle):
    with pytest.raises(SpecError) as err:
        parse_spec(yaml.safe_load(yaml.safe_dump({**SPEC, "docs": docs})))
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_simulated_run_with_documents_writes_them_in_its_row(capsys, tmp_path):
    out = tmp_path / "rows.jsonl"
    assert main(["run", "--method", "upipe", "--model", "tiny-llama", "--seq-len", "4K", "--world-size", "4",
                 "--docs", "fixed-1K:2", "--out", str(out), "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["docs"] == {"distribution": "fixed-1K", "seed": 2, "count": 4, "min": 1024, "max": 1024,
                           "mean": 1024.0}
    assert row["status"] == "ok" and not any("docs" in note and "not use" in note for note in row["notes"])
    assert json.loads(out.read_text())["docs"] == row["docs"]
