"""Which of our rows belong to which paper table, and how a row becomes a table cell.

The paper's setups (docs/paper.md, section "Setups") are fixed here once: the Table 3 shapes and GPU
counts and the "paper levers" (FSDP, activation checkpointing offloaded to host, tiled MLP,
chunked loss). How our methods map onto the paper's columns is each method's own declaration
(``records.facts.MethodFacts``, read from the committed table: ``facts_of``): on 16 GPUs the
paper's "Ulysses" and "UPipe" are the 8 Ulysses x 2 Ring mesh, our ``mesh`` methods.
Rows are selected by what they are (method, model, world size, scope, levers), not by the file
they came from or their notes, so a row written by ``python -m bench`` by hand counts as much as
a sweep's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from records.facts import TABLE3_COLUMNS, facts_of
from records.schema import MIN_TIMED_STEPS

from .style import MISSING, OOM

K, M = 2**10, 2**20
PAPER_LENGTHS = [128 * K, 256 * K, 512 * K, 1 * M, 2 * M, 3 * M, 4 * M, 5 * M]
PAPER_METHODS = list(TABLE3_COLUMNS)  # Table 3's row order
PAPER_DEVICE = "h100-80g"
PAPER_LEVERS = {"fsdp": True, "ac": True, "ac_offload": True, "tiled_mlp": True, "chunked_loss": True}


@dataclass(frozen=True)
class Setup:
    """One half of Table 3: a model on a GPU count."""

    model: str
    gpus: int

    @property
    def title(self) -> str:
        return f"{self.model}, {self.gpus} GPUs"


TABLE3_SETUPS = (Setup("llama3-8b", 8), Setup("qwen3-32b", 16))


def preferred(sub: pd.DataFrame) -> pd.Series:
    """The row a one-bar figure draws of several: the paper's implementation (``MethodFacts.paper_code``:
    the code the paper ran for its column, docs/paper.md, "Baselines and the implementations the paper
    ran") if present, then the newest."""
    key = sub["method"].map(lambda m: facts_of(m).paper_code).astype(int)
    return sub.assign(_paper=key).sort_values(["_paper", "time"], kind="stable").iloc[-1].drop("_paper")


def family(method: str, world_size: int | None = None) -> str:
    """The paper column a method belongs to (``MethodFacts.column``; a method of none: its own
    name). On more than one node (world size > 8) the paper's Ulysses/UPipe are the Ulysses x
    Ring mesh (``usp``/``usp-upipe``); Fig. 5 calls the former ``usp``."""
    return facts_of(method).column or method


def family_order(name: str) -> tuple[int, str]:
    return (PAPER_METHODS.index(name), "") if name in PAPER_METHODS else (len(PAPER_METHODS), name)


# ----------------------------------------------------------------------------- levers

def levers_of(row: pd.Series) -> dict[str, Any]:
    """The row's training-step levers as booleans (``ac: offload`` style strings normalised)."""
    out = {}
    for col, value in row.items():
        if isinstance(col, str) and col.startswith("lever."):
            out[col[len("lever."):]] = value
    ac = out.get("ac")
    if isinstance(ac, str):
        out["ac_offload"] = ac == "offload"
        out["ac"] = ac in ("full", "offload")
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def paper_levers(method: str) -> dict[str, bool]:
    """The levers the paper ran ``method`` with: PAPER_LEVERS, updated by the method's
    ``MethodFacts.levers`` (Native PyTorch had no tiled MLP or norms: docs/paper.md, "Baselines
    and the implementations the paper ran"; ``bench.stackmodel.fidelity.implementation`` runs the same)."""
    return {**PAPER_LEVERS, **facts_of(method).levers}


def has_paper_levers(df: pd.DataFrame) -> pd.Series:
    """Rows trained with every lever the paper ran their method with (``paper_levers``)."""
    if not len(df):
        return pd.Series([], dtype=bool, index=df.index)
    # only the columns levers_of reads (rows of every column are many times slower to build)
    narrow = df[[c for c in df.columns if isinstance(c, str) and c.startswith("lever.")] + ["method"]]
    return narrow.apply(lambda r: all(bool(levers_of(r).get(k)) == v for k, v in paper_levers(r["method"]).items()),
                        axis=1).astype(bool)


def option(row: pd.Series, name: str) -> Any:
    """One method option of a row (None when the row does not set it)."""
    opts = row.get("options_dict")
    value = opts.get(name) if isinstance(opts, dict) else row.get(f"opt.{name}")
    return None if is_missing(value) else value


