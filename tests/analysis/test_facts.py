"""The analysis reads what it knows about methods from their facts (``records.facts``, the table
generated from the methods' registrations), without importing torch, and selects rows by their
fields: a row counts for a table whatever the file it was written to is called."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from analysis import tables
from analysis.load import library_of, load_rows, method_label
from analysis.select import family, paper_levers, preferred
from records.facts import MethodFacts, facts_of, table
from tests.rowfactory import PAPER_LEVERS, K, make_row, write

REPO = Path(__file__).resolve().parents[2]


def test_the_analysis_imports_neither_torch_nor_the_methods():
    code = ("import sys, analysis.report, analysis.figures, analysis.tables; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'methods', 'bench')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing the analysis imported {out.stdout.strip()}"


def test_families_labels_and_levers_are_the_methods_facts():
    facts = table()
    assert len(facts) >= 15
    for name, f in facts.items():
        assert family(name) == (f.column or name)
        assert library_of(name) == (None if f.library == "ours" else f.library)
        assert paper_levers(name) == {**paper_levers("a-method-of-no-facts"), **f.levers}
    assert family("yc-usp") == "ulysses" and family("usp-upipe") == "upipe" and family("offload") == "offload"
    assert method_label("yc-usp", {"ulysses_degree": 8}) == "yc-usp[ulysses_degree=8] (yunchang)"
    assert method_label("torch-cp", None) == "torch-cp (PyTorch)" and method_label("upipe", None) == "upipe"


def test_a_method_the_table_does_not_list_has_the_defaults():
    assert facts_of("my-new-method") == MethodFacts()
    assert family("my-new-method") == "my-new-method" and library_of("my-new-method") is None
    rows = load_rows_from({"rows.jsonl": [make_row("my-new-method", time="2026-11-22T00:00:00+00:00"),
                                          make_row("yc-usp", options={"ulysses_degree": 8})]})
    assert preferred(rows)["method"] == "yc-usp"  # the paper's code wins over a newer row of another method


def load_rows_from(files: dict):
    root = Path(tempfile.mkdtemp()) / "results"
    for name, rows in files.items():
        write(root / name, rows)
    return load_rows(root, quiet=True)


def test_rows_count_for_a_table_by_their_fields_whatever_their_file():
    """The CPU-scale variants of Table 3, Fig. 1, Fig. 5 and the U ablation, all in one file whose
    name says nothing, land in their tables; rows of the same file that are none of these do not."""
    cpu = dict(device="cpu", device_name="Test CPU")
    bare = {"fsdp": True, "ac": False, "ac_offload": False, "tiled_mlp": False, "tiled_norm": False,
            "chunked_loss": False}
    rows = [
        # Table 3 at CPU scale: training steps on the cpu preset with the paper's levers
        make_row("ulysses", "tiny-llama", 4 * K, 2, tps=1000.0, **cpu),
        make_row("upipe", "tiny-llama", 4 * K, 2, tps=900.0, **cpu),
        # Fig. 5 at CPU scale: both series on one mesh (no levers)
        make_row("usp", "tiny-llama", 1 * K, 4, tps=500.0, levers={}, options={"ulysses_degree": 2}, **cpu),
        make_row("usp-upipe", "tiny-llama", 1 * K, 4, tps=450.0, levers={}, options={"ulysses_degree": 2}, **cpu),
        # Fig. 1 at CPU scale: the ladder on 8 ranks of a model the paper did not run
        make_row("no-cp", "tiny-llama", 64 * K, 8, "simulated", peak_gib=0.5, levers=bare),
        make_row("upipe", "tiny-llama", 64 * K, 8, "simulated", peak_gib=0.02),
        # the U ablation at CPU scale: UPipe at two U against Ulysses, one attention block
        *[make_row("upipe", "tiny-llama", 2 * K, 2, scope="attention", tps=t, options={"chunk_heads": u}, **cpu)
          for u, t in ((2, 4000.0), (4, 4500.0))],
        make_row("ulysses", "tiny-llama", 2 * K, 2, scope="attention", tps=5000.0, **cpu),
    ]
    df = load_rows_from({"whatever.jsonl": rows})
    t3 = tables.table3_cpu(df)
    assert set(t3.df["Row"]) >= {"ulysses", "upipe", "upipe / ulysses"}
    assert "usp" not in set(t3.df["Row"])  # Fig. 5's rows have not the paper's levers
    f5 = tables.fig5_table(df)
    assert (f5.df["Setup"] == "tiny-llama, 4 ranks").any()
    f1 = tables.fig1_table(df)
    tiny = f1.df[f1.df["Setup"] == "tiny-llama, 64K tokens, 8 ranks"]
    assert tiny["Config"].tolist() == ["FSDP", "UPipe"]
    ua = tables.u_ablation_table(df)
    assert set(ua.df[ua.df["Setup"] == "tiny-llama, 2 ranks, attention block"]["Variant"]) == {
        "Ulysses", "UPipe U=2 (= C)", "UPipe U=4"}


def test_one_u_or_one_series_alone_is_no_ablation_or_fig5():
    """UPipe at a single U is no U ablation, one of Fig. 5's series alone no comparison, and a
    training step on 2 ranks no Fig. 1 bar, whatever their file is called."""
    cpu = dict(device="cpu", device_name="Test CPU")
    rows = {"u-ablation-cpu.jsonl": [make_row("upipe", "tiny-llama", 2 * K, 2, scope="attention", tps=1.0,
                                              options={"chunk_heads": 4}, **cpu)],
            "fig5-multinode-cpu.jsonl": [make_row("usp-upipe", "tiny-llama", 1 * K, 4, tps=1.0,
                                                  options={"ulysses_degree": 2}, **cpu)],
            "fig1-memory-breakdown-cpu.jsonl": [make_row("upipe", "tiny-llama", 64 * K, 2, "simulated",
                                                         peak_gib=0.02, levers=PAPER_LEVERS)]}
    df = load_rows_from(rows)
    assert not tables.u_ablation_rows(df).shape[0]
    assert not tables.fig5_rows(df).shape[0]
    assert not tables.fig1_rows(df).shape[0]
