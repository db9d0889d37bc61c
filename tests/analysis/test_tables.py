"""Tables: paper and ours side by side; missing stays missing, OOM stays OOM, paper exact."""
from __future__ import annotations

import pandas as pd

from analysis import tables
from analysis.load import load_rows
from analysis.style import MISSING, OOM
from tests.rowfactory import M, make_row, write


def _cell(table, col, **match):
    df = table.df
    sel = pd.Series(True, index=df.index)
    for k, v in match.items():
        sel &= df[k] == v
    hit = df[sel]
    assert len(hit) == 1, (match, df)
    return hit.iloc[0][col]


def test_table3_paper_values_are_exact_and_ours_sit_beside_them(results_dir):
    rows = load_rows(results_dir, quiet=True)
    t = tables.table3(rows, "llama3-8b")
    paper = dict(Method="UPipe", Source="paper")
    assert _cell(t, "5M", **paper) == "98.25"
    assert _cell(t, "128K", **paper) == "2281.05"
    assert _cell(t, "4M", Method="Ulysses", Source="paper") == OOM
    assert _cell(t, "5M", Method="Ulysses", Source="paper") == MISSING  # not reported
    ours = dict(Method="upipe", Source="ours", **{"Mode, device": "real, NVIDIA H100 80GB HBM3"})
    assert _cell(t, "128K", **ours) == "2100.00"  # the newest of two rows of one trial
    assert _cell(t, "4M", **ours) == OOM
    for col in ("256K", "512K", "1M", "2M", "3M", "5M"):
        assert _cell(t, col, **ours) == MISSING  # no row: never a number
    assert _cell(t, "256K", Method="ring", Source="ours") == "error"
    sim = dict(Method="upipe", Source="ours", **{"Mode, device": "simulated, h100-80g, lean stack"})
    assert _cell(t, "1M", **sim) == "fits"  # ran, but simulated rows have no throughput
    assert _cell(t, "128K", Method="mystery", Source="ours (not in paper)") == "999.00"
    # ours follow the paper row of their family
    order = t.df["Method"].tolist()
    assert order.index("UPipe") < order.index("upipe") < order.index("mystery")
    assert not t.df.isna().any().any()
    md = t.to_markdown()
    assert "| UPipe | paper |" in md and "98.25" in md and "Our rows: real" in md


def test_table3_16_gpus_maps_usp_onto_the_paper_columns(results_dir):
    t = tables.table3(load_rows(results_dir, quiet=True), "qwen3-32b")
    methods = t.df["Method"].tolist()
    assert methods.index("Ulysses") < methods.index("usp[ulysses_degree=8]") < methods.index("FPDT")
    assert methods.index("UPipe") < methods.index("usp-upipe[ulysses_degree=8]")
    assert _cell(t, "5M", Method="UPipe", Source="paper") == OOM
    assert _cell(t, "128K", Method="usp-upipe[ulysses_degree=8]", Source="ours") == "480.00"


def test_ratios_paper_and_ours(results_dir):
    t = tables.table3_ratios(load_rows(results_dir, quiet=True))
    assert _cell(t, "128K", Setup="llama3-8b, 8 GPUs", Ratio="UPipe / Ulysses", Source="paper") == "0.983"
    assert _cell(t, "128K", Setup="llama3-8b, 8 GPUs", Ratio="upipe / ulysses", Source="ours") == f"{2100 / 2200:.3f}"
    assert _cell(t, "1M", Setup="llama3-8b, 8 GPUs", Ratio="upipe / ulysses", Source="ours") == MISSING
    assert _cell(t, "128K", Setup="qwen3-32b, 16 GPUs", Ratio="usp-upipe[ulysses_degree=8] / usp[ulysses_degree=8]",
                 Source="ours") == "0.960"