def over_all_ranks(row: pd.Series) -> bool:
    """A row that runs its method's algorithm over all its ranks, no ring beside it: a method
    without a mesh (``MethodFacts.mesh``), or a mesh method at ``ulysses_degree`` = world size."""
    if not facts_of(row["method"]).mesh:
        return True
    degree = option(row, "ulysses_degree")
    return degree is not None and int(degree) == int(row["world_size"])


def pure_ulysses(row: pd.Series) -> bool:
    """A row of the paper's Ulysses column run as Ulysses over all its ranks (no ring: a USP-style
    method at ``ulysses_degree`` = world size; yunchang's USP at degree 1 is the paper's Ring)."""
    return family(row["method"]) == "ulysses" and over_all_ranks(row)


def fig1_config(row: pd.Series) -> str | None:
    """Which bar of Fig. 1 a row is: fsdp, fsdp+ulysses, +ac, +ao, alst, upipe (or None).

    The ladder's levers (bench.stackmodel.fidelity.FIG1_RUNGS): every bar has FSDP; ``fsdp`` splits no
    sequence (a method of the FSDP column, ``no-cp``) and has no other lever; the Ulysses bars
    (any implementation of the paper's Ulysses column over all ranks, ``pure_ulysses``) add AC,
    then its offload, then tiled MLP and chunked loss (ALST); UPipe (an implementation of its
    column over all ranks) has every lever."""
    lv = levers_of(row)
    if not lv.get("fsdp"):
        return None
    full = lv.get("ac") and lv.get("ac_offload") and lv.get("tiled_mlp") and lv.get("chunked_loss")
    bare = not lv.get("tiled_mlp") and not lv.get("chunked_loss")
    column = family(row["method"])
    if column == "upipe" and over_all_ranks(row):
        return "upipe" if full else None
    if column == "fsdp":
        return "fsdp" if bare and not lv.get("ac") else None
    if not pure_ulysses(row):
        return None
    if full:
        return "alst"
    if not bare:
        return None
    if not lv.get("ac"):
        return "fsdp+ulysses"
    return "+ao" if lv.get("ac_offload") else "+ac"


# ----------------------------------------------------------------------------- selection

ONE_SEQUENCE = None  # the ``docs`` of a row without packed documents (``analysis.load``)


def docs_choice(text: str | None) -> str | None:
    """A packed-documents filter as given (``none``, ``NAME`` or ``NAME:SEED``) as the rows label it:
    None for one sequence, else ``NAME:SEED`` (seed 0 when left out). ``ValueError`` (one line, the
    allowed names) for an unknown distribution or a bad seed."""
    if text is None or str(text).strip() in ("", "none"):
        return ONE_SEQUENCE
    from records.workloads import DocsSpec

    return DocsSpec.parse(str(text).strip()).label


def with_docs(df: pd.DataFrame, docs: str | None = ONE_SEQUENCE) -> pd.DataFrame:
    """The rows of one packed-documents case, by the rows' ``docs`` label: ``None`` (the default)
    those of one sequence, without documents; ``prolong64k:0`` those with that draw. Every table
    and figure of the paper draws one sequence, as the paper ran; the documents' own tables
    (``analysis.documents``) take every case."""
    if not len(df) or "docs" not in df:
        return df if docs is ONE_SEQUENCE else df.iloc[0:0]
    return df[df["docs"].isna()] if docs is ONE_SEQUENCE else df[df["docs"] == docs]


def trials(df: pd.DataFrame, **eq) -> pd.DataFrame:
    """Trial rows (not max-context searches) whose columns equal ``eq``."""
    if not len(df):
        return df
    sel = df["kind"] == "trial"
    for col, value in eq.items():
        sel &= df[col] == value
    return df[sel]


