"""Loaders: result rows (JSON Lines under ``results/``) and the paper's numbers as DataFrames.

``load_rows`` reads every ``*.jsonl`` under a results folder (recursively, except
``results/paper/``) through ``records.read_rows``, so every line is validated against
the one row schema; a corrupt line is reported (printed and listed in
``df.attrs["bad_lines"]``) and skipped, never fatal. The result is flat: one column per
trial key, one per figure (``peak_bytes``, ``step_time_s``, ``tokens_per_s_per_device``,
``max_context``...), derived GiB columns, ``status``/``message``, the environment as
``env.*``, the method's options as ``opt.*``, the step's levers as ``lever.*``, the model's
shape as ``arch.*`` and the file each row came from as ``source_file``. Packed documents: ``docs``
is their label (``prolong64k:0``, ``lengths[3]``; None for one sequence), ``docs.*`` their
identity and summary (``docs.count``, ``docs.max``...), and the scalars of ``figures.doc_work``
are ``doc_work.*`` (``doc_work.imbalance``, ``doc_work.layout``...).

When several rows share a ``trial_key`` (the same trial run twice, e.g. a rerun after a
fix, or one trial in two sweeps), only the newest (``env.time``) is kept, its
``replaced_rows`` column says how many older rows it replaced and ``source_files`` lists
every file that had the trial; ``keep="all"`` returns every row. ``search_probe`` marks the
trial rows a max-context search wrote on its way (their lengths are the bisection's).

``load_paper(name)`` reads ``results/paper/<name>.csv`` unchanged: values come through
exactly as transcribed (``status`` says ``ok``/``oom``/``not_reported``; empty cells stay NaN).
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from records import BadLine, Figures, GiB, Row, human, read_rows, trial_key
from records.facts import facts_of
from records.workloads import DocsSpec

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"


def user_dirs(given: str | Path | Iterable[str | Path] | None = None) -> list[Path]:
    """Folders of the user's own rows to read beside the committed ones (``load_rows(user_dirs=...)``):
    ``given`` (one folder or several), else the runs folder (``$CPAB_RUNS``, else ``runs/`` under the
    working directory, where the commands write) where it exists."""
    if given is None:
        from records.outputs import runs_dir

        return [runs_dir()] if runs_dir().is_dir() else []
    return [Path(given)] if isinstance(given, (str, Path)) else [Path(d) for d in given]


def results_dir(given: str | Path | None = None) -> Path:
    """The rows a notebook reads: its ``RESULTS`` parameter, else ``$ANALYSIS_RESULTS``, else
    the repository's ``results/`` (so a notebook run by hand can be pointed elsewhere)."""
    return Path(given or os.environ.get("ANALYSIS_RESULTS") or RESULTS)
PAPER_DIR = RESULTS / "paper"

# Figures fields that are dictionaries: flattened to "<field>.<key>" columns.
_DICT_FIGURES = ("peak_by_category", "comm_bytes_by_op")
_ENV_FIELDS = ("device_name", "kernel", "time", "git_commit", "git_dirty", "torch", "cuda", "host")

# Column order of the trial keys in the DataFrame (the fields ``trial_key`` is made of).
KEY_COLUMNS = ["kind", "method", "options", "model", "scope", "seq_len", "batch", "world_size",
               "mode", "dtype", "device", "levers", "link", "search"]


# ----------------------------------------------------------------------------- formatting

def human_size(n: Any) -> str:
    """``131072`` -> ``128K``, ``3145728`` -> ``3M``, ``1572864`` -> ``1.5M`` (K = 1024)."""
    if n is None or (isinstance(n, float) and n != n):
        return "—"
    return human(int(n))  # exact to 3 decimals of K/M is exact to eighths: 1000 = 8 x 125


def options_string(options: dict | None) -> str:
    """A method's options as a stable string, ``chunk_heads=8,kernel=torch`` (sorted; '' if none)."""
    if not options:
        return ""
    return ",".join(f"{k}={_scalar(v)}" for k, v in sorted(options.items()))