def test_cpu_variant_has_its_own_table_with_ratios(results_dir):
    t = tables.table3_cpu(load_rows(results_dir, quiet=True))
    assert list(t.df.columns[5:7]) == ["1K", "2K"]
    assert _cell(t, "1K", Row="ulysses", Source="ours: tokens/s per rank") == "1000.00"
    assert _cell(t, "1K", Row="upipe / ulysses", Source="ours: ratio") == "0.900"
    assert _cell(t, "2K", Row="upipe / ulysses", Source="ours: ratio") == MISSING  # no upipe row at 2K
    assert "0.983–1.024" in _cell(t, "paper ratio (H100)", Row="upipe / ulysses")
    # CPU rows never enter the H100 table
    assert "tiny-llama" not in tables.table3(load_rows(results_dir, quiet=True)).to_markdown()


def _cpu_row(method, times, shared, ws=2, seq=4096):
    import statistics

    from records import Figures
    tokens = seq // ws
    med = statistics.median(times)
    f = Figures(step_time_s=med, step_time_min_s=min(times), step_time_max_s=max(times), step_times_s=list(times),
                tokens_per_device=tokens, tokens_per_s_per_device=tokens / med, host_load_before=1.0,
                host_load_after=3.5 if shared else 1.5, host_cpus=2, trial_threads=2, host_shared=shared)
    return make_row(method, "tiny-llama", seq, ws, device="cpu", device_name="Test CPU", figures=f)


def test_cpu_table_shows_the_spread_of_throughput_and_of_the_ratio(tmp_path):
    write(tmp_path / "table3-llama3-8b-cpu.jsonl", [
        _cpu_row("ulysses", [2.0, 1.0, 4.0, 2.5, 1.5], shared=False),   # 2048 tokens/rank; median 2.0 s
        _cpu_row("upipe", [4.0, 2.0, 8.0, 3.0, 5.0], shared=True),      # median 4.0 s
        make_row("ring", "tiny-llama", 4096, 2, device="cpu", device_name="Test CPU", tps=512.0),  # no spread kept
        make_row("ds-ulysses", "tiny-llama", 4096, 2, device="cpu", device_name="Test CPU", tps=2048.0),
    ])
    t = tables.table3_cpu(load_rows(tmp_path, quiet=True))
    tps = dict(Source="ours: tokens/s per rank")
    assert _cell(t, "4K", Row="ulysses", **tps) == "1024.00 [512.00–2048.00]"  # median [slowest–fastest step]
    assert _cell(t, "4K", Row="upipe", **tps) == "512.00 [256.00–1024.00]†"    # † host shared
    assert _cell(t, "4K", Row="ring", **tps) == "512.00"                        # an old row: the value alone
    # ratio of medians 2.0/4.0; range: ulysses' fastest over upipe's slowest .. its slowest over upipe's fastest
    assert _cell(t, "4K", Row="upipe / ulysses", Source="ours: ratio") == "0.500 [0.125–2.000]†"
    assert _cell(t, "4K", Row="ring / ulysses", Source="ours: ratio") == "0.500"
    # our ulysses is the baseline even where a wrapper of the Ulysses family sorts first
    assert _cell(t, "4K", Row="ds-ulysses (DeepSpeed) / ulysses", Source="ours: ratio") == "2.000"
    assert _cell(t, "paper ratio (H100)", Row="ds-ulysses (DeepSpeed) / ulysses") == ""
    md = t.to_markdown()
    assert "† host shared: in 1 of them" in md and "1-min load average 1.00–3.50" in md
    assert "ratio of the medians" in md


def test_max_context_table(results_dir):
    t = tables.max_context_table(load_rows(results_dir, quiet=True))
    llama8 = dict(Model="llama3-8b", GPUs=8)
    assert _cell(t, "Max context", Method="UPipe", Source="paper (Table 3, derived)", **llama8) == "≥ 5M"
    assert _cell(t, "Max context", Method="Ulysses", Source="paper (Table 3, derived)", **llama8) == "3M"
    assert _cell(t, "Max context", Method="upipe", Source="ours (max-context search)", **llama8) == "5.25M"
    assert _cell(t, "Max context", Method="ulysses", Source="ours (max-context search)", **llama8) == "≥ 32M"
    assert _cell(t, "Max context", Method="UPipe 8×2", Source="paper (Fig. 5 text)") == "8M"
    # runs: upipe real ok at 128K, OOM at 4M -> 128K (not a lower bound)
    assert _cell(t, "Max context", Method="upipe", Source="ours (longest run without OOM)",
                 **{"Mode, device": "real, NVIDIA H100 80GB HBM3"}, **llama8) == "128K"


