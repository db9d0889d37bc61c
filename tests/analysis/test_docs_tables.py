"""Packed documents in the analysis: the documents' table and figure draw their cells from the rows,
the single sequence beside the distributions, and the paper's tables keep to one sequence."""
from __future__ import annotations

import pandas as pd
import pytest

from analysis import documents, figures, tables
from analysis.__main__ import main as figs_main
from analysis.load import load_rows
from analysis.select import docs_choice, with_docs
from analysis.style import MISSING, OOM
from records.workloads import DocsSpec
from tests.rowfactory import K, M, make_row, write

SINGLE_DOC = "fixed-16M:0"  # one document as long as the sequence: the docs sweeps' single sequence


def docs_row(method, docs: str | None, seq_len=1 * M, tps=1000.0, pairs=(1, 1, 1, 1, 1, 1, 1, 1), options=None,
             status="ok", layout="heads", time="2026-11-27T00:00:00+00:00", **kw):
    """A simulated Llama3-8B row on 8 GPUs with the packed documents ``docs`` (None: one sequence),
    its throughput and, with documents, each rank's work ``pairs`` (``figures.doc_work``)."""
    row = make_row(method, seq_len=seq_len, mode="simulated", tps=tps if status == "ok" else None, status=status,
                   peak_gib=30.0, options=options, time=time, **kw)
    if docs is not None:
        row.docs = DocsSpec.parse(docs).fields(seq_len)
        mean = sum(pairs) / len(pairs)
        row.figures.doc_work = {"method": method, "layout": layout, "pairs": list(pairs),
                                "flops": [float(p) for p in pairs], "imbalance": round(max(pairs) / mean, 6),
                                "slowest_rank": max(range(len(pairs)), key=pairs.__getitem__)}
    return row


CONTIGUOUS = {"layout": "contiguous"}
RING_SINGLE = (1, 3, 5, 7, 9, 11, 13, 15)  # a contiguous ring under one causal sequence: the last rank works most
RING_DOCS = (4, 9, 2, 7, 5, 1, 8, 3)


@pytest.fixture
def docs_dir(tmp_path):
    root = tmp_path / "results"
    write(root / "docs-llama3-8b.jsonl", [
        docs_row("ring", SINGLE_DOC, tps=400.0, pairs=RING_SINGLE, options=CONTIGUOUS, layout="contiguous"),
        docs_row("ring", "prolong64k:0", tps=3000.0, pairs=RING_DOCS, options=CONTIGUOUS, layout="contiguous"),
        docs_row("ring", "pile:0", status="oom", options=CONTIGUOUS, layout="contiguous"),
        docs_row("ulysses", SINGLE_DOC, tps=450.0),
        docs_row("ulysses", "prolong64k:0", tps=4000.0),
        docs_row("ulysses", "prolong64k:0", seq_len=128 * K, tps=5000.0),
        docs_row("upipe", None, tps=440.0),  # no one-document row: the single sequence from a row without documents
        docs_row("upipe", "prolong64k:0", tps=3900.0),
        docs_row("fpdt", None, tps=430.0),  # a Table 3 row only: not a documents series
    ])
    return root


def _cell(table, col, **match):
    df = table.df
    sel = pd.Series(True, index=df.index)
    for k, v in match.items():
        sel &= df[k] == v
    hit = df[sel]
    assert len(hit) == 1, (match, df)
    return hit.iloc[0][col]


def test_the_loader_labels_documents_and_flattens_the_work(docs_dir):
    rows = load_rows(docs_dir, quiet=True)
    ring = rows[(rows["method"] == "ring") & (rows["docs"] == "prolong64k:0")].iloc[0]
    assert ring["docs.distribution"] == "prolong64k" and ring["docs.count"] == len(DocsSpec.parse(
        "prolong64k:0").lengths_for(1 * M))
    assert ring["doc_work.imbalance"] == pytest.approx(max(RING_DOCS) / (sum(RING_DOCS) / 8), rel=1e-5)
    assert ring["doc_work.layout"] == "contiguous"
    assert rows[rows["method"] == "fpdt"]["docs"].isna().all()


def test_each_cell_is_its_rows_figure(docs_dir):
    rows = load_rows(docs_dir, quiet=True)
    t = documents.docs_table(rows, documents.DOCS_LLAMA)
    ring = rows[(rows["method"] == "ring") & (rows["docs"] == "prolong64k:0")].iloc[0]
    where = dict(Length="1M", Method="ring[layout=contiguous]")
    assert _cell(t, "prolong64k:0: tokens/s", **where) == f"{ring['tokens_per_s_per_device']:.2f}"
    assert _cell(t, "prolong64k:0: max/mean", **where) == f"{ring['doc_work.imbalance']:.3f}"
    assert _cell(t, "pile:0: tokens/s", **where) == OOM
    assert _cell(t, "Layout", **where) == "contiguous"
    assert _cell(t, "Layout", Length="1M", Method="ulysses") == "heads"
    # a length a case did not run at stays missing, never a number
    assert _cell(t, f"{documents.SINGLE}: tokens/s", Length="128K", Method="ulysses") == MISSING
    assert "fpdt" not in set(t.df["Method"])  # no row under a distribution: not a documents series
    assert not t.df.isna().any().any()


