"""A small results folder of synthetic rows covering every table (see rowfactory.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.rowfactory import K, M, make_row, write


def standard_rows() -> dict[str, list]:
    """File name -> rows. Covers: a paper-grid row per Table 3 family, OOM, error, a simulated
    row (memory only), a rerun of one trial (newer time), option labels, a CPU variant, Fig. 1
    categories, Fig. 5, the attention micro-benchmark, the U ablation, max-context searches."""
    t3 = [
        make_row("upipe", seq_len=128 * K, tps=2000.0, reserved_gib=20.0),
        make_row("upipe", seq_len=128 * K, tps=2100.0, reserved_gib=21.0, time="2026-11-21T00:00:00+00:00"),
        make_row("upipe", seq_len=4 * M, status="oom"),
        make_row("ulysses", seq_len=128 * K, tps=2200.0, reserved_gib=25.0),
        make_row("ring", seq_len=256 * K, status="error"),
        make_row("upipe", seq_len=1 * M, mode="simulated", peak_gib=30.0),
        make_row("upipe", seq_len=1 * M, mode="simulated", peak_gib=31.0, options={"chunk_heads": 16}),
        make_row("mystery", seq_len=128 * K, tps=999.0, reserved_gib=30.0),
    ]
    q = [
        make_row("usp-upipe", "qwen3-32b", 128 * K, 16, tps=480.0, options={"ulysses_degree": 8}),
        make_row("usp", "qwen3-32b", 128 * K, 16, tps=500.0, options={"ulysses_degree": 8}),
    ]
    cpu = [make_row(m, "tiny-llama", s, 2, device="cpu", tps=t, peak_gib=0.1, device_name="Test CPU")
           for m, s, t in (("ulysses", 1 * K, 1000.0), ("upipe", 1 * K, 900.0), ("ulysses", 2 * K, 800.0))]
    cats = dict(parameter=2.0, gradient=2.0, optstate=11.0, activation=20.0, temp=10.0, other=1.0)
    fig1 = [make_row("upipe", seq_len=3 * M, mode="simulated", peak_gib=46.0, by_category=cats),
            make_row("ulysses", seq_len=3 * M, mode="simulated", status="oom", peak_gib=90.0,
                     by_category=dict(cats, activation=64.0),
                     levers={"fsdp": True, "ac": True, "ac_offload": False, "tiled_mlp": False, "chunked_loss": False})]
    fig5 = [make_row("usp", "llama3-8b", 2 * M, 16, tps=100.0, reserved_gib=29.5, options={"ulysses_degree": 8}),
            make_row("usp-upipe", "llama3-8b", 2 * M, 16, tps=98.0, reserved_gib=26.0, options={"ulysses_degree": 8})]
    attn = [make_row(m, seq_len=s, mode="simulated", scope="attention", peak_gib=g, options=o,
                     by_category={"parameter": 0.125, "activation": g - 0.125})
            for m, o, s, g in (("ulysses", {}, 128 * K, 2.0), ("upipe", {}, 128 * K, 1.5),
                               ("upipe", {"chunk_heads": 16}, 128 * K, 1.75))]
    ua = [make_row("ulysses", world_size=4, tps=3000.0, reserved_gib=17.0),
          make_row("upipe", world_size=4, tps=2900.0, reserved_gib=16.0, options={"chunk_heads": 8})]
    mc = [make_row("upipe", seq_len=0, mode="simulated", kind="max_context", max_context=5 * M + 256 * K,
                   search={"granularity": 128 * K, "max_seq_len": 32 * M}),
          make_row("ulysses", seq_len=0, mode="simulated", kind="max_context", max_context=32 * M,
                   search={"granularity": 128 * K, "max_seq_len": 32 * M}),
          make_row("upipe", seq_len=5 * M + 256 * K, mode="simulated", peak_gib=70.0)]  # a probe of the search
    tiny = dict(device="cpu", device_name="Test CPU")
    fig1_cpu = [make_row("upipe", "tiny-llama", 64 * K, 8, "simulated", peak_gib=0.02,
                         by_category=dict(parameter=0.01, activation=0.01))]
    u2 = {"ulysses_degree": 2}
    fig5_cpu = [make_row("usp", "tiny-llama", 1 * K, 4, tps=500.0, peak_gib=0.05, options=u2, **tiny),
                make_row("usp-upipe", "tiny-llama", 1 * K, 4, tps=450.0, peak_gib=0.04, options=u2, **tiny)]
    attn_cpu = [make_row(m, "tiny-llama", 2 * K, 2, scope="attention", peak_gib=g, tps=t, options=o, **tiny)
                for m, o, g, t in (("ulysses", {}, 0.010, 5000.0), ("upipe", {}, 0.008, 4000.0))]
    ua_cpu = [make_row(m, "tiny-llama", 2 * K, 2, scope="attention", peak_gib=g, tps=t, options=o, **tiny)
              for m, o, g, t in (("ulysses", {}, 0.010, 5000.0), ("upipe", {"chunk_heads": 4}, 0.009, 4500.0))]
    return {"fig1-memory-breakdown-cpu.jsonl": fig1_cpu, "fig5-multinode-cpu.jsonl": fig5_cpu,
            "attn-memory-cpu.jsonl": attn_cpu, "u-ablation-cpu.jsonl": ua_cpu,
            "table3-llama3-8b.jsonl": t3, "table3-qwen3-32b.jsonl": q, "table3-cpu.jsonl": cpu,
            "fig1-memory-breakdown.jsonl": fig1, "fig5-multinode.jsonl": fig5, "attn-memory.jsonl": attn,
            "u-ablation.jsonl": ua, "sub/maxctx.jsonl": mc}


def write_standard_results(root: Path) -> Path:
    """``standard_rows`` written under ``root``, with a corrupt line and a ``paper/`` file to skip."""
    for name, rows in standard_rows().items():
        write(root / name, rows)  # one append per file
    with open(root / "table3-llama3-8b.jsonl", "a") as f:
        f.write('{"kind": "trial", "method": "cut-off"\n')  # a corrupt line
    write(root / "paper" / "ignored.jsonl", [make_row("upipe", seq_len=5 * M, tps=1.0)])  # results/paper/ is skipped
    return root


@pytest.fixture
def results_dir(tmp_path):
    return write_standard_results(tmp_path / "results")
