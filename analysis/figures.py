"""One function per regenerated figure; each returns a ``Plot`` (paper and ours together).

Paper values are hollow (dashed lines with open markers, hatched unfilled bars) and say
"paper" in the legend; ours are solid and say their mode and device. A missing value is
not drawn. An OOM has no memory or throughput value, so it is never a point on a value
axis: line plots put it in an "OOM" band above the panel (one row per series, the series'
own marker), bar plots write "OOM" in the bar's slot. Figures with many series encode them
(colour = method, marker = source, line style = variant) in a few short legends under the
panels instead of one entry per series.
"""
from __future__ import annotations

import os

import numpy as np
import pandas as pd
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter
from matplotlib.transforms import Bbox

from records.facts import OURS, facts_of

from .load import human_size, load_paper, method_label
from .select import (
    PAPER_LENGTHS,
    PAPER_METHODS,
    TABLE3_SETUPS,
    family,
    family_order,
    groups,
    lookup,
    number,
    preferred,
)
from .style import (
    CAPACITY_COLOR,
    Encoding,
    Plot,
    display_name,
    layout_with_legends,
    method_color,
    new_figure,
    note_box,
    ours_bar_style,
    ours_line_style,
    paper_bar_style,
    paper_line_style,
    seq_axis,
)
from .tables import (
    FIG1_CONFIGS,
    FIG1_NAMES,
    PAPER_ATTN,
    PAPER_FIG1,
    PAPER_FIG5,
    _rows,
    activation_gib,
    attn_rows,
    attn_setups,
    fig1_rows,
    fig1_setups,
    fig5_rows,
    fig5_setups,
    heads_of,
    max_context_rows,
    setup_name,
    split_categories,
    table3_rows,
    u_ablation_rows,
    u_setups,
    variant_name,
)

H100_GIB = 81559 / 1024  # what nvidia-smi reports for an H100 80GB, in GiB
OURS_MARKERS = ["s", "^", "D", "v", "P", "*"]
OOM_COLOR = "#b00000"
OOM_ROW_IN = 0.1  # height of one series' row in an OOM band, inches
OOM_GAP_IN = 0.05  # between a panel and its OOM band, inches


class _Above:
    """Axes locator of an OOM band: as wide as its panel, a fixed height in inches just above
    it, wherever the layout moves the panel (a height in axes fractions would shrink with it).
    Computed in pixels of the figure's own transform, which ``savefig(bbox_inches="tight")``
    keeps consistent while it crops (the figure's size in inches does not stay)."""

    def __init__(self, parent, height_in: float):
        self.parent, self.height_in = parent, height_in

    def __call__(self, ax, renderer) -> Bbox:
        fig = self.parent.get_figure(root=False)
        p = self.parent.get_position().transformed(fig.transFigure)
        bottom = p.y1 + OOM_GAP_IN * fig.dpi
        band = Bbox.from_extents(p.x0, bottom, p.x1, bottom + self.height_in * fig.dpi)
        return band.transformed(fig.transFigure.inverted())


class OOMs:
    """Out-of-memory points of line plots, kept per panel and drawn in a band above it.

    An OOM row has no value on the panel's axis (a simulated one records the demand that did
    not fit, a real one nothing), so a point at the axis floor or at a recorded peak would
    read as a measurement; in the band a point only says "this length ran out of memory".
    Each series gets its own row, so OOMs of several series at one length never hide or
    push each other out of the panel."""

    def __init__(self):
        self.by_axes: dict = {}

    def add(self, ax, xs, style: dict) -> None:
        """The OOM lengths (x values) of one series, drawn with the series' own style."""
        xs = sorted({float(x) for x in xs})
        if xs:
            self.by_axes.setdefault(ax, []).append((xs, style))

    def draw(self) -> list:
        """One band per panel with OOMs (call once the panels' x axes are set); the bands.

        The figure grows by the tallest band of each row of panels, so that the bands do not
        take their height from the panels' value axes."""
        bands, grow = [], {}
        for ax, series in self.by_axes.items():
            height = 0.08 + OOM_ROW_IN * len(series)
            spec = ax.get_subplotspec()
            row = spec.rowspan.start if spec is not None else id(ax)
            grow[row] = max(grow.get(row, 0.0), height + OOM_GAP_IN)
            band = ax.inset_axes([0, 1, 1, 0.1], sharex=ax)
            band.set_axes_locator(_Above(ax, height))
            band.set_label("OOM band")
            n = len(series)
            for i, (xs, style) in enumerate(series):
                band.plot(xs, [n - 1 - i] * len(xs), **dict(style, markersize=4.5, linewidth=1.0))
            band.set_ylim(-0.7, n - 0.3)
            band.set_yticks([])
            band.tick_params(axis="x", which="both", bottom=False, labelbottom=False)
            band.set_facecolor("#fbf1f1")
            band.grid(True, axis="x", alpha=0.3, linewidth=0.6)
            band.set_ylabel("OOM", rotation=0, ha="right", va="center", fontsize=8.5, color=OOM_COLOR,
                            fontweight="bold")
            bands.append(band)
        if grow:
            fig = next(iter(self.by_axes)).get_figure(root=True)
            width, height = fig.get_size_inches()
            fig.set_size_inches(width, height + sum(grow.values()))
        return bands


def seq_span(ax, xs) -> None:
    """A sequence-length axis with the paper's ticks, widened by powers of two to every length
    drawn (lines and OOM bands alike), so that no point lies outside its panel."""
    xs = [float(x) for x in xs if x and x == x]
    lo, hi = min([PAPER_LENGTHS[0]] + xs), max([PAPER_LENGTHS[-1]] + xs)
    ticks = list(PAPER_LENGTHS)
    k = PAPER_LENGTHS[0] // 2
    while k >= lo:
        ticks.insert(0, k)
        k //= 2
    k = 2 ** int(np.ceil(np.log2(PAPER_LENGTHS[-1] + 1)))
    while k <= hi:
        ticks.append(k)
        k *= 2
    seq_axis(ax, ticks)
    ax.set_xlim(lo / 1.35, hi * 1.35)


