"""The CPU documents table (``docs_cpu``) sets each row's measured attention imbalance beside the
modelled one, in columns that say which is which; the GPU tables keep their one imbalance column."""
from __future__ import annotations

import pandas as pd

from analysis import documents
from analysis.style import MISSING
from records.workloads import DocsSpec
from tests.rowfactory import K, make_row, write


def cpu_row(method, docs, pairs, measured=None, options=None, layout="contiguous"):
    """A real tiny-llama row on 2 gloo ranks with documents, the modelled work ``pairs`` and, when given,
    each rank's measured attention seconds ``measured``."""
    row = make_row(method, model="tiny-llama", seq_len=4 * K, world_size=2, device="cpu", tps=100.0,
                   options=options, device_name="test CPU")
    row.docs = DocsSpec.parse(docs).fields(row.seq_len)
    mean = sum(pairs) / len(pairs)
    row.figures.doc_work = {"method": method, "layout": layout, "pairs": list(pairs),
                            "flops": [float(p) for p in pairs], "imbalance": round(max(pairs) / mean, 6),
                            "slowest_rank": max(range(len(pairs)), key=pairs.__getitem__)}
    if measured is not None:
        row.figures.rank_attention_s = list(measured)
        row.figures.attention_imbalance = round(max(measured) / (sum(measured) / len(measured)), 6)
    return row


def test_the_cpu_table_shows_measured_beside_modelled(tmp_path):
    ring = {"layout": "contiguous"}
    write(tmp_path / "docs-llama3-8b-cpu.jsonl", [
        cpu_row("ring", "fixed-16M:0", (1, 3), measured=(0.4, 0.6), options=ring),
        cpu_row("ring", "pile:0", (2, 6), measured=(0.2, 0.6), options=ring),
        cpu_row("rfa-zigzag", "pile:0", (5, 5), layout="zigzag"),  # a library's own kernels: none measured
    ])
    t = documents.docs_table(tmp_path, documents.DOCS_CPU)
    df = t.df
    for case in ("single sequence", "pile:0"):
        assert {f"{case}: max/mean modelled", f"{case}: max/mean measured"} <= set(df.columns)
    ring_line = df[df["Method"] == "ring[layout=contiguous]"].iloc[0]
    assert ring_line["single sequence: max/mean modelled"] == "1.500"
    assert ring_line["single sequence: max/mean measured"] == "1.200"
    assert ring_line["pile:0: max/mean modelled"] == "1.500"
    assert ring_line["pile:0: max/mean measured"] == "1.500"
    rfa = df[df["Method"].str.startswith("rfa-zigzag")].iloc[0]
    assert rfa["pile:0: max/mean modelled"] == "1.000" and rfa["pile:0: max/mean measured"] == MISSING
    assert any("max/mean measured" in n and "attention_imbalance" in n for n in t.notes)


def test_the_gpu_tables_keep_one_imbalance_column(tmp_path):
    row = make_row("ulysses", seq_len=1024 * K, mode="simulated", tps=1000.0, peak_gib=30.0)
    row.docs = DocsSpec.parse("pile:0").fields(row.seq_len)
    row.figures.doc_work = {"method": "ulysses", "layout": "heads", "pairs": [1] * 8, "flops": [1.0] * 8,
                            "imbalance": 1.0, "slowest_rank": 0}
    write(tmp_path / "docs-llama3-8b.jsonl", [row])
    df: pd.DataFrame = documents.docs_table(tmp_path, documents.DOCS_LLAMA).df
    assert "pile:0: max/mean" in df.columns
    assert not any("measured" in c or "modelled" in c for c in df.columns)
