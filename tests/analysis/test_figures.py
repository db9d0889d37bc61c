"""Figures a reader can use: nothing overprints another panel, an OOM is never drawn at a
value, legends stay short, and the max-context figure gives one answer per series with its
search step. Checked on the artists of each ``Plot.fig`` (positions after a draw, the data
of lines), never on pixels."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from analysis import figures
from analysis.load import load_rows
from analysis.style import Encoding
from tests.rowfactory import PAPER_LEVERS, K, M, make_row, write

REPO = Path(__file__).resolve().parents[2]
BUILDERS = (figures.table3_plot, figures.max_context_plot, figures.fig1_plot, figures.fig5_plot,
            figures.attn_memory_plot, figures.u_ablation_plot, figures.memory_vs_seq_plot)
MAX_LEGEND_ENTRIES = 10
OOM_PEAK = 91.5  # a simulated OOM records the demand that did not fit: a value no panel may show
FA3 = dict(PAPER_LEVERS, kernel_workspace="fa3")
CROWDED_METHODS = ("ring", "ulysses", "usp", "fpdt", "upipe", "usp-upipe")


def crowded_rows() -> list:
    """The Table 3 setup with 18 series (6 methods; simulated with and without a kernel-scratch
    model, and real), each fitting up to a length and out of memory above it; an attention
    block and a U ablation with OOMs too. No series fits 4M or 5M."""
    rows = []
    for i, method in enumerate(CROWDED_METHODS):
        last = 2 * M if method == "ring" else 3 * M
        for mode, levers in (("simulated", None), ("simulated", FA3), ("real", None)):
            for s in (1 * M, 2 * M, 3 * M, 4 * M, 5 * M):
                if s > last:  # a real OOM records nothing, a simulated one the demand that did not fit
                    rows.append(make_row(method, seq_len=s, mode=mode, status="oom", levers=levers,
                                         peak_gib=OOM_PEAK if mode == "simulated" else None))
                elif mode == "real":
                    rows.append(make_row(method, seq_len=s, tps=900.0 / (s // M) - i, reserved_gib=20.0 * s / M + i))
                else:
                    rows.append(make_row(method, seq_len=s, mode=mode, levers=levers,
                                         peak_gib=18.0 * s / M + i + (2 if levers else 0)))
    for m, o, s, status in (("ulysses", {}, 1 * M, "ok"), ("upipe", {}, 1 * M, "ok"), ("ulysses", {}, 4 * M, "oom"),
                            ("upipe", {}, 4 * M, "ok")):
        rows.append(make_row(m, seq_len=s, mode="simulated", scope="attention", options=o, status=status,
                             peak_gib=OOM_PEAK if status == "oom" else 3.0 * s / M,
                             by_category={"parameter": 0.125}))
    for o, s, status in (({}, 128 * K, "ok"), ({"chunk_heads": 8}, 128 * K, "ok"), ({}, 256 * K, "oom"),
                         ({"chunk_heads": 8}, 256 * K, "ok")):
        rows.append(make_row("upipe" if o else "ulysses", world_size=4, seq_len=s, options=o, status=status,
                             tps=3000.0 if status == "ok" else None, reserved_gib=17.0 if status == "ok" else None))
    return rows


def _load(tmp_path, rows, name="rows.jsonl"):
    write(tmp_path / "results" / name, rows)
    return load_rows(tmp_path / "results", quiet=True)


@pytest.fixture(scope="module")
def committed():
    return load_rows(REPO / "results", quiet=True)


@pytest.fixture(scope="module")
def crowded(tmp_path_factory):
    return _load(tmp_path_factory.mktemp("crowded"), crowded_rows())


@pytest.fixture(scope="module")
def plots(crowded, committed):
    """``plots(data)``: every figure of ``BUILDERS`` on the crowded or the committed rows, by its
    builder, built once for the module and closed at its end. Building them is most of a figure
    test's time (on the committed rows most of all), and the tests only read them: the overprint
    check draws a figure, which lays it out but changes no artist's data or text."""
    rows = {"crowded": crowded, "committed": committed}
    built: dict[str, dict] = {}

    def get(data: str) -> dict:
        if data not in built:
            built[data] = {build: build(rows[data]) for build in BUILDERS}
        return built[data]

    yield get
    for by_builder in built.values():
        for plot in by_builder.values():
            plot.close()


# ----------------------------------------------------------------------------- helpers

