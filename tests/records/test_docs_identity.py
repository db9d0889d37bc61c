"""Packed documents in rows and in the trial identity: a row without ``docs`` keeps exactly the key
and the JSON it had before documents existed (every committed row is checked), a row with them has
their identity appended to that key, and a row's ``docs`` is validated."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from records import RowError, encode, key_string, trial_key, validate_row
from records.workloads import DocsSpec
from tests.rowfactory import make_row

REPO = Path(__file__).resolve().parents[2]
COMMITTED = sorted((REPO / "results").rglob("*.jsonl"))
BASE_KEY_LEN = 14  # the fields of a trial key before documents existed


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_there_are_committed_rows():
    assert COMMITTED and sum(len(_lines(p)) for p in COMMITTED) > 100


@pytest.mark.parametrize("path", COMMITTED, ids=[str(p.relative_to(REPO)) for p in COMMITTED])
def test_every_committed_row_keeps_its_key_and_its_json(path):
    for raw in _lines(path):
        if "docs" in raw:  # a documents sweep's row (docs-*-cpu): its key is the base key and the documents'
            row, base = validate_row(raw), trial_key({**raw, "docs": None})
            assert row.docs is not None and trial_key(raw)[:BASE_KEY_LEN] == base and trial_key(raw) != base
            continue
        key = trial_key(raw)
        assert len(key) == BASE_KEY_LEN, key
        row = validate_row(raw)
        assert row.docs is None and trial_key(row) == key == trial_key({**raw, "docs": None})
        assert "docs" not in row.to_dict() and b'"docs"' not in encode(row)
        with_docs = {**raw, "docs": DocsSpec("pile", 1).fields()}
        assert trial_key(with_docs)[:BASE_KEY_LEN] == key and trial_key(with_docs) != key


def test_documents_are_part_of_the_identity():
    plain = make_row()
    rows = [make_row(docs=DocsSpec("prolong64k", s).fields(plain.seq_len)) for s in (0, 1)]
    rows.append(make_row(docs=DocsSpec("pile", 0).fields(plain.seq_len)))
    rows.append(make_row(docs=DocsSpec(lengths=(plain.seq_len,)).fields(plain.seq_len)))
    keys = [trial_key(r) for r in [plain, *rows]]
    assert len(set(keys)) == len(keys) and len({key_string(k) for k in keys}) == len(keys)
    # the summary is what came of the identity, not part of it
    summary_only = dict(rows[0].docs, count=1, mean=1.0)
    assert trial_key(make_row(docs=summary_only)) == keys[1]


def test_a_row_with_docs_round_trips():
    row = make_row(docs=DocsSpec("prolong64k", 2).fields(make_row().seq_len))
    back = validate_row(json.loads(encode(row)))
    assert back.docs == row.docs and back.docs["count"] >= 1 and trial_key(back) == trial_key(row)


@pytest.mark.parametrize("docs,needle", [
    ({"distribution": "nope", "seed": 0}, "unknown document-length distribution 'nope'"),
    ({"distribution": "pile", "seed": "1"}, "seed must be an integer"),
    ({"lengths": [4, -1]}, "positive token counts"),
    ({"distribution": "pile", "seed": 0, "colour": "red"}, "unknown key(s) ['colour']"),
    (["pile"], "has the wrong type (expected dict | None)"),
])
def test_a_bad_docs_field_is_refused_naming_it(docs, needle):
    with pytest.raises(RowError) as err:
        validate_row({**make_row().to_dict(), "docs": docs})
    assert str(err.value).startswith("row.docs") and needle in str(err.value), str(err.value)
