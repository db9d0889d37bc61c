"""Row schema versions: schema 1 rows stay readable beside schema 2 rows; an unknown version,
or schema 2's fields in a row that says schema 1, is refused naming the field."""
from __future__ import annotations

import pytest

from records import RowError, validate_row
from records.schema import READABLE_VERSIONS, SCHEMA_VERSION
from tests.rowfactory import make_row


def test_both_versions_read_and_new_rows_are_the_newest():
    assert SCHEMA_VERSION == max(READABLE_VERSIONS) == 2
    assert make_row().schema == SCHEMA_VERSION
    old = make_row(schema=1)
    assert validate_row(old.to_dict()).schema == 1 and old.ran is None and old.presets == []
    new = make_row(ran={"fsdp": True}, presets=["paper-stack"])
    assert validate_row(new.to_dict()).presets == ["paper-stack"]


def test_an_unknown_version_is_refused():
    with pytest.raises(RowError, match=r"row.schema = 3 is not a readable version \[1, 2\]"):
        validate_row(make_row(schema=3).to_dict())


def test_schema_2_fields_in_a_schema_1_row_are_refused():
    with pytest.raises(RowError, match="came with schema 2"):
        validate_row(make_row(schema=1, presets=["paper-stack"]).to_dict())
