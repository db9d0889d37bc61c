"""The sweep runner's messages: what a submitted sweep leaves to the compute node, and the
progress line of each finished trial (which peak it shows, as the comparison table does)."""
from __future__ import annotations

from pathlib import Path

from analysis import tables
from analysis.load import load_rows
from sweeps.__main__ import main
from sweeps.runner import RowTail, describe
from tests.rowfactory import make_row, write

TABLE3 = Path(__file__).resolve().parents[2] / "sweeps" / "configs" / "table3-llama3-8b.yaml"


def test_a_slurm_dry_run_without_flash_attn_says_what_the_compute_node_must_import(no_flash_attn, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert main(["run", str(TABLE3), "--executor", "slurm", "--dry-run", "--set", f"out={out}"]) == 0
    err = capsys.readouterr().err
    assert "error" not in err
    assert err.count("  yc-usp needs flash_attn (checked on the compute node)\n") == 1, err[:2000]
    assert err.count("  ds-fpdt needs flash_attn (checked on the compute node)\n") == 1
    assert err.count("python -m bench trial") == 64 and not out.exists()
    # a local executor runs the trials here: refused up front, as before
    assert main(["run", str(TABLE3), "--executor", "local", "--dry-run", "--set", f"out={out}"]) == 2
    err = capsys.readouterr().err
    assert "error: yc-usp[attn_type=fa3,ulysses_degree=1] on llama3-8b x8: method 'yc-usp' needs flash_attn" in err
    assert "3 problem(s); nothing was submitted" in err and "python -m bench trial" not in err


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
