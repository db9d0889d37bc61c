"""The sweep runner's messages: the progress line of each finished trial (which peak it shows,
as the comparison table does)."""
from __future__ import annotations

from analysis import tables
from analysis.load import load_rows
from sweeps.runner import RowTail, describe
from tests.rowfactory import make_row, write


def test_the_progress_line_shows_the_peak_the_comparison_table_shows_and_says_which(tmp_path):
    rows = tmp_path / "results" / "t.jsonl"
    tail = RowTail(rows)
    paper = make_row("upipe", mode="simulated", peak_gib=15.75, reserved_gib=16.74, levers={"stack": "paper"})
    lean = make_row("ulysses", mode="simulated", peak_gib=15.0, levers={"stack": "lean"})
    write(rows, [paper, lean])
    lines = [describe(row) for row in tail.new_rows()]
    assert lines == ["upipe llama3-8b 128K x8 simulated: ok reserved peak 16.74 GiB (allocated 15.75)",
                     "ulysses llama3-8b 128K x8 simulated: ok allocated peak 15.00 GiB"]
    table = tables.compare_methods(load_rows(tmp_path / "results", quiet=True), metric="mem_gib")
    cells = dict(zip(table.df["Method"], table.df["128K"], strict=True))
    assert cells == {"upipe": "16.74", "ulysses": "15.00"}
    assert any(note.startswith("Peak GiB: the reserved peak where the row has one") for note in table.notes)