def _scalar(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, separators=(",", ":"))
    return str(v)


def library_of(method: str) -> str | None:
    """The library a wrapper method runs (``yc-usp``: yunchang; ``MethodFacts.library``), or None
    for our own: a series of theirs is labelled as theirs."""
    return facts_of(method).library_name


def method_label(method: str, options: str | dict | None) -> str:
    """``upipe``, ``upipe[chunk_heads=16]`` or ``yc-usp[ulysses_degree=8] (yunchang)``: a method
    with its non-default options, and the library's name when it wraps one."""
    opts = options_string(options) if isinstance(options, dict) else (options or "")
    lib = library_of(method)
    return (f"{method}[{opts}]" if opts else method) + (f" ({lib})" if lib else "")


def mode_label(mode: str, device: str, device_name: str | None = None, stack: str | None = None,
               pools: str | None = None) -> str:
    """How a row was produced, for legends and table rows: ``real, NVIDIA H100 80GB HBM3``,
    ``emulated, NVIDIA H100 (link nvlink-h100)``, ``simulated, h100-80g, paper stack``,
    ``simulated, h100-80g, hf stack``, ``simulated, h100-80g, lean stack`` (``bench.stackmodel.stack``;
    rows without a stack are lean).
    The paper stack's allocator keeps a pool per stream (``allocator_pools``, the default since it
    was checked on an H100); a paper-stack row made with one shared pool (every row made before,
    which does not record the lever) is its own series: ``simulated, h100-80g, paper stack,
    shared pool``."""
    if mode == "simulated":
        if stack == "paper":
            return f"simulated, {device}, paper stack" + ("" if pools == "per-stream" else ", shared pool")
        if stack == "hf":
            return f"simulated, {device}, hf stack"
        return f"simulated, {device}, lean stack"
    name = (device_name or device or "").strip()
    if len(name) > 40:
        name = name[:38] + "…"
    return f"{mode}, {name or device}"


# ----------------------------------------------------------------------------- rows

def _row_record(row: Row, source: str) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "kind": row.kind, "method": row.method, "options": options_string(row.options),
        "model": row.model, "scope": row.scope, "seq_len": row.seq_len, "batch": row.batch,
        "world_size": row.world_size, "mode": row.mode, "dtype": row.dtype, "device": row.device,
        "levers": options_string(row.levers), "link": row.link["name"] if row.link else None,
        "search": options_string(row.search) if row.search else None,
        "status": row.status, "message": row.message,
    }
    figs = row.figures
    for name in Figures.__dataclass_fields__:
        value = getattr(figs, name)
        if name in _DICT_FIGURES:
            for k, v in (value or {}).items():
                rec[f"{name}.{k}"] = v
        else:
            rec[name] = value
    for name in _ENV_FIELDS:
        rec[f"env.{name}"] = getattr(row.env, name)
    for k, v in (row.options or {}).items():
        rec[f"opt.{k}"] = v
    for k, v in (row.levers or {}).items():
        rec[f"lever.{k}"] = v
    for k, v in (row.model_arch or {}).items():
        rec[f"arch.{k}"] = v
    rec["docs"] = DocsSpec.from_fields(row.docs).label if row.docs else None
    for k, v in (row.docs or {}).items():
        rec[f"docs.{k}"] = v
    for k, v in (figs.doc_work or {}).items():
        if not isinstance(v, (list, dict)):
            rec[f"doc_work.{k}"] = v
    rec["options_dict"] = dict(row.options or {})
    rec["peak_by_category"] = dict(figs.peak_by_category) if figs.peak_by_category else None
    rec["notes"] = " | ".join(row.notes)
    rec["trial_key"] = trial_key(row)
    rec["source_file"] = source
    return rec


def row_files(results_dir: str | Path = RESULTS) -> list[Path]:
    """Every ``*.jsonl`` under ``results_dir`` (recursively), except those under ``paper/``."""
    root = Path(results_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*.jsonl")
                  if p.is_file() and "paper" not in p.relative_to(root).parts[:-1])