def _panels(fig) -> list[list]:
    """The figure's axes grouped into panels: axes whose frames overlap or touch (a twin
    axis, an OOM band on its panel) belong to one panel."""
    axes = list(fig.axes)
    boxes = [ax.get_position() for ax in axes]
    group = list(range(len(axes)))

    def root(i):
        while group[i] != i:
            i = group[i]
        return i

    eps = 0.002
    for i, j in itertools.combinations(range(len(axes)), 2):
        a, b = boxes[i], boxes[j]
        if a.x0 - eps < b.x1 and b.x0 - eps < a.x1 and a.y0 - eps < b.y1 and b.y0 - eps < a.y1:
            group[root(i)] = root(j)
    out: dict[int, list] = {}
    for i, ax in enumerate(axes):
        out.setdefault(root(i), []).append(ax)
    return list(out.values())


def _bands(ax) -> list:
    return [c for c in ax.child_axes if c.get_label() == "OOM band"]


def _points(ax) -> list[tuple[float, float]]:
    """(x, y) data of every line drawn in ``ax`` (lines spanning the axes, e.g. axhline, excluded)."""
    out = []
    for line in ax.get_lines():
        if line.get_transform() != ax.transData:
            continue
        out += [(float(x), float(y)) for x, y in zip(line.get_xdata(), line.get_ydata(), strict=False)]
    return out


def _overprints(fig) -> list[str]:
    """Every way one part of the figure prints over another a reader would see."""
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    faults = []
    panels = _panels(fig)
    boxes = [[ax.get_tightbbox(r) for ax in panel] for panel in panels]
    for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
        if any(x.overlaps(y) for x in a for y in b):
            faults.append(f"panels {panels[i][0].get_title()!r} and {panels[j][0].get_title()!r} overlap")
    outside = [("suptitle", fig._suptitle)] if fig._suptitle is not None else []
    outside += [(f"figure legend {leg.get_title().get_text()!r}", leg) for leg in fig.legends]
    for name, artist in outside:
        box = artist.get_window_extent(r)
        for panel, pboxes in zip(panels, boxes, strict=False):
            if any(box.overlaps(p) for p in pboxes):
                faults.append(f"{name} overlaps panel {panel[0].get_title()!r}")
    for (n1, a1), (n2, a2) in itertools.combinations(outside, 2):
        if a1.get_window_extent(r).overlaps(a2.get_window_extent(r)):
            faults.append(f"{n1} overlaps {n2}")
    for ax in list(fig.axes) + [b for panel in fig.axes for b in _bands(panel)]:
        frame = ax.get_window_extent(r).padded(1)
        for x, y in _points(ax):
            px, py = ax.transData.transform((x, y))
            if np.isfinite(px) and np.isfinite(py) and not frame.contains(px, py):
                faults.append(f"point ({x:g}, {y:g}) lies outside its panel {ax.get_title()!r}")
        for coll in ax.collections:  # markers placed by offsets (scatter), clipped or not
            for px, py in coll.get_offset_transform().transform(np.asarray(coll.get_offsets(), dtype=float)):
                if np.isfinite(px) and np.isfinite(py) and not frame.contains(px, py):
                    faults.append(f"a marker lies outside its panel {ax.get_title()!r}")
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t for t in axis.get_ticklabels() if t.get_visible() and t.get_text()]
            extents = sorted((t.get_window_extent(r) for t in labels), key=lambda b: (b.x0, b.y0))
            for b1, b2 in zip(extents, extents[1:], strict=False):
                if b1.overlaps(b2):
                    faults.append(f"tick labels overlap on {ax.get_title()!r}")
    return faults


def _legends(fig) -> list:
    return list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]


# ----------------------------------------------------------------------------- every figure

@pytest.mark.parametrize("data", ["none", "standard", "crowded", "committed"])
def test_no_figure_prints_over_another_panel(data, tmp_path, results_dir, plots):
    """Panels, their labels and OOM bands, the suptitle and figure legends never overlap; no
    line point lies outside its panel (the old OOM crosses sat on the next panel's label);
    tick labels of one axis stay apart."""
    faults = {}
    if data in ("crowded", "committed"):  # the module's figures, shared with the tests below
        for plot in plots(data).values():
            found = _overprints(plot.fig)
            if found:
                faults[plot.name] = found
        assert not faults, faults
        return
    rows = load_rows(tmp_path / "empty" if data == "none" else results_dir, quiet=True)
    for build in BUILDERS:
        plot = build(rows)
        try:
            found = _overprints(plot.fig)
            if found:
                faults[plot.name] = found
        finally:
            plot.close()
    assert not faults, faults


