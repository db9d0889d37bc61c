"""Shared look of every figure and the two result types, ``Table`` and ``Plot``.

Conventions, the same in every figure:

* **paper** values are hollow: hatched, unfilled bars and dashed lines with hollow markers,
  with "paper" in the legend entry; **ours** are solid (filled bars, solid lines, filled
  markers), with the mode and device in the legend entry.
* A method keeps its colour in every figure (``method_color``).
* Sequence-length axes are log2 with human ticks (128K, 1M, ...), K = 1024.
* Figures are written as PNG and SVG; tables as Markdown and CSV. Missing cells are "—"
  and out-of-memory cells "OOM", never a number; in line figures an OOM is a marker in an
  "OOM" band above its panel, never a point on the value axis.
* A figure with many series encodes them (``Encoding``: colour = method, marker = source,
  line style = variant) in a few short legends under the panels (``layout_with_legends``).
"""
from __future__ import annotations

import io
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from .load import human_size, modes_summary

MISSING = "—"
OOM = "OOM"

# Display names of the paper's methods and their suite counterparts.
DISPLAY = {
    "torch-cp": "Native PyTorch CP (torch)", "ring": "Ring", "ulysses": "Ulysses", "fpdt": "FPDT", "upipe": "UPipe",
    "usp": "USP-Hybrid", "usp-upipe": "UPipe (USP mesh)", "offload": "Ulysses + offload",
    "ds-ulysses": "DeepSpeed Ulysses", "ds-fpdt": "DeepSpeed FPDT", "rfa-zigzag": "ring-flash-attn zigzag",
    "ds-ulysses-hf": "DeepSpeed Ulysses (HF/ALST)", "yc-ulysses": "yunchang Ulysses", "yc-ring": "yunchang Ring",
    "yc-usp": "yunchang USP",
}
_COLORS = {
    "torch-cp": "#7f7f7f", "ring": "#2ca02c", "ulysses": "#1f77b4", "usp": "#1f77b4", "fpdt": "#9467bd",
    "upipe": "#d62728", "usp-upipe": "#d62728", "offload": "#17becf", "ds-ulysses": "#8c564b",
    "ds-fpdt": "#e377c2", "rfa-zigzag": "#bcbd22", "ds-ulysses-hf": "#393b79", "yc-ulysses": "#6baed6",
    "yc-ring": "#74c476", "yc-usp": "#9ecae1",
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


def shade(color: str, k: int) -> str:
    """The ``k``-th shade of a colour (0: the colour itself, then darker, lighter, darker...).

    Methods of one paper family share a colour (``usp`` is Ulysses' blue); when two of them,
    or one method with two option sets, are in one figure they need telling apart without
    leaving the family's hue."""
    if k == 0:
        return color
    towards, amount = [("black", 0.4), ("white", 0.45), ("black", 0.65), ("white", 0.7)][(k - 1) % 4]
    rgb, end = mcolors.to_rgb(color), mcolors.to_rgb(towards)
    return mcolors.to_hex([c + amount * (e - c) for c, e in zip(rgb, end, strict=False)])


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


# Our modes' markers (the paper's is a hollow circle); another device of a mode takes a spare.
MODE_MARKERS = {"simulated": "s", "real": "^", "emulated": "D"}
SPARE_MARKERS = ["v", "P", "*", "h", "<", ">"]
# Variants of one method (e.g. a kernel-scratch model): dashes are the paper's, so none here.
VARIANT_LINES = ["-", (0, (1, 1.3)), "-.", (0, (3, 1, 1, 1, 1, 1))]


class Encoding:
    """How one figure tells its series apart: colour = method, marker = source (the paper or
    one of our modes), line style = variant of a method (e.g. a kernel-scratch model).

    A series is a combination of the three, so a figure of 13 series needs three short
    legends (``legend_groups``) rather than 13 entries a reader has to scan for a colour and
    a marker at once. Register in drawing order; legends list what was registered."""

    def __init__(self, variant_title: str = "variant"):
        self.methods: dict[str, tuple[str, str]] = {}  # key -> (colour, legend text)
        self.sources: dict[str, tuple[str, bool, bool, str]] = {}  # key -> (marker, hollow, line?, text)
        self.variants: dict[str, object] = {}  # key -> line style
        self.variant_title = variant_title

    def color(self, key: str, method: str | None = None) -> str:
        """The colour of a method key (a label such as ``usp[ulysses_degree=8]``): its family's
        colour, shaded when another key of this figure already has that colour."""
        if key not in self.methods:
            base = method or key.split("[", 1)[0]
            color = method_color(base)
            taken = sum(1 for k in self.methods if method_color(k.split("[", 1)[0]) == color)
            text, name = key, display_name(base)
            if key == base and name.lower() != base.lower():  # the paper's name too: "torch-cp — Native PyTorch"
                text = f"{key} — {name}"
            self.methods[key] = (shade(color, taken), text)
        return self.methods[key][0]

    def source(self, key: str, line: bool = True, text: str | None = None) -> tuple[str, bool]:
        """(marker, hollow) of a source: ``paper`` is a hollow circle, each of our mode labels
        (``simulated, h100-80g``) a filled marker of its mode. ``line``: whether the legend
        shows it with a line; ``text``: its legend entry (default "paper" / "ours: <key>")."""
        if key not in self.sources:
            if key == "paper":
                marker, hollow = "o", True
            else:
                mode = key.split(",", 1)[0].split("(", 1)[0].strip()  # "simulated (paper stack), ..."
                used = {m for m, *_ in self.sources.values()}
                marker = MODE_MARKERS.get(mode, SPARE_MARKERS[0])
                if marker in used:
                    marker = next((m for m in SPARE_MARKERS if m not in used), SPARE_MARKERS[-1])
                hollow = False
            text = text or ("paper" if key == "paper" else f"ours: {key}")
            self.sources[key] = (marker, hollow, line, text)
        return self.sources[key][:2]

    def linestyle(self, variant: str = "") -> object:
        """Line style of a variant: none ("") is solid, others take the next of ``VARIANT_LINES``;
        the paper's dashes are never one of them."""
        if variant not in self.variants:
            others = sum(1 for v in self.variants if v)
            self.variants[variant] = "-" if not variant else VARIANT_LINES[1 + others % (len(VARIANT_LINES) - 1)]
        return self.variants[variant]

    def style(self, key: str, source: str, variant: str = "", method: str | None = None) -> dict:
        """Keyword arguments of ``ax.plot`` for one series."""
        color = self.color(key, method)
        marker, hollow = self.source(source)
        line = "--" if source == "paper" else self.linestyle(variant)
        return dict(color=color, linestyle=line, marker=marker, markerfacecolor="white" if hollow else color,
                    markeredgecolor=color, linewidth=1.4 if hollow else 1.8, markersize=6)

    def legend_groups(self, order=None) -> list[tuple[str, list]]:
        """(title, handles) per dimension that varies; a dimension with one value is still
        listed for sources (a reader must know what is paper and what is ours). ``order``:
        sort key of the method keys (e.g. the paper's family order), else drawing order."""
        groups = []
        keys = sorted(self.methods, key=order) if order else list(self.methods)
        methods = [Line2D([], [], color=self.methods[k][0], linewidth=4, label=self.methods[k][1]) for k in keys]
        if methods:
            groups.append(("colour: method", methods))
        sources = []
        for marker, hollow, line, text in self.sources.values():
            sources.append(Line2D([], [], color="#555555", marker=marker, markersize=6,
                                  linestyle=("--" if hollow else "-") if line else "",
                                  markerfacecolor="white" if hollow else "#555555", markeredgecolor="#555555",
                                  label=text))
        if sources:
            groups.append(("marker: source", sources))
        if len(self.variants) > 1:
            groups.append((f"line: {self.variant_title}",
                           [Line2D([], [], color="#555555", linestyle=self.variants[key], linewidth=1.8,
                                   label=key or "none") for key in sorted(self.variants, key=bool)]))
        return groups


def _suptitle_at_top(fig) -> None:
    """Put the suptitle at the figure's top edge: ``tight_layout`` reserves its height from that
    edge, while its default place (2% of the height down) is inches down on a tall figure."""
    sup = getattr(fig, "_suptitle", None)
    if sup is not None:
        sup.set_y(1 - 0.06 / fig.get_size_inches()[1])
        sup.set_va("top")


def layout_with_legends(fig, groups: list[tuple[str, list]], gap_in: float = 0.25) -> list:
    """``tight_layout`` with the figure's legends in rows under the panels, outside every panel.

    Each group (title, handles) is one legend; the figure grows by the legends' height so the
    panels keep their size, and no legend can cover data or another panel's labels."""
    legends = []
    for title, handles in groups:
        ncol = 1 if len(handles) <= 5 else 2 if len(handles) <= 10 else 3
        legends.append(fig.legend(handles=handles, title=title, loc="upper left", ncol=ncol, fontsize=7.5,
                                  title_fontsize=8, frameon=False, alignment="left"))
    width, height = fig.get_size_inches()
    if not legends:
        _suptitle_at_top(fig)
        fig.tight_layout()
        return legends
    renderer = fig.canvas.get_renderer()
    sizes = [(e.width / fig.dpi, e.height / fig.dpi) for e in (leg.get_window_extent(renderer) for leg in legends)]
    rows, row, used = [], [], 0.0  # greedy rows of legends no wider than the figure
    for leg, (w, h) in zip(legends, sizes, strict=False):
        if row and used + gap_in + w > width:
            rows.append(row)
            row, used = [], 0.0
        row.append((leg, w, h))
        used += (gap_in if len(row) > 1 else 0) + w
    rows.append(row)
    block = sum(max(h for _, _, h in r) for r in rows) + 0.1 * len(rows) + 0.1
    total = height + block
    fig.set_size_inches(width, total)
    _suptitle_at_top(fig)
    fig.tight_layout(rect=(0, block / total, 1, 1))
    y = block
    for r in rows:
        x = (width - sum(w for _, w, _ in r) - gap_in * (len(r) - 1)) / 2
        for leg, w, _ in r:
            leg.set_bbox_to_anchor((x / width, y / total), transform=fig.transFigure)
            x += w + gap_in
        y -= max(h for _, _, h in r) + 0.1
    return legends


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
    fig: plt.Figure
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