def load_rows(results_dir: str | Path = RESULTS, keep: str = "newest", quiet: bool = False,
              user_dirs: Iterable[str | Path] = ()) -> pd.DataFrame:
    """All valid rows under ``results_dir`` as one flat DataFrame (see the module docstring).

    ``user_dirs``: folders of the user's own rows (``runs/``...), read beside the committed
    ones and labelled apart: their ``origin`` is ``yours`` (``committed`` otherwise) and their
    ``mode_label`` ends in ``, yours``, so every table and figure shows them as their own
    series; a trial run by both keeps one row of each.

    ``keep="newest"``: one row per ``trial_key`` (the newest by ``env.time``; the
    ``replaced_rows`` column counts the older ones dropped); ``keep="all"``: every row.
    Corrupt lines are skipped, printed to stderr (unless ``quiet``) and listed as
    ``records.BadLine`` in ``df.attrs["bad_lines"]``.
    """
    if keep not in ("newest", "all"):
        raise ValueError(f"keep must be 'newest' or 'all', got {keep!r}")
    root = Path(results_dir)
    bad: list[BadLine] = []
    records = []
    for origin, folder in [("committed", root)] + [("yours", Path(d)) for d in user_dirs]:
        for path in row_files(folder):
            try:
                source = str(path.relative_to(folder))
            except ValueError:
                source = str(path)
            if origin == "yours":
                source = str(path)
            for row in read_rows(path, on_error="skip", bad=bad):
                records.append({**_row_record(row, source), "origin": origin})
    if not quiet:
        for issue in bad:
            print(f"warning: skipping corrupt row {issue}", file=sys.stderr)
    df = pd.DataFrame.from_records(records) if records else _empty_frame()
    df = _derive(df)
    df["replaced_rows"] = 0
    df["source_files"] = pd.Series([(f,) for f in df["source_file"]], index=df.index, dtype=object)
    df["search_probe"] = _search_probes(df)
    if keep == "newest" and len(df):
        df = _keep_newest(df)
    df = df.reset_index(drop=True)
    df.attrs["bad_lines"] = bad
    df.attrs["results_dir"] = str(root)
    return df


def _empty_frame() -> pd.DataFrame:
    cols = KEY_COLUMNS + ["status", "message"] + list(Figures.__dataclass_fields__) + \
        [f"env.{n}" for n in _ENV_FIELDS] + ["docs", "options_dict", "notes", "trial_key", "source_file", "origin"]
    return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})


def _derive(df: pd.DataFrame) -> pd.DataFrame:
    """GiB columns and labels used by every table and figure."""
    df = df.copy()
    for src, dst in (("peak_bytes", "peak_gib"), ("peak_reserved_bytes", "peak_reserved_gib"),
                     ("host_peak_bytes", "host_peak_gib"), ("capacity_bytes", "capacity_gib"),
                     ("usable_bytes", "usable_gib")):
        df[dst] = pd.to_numeric(df[src], errors="coerce") / GiB
    # The paper reports max_reserved: use the reserved peak where measured (CUDA), else allocated.
    df["mem_gib"] = df["peak_reserved_gib"].where(df["peak_reserved_gib"].notna(), df["peak_gib"])
    df["mem_basis"] = ["reserved" if pd.notna(r) else ("allocated" if pd.notna(a) else None)
                       for r, a in zip(df["peak_reserved_gib"], df["peak_gib"], strict=False)]
    # a simulation with a kernel-scratch model (bench.stackmodel.workspace) is another series than one without
    # (under the paper stack the scratch model is one of its terms, so the stack names it instead)
    scratch = df["lever.kernel_workspace"] if "lever.kernel_workspace" in df else [None] * len(df)
    stacks = df["lever.stack"] if "lever.stack" in df else [None] * len(df)
    df["label"] = [method_label(m, o) + (f" +{w} scratch" if isinstance(w, str) and w != "none" and s != "paper"
                                         else "")
                   for m, o, w, s in zip(df["method"], df["options"], scratch, stacks, strict=False)]
    origins = df["origin"] if "origin" in df else ["committed"] * len(df)
    pools = df["lever.allocator_pools"] if "lever.allocator_pools" in df else [None] * len(df)
    df["mode_label"] = [mode_label(m, d, n, s if isinstance(s, str) else None, p if isinstance(p, str) else None)
                        + (", yours" if o == "yours" else "")
                        for m, d, n, s, p, o in zip(df["mode"], df["device"], df["env.device_name"], stacks, pools,
                                                    origins, strict=False)]
    df["seq"] = [human_size(s) if s else "" for s in df["seq_len"]]
    df["time"] = pd.to_datetime(df["env.time"], utc=True, errors="coerce")
    return df