@pytest.mark.parametrize("data", ["crowded", "committed"])
def test_legends_are_short(data, plots):
    """No legend lists more than a reader can scan: many series are told apart by colour
    (method), marker (source) and line style (variant), each in its own short legend."""
    for plot in plots(data).values():
        for legend in _legends(plot.fig):
            assert len(legend.get_texts()) <= MAX_LEGEND_ENTRIES, (plot.name, [t.get_text() for t in
                                                                                legend.get_texts()])


def test_memory_vs_seq_factors_its_series_into_three_small_legends(plots):
    plot = plots("crowded")[figures.memory_vs_seq_plot]
    legends = {leg.get_title().get_text(): [t.get_text() for t in leg.get_texts()] for leg in plot.fig.legends}
    assert set(legends) == {"colour: method", "marker: source", "line: kernel-scratch model (simulation)"}
    assert len(legends["colour: method"]) == len(CROWDED_METHODS)
    assert sorted(legends["marker: source"]) == ["ours: real, NVIDIA H100 80GB HBM3",
                                                 "ours: simulated, h100-80g, lean stack",
                                                 "paper (128K anchors, unconfirmed)"]
    drawn = [line for line in plot.fig.axes[0].get_lines() if line.get_transform() == plot.fig.axes[0].transData]
    assert len(drawn) > sum(len(v) for v in legends.values())  # 18 series and an anchor, 11 entries
    styles = {(line.get_color(), line.get_marker(), str(line.get_linestyle())) for line in drawn}
    assert len(styles) == len(drawn)  # yet every series looks different


# ----------------------------------------------------------------------------- OOM

def _oom_check(ax, oom_lengths: set[float], n_series: int, nothing_fits: set[float]) -> None:
    """OOM lengths are in the band above ``ax`` (one row per series), never on its value axis:
    no point at a length where no series fits, none at an OOM's recorded demand."""
    points = _points(ax)
    assert points, "the panel draws the rows that fit"
    assert not [p for p in points if p[0] in nothing_fits], "an OOM length is drawn at a value"
    assert not [p for p in points if abs(p[1] - OOM_PEAK) < 1e-6], "an OOM's recorded demand is drawn"
    (band,) = _bands(ax)
    assert band.get_ylabel() == "OOM"
    band_points = _points(band)
    assert {x for x, _ in band_points} == oom_lengths
    assert len({y for _, y in band_points}) == n_series  # a row per series: none hides another


def test_memory_vs_seq_draws_oom_in_a_band_not_at_a_memory_value(plots):
    plot = plots("crowded")[figures.memory_vs_seq_plot]
    _oom_check(plot.fig.axes[0], {3.0 * M, 4.0 * M, 5.0 * M}, 3 * len(CROWDED_METHODS), {4.0 * M, 5.0 * M})
    assert not _bands(plot.fig.axes[1])  # no OOM rows of ours on 16 GPUs: no band


def test_table3_draws_oom_in_a_band_not_at_the_axis_floor(plots):
    ax = plots("crowded")[figures.table3_plot].fig.axes[0]
    # the paper's OOMs (2M: Native PyTorch; 4M: Ring, Ulysses) and our real series' (3M-5M)
    _oom_check(ax, {2.0 * M, 3.0 * M, 4.0 * M, 5.0 * M}, 3 + len(CROWDED_METHODS), set())
    floor = ax.get_ylim()[0]
    assert all(y > floor for _, y in _points(ax))


def test_attention_and_u_ablation_draw_oom_in_bands(plots):
    top = plots("crowded")[figures.attn_memory_plot].fig.axes[0]
    (band,) = _bands(top)
    assert {x for x, _ in _points(band)} == {4.0 * M}
    assert (4.0 * M, 12.0) in _points(top)  # UPipe fits 4M
    assert not [p for p in _points(top) if abs(p[1] - OOM_PEAK) < 1e-6]
    throughput, _, memory = plots("crowded")[figures.u_ablation_plot].fig.axes[:3]
    for ax in (throughput, memory):
        (band,) = _bands(ax)
        assert len(_points(band)) == 1  # Ulysses at 256K
        x_oom = _points(band)[0][0]
        lines = [line for line in ax.get_lines() if line.get_label().startswith("256K")]
        assert lines and all(x_oom not in line.get_xdata() for line in lines)


# ----------------------------------------------------------------------------- max context

