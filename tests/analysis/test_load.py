"""Loaders: validated rows into one flat frame, newest row per trial, paper CSVs exact."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.load import human_size, load_paper, load_rows, method_label, options_string, paper_names
from tests.rowfactory import K, M, make_row, write


def test_rows_are_flat_with_trial_keys_figures_and_env(results_dir):
    df = load_rows(results_dir, quiet=True)
    for col in ("kind", "method", "options", "model", "scope", "seq_len", "batch", "world_size", "mode", "dtype",
                "device", "levers", "status", "message", "peak_bytes", "peak_gib", "step_time_s",
                "tokens_per_s_per_device", "tflops_per_device", "max_context", "env.device_name", "env.kernel",
                "env.time", "source_file", "replaced_rows", "label", "mode_label"):
        assert col in df.columns, col
    u16 = df[(df["method"] == "upipe") & (df["options"] == "chunk_heads=16") & (df["scope"] == "model")]
    assert len(u16) == 1
    row = u16.iloc[0]
    assert row["label"] == "upipe[chunk_heads=16]"
    assert row["peak_gib"] == pytest.approx(31.0)
    assert row["env.device_name"].startswith("fake tensors")
    assert row["source_file"] == "table3-llama3-8b.jsonl"
    assert row["mode_label"] == "simulated, h100-80g, lean stack"
    assert set(df["source_file"]) >= {"sub/maxctx.jsonl", "table3-cpu.jsonl"}  # recursive


def test_category_columns_and_max_context(results_dir):
    df = load_rows(results_dir, quiet=True)
    fig1 = df[(df["seq_len"] == 3 * M) & (df["method"] == "upipe")].iloc[0]
    assert fig1["peak_by_category.activation"] == 20 * 2**30
    assert fig1["peak_by_category"]["optstate"] == 11 * 2**30
    mc = df[df["kind"] == "max_context"].set_index("method")
    assert mc.loc["upipe", "max_context"] == 5 * M + 256 * K


def test_max_context_search_probes_are_marked(results_dir):
    df = load_rows(results_dir, quiet=True)
    probes = df[df["search_probe"]]
    assert len(probes) == 1 and probes.iloc[0]["seq_len"] == 5 * M + 256 * K
    assert probes.iloc[0]["source_file"] == "sub/maxctx.jsonl"


def test_results_paper_is_skipped_and_corrupt_lines_are_reported(results_dir, capsys):
    df = load_rows(results_dir)
    assert not (df["source_file"].str.startswith("paper")).any()
    assert 5 * M not in set(df[df["tokens_per_s_per_device"] == 1.0]["seq_len"])
    bad = df.attrs["bad_lines"]
    assert len(bad) == 1 and bad[0].path.endswith("table3-llama3-8b.jsonl")
    assert "skipping corrupt row" in capsys.readouterr().err


def test_newest_row_per_trial_key_is_kept_and_counted(results_dir):
    df = load_rows(results_dir, quiet=True)
    hit = df[(df["method"] == "upipe") & (df["seq_len"] == 128 * K) & (df["mode"] == "real") & (df["world_size"] == 8)]
    assert len(hit) == 1
    assert hit.iloc[0]["tokens_per_s_per_device"] == 2100.0  # the 2026-11-21 rerun, not the older 2000
    assert hit.iloc[0]["replaced_rows"] == 1
    # the same CPU attention trial is in two sweeps' files: one row, both files remembered
    shared = df[df["replaced_rows"] > 0].drop(hit.index)
    assert len(shared) == 1 and shared.iloc[0]["model"] == "tiny-llama"
    assert shared.iloc[0]["source_files"] == ("attn-memory-cpu.jsonl", "u-ablation-cpu.jsonl")
    assert df["replaced_rows"].sum() == 2
    every = load_rows(results_dir, keep="all", quiet=True)
    assert len(every) == len(df) + 2


def test_empty_or_missing_results_give_an_empty_frame(tmp_path):
    for where in (tmp_path, tmp_path / "nowhere"):
        df = load_rows(where, quiet=True)
        assert len(df) == 0 and "tokens_per_s_per_device" in df.columns and "mode_label" in df.columns


def test_unmeasured_figures_stay_missing(tmp_path):
    write(tmp_path / "r.jsonl", [make_row("upipe", mode="simulated", peak_gib=3.0)])
    row = load_rows(tmp_path, quiet=True).iloc[0]
    assert pd.isna(row["tokens_per_s_per_device"]) and pd.isna(row["step_time_s"])
    assert row["mem_gib"] == pytest.approx(3.0) and row["mem_basis"] == "allocated"


def test_paper_values_come_through_exactly():
    t3 = load_paper("table3_throughput")
    cell = t3[(t3["model"] == "llama3-8b") & (t3["method"] == "upipe") & (t3["seq_len"] == 5 * M)]
    assert cell["tokens_per_s_per_gpu"].iloc[0] == 98.25
    assert cell["status"].iloc[0] == "ok"
    oom = t3[(t3["model"] == "llama3-8b") & (t3["method"] == "ulysses") & (t3["seq_len"] == 4 * M)].iloc[0]
    assert oom["status"] == "oom" and math.isnan(oom["tokens_per_s_per_gpu"])
    assert load_paper("fig1_memory_breakdown.csv").set_index("config").loc["upipe", "attn_act_gib"] == 19.5
    assert set(paper_names()) >= {"table3_throughput", "max_context", "fig5_multinode", "memory_anchors"}
    with pytest.raises(ValueError, match="available"):
        load_paper("table9")


def test_formatting_helpers():
    assert [human_size(n) for n in (131072, 3 * M, 1572864, 4096, 1000)] == ["128K", "3M", "1.5M", "4K", "1000"]
    assert human_size(float("nan")) == "—"
    assert options_string({"ulysses_degree": 8, "chunk_heads": 16}) == "chunk_heads=16,ulysses_degree=8"
    assert options_string({}) == ""
    assert method_label("usp", {"ulysses_degree": 8}) == "usp[ulysses_degree=8]"


def test_mode_labels_name_the_stack_and_a_shared_pool():
    """The paper stack's series is the per-stream one; a paper-stack row with one shared pool
    (or made before the lever existed) is its own series; lean and real rows say nothing of pools."""
    from analysis.load import mode_label

    assert mode_label("simulated", "h100-80g", stack="paper", pools="per-stream") == "simulated, h100-80g, paper stack"
    assert mode_label("simulated", "h100-80g", stack="paper") == "simulated, h100-80g, paper stack, shared pool"
    assert mode_label("simulated", "h100-80g", stack="paper", pools="shared").endswith("paper stack, shared pool")
    assert mode_label("simulated", "h100-80g") == "simulated, h100-80g, lean stack"
    assert mode_label("simulated", "h100-80g", stack="hf", pools="per-stream") == "simulated, h100-80g, hf stack"
    assert "pool" not in mode_label("real", "h100-80g", "NVIDIA H100 80GB HBM3")
