"""Fig. 1's ladder and Fig. 5 from the rows ``python -m bench fidelity`` writes, and the paper's
levers per method (``analysis.select.paper_levers``). Synthetic rows (tests/rowfactory.py): the
numbers are made up; the tests check which bar or series a row lands in."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
import pytest

from analysis import figures, tables
from analysis.load import load_rows
from analysis.select import fig1_config, has_paper_levers, paper_levers
from tests.rowfactory import PAPER_LEVERS, M, make_row, write

FA3_8 = {"attn_type": "fa3", "ulysses_degree": 8}
BARE = {"fsdp": True, "ac": False, "ac_offload": False, "tiled_mlp": False, "tiled_norm": False,
        "chunked_loss": False}
CATS = dict(parameter=2.0, gradient=2.0, optstate=11.0, activation=20.0, other=1.0)


def _sim(method, levers=None, options=None, **kw):
    defaults = dict(seq_len=3 * M, mode="simulated", peak_gib=40.0, by_category=CATS)
    return make_row(method, options=options, levers=levers, **{**defaults, **kw})


@pytest.fixture
def ladder_rows(tmp_path):
    rows = [
        _sim("no-cp", BARE, status="oom", peak_gib=25000.0),
        _sim("yc-usp", BARE, FA3_8, status="oom", peak_gib=900.0),
        _sim("yc-usp", dict(BARE, ac=True), FA3_8, status="oom", peak_gib=120.0),
        _sim("yc-usp", dict(BARE, ac=True, ac_offload=True), FA3_8, status="oom", peak_gib=100.0),
        _sim("yc-usp", None, FA3_8, peak_gib=58.0),  # ALST: every lever
        _sim("yc-usp", None, {"attn_type": "fa3", "ulysses_degree": 1}, peak_gib=69.0),  # the paper's Ring
        _sim("upipe", None, peak_gib=47.0),
    ]
    write(tmp_path / "results" / "fidelity" / "fidelity.jsonl", rows)
    return load_rows(tmp_path / "results", quiet=True)


def test_every_rung_of_the_ladder_lands_in_its_bar(ladder_rows):
    t = tables.fig1_table(ladder_rows)
    ours = t.df[t.df["Source"] == "ours"].set_index("Config")
    assert list(ours.index) == ["FSDP", "FSDP+Ulysses", "+AC", "+AO (offload)", "ALST", "UPipe"]
    assert ours.loc["FSDP", "Implementation"].startswith("no-cp")
    assert ours.loc["ALST", "Implementation"] == "yc-usp[attn_type=fa3,ulysses_degree=8] (yunchang)"
    assert ours.loc["FSDP", "Result"] == "OOM (25000.0)" and ours.loc["ALST", "Result"] == "fits"
    assert ours.loc["+AO (offload)", "Result"] == "OOM (100.0)"
    plot = figures.fig1_plot(ladder_rows)
    assert len(plot.rows_used[plot.rows_used["config"].notna()]) == 6  # the Ring row is no bar
    texts = [t.get_text() for t in plot.fig.axes[0].texts]
    assert "OOM ↑ 25000 GiB" in texts  # an OOM bar of ours is drawn, labelled with the memory it needed


def test_ring_and_partial_levers_are_no_bar():
    ring = _sim("yc-usp", None, {"ulysses_degree": 1})
    half = _sim("ulysses", dict(BARE, tiled_mlp=True))  # tiled MLP without AC: not a bar of the paper's
    df = load_rows_from([ring, half])
    assert [fig1_config(r) for _, r in df.iterrows()] == [None, None]


def load_rows_from(rows):
    root = Path(tempfile.mkdtemp()) / "results"
    write(root / "rows.jsonl", rows)
    return load_rows(root, quiet=True)


def test_fig5_shows_yunchangs_usp_as_usp_hybrid():
    rows = [make_row("yc-usp", "llama3-8b", 2 * M, 16, mode="simulated", peak_gib=28.0, options=FA3_8),
            make_row("yc-usp", "llama3-8b", 2 * M, 16, mode="simulated", peak_gib=30.0,
                     options={"attn_type": "fa3", "ulysses_degree": 1}),  # a ring: not Fig. 5's USP-Hybrid
            make_row("usp-upipe", "llama3-8b", 2 * M, 16, mode="simulated", peak_gib=24.0,
                     options={"ulysses_degree": 8})]
    t = tables.fig5_table(load_rows_from(rows))
    ours = t.df[(t.df["Source"] == "ours") & t.df["Quantity"].str.endswith("peak GiB")]
    assert ours["Quantity"].tolist() == ["yc-usp[attn_type=fa3,ulysses_degree=8] (yunchang) peak GiB",
                                         "usp-upipe[ulysses_degree=8] peak GiB"]
    assert ours["2M"].tolist() == ["28.0", "24.0"]


def test_paper_levers_are_per_method():
    """The paper ran torch-cp without tiled MLP or norms: those rows have its levers; torch-cp
    with tiling, or another method without it, do not."""
    no_tiles = dict(PAPER_LEVERS, tiled_mlp=False, tiled_norm=False)
    rows = [make_row("torch-cp", levers=no_tiles), make_row("torch-cp", levers=dict(PAPER_LEVERS, tiled_norm=True)),
            make_row("ulysses", levers=no_tiles), make_row("ulysses", levers=dict(PAPER_LEVERS, tiled_norm=True))]
    df = load_rows_from(rows)
    assert has_paper_levers(df).tolist() == [True, False, False, True]
    assert paper_levers("upipe")["tiled_mlp"] and not paper_levers("torch-cp")["tiled_mlp"]


def test_paper_levers_agree_with_the_fidelity_implementations():
    from bench.stackmodel import fidelity
    impl = fidelity.implementation("torch-cp", 8)
    assert {k: paper_levers("torch-cp")[k] for k in impl.levers} == impl.levers
    assert pd.Series(paper_levers("torch-cp")).drop(list(impl.levers)).to_dict() == {
        k: v for k, v in paper_levers("upipe").items() if k not in impl.levers}