def test_the_single_sequence_column_comes_first_from_the_one_document_row(docs_dir):
    rows = load_rows(docs_dir, quiet=True)
    t = documents.docs_table(rows, documents.DOCS_LLAMA)
    value_cols = list(t.df.columns[5:])
    assert value_cols[:2] == [f"{documents.SINGLE}: tokens/s", f"{documents.SINGLE}: max/mean"]
    assert value_cols[2:] == ["pile:0: tokens/s", "pile:0: max/mean", "prolong64k:0: tokens/s",
                              "prolong64k:0: max/mean"]
    where = dict(Length="1M", Method="ring[layout=contiguous]")
    assert _cell(t, f"{documents.SINGLE}: tokens/s", **where) == "400.00"
    assert _cell(t, f"{documents.SINGLE}: max/mean", **where) == f"{15 / 8:.3f}"
    # a series without a one-document row takes its row without documents, marked, with no imbalance
    upipe = dict(Length="1M", Method="upipe")
    assert _cell(t, f"{documents.SINGLE}: tokens/s", **upipe) == "440.00" + documents.ROW_WITHOUT_DOCS
    assert _cell(t, f"{documents.SINGLE}: max/mean", **upipe) == MISSING
    # beside a one-document row, a row without documents of the same trial does not replace it
    write(docs_dir / "more.jsonl", [docs_row("ring", None, tps=9999.0, options=CONTIGUOUS,
                                             time="2026-11-28T00:00:00+00:00")])
    t = documents.docs_table(load_rows(docs_dir, quiet=True), documents.DOCS_LLAMA)
    assert _cell(t, f"{documents.SINGLE}: tokens/s", **where) == "400.00"


def test_the_notes_give_each_draw_from_the_rows(docs_dir):
    t = documents.docs_table(load_rows(docs_dir, quiet=True), documents.DOCS_LLAMA)
    lengths = DocsSpec.parse("prolong64k:0").lengths_for(1 * M)
    line = next(n for n in t.notes if "`prolong64k:0`" in n)
    assert f"1M: {len(lengths)} documents, longest {max(lengths)}" in line


def test_the_paper_tables_and_max_context_keep_to_one_sequence(results_dir):
    before = load_rows(results_dir, quiet=True)
    outputs = [tables.table3(before, "llama3-8b").to_markdown(), tables.max_context_table(before).to_markdown(),
               tables.compare_methods(before).to_markdown(), tables.memory_vs_seq_table(before).to_markdown()]
    write(results_dir / "docs-llama3-8b.jsonl", [
        docs_row("upipe", "prolong64k:0", seq_len=s, tps=5000.0) for s in (128 * K, 1 * M, 8 * M)])
    after = load_rows(results_dir, quiet=True)
    assert (after["docs"] == "prolong64k:0").sum() == 3
    assert [tables.table3(after, "llama3-8b").to_markdown(), tables.max_context_table(after).to_markdown(),
            tables.compare_methods(after).to_markdown(), tables.memory_vs_seq_table(after).to_markdown()] == outputs
    # the filter: the rows with that draw, and their longest run
    mc = tables.max_context_table(after, docs="prolong64k:0")
    ours = mc.df[mc.df["Source"].str.startswith("ours")]
    assert list(ours["Method"]) == ["upipe"] and list(ours["Max context"]) == ["≥ 8M"]
    assert "prolong64k:0" in mc.title
    assert with_docs(after, "pile:0").empty and len(with_docs(after)) == len(before)
    plot = figures.max_context_plot(after, docs="prolong64k:0")
    assert set(plot.rows_used["docs"]) <= {"prolong64k:0"}
    plot.close()


def test_a_filter_names_a_distribution_or_one_sequence():
    assert docs_choice("none") is None and docs_choice(None) is None
    assert docs_choice("prolong64k") == "prolong64k:0" and docs_choice("pile:3") == "pile:3"
    with pytest.raises(ValueError, match="nosuch"):
        docs_choice("nosuch")


def test_the_figs_command_refuses_an_unknown_distribution_in_one_line(tmp_path, capsys):
    assert figs_main(["figs", "--results", str(tmp_path), "--out", str(tmp_path / "out"),
                      "--max-context-docs", "nosuch:1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("python -m analysis figs: error: --max-context-docs:")
    assert not (tmp_path / "out").exists()


def test_the_figure_draws_a_bar_per_row_with_a_value(docs_dir):
    rows = load_rows(docs_dir, quiet=True)
    plot = documents.docs_plot(rows, documents.DOCS_LLAMA)
    ours = documents.docs_rows(rows, documents.DOCS_LLAMA)
    top, bottom = plot.fig.axes[1], plot.fig.axes[3]  # rows tokens/s, imbalance; 1M the second column
    at_1m = ours[ours["seq_len"] == 1 * M]
    picked = [documents.pick(sub, case, 1 * M) for _, sub in documents.series_of(at_1m)
              for case in documents.cases(ours)]
    with_tps = [r for r in picked if r is not None and r["status"] == "ok"]
    assert len(top.patches) == len(with_tps)
    # the imbalance is the documents' and the layout's, so an OOM row has one too
    assert len(bottom.patches) == sum(1 for r in picked if r is not None and r["status"] != "error"
                                      and pd.notna(r.get("doc_work.imbalance")))
    assert OOM in [t.get_text() for t in top.texts]
    heights = sorted(p.get_height() for p in top.patches)
    assert heights == sorted(float(r["tokens_per_s_per_device"]) for r in with_tps)
    plot.close()


def test_no_rows_give_empty_outputs_that_say_how_to_make_them(tmp_path):
    t = documents.docs_table(tmp_path, documents.DOCS_QWEN)
    assert t.df.empty and "docs-qwen3-32b.yaml" in t.notes[-1]
    plot = documents.docs_plot(tmp_path, documents.DOCS_QWEN)
    plot.close()
