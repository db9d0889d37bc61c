"""Shared look of every figure and the two result types, ``Table`` and ``Plot``.

Conventions, the same in every figure:

* **paper** values are hollow: hatched, unfilled bars and dashed lines with hollow markers,
  with "paper" in the legend entry; **ours** are solid (filled bars, solid lines, filled
  markers), with the mode and device in the legend entry.
* A method keeps its colour in every figure (``method_color``).
* Sequence-length axes are log2 with human ticks (128K, 1M, ...), K = 1024.
* Figures are written as PNG and SVG; tables as Markdown and CSV. Missing cells are "—"
  and out-of-memory cells "OOM", never a number.
"""
from __future__ import annotations

import io
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from .load import human_size, modes_summary

MISSING = "—"
OOM = "OOM"

# Display names of the paper's methods and their suite counterparts.
DISPLAY = {
    "torch-cp": "Native PyTorch", "ring": "Ring", "ulysses": "Ulysses", "fpdt": "FPDT", "upipe": "UPipe",
    "usp": "USP-Hybrid", "usp-upipe": "UPipe (USP mesh)", "offload": "Ulysses + offload",
    "ds-ulysses": "DeepSpeed Ulysses", "ds-fpdt": "DeepSpeed FPDT", "rfa-zigzag": "ring-flash-attn zigzag",
}
_COLORS = {
    "torch-cp": "#7f7f7f", "ring": "#2ca02c", "ulysses": "#1f77b4", "usp": "#1f77b4", "fpdt": "#9467bd",
    "upipe": "#d62728", "usp-upipe": "#d62728", "offload": "#17becf", "ds-ulysses": "#8c564b",
    "ds-fpdt": "#e377c2", "rfa-zigzag": "#bcbd22",
}
_SPARE = ["#ff7f0e", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#393b79", "#637939", "#843c39"]
PAPER_HATCH = "///"
CAPACITY_COLOR = "#444444"


def method_color(method: str) -> str:
    """A stable colour per method name (known methods fixed, others by a hash of the name)."""
    base = method.split("[", 1)[0]
    if base in _COLORS:
        return _COLORS[base]
    return _SPARE[zlib.crc32(base.encode()) % len(_SPARE)]


def display_name(method: str) -> str:
    return DISPLAY.get(method, method)


def paper_line_style(color: str) -> dict:
    return dict(color=color, linestyle="--", marker="o", markerfacecolor="white", markeredgecolor=color,
                linewidth=1.4, markersize=6)


def ours_line_style(color: str, marker: str = "s") -> dict:
    return dict(color=color, linestyle="-", marker=marker, markerfacecolor=color, markeredgecolor=color,
                linewidth=1.8, markersize=6)


def paper_bar_style(color: str) -> dict:
    return dict(facecolor="white", edgecolor=color, hatch=PAPER_HATCH, linewidth=1.2)


def ours_bar_style(color: str) -> dict:
    return dict(facecolor=color, edgecolor="black", linewidth=0.6)


def seq_axis(ax, seq_lens, axis: str = "x") -> None:
    """Log2 axis over sequence lengths with human tick labels at the given lengths."""
    values = sorted({int(s) for s in seq_lens if s and s == s})
    set_scale = ax.set_xscale if axis == "x" else ax.set_yscale
    set_scale("log", base=2)
    target = ax.xaxis if axis == "x" else ax.yaxis
    if values:
        target.set_major_locator(FixedLocator(values))
        target.set_major_formatter(FuncFormatter(lambda v, _: human_size(v)))
        target.set_minor_locator(NullLocator())
        lo, hi = values[0], values[-1]
        if axis == "x":
            ax.set_xlim(lo / 1.35, hi * 1.35)
        else:
            ax.set_ylim(lo / 1.35, hi * 1.35)


def note_box(ax, text: str, loc: str = "center") -> None:
    """A grey note inside an axes (e.g. 'no rows yet: run ...')."""
    x, y, ha = {"center": (0.5, 0.5, "center"), "top": (0.5, 0.93, "center"), "bottom": (0.5, 0.07, "center"),
                "top right": (0.98, 0.93, "right"), "bottom right": (0.98, 0.07, "right")}[loc]
    ax.text(x, y, text, transform=ax.transAxes, ha=ha, va="center", fontsize=8.5, color="#555555",
            bbox=dict(boxstyle="round,pad=0.4", facecolor="#f4f4f4", edgecolor="#cccccc"))


def new_figure(ncols: int = 1, nrows: int = 1, width: float = 6.4, height: float = 4.4, **kw):
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, **kw)
    for ax in axes.flat:
        ax.grid(True, which="major", alpha=0.3, linewidth=0.6)
        ax.set_axisbelow(True)
    return fig, axes


# ----------------------------------------------------------------------------- result types


def _md_cell(v) -> str:
    text = MISSING if v is None or (isinstance(v, float) and v != v) else str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub Markdown table of a frame of display strings (no dependency on tabulate)."""
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(_md_cell(c) for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(_md_cell(v) for v in r.tolist()) + " |")
    return "\n".join(lines)


@dataclass
class Table:
    """A regenerated table: display strings (``df``), notes, and the rows it was drawn from."""

    name: str  # file stem in paper_figs/
    title: str
    df: pd.DataFrame
    notes: list[str] = field(default_factory=list)
    rows_used: pd.DataFrame | None = None

    @property
    def modes(self) -> str:
        return modes_summary(self.rows_used)

    def to_markdown(self) -> str:
        parts = [f"### {self.title}", "", markdown_table(self.df) if len(self.df.columns) else "(empty)"]
        notes = list(self.notes) + [f"Our rows: {self.modes}."]
        parts += [""] + [f"- {n}" for n in notes]
        return "\n".join(parts) + "\n"

    def write(self, out_dir: str | Path) -> list[Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        md, csv = out / f"{self.name}.md", out / f"{self.name}.csv"
        md.write_text(self.to_markdown())
        self.df.to_csv(csv, index=False)
        return [md, csv]

    def _repr_markdown_(self) -> str:
        return self.to_markdown()


@dataclass
class Plot:
    """A regenerated figure with its notes and the rows it was drawn from."""

    name: str
    title: str
    fig: "plt.Figure"
    notes: list[str] = field(default_factory=list)
    rows_used: pd.DataFrame | None = None

    @property
    def modes(self) -> str:
        return modes_summary(self.rows_used)

    def write(self, out_dir: str | Path) -> list[Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        png, svg = out / f"{self.name}.png", out / f"{self.name}.svg"
        self.fig.savefig(png, dpi=150, bbox_inches="tight", metadata={"Software": None})
        with matplotlib.rc_context({"svg.hashsalt": "cp-attn-bench"}):
            self.fig.savefig(svg, bbox_inches="tight", metadata={"Date": None, "Creator": None})
        return [png, svg]

    def close(self) -> None:
        plt.close(self.fig)

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        return buf.getvalue()