def test_fig1_table_splits_categories_and_keeps_ooms(results_dir):
    t = tables.fig1_table(load_rows(results_dir, quiet=True))
    assert _cell(t, "Result", Config="Default", Source="paper") == "OOM (119)"
    assert _cell(t, "Activations GiB", Config="UPipe", Source="paper") == "19.5"
    up = dict(Config="UPipe", Source="ours", Setup="llama3-8b, 3M tokens, 8 ranks")
    assert _cell(t, "Model GiB", **up) == "15.0"
    assert _cell(t, "Activations GiB", **up) == "20.0"
    assert _cell(t, "Other GiB", **up) == "11.0"
    assert _cell(t, "Result", **up) == "fits"
    # an OOM bar of ours keeps the memory it would have needed, as the paper labels its own
    assert _cell(t, "Result", Config="+AC", Source="ours") == "OOM (90.0)"
    assert "ALST" in t.df["Config"].tolist() and len(t.df[(t.df["Config"] == "ALST") & (t.df["Source"] == "ours")]) == 0
    assert _cell(t, "Total GiB", **up) == "46.0"


def test_fig5_attention_and_u_ablation_tables(results_dir):
    rows = load_rows(results_dir, quiet=True)
    f5 = tables.fig5_table(rows)
    paper_setup = dict(Setup="llama3-8b, 16 ranks")
    assert _cell(f5, "8M", Quantity="USP-Hybrid 8×2 peak GiB", Source="paper (by eye ±1 GiB)", **paper_setup) == OOM
    up = dict(Quantity="usp-upipe[ulysses_degree=8] peak GiB", Source="ours")
    assert _cell(f5, "2M", **up) == "26.0"
    assert _cell(f5, "512K", **up) == MISSING
    assert _cell(f5, "2M", Quantity="UPipe / USP throughput", Source="ours", **paper_setup) == "0.980"
    cpu = dict(Setup="tiny-llama, 4 ranks")
    assert _cell(f5, "1K", Quantity="UPipe / USP throughput", Source="ours", **cpu) == "0.900"
    assert not (f5.df[f5.df["Setup"] == "tiny-llama, 4 ranks"]["Source"].str.startswith("paper")).any()

    at = tables.attn_memory_table(rows)
    assert at.df["Setup"].iloc[0].startswith("llama3-8b (H=32, G=8), C=8")
    red = at.df[at.df["Setup"].str.startswith("llama3-8b") & at.df["Quantity"].str.startswith("reduction")]
    u8 = red[red["Variant"] == "UPipe U=8 (= C)"].iloc[0]
    assert u8["128K"] == f"{1 - 1.375 / 1.875:.1%}" and u8["paper"].startswith("75.0%")
    assert at.df[at.df["Setup"].str.startswith("qwen3-32b")].iloc[0]["paper"].startswith("87.5%")
    tiny = at.df[at.df["Setup"] == "tiny-llama (H=8, G=4), C=2"]
    assert _cell(at, "2K", Setup="tiny-llama (H=8, G=4), C=2", Variant="Ulysses") == "0.01"
    assert "per-stage" not in " ".join(tiny["paper"])  # the paper's 75% is not claimed at another scale

    ua = tables.u_ablation_table(rows)
    assert ua.df["Setup"].iloc[0] == "llama3-8b, 4 ranks, training step"
    assert _cell(ua, "128K", Variant="UPipe U=8", Quantity="tokens/s per device") == "2900.00"
    assert _cell(ua, "2K", Setup="tiny-llama, 2 ranks, attention block", Variant="UPipe U=4",
                 Quantity="tokens/s per device") == "4500.00"


def test_fig1_cpu_variant_is_its_own_setup(results_dir):
    t = tables.fig1_table(load_rows(results_dir, quiet=True))
    tiny = t.df[t.df["Setup"] == "tiny-llama, 64K tokens, 8 ranks"]
    assert len(tiny) == 1 and tiny.iloc[0]["Source"] == "ours" and tiny.iloc[0]["Config"] == "UPipe"
    assert tiny.iloc[0]["Total GiB"] == "0.020"


