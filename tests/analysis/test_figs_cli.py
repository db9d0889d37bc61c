"""`python -m analysis figs` writes every table, figure and the index, with or without rows."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis import figures
from analysis.load import load_rows
from analysis.report import ARTEFACTS, expected_files

REPO = Path(__file__).resolve().parents[2]


def _figs(results: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "analysis", "figs", "--results", str(results), "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("with_rows", [False, True], ids=["no-rows", "rows"])
def test_figs_writes_everything_and_the_index(tmp_path, results_dir, with_rows):
    results = results_dir if with_rows else tmp_path / "empty"
    out = tmp_path / "figs"
    proc = _figs(results, out)
    assert proc.returncode == 0, proc.stderr
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(set(expected_files())), written
    for name in expected_files():
        assert (out / name).stat().st_size > 0, name
        assert f"wrote {out / name}" in proc.stdout or name in proc.stdout
    index = (out / "README.md").read_text()
    for art in ARTEFACTS:
        assert art.paper in index
        assert f"[{art.name}." in index
    assert "python -m sweeps run sweeps/configs/table3-llama3-8b.yaml --executor slurm" in index
    assert "python -m sweeps run sweeps/configs/attn-memory.yaml --executor local" in index
    table3 = (out / "table3_llama3-8b.md").read_text()
    assert "98.25" in table3
    if with_rows:
        assert "simulated (h100-80g, lean stack)" in index and "real (NVIDIA H100 80GB HBM3)" in index
        assert "1 corrupt lines skipped" in index
        assert "2100.00" in table3
    else:
        assert "| no rows |" in index and "ours" not in (out / "table3_llama3-8b.csv").read_text()


def test_figures_label_paper_and_ours(results_dir):
    rows = load_rows(results_dir, quiet=True)
    for build in (figures.table3_plot, figures.max_context_plot, figures.fig1_plot, figures.fig5_plot,
                  figures.attn_memory_plot, figures.u_ablation_plot, figures.memory_vs_seq_plot):
        plot = build(rows)
        try:
            labels = []
            for ax in plot.fig.axes:
                assert ax.get_xlabel() or ax.get_ylabel(), (plot.name, ax.get_title())
                legend = ax.get_legend()
                if legend is not None:
                    labels += [t.get_text() for t in legend.get_texts()]
                labels += [t.get_text() for t in ax.get_yticklabels()] + [ax.get_title()]
            for legend in plot.fig.legends:  # figures with many series have their legends under the panels
                labels += [t.get_text() for t in legend.get_texts()]
            text = " ".join(labels)
            if plot.name != "u_ablation":  # the paper has no U ablation numbers
                assert "paper" in text, (plot.name, text)
            assert "ours" in text, (plot.name, text)
            assert plot.modes != "no rows", plot.name
        finally:
            plot.close()


def test_sequence_axes_are_log2_with_human_ticks(results_dir):
    plot = figures.table3_plot(load_rows(results_dir, quiet=True))
    try:
        ax = plot.fig.axes[0]
        assert ax.get_xscale() == "log"
        ticks = [t.get_text() for t in ax.get_xticklabels()]
        assert ticks[:3] == ["128K", "256K", "512K"] and "1M" in ticks and ticks[-1] == "5M"
    finally:
        plot.close()
