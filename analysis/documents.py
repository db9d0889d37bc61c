"""Packed documents: throughput and per-rank imbalance by method, layout and distribution.

The paper trains on one sequence; these tables and the figure set each method, in each of its
sequence layouts, under document-length distributions (``records/workloads/data/README.md``)
beside the single sequence. Rows are selected by their fields, never by their file or notes: a
training step (scope ``model``) with the paper's levers, the setup's model, world size and kind
of device (a GPU preset for the paper-scale setups, the ``cpu`` preset for the gloo runs), and
their ``docs`` (``analysis.load``). A series is a method with its options (the layout is one) in
one mode on one device; only a series with at least one row under a distribution is shown.

Cases, one pair of columns each: the **single sequence**, then each distribution's draw
(``prolong64k:0``: the distribution and its seed). The single sequence is a row with one document
as long as the sequence (what the ``docs-*`` sweeps run, ``fixed-16M:0``): the causal mask of one
sequence through the path the distributions take, so it records each rank's work and its modelled
step waits for the slowest rank as theirs do. A series without such a row at a length takes a row
without documents there, marked ``‡``: a simulated one models rank 0's attention alone.

Cells: tokens/s per device (simulated: the step-time model's, ``bench.stackmodel.steptime``; real:
the measured median with its range, as ``table3_cpu``) and the attention work's imbalance, the
slowest rank's (query, key) pairs over the mean rank's (``figures.doc_work``,
``bench.stackmodel.docwork``; 1: balanced). The CPU table (real gloo ranks) sets that modelled
imbalance beside the measured one: the slowest rank's time in attention kernel calls over the mean
rank's (``figures.attention_imbalance``, ``bench.measure.attntime``), on the clock the row names
(``figures.attention_clock``: the CPU time of a rank's one intra-op thread; rows without it, the wall
clock), "—" where a row measured none (a library that calls its own kernels, a row from before the
measurement).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from .figures import plain_log_y
from .load import human_size, load_rows
from .select import family, family_order, fmt, has_paper_levers, is_missing, number, throughput_cell, trials
from .style import (
    MISSING,
    OOM,
    Encoding,
    Plot,
    Table,
    layout_with_legends,
    new_figure,
    note_box,
    ours_bar_style,
)

SINGLE = "single sequence"  # the case's name in the tables' columns and the figure's groups
ROW_WITHOUT_DOCS = "‡"  # a single-sequence cell from a row without documents (module docstring)


@dataclass(frozen=True)
class DocsSetup:
    """Which rows one documents table draws, and how they are made."""

    name: str  # output file stem
    title: str
    model: str | None  # None: any model (the CPU-scale runs' small models)
    world_size: int | None  # None: any
    cpu: bool  # the ``cpu`` device preset (real gloo ranks), else a GPU preset
    sweeps: tuple[str, ...]  # the specs that make the rows (the "no rows yet" note)

    def setup_name(self, model: str, world_size: int) -> str:
        return f"{model}, {world_size} {'ranks' if self.cpu else 'GPUs'}"


DOCS_LLAMA = DocsSetup("docs_llama3-8b", "Packed documents — tokens/s per GPU and imbalance, llama3-8b, 8 GPUs",
                       "llama3-8b", 8, False, ("docs-llama3-8b",))
DOCS_QWEN = DocsSetup("docs_qwen3-32b", "Packed documents — tokens/s per GPU and imbalance, qwen3-32b, 16 GPUs",
                      "qwen3-32b", 16, False, ("docs-qwen3-32b",))
DOCS_CPU = DocsSetup("docs_cpu", "Packed documents on CPU — tokens/s per rank and imbalance (ours)", None, None, True,
                     ("docs-llama3-8b-cpu", "docs-qwen3-32b-cpu"))
SERIES = ["model", "world_size", "label", "mode_label"]
# the order of a family's series by layout: head-parallel, then the ring layouts from the least balanced
# under a causal mask to the most (``methods.core.seqlayout``); another layout after them
LAYOUT_ORDER = ("heads", "contiguous", "zigzag", "doc-zigzag")


def _all_rows(rows) -> pd.DataFrame:
    """Every row, documents or not (the paper's tables take one sequence: ``tables._rows``)."""
    if rows is None:
        return load_rows(quiet=True)
    if isinstance(rows, (str, Path)):
        return load_rows(rows, quiet=True)
    return rows


def case_of(row: pd.Series) -> str:
    """The case a row belongs to: ``SINGLE`` for one sequence (no documents, or one document as
    long as the sequence), else its documents' label."""
    docs = row.get("docs")
    if is_missing(docs):
        return SINGLE
    count = row.get("docs.count")
    return SINGLE if not is_missing(count) and int(count) == 1 else str(docs)


def docs_rows(rows, setup: DocsSetup) -> pd.DataFrame:
    """The setup's rows (module docstring), with ``case`` (``case_of``) and ``has_docs`` (the row
    has documents, the single sequence's one document included)."""
    t = trials(_all_rows(rows), scope="model")
    if not len(t):
        return t.assign(case=pd.Series(dtype=object), has_docs=pd.Series(dtype=bool))
    t = t[(t["device"] == "cpu") == setup.cpu]
    if setup.model is not None:
        t = t[t["model"] == setup.model]
    if setup.world_size is not None:
        t = t[t["world_size"] == setup.world_size]
    t = t[~t["search_probe"].astype(bool)] if len(t) else t
    t = t[has_paper_levers(t)] if len(t) else t
    if not len(t):
        return t.assign(case=pd.Series(dtype=object), has_docs=pd.Series(dtype=bool))
    t = t.assign(case=t.apply(case_of, axis=1), has_docs=t["docs"].notna())
    distributed = t[t["case"] != SINGLE].groupby(SERIES, dropna=False).size()
    keep = [tuple(k) in distributed.index for k in t[SERIES].itertuples(index=False)]
    return t[pd.Series(keep, index=t.index, dtype=bool)]


def cases(ours: pd.DataFrame) -> list[str]:
    """``SINGLE`` first, then the distributions' labels in order."""
    found = sorted(set(ours["case"]) - {SINGLE}) if len(ours) else []
    return [SINGLE] + found


def pick(sub: pd.DataFrame, case: str, seq_len: int) -> pd.Series | None:
    """A series' row of one case at one length (the newest); for the single sequence the row with
    one document, else one without documents (``ROW_WITHOUT_DOCS``)."""
    hit = sub[(sub["case"] == case) & (sub["seq_len"] == seq_len)]
    if case == SINGLE and len(hit) and hit["has_docs"].any():
        hit = hit[hit["has_docs"]]
    if not len(hit):
        return None
    return hit.sort_values("time", kind="stable").iloc[-1]


def throughput(row: pd.Series | None, real: bool) -> str:
    """Tokens/s per device: the model's (simulated) or the measured median and range (real), with
    ``ROW_WITHOUT_DOCS`` on a single-sequence cell from a row without documents."""
    if row is None:
        return MISSING
    text = throughput_cell(row) if real else _value(row, "tokens_per_s_per_device", 2)
    return text + (ROW_WITHOUT_DOCS if not row["has_docs"] and text not in (MISSING, OOM, "error") else "")


def imbalance(row: pd.Series | None, column: str = "doc_work.imbalance") -> str:
    """The row's attention imbalance (slowest rank over the mean), "—" where it records none: the modelled
    one (counted pairs, ``doc_work.imbalance``) or, with ``column="attention_imbalance"``, the measured one."""
    if row is None or row["status"] == "error":
        return MISSING if row is None else "error"
    return fmt(row.get(column), 3)


def _value(row: pd.Series, metric: str, digits: int) -> str:
    if row["status"] == "oom":
        return OOM
    if row["status"] == "error":
        return "error"
    return fmt(row.get(metric), digits)


def layout_of(sub: pd.DataFrame) -> str:
    """The series' layout as its rows record it (``doc_work.layout``: ``heads`` for a head-parallel
    method), else its ``layout`` option."""
    for col in ("doc_work.layout", "opt.layout"):
        if col in sub and sub[col].notna().any():
            return str(sub[col].dropna().iloc[0])
    return MISSING


def series_of(ours: pd.DataFrame) -> list[tuple[tuple, pd.DataFrame]]:
    """(model, world size, label, mode label) and its rows, in the paper's family order, then by layout
    (``LAYOUT_ORDER``), then by label."""
    if not len(ours):
        return []

    def order(kv):
        layout = layout_of(kv[1])
        rank = LAYOUT_ORDER.index(layout) if layout in LAYOUT_ORDER else len(LAYOUT_ORDER)
        return kv[0][0], kv[0][1], family_order(family(kv[1]["method"].iloc[0])), rank, kv[0][2], kv[0][3]

    return sorted(ours.groupby(SERIES, sort=False, dropna=False), key=order)


def draws(ours: pd.DataFrame) -> list[str]:
    """One line per distribution: its draw at each length (documents, longest, mean), from the rows."""
    out = []
    docs = ours[ours["case"] != SINGLE] if len(ours) else ours
    for label in sorted(set(docs["case"])) if len(docs) else []:
        sub = docs[docs["case"] == label].drop_duplicates("seq_len").sort_values("seq_len")
        parts = [f"{human_size(r['seq_len'])}: {int(r['docs.count'])} documents, longest {int(r['docs.max'])}, "
                 f"mean {float(r['docs.mean']):.0f} tokens" for _, r in sub.iterrows()]
        out.append(f"`{label}`: " + "; ".join(parts))
    return out


def docs_table(rows=None, setup: DocsSetup = DOCS_LLAMA) -> Table:
    """Per length and series: tokens/s per device and imbalance under each case, the single
    sequence first (module docstring)."""
    ours = docs_rows(rows, setup)
    columns = cases(ours)
    cols = ["Setup", "Length", "Method", "Layout", "Mode, device"]
    for case in columns:  # the CPU rows' measured imbalance beside the modelled one
        cols += ([f"{case}: tokens/s", f"{case}: max/mean modelled", f"{case}: max/mean measured"] if setup.cpu
                 else [f"{case}: tokens/s", f"{case}: max/mean"])
    out = []
    series = series_of(ours)
    for seq_len in sorted(set(ours["seq_len"])) if len(ours) else []:
        for (model, ws, label, mode_label), sub in series:
            if not (sub["seq_len"] == seq_len).any():
                continue
            line = [setup.setup_name(model, int(ws)), human_size(seq_len), label, layout_of(sub), mode_label]
            for case in columns:
                row = pick(sub, case, seq_len)
                line += [throughput(row, real=setup.cpu), imbalance(row)]
                if setup.cpu:
                    line.append(imbalance(row, "attention_imbalance"))
            out.append(line)
    unit = "rank" if setup.cpu else "GPU"
    notes = [f"Tokens/s per {unit} and the attention's imbalance (max/mean: the slowest rank's causal "
             "(query, key) pairs within documents over the mean rank's, `figures.doc_work`; 1 = balanced), by "
             "method, layout (`heads`: head-parallel, every rank attends the whole sequence for its heads) and "
             "packed documents, full training step with the paper's levers.",
             f"{SINGLE}: one document as long as the sequence (the causal mask of one sequence, through the path "
             "the distributions take, so the per-rank work is recorded and the step waits for the slowest rank); "
             f"{ROW_WITHOUT_DOCS}: a row without documents (simulated: rank 0's attention alone, no imbalance "
             "recorded)."]
    if setup.cpu:
        notes.append("max/mean modelled: the counted pairs' ratio above; max/mean measured: the slowest rank's time "
                     "in attention kernel calls (forward, recomputation and backward, the median over the timed "
                     "steps) over the mean rank's (`figures.attention_imbalance`, `bench.measure.attntime`), on the "
                     "row's `figures.attention_clock` (`thread`: the CPU time of the rank's one intra-op thread; rows "
                     f"without it: the wall clock); {MISSING} where the row measured none (a library that calls its "
                     "own kernels).")
        notes.append("Measured on gloo ranks: `median [min–max]` over the timed steps, † where the host ran "
                     "other work (as table3_cpu.md); CPU numbers say nothing about GPU throughput.")
    else:
        notes.append("Simulated: the step-time model's throughput (`bench.stackmodel.steptime`), the step the "
                     "slowest rank's (its own counts where it was simulated, else the worst rank's with the "
                     "attention carried by pairs; the row's notes say which), each varlen call at the rate measured "
                     "for its documents' lengths and heads per call (`bench.stackmodel.varlenrate`). Tokens count "
                     "once per device whatever the documents, so a draw of short documents (fewer causal pairs) "
                     "runs faster than one sequence.")
    notes += ["Each distribution is one seeded draw per length (`records/workloads/data/README.md`): " + d
              for d in draws(ours)]
    if not len(ours):
        notes.append("No rows of ours yet: " + "; ".join(f"`python -m sweeps run sweeps/configs/{s}.yaml "
                                                         "--executor local`" for s in setup.sweeps) + ".")
    return Table(setup.name, setup.title, pd.DataFrame(out, columns=cols), notes, ours)


def docs_plot(rows=None, setup: DocsSetup = DOCS_LLAMA) -> Plot:
    """Bars per case (the single sequence first, then each distribution), one per series (colour:
    the method and its options); top row tokens/s per device (log scale), bottom row the imbalance,
    one column per length. An OOM writes "OOM" in its slot; a missing row leaves it empty."""
    ours = docs_rows(rows, setup)
    lengths = sorted(set(ours["seq_len"])) if len(ours) else [0]
    fig, axes = new_figure(len(lengths), 2, width=6.4, height=3.3)
    enc = Encoding()
    columns = cases(ours)
    series = series_of(ours)
    modes = sorted(ours["mode_label"].unique()) if len(ours) else []
    width = 0.8 / max(len(series), 1)
    for k, seq_len in enumerate(lengths):
        top, bottom = axes[0][k], axes[1][k]
        for j, ((_, _, label, mode_label), sub) in enumerate(series):
            key = label if len(modes) < 2 else f"{label}, {mode_label}"
            style = ours_bar_style(enc.color(key, sub["method"].iloc[0]))
            for i, case in enumerate(columns):
                x = i - 0.4 + width * (j + 0.5)
                row = pick(sub, case, seq_len)
                value = number(row, "tokens_per_s_per_device")
                if value is not None:
                    top.bar(x, value, width=width, **style)
                elif row is not None and row["status"] in ("oom", "error"):
                    top.text(x, 0.02, OOM if row["status"] == "oom" else "error", rotation=90, ha="center",
                             va="bottom", fontsize=6.5, transform=top.get_xaxis_transform())
                ratio = None if row is None or row["status"] == "error" else row.get("doc_work.imbalance")
                if not is_missing(ratio):
                    bottom.bar(x, float(ratio), width=width, **style)
        for ax in (top, bottom):
            ax.set_xticks(np.arange(len(columns)), columns, fontsize=8)
            ax.set_xlim(-0.5, len(columns) - 0.5)
        top.set_yscale("log")
        plain_log_y(top)
        top.set_ylabel(f"tokens/s per {'rank' if setup.cpu else 'GPU'}")
        bottom.axhline(1.0, color="#444444", linewidth=0.8, linestyle=":")
        bottom.set_ylim(bottom=0)
        bottom.set_ylabel("attention imbalance (max/mean)")
        where = f"{human_size(seq_len)} tokens" if seq_len else ""
        top.set_title(f"{setup.title.split(' — ')[0]}: {where}", fontsize=10)
        bottom.set_title(f"slowest rank's attention over the mean, {where}", fontsize=10)
        if not len(ours):
            note_box(top, "no rows of ours yet\n" + "\n".join(f"python -m sweeps run sweeps/configs/{s}.yaml"
                                                             for s in setup.sweeps))
    model = f"{setup.model}, {setup.world_size} {'ranks' if setup.cpu else 'GPUs'}" if setup.model else "ours"
    fig.suptitle(f"Packed documents: {model}, by method and distribution ({SINGLE} first)")
    groups = enc.legend_groups()[:1]
    source = modes[0] if len(modes) == 1 else "several modes (in the method legend)"
    groups.append(("source", [Patch(**ours_bar_style("grey"), label=f"ours: {source}")]))
    layout_with_legends(fig, groups)
    notes = [f"{SINGLE}: one document as long as the sequence (analysis.documents)."]
    return Plot(setup.name, f"{setup.title}, as bars", fig, notes, ours)
