"""Checks on results/paper/: the paper's reported numbers (sources and certainty: docs/paper.md).

Schema: required columns, non-empty sources, and valid enum values. Spot values against
docs/paper.md. Internal consistency: status against value, max context against Table 3, and the
derived UPipe/Ulysses throughput ratios.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

PAPER_DIR = Path(__file__).resolve().parents[1] / "results" / "paper"
K, M = 1024, 1024 * 1024

REQUIRED = {
    "table3_throughput.csv": ["source", "model", "gpus", "device", "method", "seq_len", "status",
                              "tokens_per_s_per_gpu", "confidence"],
    "max_context.csv": ["source", "model", "gpus", "method", "max_seq_len", "confidence", "note"],
    "fig1_memory_breakdown.csv": ["source", "model", "seq_len", "gpus", "config", "model_gib", "attn_act_gib",
                                  "other_gib", "total_gib", "status", "oom_required_gib", "confidence"],
    "fig5_multinode.csv": ["source", "model", "gpus", "layout", "method", "seq_len", "peak_mem_gib", "status",
                           "norm_throughput", "confidence"],
    "memory_anchors.csv": ["source", "model", "gpus", "method", "seq_len", "peak_mem_gib", "confidence", "note"],
    "attn_memory_reduction.csv": ["source", "model", "heads", "head_chunk_u", "reduction", "confidence", "note"],
}

MODELS = {"llama3-8b", "qwen3-32b"}
METHODS = {"torch-cp", "ring", "ulysses", "fpdt", "upipe", "usp"}
STATUSES = {"ok", "oom", "not_reported"}
CONFIDENCES = {"reported", "derived", "read-off-image", "eyeballed", "unconfirmed"}
TABLE3_LENS = [128 * K, 256 * K, 512 * K, 1 * M, 2 * M, 3 * M, 4 * M, 5 * M]


def load(name: str) -> pd.DataFrame:
    return pd.read_csv(PAPER_DIR / name, keep_default_na=True)


@pytest.fixture(scope="module")
def t3() -> pd.DataFrame:
    return load("table3_throughput.csv")


def t3_value(t3, model, method, seq_len):
    row = t3[(t3.model == model) & (t3.method == method) & (t3.seq_len == seq_len)]
    assert len(row) == 1, (model, method, seq_len, len(row))
    return row.iloc[0]


# --------------------------------------------------------------------------------------------
# Schema, for every CSV in the directory
# --------------------------------------------------------------------------------------------


def test_expected_files_present():
    present = {p.name for p in PAPER_DIR.glob("*.csv")}
    assert set(REQUIRED) <= present, set(REQUIRED) - present
    assert (PAPER_DIR / "README.md").is_file()


@pytest.mark.parametrize("path", sorted(PAPER_DIR.glob("*.csv")), ids=lambda p: p.name)
def test_csv_schema(path):
    df = pd.read_csv(path)
    assert len(df) > 0
    for col in REQUIRED.get(path.name, ["source", "confidence"]):
        assert col in df.columns, f"{path.name}: missing column {col}"
    assert df["source"].notna().all() and (df["source"].astype(str).str.strip() != "").all(), \
        f"{path.name}: empty source"
    assert set(df["confidence"]) <= CONFIDENCES, f"{path.name}: {set(df['confidence']) - CONFIDENCES}"
    if "model" in df.columns:
        assert set(df["model"]) <= MODELS, f"{path.name}: {set(df['model']) - MODELS}"
    if "method" in df.columns:
        assert set(df["method"]) <= METHODS, f"{path.name}: {set(df['method']) - METHODS}"
    if "status" in df.columns:
        assert set(df["status"]) <= STATUSES, f"{path.name}: {set(df['status']) - STATUSES}"
    for col in ("seq_len", "max_seq_len", "gpus"):
        if col in df.columns:
            vals = df[col].dropna()
            assert (vals == vals.astype(int)).all() and (vals > 0).all(), f"{path.name}: bad {col}"
    # Every source names its table/figure (or the abstract/derivation) and carries a tag.
    for src in df["source"]:
        assert "[" in src and "]" in src, f"{path.name}: source without tag: {src!r}"


# --------------------------------------------------------------------------------------------
# Table 3
# --------------------------------------------------------------------------------------------


def test_table3_grid_complete(t3):
    assert len(t3) == 2 * 5 * 8
    assert (t3.confidence == "reported").all()
    assert (t3.source == "Table 3 [W]").all()
    assert (t3.device == "h100-80g").all()
    assert set(t3.seq_len) == set(TABLE3_LENS)
    assert set(t3[t3.model == "llama3-8b"].gpus) == {8}
    assert set(t3[t3.model == "qwen3-32b"].gpus) == {16}
    assert not t3.duplicated(["model", "method", "seq_len"]).any()


def test_table3_status_matches_value(t3):
    ok = t3.status == "ok"
    assert t3.loc[ok, "tokens_per_s_per_gpu"].notna().all()
    assert (t3.loc[ok, "tokens_per_s_per_gpu"] > 0).all()
    assert t3.loc[~ok, "tokens_per_s_per_gpu"].isna().all()


@pytest.mark.parametrize(
    "model, method, seq_len, status, value",
    [
        ("llama3-8b", "upipe", 5 * M, "ok", 98.25),
        ("llama3-8b", "upipe", 128 * K, "ok", 2281.05),
        ("llama3-8b", "ulysses", 4 * M, "oom", None),
        ("llama3-8b", "ulysses", 5 * M, "not_reported", None),
        ("llama3-8b", "torch-cp", 2 * M, "oom", None),
        ("llama3-8b", "fpdt", 4 * M, "ok", 119.76),
        ("llama3-8b", "ring", 3 * M, "ok", 159.96),
        ("qwen3-32b", "upipe", 4 * M, "ok", 29.97),
        ("qwen3-32b", "upipe", 5 * M, "oom", None),
        ("qwen3-32b", "torch-cp", 1 * M, "oom", None),
        ("qwen3-32b", "ulysses", 128 * K, "ok", 545.29),
        ("qwen3-32b", "fpdt", 4 * M, "ok", 27.66),
    ],
)
def test_table3_spot_values(t3, model, method, seq_len, status, value):
    row = t3_value(t3, model, method, seq_len)
    assert row.status == status
    if value is not None:
        assert row.tokens_per_s_per_gpu == pytest.approx(value, abs=1e-9)


def test_upipe_over_ulysses_ratio_128k(t3):
    up = t3_value(t3, "llama3-8b", "upipe", 128 * K).tokens_per_s_per_gpu
    uly = t3_value(t3, "llama3-8b", "ulysses", 128 * K).tokens_per_s_per_gpu
    assert round(up / uly, 3) == 0.983


@pytest.mark.parametrize(
    "model, ratios",
    [
        ("llama3-8b", [0.983, 0.989, 0.987, 0.994, 1.000, 1.024]),  # 128K..3M
        ("qwen3-32b", [0.886, 0.916, 0.942, 0.968, 0.993]),  # 128K..2M
    ],
)
def test_derived_ratios_in_paper_md(t3, model, ratios):
    for n, expected in zip(TABLE3_LENS, ratios, strict=False):
        up = t3_value(t3, model, "upipe", n).tokens_per_s_per_gpu
        uly = t3_value(t3, model, "ulysses", n).tokens_per_s_per_gpu
        assert round(up / uly, 3) == pytest.approx(expected, abs=1e-9), (model, n)


# --------------------------------------------------------------------------------------------
# Max context, recomputed from Table 3
# --------------------------------------------------------------------------------------------


def test_max_context_consistent_with_table3(t3):
    mc = load("max_context.csv")
    assert (mc.confidence == "derived").all()
    assert len(mc) == 10
    for _, r in mc.iterrows():
        sub = t3[(t3.model == r.model) & (t3.method == r.method) & (t3.status == "ok")]
        assert int(sub.seq_len.max()) == int(r.max_seq_len), (r.model, r.method)
        assert int(sub.gpus.iloc[0]) == int(r.gpus)


@pytest.mark.parametrize(
    "model, method, expected",
    [
        ("llama3-8b", "torch-cp", 1 * M), ("llama3-8b", "ring", 3 * M), ("llama3-8b", "ulysses", 3 * M),
        ("llama3-8b", "fpdt", 4 * M), ("llama3-8b", "upipe", 5 * M),
        ("qwen3-32b", "torch-cp", 512 * K), ("qwen3-32b", "ring", 2 * M), ("qwen3-32b", "ulysses", 2 * M),
        ("qwen3-32b", "fpdt", 4 * M), ("qwen3-32b", "upipe", 4 * M),
    ],
)
def test_max_context_values(model, method, expected):
    mc = load("max_context.csv")
    r = mc[(mc.model == model) & (mc.method == method)]
    assert len(r) == 1 and int(r.iloc[0].max_seq_len) == expected


# --------------------------------------------------------------------------------------------
# Fig. 1, Fig. 5, memory anchors, attention reduction
# --------------------------------------------------------------------------------------------


def test_fig1_values():
    f1 = load("fig1_memory_breakdown.csv").set_index("config")
    assert list(f1.index) == ["default", "fsdp", "fsdp+ulysses", "+ac", "+ao", "alst", "upipe"]
    assert (f1.seq_len == 3 * M).all() and (f1.gpus == 8).all() and (f1.model == "llama3-8b").all()
    assert (f1.confidence == "read-off-image").all()
    oom = f1[f1.status == "oom"]
    assert list(oom.index) == ["default", "fsdp", "fsdp+ulysses", "+ac", "+ao"]
    assert oom.oom_required_gib.tolist() == [119, 7680, 960, 126, 368]
    assert oom.total_gib.isna().all()
    for cfg, attn, total in [("alst", 33.0, 64.6), ("upipe", 19.5, 51.1)]:
        r = f1.loc[cfg]
        assert r.status == "ok" and r.attn_act_gib == attn
        assert r.total_gib == pytest.approx(r.model_gib + r.attn_act_gib + r.other_gib, abs=0.05)
        assert r.total_gib == pytest.approx(total)
        assert r.total_confidence == "derived"
    # UPipe/ALST attention-activation ratio as quoted in docs/paper.md (19.5/33.0 = 0.59).
    assert round(f1.loc["upipe"].attn_act_gib / f1.loc["alst"].attn_act_gib, 2) == 0.59


def test_fig5_values():
    f5 = load("fig5_multinode.csv")
    pts = f5[f5.kind == "point"]
    assert (pts.confidence == "eyeballed").all()
    assert (f5.gpus == 16).all() and (f5.layout == "8x2").all() and (f5.model == "llama3-8b").all()
    up = pts[pts.method == "upipe"].set_index("seq_len")
    usp = pts[pts.method == "usp"].set_index("seq_len")
    assert up.loc[8 * M].peak_mem_gib == pytest.approx(69.5)
    assert up.loc[8 * M].status == "ok"
    assert usp.loc[8 * M].status == "oom" and pd.isna(usp.loc[8 * M].peak_mem_gib)
    assert usp.loc[6 * M].peak_mem_gib == pytest.approx(62)
    assert up.loc[512 * K].norm_throughput == pytest.approx(0.955)
    assert (usp[usp.status == "ok"].norm_throughput == 1.0).all()
    # UPipe uses no more memory than USP wherever both ran (read by eye, so allow 1 GiB).
    both = up.merge(usp, left_index=True, right_index=True, suffixes=("_up", "_usp"))
    both = both.dropna(subset=["peak_mem_gib_up", "peak_mem_gib_usp"])
    assert len(both) == 4
    assert (both.peak_mem_gib_up <= both.peak_mem_gib_usp + 1).all()
    # All memory below the 80 GiB H100 line.
    assert (pts.peak_mem_gib.dropna() < 80).all()
    claims = f5[f5.kind == "max_context_claim"].set_index("method")
    assert int(claims.loc["upipe"].seq_len) == 8 * M and int(claims.loc["usp"].seq_len) == 6 * M
    assert (claims.confidence == "reported").all()


def test_memory_anchors():
    a = load("memory_anchors.csv").set_index("model")
    assert (a.confidence == "unconfirmed").all()
    assert (a.seq_len == 128 * K).all()
    assert a.loc["llama3-8b"].peak_mem_gib == pytest.approx(21.1)
    assert a.loc["qwen3-32b"].peak_mem_gib == pytest.approx(39.98)
    assert a.note.str.contains("not confirmed", case=False).all()


def test_attn_memory_reduction():
    r = load("attn_memory_reduction.csv").set_index("model")
    for model, h, expected, source in [("llama3-8b", 32, 0.75, "[D]"), ("qwen3-32b", 64, 0.875, "[A]")]:
        row = r.loc[model]
        assert row.heads == h and row.head_chunk_u == 8
        assert row.reduction == pytest.approx(expected)
        assert row.reduction == pytest.approx(1 - row.head_chunk_u / row.heads)
        assert row.source == source
        assert "1 - U/H" in row.note