def newest_per(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """One row per ``by`` (the newest); rows differing only in keys not in ``by`` collapse."""
    if not len(df):
        return df
    return df.sort_values("time", kind="stable").drop_duplicates(by, keep="last")


def groups(df: pd.DataFrame, by=("label", "mode_label")):
    """(key, rows) per series of our rows, ordered by paper family then name then mode."""
    if not len(df):
        return []
    out = []
    for key, sub in df.groupby(list(by), sort=False, dropna=False):
        out.append((key, sub))
    out.sort(key=lambda kv: (family_order(family(kv[1]["method"].iloc[0])), kv[0]))
    return out


def lookup(sub: pd.DataFrame, seq_len: int) -> pd.Series | None:
    """The newest row of ``sub`` at ``seq_len`` (the last of the rows sorted stably by time), or None.
    Sorted by position on the time column alone: taking every column of the matching rows first
    made this most of the tables' cost."""
    at = (sub["seq_len"] == seq_len).to_numpy().nonzero()[0]
    if not len(at):
        return None
    times = sub["time"].iloc[at].reset_index(drop=True).sort_values(kind="stable")
    return sub.iloc[at[times.index[-1]]]


# ----------------------------------------------------------------------------- cells

def is_missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA


def fmt(v: Any, digits: int = 2) -> str:
    if is_missing(v):
        return MISSING
    return f"{float(v):.{digits}f}"


def cell(row: pd.Series | None, metric: str, digits: int = 2) -> str:
    """A table cell for one of our rows: the value, "OOM", "error", "fits" (ran, but this
    figure is not measured in its mode, e.g. throughput of a simulated row) or "—" (no row)."""
    if row is None:
        return MISSING
    if row["status"] == "oom":
        return OOM
    if row["status"] == "error":
        return "error"
    value = row.get(metric)
    if is_missing(value):
        return "fits"
    return fmt(value, digits)


def paper_cell(status: str, value: Any, digits: int = 2) -> str:
    if status == "oom":
        return OOM
    if status != "ok" or is_missing(value):
        return MISSING
    return fmt(value, digits)


def number(row: pd.Series | None, metric: str) -> float | None:
    """The row's value if the trial ran (status ok) and measured it, else None."""
    if row is None or row["status"] != "ok":
        return None
    v = row.get(metric)
    return None if is_missing(v) else float(v)


# ----------------------------------------------------------------------------- spread of real step times

SHARED_MARK = "†"  # a cell whose row ran while the host also ran others' work (figures.host_shared)


def step_spread(row: pd.Series | None) -> tuple[float, float, float, int] | None:
    """(median, fastest, slowest step time in s, number of timed steps) of an ``ok`` row that
    recorded its steps; None for other rows (rows written before the spread was recorded)."""
    if row is None or row["status"] != "ok":
        return None
    steps = row.get("step_times_s")
    if not isinstance(steps, (list, tuple)) or not steps:
        return None
    return float(row["step_time_s"]), float(row["step_time_min_s"]), float(row["step_time_max_s"]), len(steps)


def _marks(row: pd.Series, n: int | None) -> str:
    few = f" (n={n})" if n is not None and n < MIN_TIMED_STEPS else ""
    return few + (SHARED_MARK if row.get("host_shared") is True else "")


def throughput_cell(row: pd.Series | None, digits: int = 2) -> str:
    """Tokens/s per device as ``median [min–max]``: the median from the median step, the range
    from the slowest and fastest steps; ``†`` when the host was shared, ``(n=k)`` when fewer
    than the minimum of timed steps (a smoke row). Rows without step times: the plain value."""
    spread = step_spread(row)
    if spread is None:
        return cell(row, "tokens_per_s_per_device", digits)
    _, fast, slow, n = spread
    tokens = float(row["tokens_per_device"])
    return (f"{fmt(row['tokens_per_s_per_device'], digits)} [{fmt(tokens / slow, digits)}–"
            f"{fmt(tokens / fast, digits)}]" + _marks(row, n))


def ratio_cell(row: pd.Series | None, base: pd.Series | None, digits: int = 3) -> str:
    """Throughput of ``row`` over ``base``'s at the same length: the ratio of the medians, and,
    where both rows recorded their steps, ``[lo–hi]`` from the per-step extremes (lo: the row's
    slowest step against the base's fastest; hi: its fastest against the base's slowest)."""
    a, b = number(row, "tokens_per_s_per_device"), number(base, "tokens_per_s_per_device")
    if a is None or b is None or b == 0:
        return MISSING
    text = f"{a / b:.{digits}f}"
    sa, sb = step_spread(row), step_spread(base)
    if sa is None or sb is None:
        return text
    lo, hi = sb[1] / sa[2], sb[2] / sa[1]  # throughput ratio = base step time / row step time
    n = min(sa[3], sb[3])
    mark = _marks(row, n) if row.get("host_shared") is True else _marks(base, n)
    return f"{text} [{lo:.{digits}f}–{hi:.{digits}f}]" + mark