def test_compare_methods_marks_the_chosen_method(results_dir):
    rows = load_rows(results_dir, quiet=True)
    t = tables.compare_methods(rows, model="llama3-8b", world_size=8, scope="model", highlight="upipe")
    first = t.df.iloc[0]
    assert first[""] == "◀" and first["Method"].startswith("upipe")
    real = t.df[(t.df["Method"] == "upipe") & (t.df["Mode, device"] == "real, NVIDIA H100 80GB HBM3")].iloc[0]
    assert real["128K"] == "2100.00" and real["4M"] == OOM and real["1M"] == MISSING
    sim = t.df[(t.df["Method"] == "upipe") & (t.df["Mode, device"] == "simulated, h100-80g, lean stack")].iloc[0]
    assert sim["Max context (search)"] == "5.25M"
    mem = tables.compare_methods(rows, metric="mem_gib", model="llama3-8b", world_size=8, scope="model")
    real_ulysses = (mem.df["Method"] == "ulysses") & (mem.df["Mode, device"].str.startswith("real"))
    assert mem.df[real_ulysses].iloc[0]["128K"] == "25.00"
    assert "5.25M" not in t.df.columns  # a max-context search's probe length gets no column by default
    every = tables.compare_methods(rows, model="llama3-8b", world_size=8, scope="model", lengths="all")
    assert _cell(every, "5.25M", Method="upipe", **{"Mode, device": "simulated, h100-80g, lean stack"}) == "fits"
    none = tables.compare_methods(rows, highlight="not-a-method")
    assert "No rows of 'not-a-method'" in none.to_markdown()


def test_every_table_builds_from_no_rows(tmp_path):
    rows = load_rows(tmp_path, quiet=True)
    for build in (lambda r: tables.table3(r, "llama3-8b"), lambda r: tables.table3(r, "qwen3-32b"),
                  tables.table3_ratios, tables.table3_cpu, tables.max_context_table, tables.fig1_table,
                  tables.fig5_table, tables.attn_memory_table, tables.u_ablation_table, tables.memory_vs_seq_table,
                  tables.compare_methods):
        t = build(rows)
        assert t.modes == "no rows"
        assert not t.df.isna().any().any()
    t = tables.table3(rows, "llama3-8b")
    assert (t.df["Source"] == "paper").all() and _cell(t, "5M", Method="UPipe") == "98.25"


def test_a_missing_figure_is_never_zero(tmp_path):
    write(tmp_path / "r.jsonl", [make_row("upipe", seq_len=2 * M, tps=None, peak_gib=None)])
    t = tables.table3(load_rows(tmp_path, quiet=True), "llama3-8b")
    assert _cell(t, "2M", Method="upipe", Source="ours") == "fits"
    m = tables.memory_vs_seq_table(load_rows(tmp_path, quiet=True))
    assert _cell(m, "2M", Method="upipe", Source="ours") == "fits"
    assert "0.00" not in t.to_markdown()


def test_fig1_leaves_out_the_hf_stacks_rows(tmp_path):
    """A row of the hf stack (ALST's recipe, results/hf/) at Fig. 1's GPU count is no bar of the paper's
    ladder, even on a model the paper did not run; the same row under the paper stack is one."""
    cats = dict(parameter=2.0, gradient=2.0, optstate=11.0, activation=20.0, temp=10.0, other=1.0)
    levers = {"fsdp": True, "ac": True, "ac_offload": True, "tiled_mlp": True, "chunked_loss": True}
    for stack in ("hf", "paper"):
        write(tmp_path / stack / "rows.jsonl", [make_row("upipe", "Llama-3.1-8B", 3700000, 8, mode="simulated",
                                                         peak_gib=60.0, by_category=cats,
                                                         levers={**levers, "stack": stack})])
        t = tables.fig1_table(load_rows(tmp_path / stack, quiet=True))
        assert (t.df["Setup"] == "Llama-3.1-8B, 3700000 tokens, 8 ranks").any() == (stack == "paper"), stack