def series_style(enc: Encoding, sub: pd.DataFrame) -> dict:
    """The plot style of one series of ours: colour by its method and options, marker by its
    mode and device, line style by what its label adds (e.g. "+fa3 scratch")."""
    r = sub.iloc[0]
    key = method_label(r["method"], r["options"])
    label = str(r["label"])
    variant = label[len(key):].strip().lstrip("+").strip() if label.startswith(key) else ""
    return enc.style(key, r["mode_label"], variant, method=r["method"])


def paper_order(key: str) -> tuple:
    """Sort key of a method key (``usp[ulysses_degree=8]``): the paper's family order, then the name."""
    base = key.split("[", 1)[0]
    return family_order(family(base)), base != family(base), key


def capacity_line(ax, label: str = "H100 capacity (79.6 GiB)") -> None:
    """The H100's memory as a dotted line, named on the line (no legend entry to look up)."""
    ax.axhline(H100_GIB, color=CAPACITY_COLOR, linestyle=":", linewidth=1.2)
    ax.text(0.01, H100_GIB + 1, label, transform=ax.get_yaxis_transform(), fontsize=7.5, color=CAPACITY_COLOR,
            va="bottom")


def below(ax, handles=None, labels=None, ncol: int = 2) -> None:
    """The axes' legend under it, in columns, so it never hides data."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=ncol,
                  frameon=False)


def plain_log_y(ax) -> None:
    """Log y axis labelled with plain numbers (300, not 3×10²)."""
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "235" else ""))


def _run_hint(ax, sweeps: str) -> None:
    note_box(ax, f"no rows of ours yet\n{sweeps}", loc="bottom")


# ----------------------------------------------------------------------------- Table 3

# whose implementations the Table 3 figure draws (``MethodFacts.library``): ours and PyTorch's CP
# (the paper's Native PyTorch). The wrappers of yunchang (USP, Ring, Ulysses), DeepSpeed and
# ring-flash-attn run the algorithms of our ring, ulysses, usp and fpdt, which the figure draws;
# they stay in the tables, and the legend stays readable
TABLE3_FIGURE_LIBRARIES = (OURS, "PyTorch")


def figure_series(ours: pd.DataFrame) -> pd.DataFrame:
    """Our Table 3 rows that the figure draws: those of ``TABLE3_FIGURE_LIBRARIES``' methods but
    PyTorch CP's ``alltoall`` rotation (its ``rotate`` option), which the paper did not run (it set
    ``allgather``); the others stay in the tables, and the legend stays short enough to read
    (``MAX_LEGEND_ENTRIES`` in the figure tests)."""
    ours = ours[ours["method"].map(lambda m: facts_of(m).library in TABLE3_FIGURE_LIBRARIES).astype(bool)]
    if "opt.rotate" not in ours:
        return ours
    return ours[~(ours["opt.rotate"] == "alltoall")]


def table3_plot(rows=None) -> Plot:
    """Table 3 as curves: tokens/s per GPU vs sequence length, paper (dashed, open) vs ours.

    Colour = method, marker = source, line style = variant, in legends under the panels; OOM
    lengths (the paper's and those of our series that measure throughput) in a band above
    each panel, not at the axis floor where they read as a throughput."""
    rows = _rows(rows)
    paper = load_paper("table3_throughput")
    fig, axes = new_figure(2, 1, width=6.8, height=4.6)
    enc = Encoding("kernel-scratch model (simulation)")
    ooms = OOMs()
    used = []
    for ax, setup in zip(axes[0], TABLE3_SETUPS, strict=False):
        p = paper[paper["model"] == setup.model]
        xs_drawn = list(p["seq_len"])
        for pm in PAPER_METHODS:
            pp = p[p["method"] == pm]
            ok = pp[pp["status"] == "ok"]
            style = enc.style(pm, "paper")
            ax.plot(ok["seq_len"], ok["tokens_per_s_per_gpu"], **style)
            ooms.add(ax, pp[pp["status"] == "oom"]["seq_len"], style)
        ours = figure_series(table3_rows(rows, setup))
        used.append(ours)
        drawn = 0
        for _, sub in groups(ours):
            xs, ys, oom = [], [], []
            for s in sorted(sub["seq_len"].unique()):
                r = lookup(sub, s)
                v = number(r, "tokens_per_s_per_device")
                if v is not None:
                    xs.append(s), ys.append(v)
                elif r["status"] == "oom":
                    oom.append(s)
            if not xs:  # a series without throughput (e.g. simulated: memory only) is not on this figure
                continue
            style = series_style(enc, sub)
            ax.plot(xs, ys, **style)
            ooms.add(ax, oom, style)
            xs_drawn += xs + oom
            drawn += 1
        ax.set_yscale("log")
        plain_log_y(ax)
        seq_span(ax, xs_drawn)
        ax.set_xlabel("sequence length (tokens, K = 1024)")
        ax.set_ylabel("throughput (tokens/s per GPU)")
        ax.set_title(f"Table 3: {setup.model}, {setup.gpus} GPUs")
        if not drawn:
            msg = "no throughput rows of ours yet" if not len(ours) else \
                "our rows here have no throughput (e.g. simulated: memory only)"
            note_box(ax, f"{msg}\npython -m sweeps run sweeps/configs/table3-{setup.model}.yaml", loc="top")
    ooms.draw()
    fig.suptitle("Training throughput vs sequence length (paper: dashed, open markers; ours: solid)")
    layout_with_legends(fig, enc.legend_groups(order=paper_order))
    used_df = pd.concat(used) if any(len(u) for u in used) else rows.iloc[0:0]
    return Plot("table3_throughput", "Table 3 as curves", fig,
                ["Ours: rows with the paper's levers on a GPU preset; CPU rows are in table3_cpu.md."], used_df)


# ----------------------------------------------------------------------------- max context

def _one_answer_per_series(ours: pd.DataFrame) -> list:
    """Our max-context answers of one setup, one per series (label, mode, scope): the search
    where the series has one (``max_context_rows`` keeps its finest), else the longest run.

    A search and a longest run of one series answer the same question, the search exactly to
    its step; shown together they contradict each other whenever the runs' lengths are not the
    search's (e.g. "search: < 1M" above "longest run: 896K")."""
    if not len(ours):
        return []
    out = []
    for _, sub in ours.groupby(["label", "mode_label", "scope"], sort=False):
        searches = sub[sub["kind"] == "search"]
        out.append((searches if len(searches) else sub).iloc[0])
    return out


def _answer_text(r, step_on_bar: bool) -> str:
    """What one of our max-context answers says at the end of its bar."""
    step = human_size(r["step"]) if r["kind"] == "search" and pd.notna(r["step"]) else None
    value = int(r["max_seq_len"])
    if r["kind"] == "runs":
        if value == 0:
            return "no run fits (no search)"
        return ("≥ " if r["lower_bound"] else "") + f"{human_size(value)} (longest run, no search)"
    if value == 0:
        if r["status"] == "error":
            return "no answer: the search stopped by an error"
        return f"< {step}: nothing fits (search step {step})" if step else "nothing fits"
    text = ("≥ " if r["lower_bound"] else "") + human_size(value)
    if r["status"] == "error":
        text += " (search stopped by an error)"
    elif r["lower_bound"]:
        text += " (search limit)"
    return text + (f"  step {step}" if step_on_bar and step else "")


def _fit_bar_texts(axes, lo: float, hi: float) -> None:
    """Widen the shared log2 x axis of the max-context panels until every text at a bar's end
    ends inside its panel ("≥ 32M (search limit)" at the longest bar would otherwise run over
    the frame). A text keeps its width in pixels while the axis compresses, so a few rounds."""
    renderer = axes[0].get_figure(root=True).canvas.get_renderer()
    for _ in range(4):
        octaves = np.log2(hi / lo)
        need = octaves
        for ax in axes:
            box = ax.get_window_extent(renderer)
            for t in ax.texts:
                if t.get_transform() != ax.transData:
                    continue
                start = np.log2(t.get_position()[0] / lo) / octaves * box.width  # pixels from the left edge
                width = t.get_window_extent(renderer).width + 6
                if start + width > box.width:
                    need = max(need, np.log2(t.get_position()[0] / lo) * box.width / (box.width - width))
        if need <= octaves:
            return
        hi = lo * 2 ** need
        ticks = [2**k for k in range(int(np.log2(lo)), int(np.log2(hi)) + 1)]
        for ax in axes:
            ax.set_xticks(ticks, [human_size(t) for t in ticks], fontsize=7.5)
            ax.set_xlim(lo, hi)


def max_context_plot(rows=None, docs: str | None = None) -> Plot:
    """Max context per method: paper (hatched) vs ours (solid), log2 axis. Panels: Table 3's
    two setups and Fig. 5's Llama3-8B on 16 GPUs (8×2), then any other setup of ours.

    One bar per method and source: the paper's number, and per series of ours one answer,
    its search's (the finest of several) or, without a search, its longest run. The search
    step says how exact an answer is ("6.125M" is exact to 128K), so the panel title states it
    (each bar does when a panel's searches differ), and a search that fit nothing says
    "< step" rather than drawing a zero. ``docs``: which of our rows, by their packed documents
    (``tables.max_context_table``'s; None, the default, one sequence)."""
    import matplotlib.pyplot as plt

    rows = _rows(rows, docs)
    paper = load_paper("max_context")
    fig5 = load_paper("fig5_multinode")
    claims = fig5[fig5["kind"] == "max_context_claim"]
    ours = max_context_rows(rows)
    panels = [(s.model, s.gpus, f"{s.model}, {s.gpus} GPUs (Table 3)") for s in TABLE3_SETUPS]
    panels.append(("llama3-8b", 16, "llama3-8b, 16 GPUs, 8×2 mesh (Fig. 5)"))
    seen = {(m, g) for m, g, _ in panels}
    setups = {(m, int(w)) for m, w in zip(ours["model"], ours["world_size"], strict=True)}
    for m, g in sorted(setups - seen) if len(ours) else []:
        panels.append((m, g, f"{m}, {g} ranks (ours only: no paper values at this scale)"))
    modes = sorted(ours["mode_label"].unique()) if len(ours) else []
    # what every series shares ("simulated, h100-80g, ") is said once, in the legend, not on each bar
    shared = os.path.commonprefix(modes) if len(modes) > 1 else ""
    shared = shared[: shared.rfind(", ") + 2] if ", " in shared else ""
    order = {m: i for i, m in enumerate(PAPER_METHODS)}
    content = []
    for model, gpus, title in panels:
        bars = []  # (family, label, value, text, is_paper, color, series name)
        for r in paper[(paper["model"] == model) & (paper["gpus"] == gpus)].itertuples():
            text = ("≥ " if "lower bound" in str(r.note) else "") + human_size(int(r.max_seq_len))
            bars.append((family(r.method), f"{display_name(r.method)} — paper", int(r.max_seq_len), text, True,
                         method_color(r.method), (r.method,)))
        for r in claims[(claims["model"] == model) & (claims["gpus"] == gpus)].itertuples():
            name = "USP-Hybrid 8×2" if r.method == "usp" else "UPipe 8×2"
            bars.append((family(r.method), f"{name} — paper", int(r.seq_len), human_size(int(r.seq_len)), True,
                         method_color(r.method), (r.method,)))
        o = ours[(ours["model"] == model) & (ours["world_size"] == gpus)] if len(ours) else ours
        answers = [r for r in _one_answer_per_series(o) if pd.notna(r["max_seq_len"])]
        steps = sorted({int(r["step"]) for r in answers if r["kind"] == "search" and pd.notna(r["step"])})
        for r in answers:
            label = f"{r['label']} — ours" + (f" ({r['mode_label'][len(shared):]})" if len(modes) > 1 else "") + (
                ", attention block" if r["scope"] == "attention" else "")
            bars.append((family(r["method"]), label, int(r["max_seq_len"]), _answer_text(r, len(steps) > 1), False,
                         method_color(r["method"]), (r["label"], r["mode_label"], r["scope"])))
        bars.sort(key=lambda b: (order.get(b[0], len(order)), not b[4], b[6]))
        if len(steps) == 1:
            title += f"\nours: max-context search, step {human_size(steps[0])}"
        elif steps:
            title += "\nours: max-context searches, step on each bar"
        content.append((model, gpus, title, bars, len(o)))
    heights = [len(c[3]) + 2.6 for c in content]
    fig = plt.figure(figsize=(10, 0.3 * sum(heights) + 1.2))
    grid = fig.add_gridspec(len(content), 1, height_ratios=heights)
    all_values = [b[2] for c in content for b in c[3] if b[2] > 0]
    lo = min(all_values + [128 * 2**10]) / 2
    hi = max(all_values + [8 * 2**20]) * 2.5
    ticks = [2**k for k in range(int(np.log2(lo)), int(np.log2(hi)) + 1)]
    for k, (model, gpus, title, bars, n_ours) in enumerate(content):
        ax = fig.add_subplot(grid[k])
        ax.grid(True, axis="x", alpha=0.3, linewidth=0.6)
        ax.set_axisbelow(True)
        ys = np.arange(len(bars))[::-1] + 1.0  # slot 0 (bottom) stays free for a note
        for y, b in zip(ys, bars, strict=False):
            style = paper_bar_style(b[5]) if b[4] else ours_bar_style(b[5])
            if b[2] > 0:  # a search that fit nothing has no bar: its text says "< step"
                ax.barh(y, b[2] - lo, left=lo, height=0.72, **style)
            ax.text(max(b[2], lo) * 1.08, y, b[3], va="center", fontsize=8)
        ax.set_yticks(ys, [b[1] for b in bars], fontsize=7.5)
        ax.set_ylim(-0.2 if n_ours else -0.6, len(bars) + 0.6)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [human_size(t) for t in ticks], fontsize=7.5)
        ax.set_xlim(lo, hi)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("maximum context (tokens, log2 scale" + ("; bars start at the axis edge)"
                                                                if k == len(content) - 1 else ")"), fontsize=9)
        if not n_ours:
            prefix = "fig5-multinode" if gpus == 16 and model == "llama3-8b" else f"maxctx-{model}"
            ax.text(0.5, 0.5 / (len(bars) + 1.2), f"no rows of ours yet: python -m sweeps run "
                    f"sweeps/configs/{prefix}.yaml", transform=ax.transAxes, ha="center", va="center",
                    fontsize=7.5, color="#555555")
    ours_text = "ours (solid)" + (f": {modes[0]}" if len(modes) == 1 else f": {shared[:-2]}" if shared else "")
    fig.suptitle("Maximum context per method (≥: lower bound)" + (f"; ours with documents {docs}" if docs else ""))
    layout_with_legends(fig, [("source", [Patch(**paper_bar_style("black"), label="paper (hatched)"),
                                          Patch(**ours_bar_style("grey"), label=ours_text)])])
    _fit_bar_texts(fig.axes, lo, hi)
    return Plot("max_context", "Maximum context per method", fig, [], rows[rows["kind"] == "max_context"]
                if len(rows) else rows)