def _search_probes(df: pd.DataFrame) -> list[bool]:
    """Trial rows that a max-context search wrote on its way (same file, same trial but for the
    length as a ``max_context`` row, the same documents): real rows, but their lengths are the search's,
    not a grid's."""
    if not len(df):
        return []
    cols = ["source_file", "method", "options", "model", "scope", "world_size", "mode", "dtype", "device", "levers",
            "docs"]
    searches = set(map(tuple, df.loc[df["kind"] == "max_context", cols].astype(str).values.tolist()))
    sigs = map(tuple, df[cols].astype(str).values.tolist())
    return [kind == "trial" and sig in searches for kind, sig in zip(df["kind"], sigs, strict=False)]


def _keep_newest(df: pd.DataFrame) -> pd.DataFrame:
    """One row per trial key: the newest (ties: the one read last). ``source_files`` keeps
    every file that had the trial, so a row shared by two sweeps still counts for both."""
    keys = df["trial_key"].map(repr) + "|" + df["origin"].astype(str)
    order = df.assign(_key=keys, _pos=range(len(df))).sort_values(["_key", "time", "_pos"])
    counts = order.groupby("_key")["_pos"].transform("size")
    files = order.groupby("_key")["source_file"].agg(lambda f: tuple(sorted(set(f))))
    probe = order.groupby("_key")["search_probe"].agg(lambda p: bool(all(p)))
    newest = order.drop_duplicates("_key", keep="last").copy()
    newest["replaced_rows"] = (counts.loc[newest.index] - 1).astype(int)
    newest["source_files"] = newest["_key"].map(files)
    newest["search_probe"] = newest["_key"].map(probe).astype(bool)
    return newest.sort_values("_pos").drop(columns=["_key", "_pos"])


# ----------------------------------------------------------------------------- paper numbers

def paper_names() -> list[str]:
    """The paper tables available (file stems in ``results/paper/``)."""
    return sorted(p.stem for p in PAPER_DIR.glob("*.csv"))


def load_paper(name: str, paper_dir: str | Path = PAPER_DIR) -> pd.DataFrame:
    """``results/paper/<name>.csv`` as transcribed (``name`` with or without ``.csv``)."""
    stem = name[:-4] if name.endswith(".csv") else name
    path = Path(paper_dir) / f"{stem}.csv"
    if not path.is_file():
        raise ValueError(f"no paper table {stem!r} in {paper_dir}; available: {paper_names()}")
    df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    for col in ("seq_len", "gpus", "max_seq_len"):
        if col in df:
            df[col] = pd.to_numeric(df[col]).astype("Int64")
    return df


def modes_summary(df: pd.DataFrame) -> str:
    """``simulated (h100-80g): 12 rows; real (NVIDIA H100 80GB HBM3): 3 rows`` or ``no rows``."""
    if df is None or not len(df):
        return "no rows"
    parts = []
    for label, n in df.groupby("mode_label", sort=True).size().items():
        mode, _, dev = label.partition(", ")
        parts.append(f"{mode} ({dev}): {n} row{'s' if n != 1 else ''}")
    return "; ".join(parts)


def describe_bad_lines(df: pd.DataFrame) -> Iterable[str]:
    return [str(b) for b in df.attrs.get("bad_lines", [])]