def _search(method, found, step, time="2026-11-20T00:00:00+00:00", mode="simulated", **kw):
    return make_row(method, seq_len=16 * M, mode=mode, kind="max_context", max_context=found, time=time,
                    search={"granularity": step, "step": step, "max_seq_len": 16 * M, "start": step}, **kw)


def _panel(plot, title_start: str):
    (ax,) = [ax for ax in plot.fig.axes if ax.get_title().startswith(title_start)]
    return ax, [t.get_text() for t in ax.get_yticklabels()], {t.get_position()[1]: t.get_text() for t in ax.texts}


def test_max_context_gives_one_answer_per_method_and_series(tmp_path):
    rows = [
        # two searches of one series: the finer (128K) answers, though the 1M one is newer
        _search("upipe", 5 * M + 256 * K, 128 * K, time="2026-11-20T00:00:00+00:00"),
        _search("upipe", 5 * M, 1 * M, time="2026-11-22T00:00:00+00:00"),
        # a search that fit nothing at its 1M step, and runs of the same series that fit 896K
        _search("ulysses", 0, 1 * M),
        make_row("ulysses", seq_len=896 * K, mode="simulated", peak_gib=70.0),
        make_row("ulysses", seq_len=1 * M, mode="simulated", status="oom", peak_gib=OOM_PEAK),
        # runs only, no search
        make_row("ring", seq_len=128 * K, tps=2000.0, reserved_gib=30.0),
        make_row("ring", seq_len=256 * K, status="oom"),
    ]
    plot = figures.max_context_plot(_load(tmp_path, rows))
    try:
        ax, labels, texts = _panel(plot, "llama3-8b, 8 GPUs")
        assert len(labels) == len(set(labels))  # one bar per method and series
        ours = [t for t in labels if "— ours" in t]
        assert sorted(ours) == ["ring — ours (real, NVIDIA H100 80GB HBM3)",
                                "ulysses — ours (simulated, h100-80g, lean stack)",
                                "upipe — ours (simulated, h100-80g, lean stack)"]
        assert len([t for t in labels if t.endswith("— paper")]) == 5
        by_label = {label: texts[y] for label, y in zip(labels, ax.get_yticks(), strict=False)}
        assert by_label["upipe — ours (simulated, h100-80g, lean stack)"].startswith("5.25M")  # the finest search
        assert "step 128K" in by_label["upipe — ours (simulated, h100-80g, lean stack)"]
        assert by_label["ulysses — ours (simulated, h100-80g, lean stack)"].startswith("< 1M")
        assert "step 1M" in by_label["ulysses — ours (simulated, h100-80g, lean stack)"]
        assert not [t for t in texts.values() if "896K" in t]  # the search answers; no longest run beside it
        assert "longest run" in by_label["ring — ours (real, NVIDIA H100 80GB HBM3)"]
        bars = [p for p in ax.patches if p.get_width() > 0]
        assert len(bars) == len(labels) - 1  # every answer has a bar but "nothing fits"
    finally:
        plot.close()


def test_max_context_states_a_shared_search_step_once_in_the_panel(tmp_path):
    rows = [_search("upipe", 5 * M + 256 * K, 128 * K), _search("ulysses", 4 * M, 128 * K)]
    plot = figures.max_context_plot(_load(tmp_path, rows))
    try:
        ax, labels, texts = _panel(plot, "llama3-8b, 8 GPUs")
        assert "step 128K" in ax.get_title()
        assert sorted(t for t in labels if "ours" in t) == ["ulysses — ours", "upipe — ours"]
        assert {"5.25M", "4M"} <= set(texts.values())
    finally:
        plot.close()


# ----------------------------------------------------------------------------- encoding

def test_encoding_tells_methods_of_one_family_apart_and_keeps_dashes_for_the_paper():
    enc = Encoding()
    assert enc.color("ulysses") != enc.color("usp") != enc.color("usp[ulysses_degree=8]")
    assert enc.color("ulysses") == enc.color("ulysses")  # stable within a figure
    styles = [enc.style("ring", "simulated, h100-80g, lean stack", v)["linestyle"]
              for v in ("", "fa3 scratch", "x", "y", "z")]
    assert "--" not in styles and enc.style("ring", "paper")["linestyle"] == "--"
    assert enc.style("ring", "paper")["markerfacecolor"] == "white"
    assert enc.source("simulated, h100-80g, lean stack")[0] != enc.source("real, NVIDIA H100 80GB HBM3")[0]