# ----------------------------------------------------------------------------- Fig. 1

SEGMENTS = (("model", "model (weights, grads, optimizer)", "#4c72b0"),
            ("act", "activations (paper: attention activations)", "#dd8452"),
            ("other", "other", "#55a868"))


def _fig1_panel(ax, ours: pd.DataFrame, paper: pd.DataFrame | None, title: str, capacity: bool) -> None:
    """One setup: per configuration, the paper's stacked bar (hatched) then ours, one per mode.
    The y axis stops a little above the tallest paper bar or the H100's capacity (or above our
    bars when there is no paper); a taller bar is cut there and labelled with its height."""
    modes = sorted(ours["mode_label"].unique()) if len(ours) else []
    n = (1 if paper is not None else 0) + max(1, len(modes))
    width = 0.8 / n
    x = np.arange(len(FIG1_CONFIGS))
    if paper is not None:
        paper_top = float(paper["total_gib"].max()) if paper["total_gib"].notna().any() else 0.0
        ymax = max(paper_top, H100_GIB) * 1.45
    else:
        ymax = max([float(v) for v in ours["mem_gib"] if pd.notna(v)] + [1e-3]) * 1.35
    scale, unit = (1024.0, "MiB") if paper is None and ymax < 1 else (1.0, "GiB")
    ymax *= scale
    used_total = False
    for i, cfg in enumerate(FIG1_CONFIGS):
        x0 = x[i] - 0.4 + width / 2
        if paper is not None and cfg in paper.index:
            p = paper.loc[cfg]
            bottom = 0.0
            for key, _, color in SEGMENTS:
                v = p[{"model": "model_gib", "act": "attn_act_gib", "other": "other_gib"}[key]]
                if pd.notna(v):
                    ax.bar(x0, v, width, bottom=bottom, **paper_bar_style(color))
                    bottom += v
            text = f"OOM\n({p['oom_required_gib']:g})" if p["status"] == "oom" else f"{bottom:.1f}"
            ax.text(x0, bottom + ymax * 0.01, text, ha="center", va="bottom", fontsize=7.5,
                    color="#b00000" if p["status"] == "oom" else "black")
        for j, ml in enumerate(modes):
            xo = x0 + width * (j + (1 if paper is not None else 0))
            sub = ours[(ours["config"] == cfg) & (ours["mode_label"] == ml)]
            if not len(sub):
                continue
            r = preferred(sub)  # several implementations of one bar: the paper's (the table lists all)
            if r["status"] == "error" or pd.isna(r["mem_gib"]):
                ax.text(xo, ymax * 0.01, "error" if r["status"] == "error" else "OOM, no peak", ha="center",
                        va="bottom", fontsize=7, rotation=90, color="#b00000")
                continue
            split = split_categories(r["peak_by_category"])
            total = scale * float(r["mem_gib"] if split is None else r["peak_gib"])
            if split is None:  # a real CUDA run records the peak, not its categories
                ax.bar(xo, total, width, **ours_bar_style("#999999"))
                used_total = True
            else:
                bottom = 0.0
                for (_, _, color), v in zip(SEGMENTS, split, strict=False):
                    ax.bar(xo, scale * v, width, bottom=bottom, **ours_bar_style(color))
                    bottom += scale * v
            cut = total > ymax * 0.86
            digits = 1 if total >= 1 else 3
            color = "#b00000" if r["status"] == "oom" else "black"
            if cut:  # written up the bar, which is too narrow for a label across it
                text = ("OOM " if r["status"] == "oom" else "") + f"↑ {total:.0f} {unit}"
                ax.text(xo, ymax * 0.5, text, ha="center", va="center", fontsize=7.5, rotation=90, color=color,
                        bbox=dict(facecolor="white", edgecolor="none", pad=0.5, alpha=0.85))
            else:
                text = f"{total:.{digits}f}" + ("\nOOM" if r["status"] == "oom" else "")
                ax.text(xo, total + ymax * 0.01, text, ha="center", va="bottom", fontsize=7.5, color=color)
    if capacity:
        ax.axhline(H100_GIB, color=CAPACITY_COLOR, linestyle=":", linewidth=1.2)
        ax.text(len(FIG1_CONFIGS) - 0.45, H100_GIB + 0.8, "H100 capacity (79.6 GiB)", ha="right", va="bottom",
                fontsize=8, color=CAPACITY_COLOR)
    ax.set_xticks(x, [FIG1_NAMES[c] for c in FIG1_CONFIGS])
    ax.set_xlim(-0.6, len(FIG1_CONFIGS) - 0.4)
    ax.set_ylim(0, ymax)
    ax.set_ylabel(f"peak memory per device ({unit})")
    ax.set_xlabel("configuration" + (" (left bar: paper; then ours, one bar per mode)" if paper is not None
                                     else " (ours, one bar per mode)"))
    ax.set_title(title)
    handles = [Patch(**ours_bar_style(c), label=name) for _, name, c in SEGMENTS]
    if used_total:
        handles.append(Patch(**ours_bar_style("#999999"), label="total only (real run: no categories)"))
    if paper is not None:
        handles.append(Patch(**paper_bar_style("black"), label="paper (hatched, unfilled)"))
    first = 2 if paper is not None else 1
    handles += [Patch(facecolor="white", edgecolor="white", label=f"ours, bar {j + first} of each group: {ml}")
                for j, ml in enumerate(modes)]
    ax.legend(handles=handles, fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def fig1_plot(rows=None) -> Plot:
    """Fig. 1: stacked peak memory per configuration, paper (hatched) vs ours (solid); a second
    panel for each smaller-scale variant of ours (no paper values there)."""
    rows = _rows(rows)
    paper = load_paper("fig1_memory_breakdown").set_index("config")
    ours = fig1_rows(rows)
    setups = fig1_setups(ours)
    fig, axes = new_figure(1, len(setups), width=10.5, height=5.6)
    for ax, setup in zip(axes[:, 0], setups, strict=False):
        mine = ours[ours["setup"] == setup] if len(ours) else ours
        if setup == PAPER_FIG1:
            _fig1_panel(ax, mine, paper, "Fig. 1: peak memory breakdown, Llama3-8B, 3M tokens, 8 GPUs", True)
            if not len(mine):
                note_box(ax, "no rows of ours yet\npython -m bench fidelity --anchors fig1-",
                         loc="top right")
        else:
            _fig1_panel(ax, mine, None, f"ours only, smaller scale: {setup_name(*setup)} (no paper values)", False)
    fig.tight_layout()
    return Plot("fig1_memory_breakdown", "Fig. 1 memory breakdown", fig,
                ["OOM (n): the paper's label, probably GiB required."], ours)


# ----------------------------------------------------------------------------- Fig. 5

def _fig5_panel(ax, ours: pd.DataFrame, paper: pd.DataFrame | None, title: str) -> None:
    lengths = sorted((set(paper["seq_len"].astype(int)) if paper is not None else set())
                     | (set(ours["seq_len"]) if len(ours) else set()))
    modes = sorted(ours["mode_label"].unique()) if len(ours) else []
    x = np.arange(len(lengths))
    series = ([("paper", m) for m in ("usp", "upipe")] if paper is not None else []) + \
        [(ml, m) for ml in modes for m in ("usp", "upipe")]
    width = 0.8 / max(1, len(series))
    colors = {"usp": method_color("usp"), "upipe": method_color("upipe")}
    top = 0.0
    small = paper is None and max([float(v) for v in ours["mem_gib"] if pd.notna(v)] + [0.0]) < 1
    scale, unit = (1024.0, "MiB") if small else (1.0, "GiB")
    for k, (src, m) in enumerate(series):
        xs = x - 0.4 + width * (k + 0.5)
        for i, s in enumerate(lengths):
            if src == "paper":
                hit = paper[(paper["method"] == m) & (paper["seq_len"] == s)]
                status = hit["status"].iloc[0] if len(hit) else None
                v = hit["peak_mem_gib"].iloc[0] if len(hit) else None
                style = paper_bar_style(colors[m])
            else:
                r = lookup(ours[(ours["fig5_method"] == m) & (ours["mode_label"] == src)], s)
                status = r["status"] if r is not None else None
                v = r["mem_gib"] if r is not None else None
                style = ours_bar_style(colors[m])
            if status == "oom":
                ax.text(xs[i], 0, " OOM", rotation=90, ha="center", va="bottom", fontsize=7.5, color="#b00000")
            elif status == "ok" and pd.notna(v):
                ax.bar(xs[i], scale * v, width, **style)
                top = max(top, scale * float(v))
    if paper is not None:
        ax.axhline(80, color=CAPACITY_COLOR, linestyle="--", linewidth=1.0)
        ax.text(-0.45, 81, "80 GB HBM (H100)", fontsize=8, color=CAPACITY_COLOR, va="bottom")
        ax.set_ylim(0, 100)
    else:
        ax.set_ylim(0, max(top, 1e-3) * 1.3)
    ax.set_xticks(x, [human_size(s) for s in lengths])
    ax.set_xlim(-0.6, len(lengths) - 0.4)
    ax.set_xlabel("sequence length (tokens, K = 1024)")
    ax.set_ylabel(f"peak memory per device ({unit}, bars)")
    ax2 = ax.twinx()
    pos = {s: i for i, s in enumerate(lengths)}
    if paper is not None:
        p = paper[paper["method"] == "upipe"].sort_values("seq_len")
        ax2.plot([pos[s] for s in p["seq_len"]], p["norm_throughput"], **paper_line_style("black"),
                 label="UPipe / USP throughput — paper")
    ratio_lines = 0
    drawn: list[list[tuple[int, float]]] = []
    # the paper stack's ratio where there is one (it runs what the paper ran: its ring-step barriers,
    # bench.stackmodel.stack term 9, change the counts); the lean stack's only without it. Where two
    # accountings time the same counts alike, one line stands for both. The table lists each.
    timed = [(j, ml) for j, ml in enumerate(modes) if "paper stack" in ml] or list(enumerate(modes))
    for j, ml in timed:
        u = ours[(ours["fig5_method"] == "upipe") & (ours["mode_label"] == ml)]
        b = ours[(ours["fig5_method"] == "usp") & (ours["mode_label"] == ml)]
        pts = []
        for s in lengths:
            a, c = number(lookup(u, s), "tokens_per_s_per_device"), number(lookup(b, s), "tokens_per_s_per_device")
            if a and c:
                pts.append((pos[s], a / c))
        if any(len(d) == len(pts) and all(x == y and abs(v - w) < 1e-3 for (x, v), (y, w) in zip(d, pts, strict=False))
               for d in drawn):
            continue
        drawn.append(pts)
        if pts:
            ax2.plot(*zip(*pts, strict=False), **ours_line_style("black", OURS_MARKERS[j % len(OURS_MARKERS)]),
                     label=f"UPipe / USP throughput — ours ({ml})")
            ratio_lines += 1
    ratios = [v for line in ax2.get_lines() for v in line.get_ydata()]
    ax2.set_ylim(min([0.8] + [v - 0.05 for v in ratios]), max([1.1] + [v + 0.05 for v in ratios]))
    ax2.set_ylabel("throughput normalised to USP (lines)")
    handles = []
    if paper is not None:
        handles += [Patch(**paper_bar_style(colors["usp"]), label="USP-Hybrid 8×2 — paper (by eye)"),
                    Patch(**paper_bar_style(colors["upipe"]), label="UPipe 8×2 — paper (by eye)")]
    for ml in modes:
        labels = {m: sorted(ours[(ours["fig5_method"] == m) & (ours["mode_label"] == ml)]["label"].unique())
                  for m in ("usp", "upipe")}
        handles += [Patch(**ours_bar_style(colors["usp"]), label=f"{', '.join(labels['usp']) or 'usp'} — ours ({ml})"),
                    Patch(**ours_bar_style(colors["upipe"]),
                          label=f"{', '.join(labels['upipe']) or 'upipe'} — ours ({ml})")]
    h2, _ = ax2.get_legend_handles_labels()
    ax.legend(handles=handles + h2, fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2,
              frameon=False)
    ax.set_title(title)
    if modes and not ratio_lines:
        note_box(ax, "our rows have no throughput (memory only): no ours ratio line", loc="top right")


def fig5_plot(rows=None) -> Plot:
    """Figure 5: memory bars (left axis) and UPipe/USP throughput (right axis), paper vs ours;
    a further panel for each smaller-scale variant of ours."""
    rows = _rows(rows)
    paper = load_paper("fig5_multinode")
    paper = paper[paper["kind"] == "point"]
    ours = fig5_rows(rows)
    setups = fig5_setups(ours)
    fig, axes = new_figure(1, len(setups), width=9.5, height=6.4)
    for ax, setup in zip(axes[:, 0], setups, strict=False):
        mine = ours[ours["setup"] == setup] if len(ours) else ours
        if setup == PAPER_FIG5:
            _fig5_panel(ax, mine, paper, "Figure 5: Llama3-8B, 16 GPUs (8 Ulysses × 2 Ring), UPipe vs USP-Hybrid")
            if not len(mine):
                note_box(ax, "no rows of ours yet\npython -m sweeps run sweeps/configs/fig5-multinode.yaml",
                         loc="top right")
        else:
            _fig5_panel(ax, mine, None, f"ours only, smaller scale: {setup_name(setup[0], None, setup[1])} "
                                        "(no paper values)")
    fig.tight_layout()
    return Plot("fig5_multinode", "Figure 5", fig, [], ours)


# ----------------------------------------------------------------------------- attention memory

def attn_memory_plot(rows=None) -> Plot:
    """Per-rank peak of one attention block vs length (top) and reduction vs Ulysses (bottom),
    with the paper's 75% / 87.5% as dashed reference lines; one column per setup (the paper's
    two, then any other of ours, e.g. the CPU variant)."""
    rows = _rows(rows)
    ours = attn_rows(rows)
    reduction = load_paper("attn_memory_reduction")
    setups = attn_setups(ours)
    fig, axes = new_figure(len(setups), 2, width=6.2, height=5.6)
    default_lengths = [128 * 2**10, 512 * 2**10, 2**20, 2 * 2**20, 4 * 2**20]
    palette = ["#d62728", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"]
    ooms = OOMs()
    for col, (model, ws) in enumerate(setups):
        h, g = heads_of(rows, model)
        top, bot = axes[0][col], axes[1][col]
        sub = ours[(ours["model"] == model) & (ours["world_size"] == ws)] if len(ours) else ours
        lengths = sorted(sub["seq_len"].unique()) if len(sub) else default_lengths
        modes = sorted(sub["mode_label"].unique()) if len(sub) else []
        us = sorted({u for u in sub["u"] if u is not None}) if len(sub) else []
        cmap = dict(zip(us, palette, strict=False))
        small = len(sub) and max([float(v) for v in sub["peak_gib"] if pd.notna(v)] + [0.0]) < 1
        scale, unit = (1024.0, "MiB") if small else (1.0, "GiB")
        for mi, ml in enumerate(modes):
            msub = sub[sub["mode_label"] == ml]
            base = msub[msub["u"].isna()]
            for u in [None] + us:
                vs = base if u is None else msub[msub["u"] == u]
                if not len(vs):
                    continue
                color = method_color("ulysses") if u is None else cmap[u]
                style = ours_line_style(color, OURS_MARKERS[mi % len(OURS_MARKERS)])
                pts = [(s, number(lookup(vs, s), "peak_gib")) for s in lengths]
                pts = [(s, scale * v) for s, v in pts if v is not None]
                if pts:
                    top.plot(*zip(*pts, strict=False), **style, label=f"{variant_name(u, h, ws)} — ours ({ml})")
                ooms.add(top, [s for s in lengths if (r := lookup(vs, s)) is not None and r["status"] == "oom"],
                         style)
                if u is None or not len(base):
                    continue
                red = []
                for s in lengths:
                    a, b = activation_gib(lookup(vs, s)), activation_gib(lookup(base, s))
                    if a is not None and b:
                        red.append((s, 100 * (1 - a / b)))
                if red:
                    bot.plot(*zip(*red, strict=False), **style, label=f"U={u} vs Ulysses — ours ({ml})")
        ref = reduction[(reduction["model"] == model) & (reduction["ulysses_degree"] == ws)]
        if len(ref):
            r = ref.iloc[0]
            bot.axhline(100 * r["reduction"], color="black", linestyle="--", linewidth=1.4,
                        label=f"paper: {r['reduction']:.1%} at U=C={int(r['head_chunk_u'])} "
                              f"(1 − U/H, per-stage intermediates)")
        ys = [v for line in top.get_lines() for v in line.get_ydata() if np.isfinite(v) and v > 0]
        log = not ys or max(ys) / min(ys) >= 4  # a log axis needs a range to show ticks on
        if log:
            top.set_yscale("log", base=2)
            top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        for ax in (top, bot):
            seq_axis(ax, lengths)
            ax.set_xlabel("sequence length (tokens, K = 1024)")
        top.set_ylabel(f"peak memory per rank ({unit}{', log2' if log else ''})")
        bot.set_ylabel("reduction vs Ulysses (%, peak − weights)")
        lows = [v for line in bot.get_lines() for v in line.get_ydata() if np.isfinite(v)]
        bot.set_ylim(min([0.0] + lows) - 5, 100)
        bot.axhline(0, color="grey", linewidth=0.8)
        scale = "" if (model, ws) in PAPER_ATTN else " — ours only, smaller scale"
        top.set_title(f"{model} (H={h}, G={g}), one attention block, C={ws}{scale}", fontsize=10)
        bot.set_title(f"{model}, C={ws}: memory UPipe saves", fontsize=10)
        if not modes:
            note_box(top, "no rows of ours yet\npython -m sweeps run sweeps/configs/attn-memory.yaml")
        else:
            below(top, ncol=1)
        below(bot, ncol=1)
    ooms.draw()
    fig.suptitle("Attention-block micro-benchmark (ours: solid; paper reference: dashed)")
    fig.tight_layout()
    return Plot("attn_memory", "Attention-block memory", fig, [], ours)


# ----------------------------------------------------------------------------- U ablation

def u_ablation_plot(rows=None) -> Plot:
    """Per setup (a row of panels), against the chunk size U on the x axis (Ulysses at the right
    end), one line per sequence length: throughput, throughput relative to Ulysses at the same
    length, and peak memory."""
    import matplotlib

    rows = _rows(rows)
    ours = u_ablation_rows(rows)
    setups = u_setups(ours) or [("llama3-8b", 4, "model")]
    fig, axes = new_figure(3, len(setups), width=5.4, height=5.0)
    metric = "tokens_per_s_per_device"
    ooms = OOMs()
    for row_axes, (model, ws, scope) in zip(axes, setups, strict=False):
        sub = ours[(ours["model"] == model) & (ours["world_size"] == ws) & (ours["scope"] == scope)] \
            if len(ours) else ours
        h, _ = heads_of(rows, model)
        us = sorted({u for u in sub["u"] if u is not None}) if len(sub) else []
        variants = us + ([None] if len(sub) and sub["u"].isna().any() else [])
        xs = {u: k for k, u in enumerate(variants)}
        lengths = sorted(sub["seq_len"].unique()) if len(sub) else []
        modes = sorted(sub["mode_label"].unique()) if len(sub) else []
        cmap = matplotlib.colormaps["viridis"]
        small = len(sub) and max([float(v) for v in sub["mem_gib"] if pd.notna(v)] + [0.0]) < 1
        scale, unit = (1024.0, "MiB") if small else (1.0, "GiB")
        drawn = [0, 0, 0]
        for mi, ml in enumerate(modes):
            msub = sub[sub["mode_label"] == ml]
            base = msub[msub["u"].isna()]
            for li, s in enumerate(lengths):
                color = cmap(0.15 + 0.7 * li / max(1, len(lengths) - 1))
                style = ours_line_style(color, OURS_MARKERS[mi % len(OURS_MARKERS)])
                b = number(lookup(base, s), metric) if len(base) else None
                pts = {0: [], 1: [], 2: []}
                oom = []
                for u in variants:
                    r = lookup(base if u is None else msub[msub["u"] == u], s)
                    t, m = number(r, metric), number(r, "mem_gib")
                    if t:
                        pts[0].append((xs[u], t))
                        if b:
                            pts[1].append((xs[u], t / b))
                    if m:
                        pts[2].append((xs[u], scale * m))
                    if r is not None and r["status"] == "oom":
                        oom.append(xs[u])
                label = f"{human_size(s)} tokens" + (f" — ours ({ml})" if len(modes) > 1 else "")
                for k, p in pts.items():
                    if p:
                        row_axes[k].plot(*zip(*p, strict=False), **style, label=label)
                        drawn[k] += 1
                ooms.add(row_axes[0], oom, style)
                ooms.add(row_axes[2], oom, style)
        what = "training step" if scope == "model" else "attention block"
        labels = ["Ulysses" if u is None else f"U={u}" + (" (=C)" if u == ws else "") + (" (=H)" if u == h else "")
                  for u in variants]
        for k, ax in enumerate(row_axes):
            ax.set_xticks(range(len(variants)), labels, fontsize=8)
            ax.set_xlim(-0.5, max(len(variants), 1) - 0.5)
            ax.set_xlabel("UPipe chunk size U (heads per stage); Ulysses at the right")
            if drawn[k]:
                below(ax, ncol=2)
            else:
                note_box(ax, ("no rows of ours yet" if not len(sub) else "no rows with this figure")
                         + "\npython -m sweeps run sweeps/configs/u-ablation.yaml")
        row_axes[0].set_ylabel("throughput (tokens/s per device)")
        row_axes[1].set_ylabel("throughput / Ulysses' at the same length")
        row_axes[2].set_ylabel(f"peak memory per device ({unit})")
        if drawn[1]:
            row_axes[1].axhline(1.0, color="grey", linewidth=0.8)
        who = f"ours, {modes[0]}" if len(modes) == 1 else "ours"
        for ax, t in zip(row_axes, ("throughput", "throughput relative to Ulysses", "peak memory"), strict=False):
            ax.set_title(f"{t}: {model}, {ws} ranks, {what}\n({who})", fontsize=9.5)
    ooms.draw()
    fig.suptitle("U ablation, one line per sequence length (ours only: the paper has no U ablation numbers)")
    fig.tight_layout()
    return Plot("u_ablation", "U ablation", fig, [], ours)


# ----------------------------------------------------------------------------- memory vs length

def memory_vs_seq_series(ours: pd.DataFrame) -> pd.DataFrame:
    """The rows memory_vs_seq draws: the suite's own implementations of the paper's columns
    (``MethodFacts.reference``) and the paper's own Ulysses (the paper's code of its Ulysses
    column, yunchang's USP, but not at Ulysses degree 1, where it is the paper's Ring), so that one
    legend stays short (at most 10 colours); the other library wrappers, the paper's Ring and
    PyTorch's CP (the paper's Native PyTorch) are in max_context, memory_vs_seq's table and compare_*."""
    facts = ours["method"].map(facts_of)
    reference = facts.map(lambda f: f.reference).astype(bool)
    paper_ulysses = facts.map(lambda f: f.paper_code and f.column == "ulysses").astype(bool)
    if "opt.ulysses_degree" in ours:
        paper_ulysses &= ours["opt.ulysses_degree"] != 1
    return ours[reference | paper_ulysses]


def memory_vs_seq_plot(rows=None) -> Plot:
    """Peak memory per GPU vs sequence length per series (Table 3 setups), with the paper's
    two 128K anchors (open markers) and the H100's capacity.

    A dozen series per panel: colour = method, marker = source, line style = kernel-scratch
    model, in legends under the panels. An OOM row is drawn in the band above its panel,
    never at the memory it recorded (the demand that did not fit is not a peak that ran)."""
    rows = _rows(rows)
    anchors = load_paper("memory_anchors")
    fig, axes = new_figure(2, 1, width=6.8, height=4.6)
    enc = Encoding("kernel-scratch model (simulation)")
    ooms = OOMs()
    used = []
    for ax, setup in zip(axes[0], TABLE3_SETUPS, strict=False):
        xs_drawn = []
        for a in anchors[anchors["model"] == setup.model].itertuples():
            enc.source("paper", line=False, text="paper (128K anchors, unconfirmed)")
            ax.plot([a.seq_len], [a.peak_mem_gib], **dict(enc.style(a.method, "paper"), linestyle=""))
            xs_drawn.append(a.seq_len)
        ours = table3_rows(rows, setup)
        if len(ours):  # the paper's methods as ours, and its Ulysses as it ran it; the rest: max_context
            ours = memory_vs_seq_series(ours)
        used.append(ours)
        for _, sub in groups(ours):
            lengths = sorted(sub["seq_len"].unique())
            pts = [(s, number(lookup(sub, s), "mem_gib")) for s in lengths]
            pts = [(s, v) for s, v in pts if v is not None]
            oom = [s for s in lengths if lookup(sub, s)["status"] == "oom"]
            if not pts and not oom:  # e.g. only an error row: nothing to draw, nothing to list in a legend
                continue
            style = series_style(enc, sub)
            if pts:
                ax.plot(*zip(*pts, strict=False), **style)
            ooms.add(ax, oom, style)
            xs_drawn += [s for s, _ in pts] + oom
        capacity_line(ax)
        seq_span(ax, xs_drawn)
        ax.set_ylim(0, 100)
        ax.set_xlabel("sequence length (tokens, K = 1024)")
        ax.set_ylabel("peak memory per GPU (GiB)")
        ax.set_title(f"{setup.model}, {setup.gpus} GPUs")
        if not len(ours):
            _run_hint(ax, f"python -m sweeps run sweeps/configs/table3-{setup.model}.yaml")
    ooms.draw()
    fig.suptitle("Peak memory vs sequence length (reserved where measured, else allocated)")
    layout_with_legends(fig, enc.legend_groups(order=paper_order))
    used_df = pd.concat(used) if any(len(u) for u in used) else rows.iloc[0:0]
    return Plot("memory_vs_seq", "Peak memory vs sequence length", fig, [], used_df)
