"""One function per regenerated table; each returns a ``Table`` (paper and ours side by side).

Layout shared by the tables: a *paper* row, then one row per series of ours (a method
with its options, in one mode on one device, labelled "real, NVIDIA H100 ...",
"simulated, h100-80g" ...), then our methods the paper does not have. Cells: the value,
"OOM", "error", "fits" (ran, but the figure is not measured in that mode) or "—" (no row).
Nothing is interpolated or filled in.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from records.facts import facts_of, implementing

from .load import human_size, load_paper, load_rows, user_dirs
from .select import (
    ONE_SEQUENCE,
    PAPER_LENGTHS,
    PAPER_METHODS,
    TABLE3_SETUPS,
    Setup,
    cell,
    family,
    family_order,
    fig1_config,
    fmt,
    groups,
    has_paper_levers,
    is_missing,
    lookup,
    number,
    option,
    paper_cell,
    ratio_cell,
    throughput_cell,
    trials,
    with_docs,
)
from .style import MISSING, Table, display_name

PAPER_MODE = "real, {gpus}×H100-80GB (paper)"
PAPER_MODELS = [s.model for s in TABLE3_SETUPS]  # the models the paper ran (other models: our smaller scales)


def _rows(rows: pd.DataFrame | str | Path | None, docs: str | None = ONE_SEQUENCE) -> pd.DataFrame:
    """The rows a table or figure draws: loaded (None: the committed ones; a folder) or as given,
    then those of one packed-documents case (``select.with_docs``; default one sequence)."""
    if rows is None:
        rows = load_rows(quiet=True)
    elif isinstance(rows, (str, Path)):
        rows = load_rows(rows, quiet=True)
    return with_docs(rows, docs)


def _seq_cols(lengths) -> list[str]:
    return [human_size(s) for s in lengths]


# ----------------------------------------------------------------------------- Table 3

def table3_rows(rows: pd.DataFrame, setup: Setup) -> pd.DataFrame:
    """Our rows for one half of Table 3: the model, the GPU count, a full training step
    with the paper's levers, on a GPU preset (CPU rows go to ``table3_cpu``)."""
    t = trials(rows, model=setup.model, world_size=setup.gpus, scope="model")
    t = t[t["device"] != "cpu"] if len(t) else t
    return t[has_paper_levers(t)] if len(t) else t


def table3(rows=None, model: str = "llama3-8b") -> Table:
    """Table 3, tokens/s per GPU: paper vs ours for ``model`` (llama3-8b: 8 GPUs, qwen3-32b: 16)."""
    rows = _rows(rows)
    setup = next((s for s in TABLE3_SETUPS if s.model == model), None)
    if setup is None:
        raise ValueError(f"Table 3 has {[s.model for s in TABLE3_SETUPS]}, not {model!r}")
    paper = load_paper("table3_throughput")
    paper = paper[paper["model"] == model]
    ours = table3_rows(rows, setup)
    lengths = PAPER_LENGTHS
    cols = ["Method", "Source", "Mode, device"] + _seq_cols(lengths)
    out = []
    our_groups = groups(ours)
    used = set()
    for pm in PAPER_METHODS:
        p = paper[paper["method"] == pm].set_index("seq_len")
        cells = [paper_cell(p.loc[s, "status"], p.loc[s, "tokens_per_s_per_gpu"]) if s in p.index else MISSING
                 for s in lengths]
        out.append([display_name(pm), "paper", PAPER_MODE.format(gpus=setup.gpus)] + cells)
        for key, sub in our_groups:
            if family(sub["method"].iloc[0]) == pm:
                used.add(key)
                cells = [cell(lookup(sub, s), "tokens_per_s_per_device") for s in lengths]
                out.append([key[0], "ours", key[1]] + cells)
    for key, sub in our_groups:
        if key not in used:
            out.append([key[0], "ours (not in paper)", key[1]]
                       + [cell(lookup(sub, s), "tokens_per_s_per_device") for s in lengths])
    notes = [
        f"Tokens/s per GPU, {setup.model} on {setup.gpus} GPUs, full training step with the paper's levers "
        "(FSDP2, AC offloaded to host, tiled MLP, chunked loss, bf16, batch 1).",
        "OOM: out of memory; —: no row (not run / not reported); fits: ran without OOM, throughput not "
        "measured in that mode (simulated rows measure memory only); error: the trial failed (see its row).",
    ]
    if setup.gpus == 16:
        notes.append("On 16 GPUs the paper's Ulysses and UPipe are the 8 Ulysses × 2 Ring mesh: ours "
                     "`usp` and `usp-upipe` with ulysses_degree=8.")
    if not len(ours):
        notes.append("No rows of ours yet: `python -m sweeps run sweeps/configs/table3-"
                     f"{setup.model}.yaml --executor slurm` regenerates them.")
    return Table(f"table3_{setup.model}", f"Table 3 — throughput (tokens/s per GPU), {setup.title}",
                 pd.DataFrame(out, columns=cols), notes, ours)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return MISSING
    return f"{a / b:.3f}"


def table3_ratios(rows=None) -> Table:
    """Each method's throughput over Ulysses' at the same length, paper vs ours: the one
    Table 3 figure that compares across hardware (including our CPU rows, in ``table3_cpu``)."""
    rows = _rows(rows)
    paper = load_paper("table3_throughput")
    cols = ["Setup", "Ratio", "Source", "Mode, device"] + _seq_cols(PAPER_LENGTHS)
    out = []
    used = []
    for setup in TABLE3_SETUPS:
        p = paper[paper["model"] == setup.model]

        def pv(method, s, p=p):
            hit = p[(p["method"] == method) & (p["seq_len"] == s) & (p["status"] == "ok")]
            return float(hit["tokens_per_s_per_gpu"].iloc[0]) if len(hit) else None

        ours = table3_rows(rows, setup)
        used.append(ours)
        for pm in [m for m in PAPER_METHODS if m != "ulysses"]:
            name = f"{display_name(pm)} / Ulysses"
            out.append([setup.title, name, "paper", PAPER_MODE.format(gpus=setup.gpus)]
                       + [_ratio(pv(pm, s), pv("ulysses", s)) for s in PAPER_LENGTHS])
            for mode_label, sub in (ours.groupby("mode_label") if len(ours) else []):
                base = sub[sub["method"].map(family) == "ulysses"]
                for label, msub in sub[sub["method"].map(family) == pm].groupby("label"):
                    if not len(base):
                        continue
                    blabel = _ratio_baseline(base, msub["method"].iloc[0])
                    b = base[base["label"] == blabel]
                    vals = [_ratio(number(lookup(msub, s), "tokens_per_s_per_device"),
                                   number(lookup(b, s), "tokens_per_s_per_device")) for s in PAPER_LENGTHS]
                    if any(v != MISSING for v in vals):  # a mode without throughput (simulated) adds nothing
                        out.append([setup.title, f"{label} / {blabel}", "ours", mode_label] + vals)
    used_df = pd.concat(used) if any(len(u) for u in used) else rows.iloc[0:0]
    notes = ["Throughput ratio at equal sequence length; UPipe/Ulysses is the paper's claim of "
             "'throughput on par' (0.98–1.02 on 8B from 128K to 3M).",
             "— where either side has no throughput (not run, OOM, or not measured in that mode)."]
    return Table("table3_ratios", "Table 3 — throughput relative to Ulysses (paper vs ours)",
                 pd.DataFrame(out, columns=cols), notes, used_df)


def _ulysses_baselines(method: str) -> tuple[str, ...]:
    """Our methods a ratio of ``method`` divides by, in order: our own implementations of the
    paper's Ulysses column (``MethodFacts.reference``), for a mesh method of another column the
    one on a mesh first (``usp`` for ``usp-upipe``, the same Ulysses x Ring mesh), else the one
    without (``ulysses``: Table 3's and the CPU table's ratios)."""
    mesh_first = facts_of(method).mesh and family(method) != "ulysses"
    ours = [name for name in implementing("ulysses") if facts_of(name).reference]
    return tuple(sorted(ours, key=lambda name: facts_of(name).mesh != mesh_first))


def _ratio_baseline(base: pd.DataFrame, method: str) -> str:
    """The label of the Ulysses-family series a ratio of ``method`` divides by: the first of
    ``_ulysses_baselines`` present, else the first label of the family (a wrapper of DeepSpeed's
    or yunchang's Ulysses). Not simply the first label: "ds-ulysses-hf" sorts before "ulysses"."""
    for name in _ulysses_baselines(method):
        labels = sorted(base[base["method"] == name]["label"].unique())
        if labels:
            return labels[0]
    return sorted(base["label"].unique())[0]


def cpu_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Our CPU variants of Table 3: training steps (scope ``model``) on the ``cpu`` device preset
    with the levers the paper ran their method with (what the ``table3-*-cpu`` sweeps run)."""
    if not len(rows):
        return rows
    t = trials(rows, scope="model")
    t = t[t["device"] == "cpu"] if len(t) else t
    return t[has_paper_levers(t)] if len(t) else t


def _paper_ratio_range(method: str) -> str:
    paper = load_paper("table3_throughput")
    parts = []
    for setup in TABLE3_SETUPS:
        p = paper[(paper["model"] == setup.model) & (paper["status"] == "ok")]
        a = p[p["method"] == method].set_index("seq_len")["tokens_per_s_per_gpu"]
        b = p[p["method"] == "ulysses"].set_index("seq_len")["tokens_per_s_per_gpu"]
        common = a.index.intersection(b.index)
        if len(common):
            r = a[common] / b[common]
            parts.append(f"{r.min():.3f}–{r.max():.3f} ({setup.model}, "
                         f"{human_size(common.min())}–{human_size(common.max())})")
    return "; ".join(parts) or MISSING


def _cpu_baseline(series: list, method: str):
    """The series a CPU ratio divides by: the paper's Ulysses column as we run it, our ``ulysses``
    (``usp`` for ``usp-upipe``, the same Ulysses x Ring mesh), else the first of the Ulysses family
    (``usp``, the wrappers of DeepSpeed's and yunchang's Ulysses)."""
    by_method = {s["method"].iloc[0]: (key, s) for key, s in series if not s["options"].iloc[0]}
    for name in _ulysses_baselines(method):
        if name in by_method:
            return by_method[name]
    family_rows = [(key, s) for key, s in series if family(s["method"].iloc[0]) == "ulysses"]
    return family_rows[0] if family_rows else None


def _host_notes(ours: pd.DataFrame) -> list[str]:
    """What the rows say about the host's load while they were timed (``figures.host_*``)."""
    if not len(ours) or "host_shared" not in ours:
        return []
    known = ours[ours["host_shared"].notna()] if len(ours) else ours
    if not len(known):
        return []
    shared = known[known["host_shared"].astype(bool)]
    loads = pd.concat([known["host_load_before"], known["host_load_after"]]).astype(float)
    cpus = sorted({int(c) for c in known["host_cpus"]})
    text = (f"Host load ({len(known)} rows with it recorded): 1-min load average {loads.min():.2f}–{loads.max():.2f} "
            f"around the timed steps on {'/'.join(map(str, cpus))} logical CPUs. ")
    if len(shared):
        text += (f"† host shared: in {len(shared)} of them the load exceeded the threads the trial itself ran "
                 f"(others' work ran during the timing; nothing was done to hide it).")
    else:
        text += "In none did it exceed the threads the trial itself ran."
    return [text]


def table3_cpu(rows=None) -> Table:
    """Our CPU runs of the Table 3 sweep (small models, few ranks): tokens/s per rank, and each
    method's ratio to Ulysses next to the paper's ratio range. CPU and H100 numbers are not
    comparable; the ratios are."""
    rows = _rows(rows)
    ours = cpu_rows(rows)
    lengths = sorted(ours["seq_len"].unique()) if len(ours) else []
    cols = ["Model", "Ranks", "Row", "Source", "Mode, device"] + _seq_cols(lengths) + ["paper ratio (H100)"]
    out = []
    for (model, ws, mode_label), sub in (ours.groupby(["model", "world_size", "mode_label"]) if len(ours) else []):
        series = groups(sub)
        for key, s in series:
            out.append([model, ws, key[0], "ours: tokens/s per rank", mode_label]
                       + [throughput_cell(lookup(s, n)) for n in lengths] + [""])
        for key, s in series:
            method = s["method"].iloc[0]
            base = _cpu_baseline(series, method)
            if base is None or key == base[0]:
                continue
            vals = [ratio_cell(lookup(s, n), lookup(base[1], n)) for n in lengths]
            paper = _paper_ratio_range(family(method)) if family(method) != "ulysses" else ""
            out.append([model, ws, f"{key[0]} / {base[0][0]}", "ours: ratio", mode_label] + vals + [paper])
    notes = ["CPU rows (gloo ranks on one host, small models): absolute numbers say nothing about "
             "H100 throughput; ratios to Ulysses at equal length are the comparable figure.",
             "tokens/s per rank: `median [min–max]` over the timed steps (the median step's throughput; "
             "min from the slowest step, max from the fastest; each step as long as its slowest rank's). "
             "Rows recorded before step times were kept show one value (the mean of two steps).",
             "ratio: the ratio of the medians, `[lo–hi]` from the per-step extremes: lo = the method's slowest "
             "step against the baseline's fastest, hi = its fastest against the baseline's slowest (the widest "
             "the ratio of any two single steps can be, not a confidence interval).",
             "The baseline is the paper's Ulysses column as we run it: our `ulysses` (for `usp-upipe`: `usp`, "
             "the same Ulysses × Ring mesh, as the paper's 16-GPU runs), else the first Ulysses variant present.",
             "paper ratio (H100): the range of the same ratio in the paper's Table 3 (none for the Ulysses "
             "variants, which are the paper's baseline itself)."]
    notes.extend(_host_notes(ours))
    if not len(ours):
        notes.append("No CPU rows yet: run a CPU variant of the Table 3 sweep (a `sweeps/configs/table3-*.yaml` "
                     "with `device: cpu`) with `--executor local`.")
    return Table("table3_cpu", "Table 3 on CPU — throughput per rank and ratio to Ulysses (ours)",
                 pd.DataFrame(out, columns=cols), notes, ours)


# ----------------------------------------------------------------------------- max context

def _max_ctx_text(n, lower_bound: bool) -> str:
    if is_missing(n):
        return MISSING
    if int(n) == 0:
        return "none fits"
    return ("≥ " if lower_bound else "") + human_size(int(n))


def search_params(search) -> dict[str, int]:
    """A row's ``search`` column (``granularity=131072,max_seq_len=...,step=131072``) as numbers."""
    out = {}
    for part in search.split(",") if isinstance(search, str) else []:
        k, _, v = part.partition("=")
        if v.isdigit():
            out[k] = int(v)
    return out


def search_step(search) -> int | None:
    """A search's length step: ``step`` where the row records it (granularity rounded up to
    the layout multiple), else its granularity; None for a row that is not a search."""
    params = search_params(search)
    return params.get("step", params.get("granularity"))


def our_max_context(rows: pd.DataFrame) -> pd.DataFrame:
    """Per series: the max-context search result (``kind: max_context`` rows) and the longest
    length our trial rows ran without OOM. Columns: model, world_size, label, method,
    scope, mode_label, kind ('search' | 'runs'), max_seq_len, lower_bound, status, step
    (the search's length step; None for runs).

    Of several searches of one series the finest (smallest step) answers, the newest of
    those if more than one: a coarser search only bounds the same answer less tightly."""
    recs = []
    if not len(rows):
        return pd.DataFrame(columns=["model", "world_size", "scope", "label", "method", "mode_label", "kind",
                                     "max_seq_len", "lower_bound", "status", "step"])
    searches = rows[rows["kind"] == "max_context"]
    searches = searches.assign(_step=[search_step(s) or 0 for s in searches["search"]])
    searches = searches.sort_values(["_step", "time"], ascending=[False, True], kind="stable").drop_duplicates(
        ["model", "world_size", "scope", "label", "mode_label"], keep="last")
    for _, r in searches.iterrows():
        limit = search_params(r.get("search")).get("max_seq_len")
        mc = r.get("max_context")
        # an error ends a search early: what it reached is then only a lower bound
        lower = r["status"] == "error" or (limit is not None and not is_missing(mc) and int(mc) >= limit)
        recs.append(dict(model=r["model"], world_size=r["world_size"], scope=r["scope"], label=r["label"],
                         method=r["method"], mode_label=r["mode_label"], kind="search", status=r["status"],
                         max_seq_len=mc, lower_bound=lower, step=r["_step"] or None))
    t = trials(rows, scope="model")
    if len(t):
        t = t[has_paper_levers(t)]
    for (model, ws, label, ml), sub in (t.groupby(["model", "world_size", "label", "mode_label"]) if len(t) else []):
        status, lengths = sub["status"], sub["seq_len"]  # two columns, not every column of the rows they select
        ok = lengths[status == "ok"]
        oom = lengths[status == "oom"]
        best = int(ok.max()) if len(ok) else 0
        lower = not len(oom) or int(oom.max()) < best
        if not len(ok) and not len(oom):
            continue
        recs.append(dict(model=model, world_size=ws, scope="model", label=label, method=sub["method"].iloc[0],
                         mode_label=ml, kind="runs", status="ok", max_seq_len=best,
                         lower_bound=bool(len(ok)) and lower, step=None))
    return pd.DataFrame.from_records(recs)


def max_ctx_cell(r) -> str:
    """A max-context result as text: ``5.25M``, ``≥ 32M``, ``≥ 1M (search stopped by an error)``."""
    text = _max_ctx_text(r["max_seq_len"], bool(r["lower_bound"]))
    return f"{text} (search stopped by an error)" if r["status"] == "error" else text


def paper_setups() -> set[tuple[str, int]]:
    """(model, GPUs) the paper reports max context for: Table 3's two and Fig. 5's 8×2 mesh."""
    return {(s.model, s.gpus) for s in TABLE3_SETUPS} | {("llama3-8b", 16)}


def max_context_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """What the max-context table and figure show of ours: every search, and the longest run
    without OOM only on the paper's setups (elsewhere it is just the longest length tried)."""
    ours = our_max_context(rows)
    if not len(ours):
        return ours
    setups = zip(ours["model"], ours["world_size"], strict=True)
    on_paper = pd.Series([(m, int(w)) in paper_setups() for m, w in setups],
                         index=ours.index, dtype=bool)
    keep = (ours["kind"] == "search") | on_paper
    return ours[keep]


def max_context_table(rows=None, docs: str | None = ONE_SEQUENCE) -> Table:
    """Max context per method: the paper's (derived from Table 3; Fig. 5's claims) vs our
    max-context searches and the longest length our runs fit. ``docs``: which of our rows, by
    their packed documents (``select.with_docs``): None (the default) one sequence, as the
    paper's; ``prolong64k:0`` the searches and runs with that draw."""
    rows = _rows(rows, docs)
    paper = load_paper("max_context")
    fig5 = load_paper("fig5_multinode")
    claims = fig5[fig5["kind"] == "max_context_claim"]
    ours = max_context_rows(rows)
    setups = ({(r.model, int(r.gpus)) for r in paper.itertuples()}
              | {(r.model, int(r.gpus)) for r in claims.itertuples()})
    if len(ours):
        setups |= {(m, int(w)) for m, w in zip(ours["model"], ours["world_size"], strict=False)}
    cols = ["Model", "GPUs", "Method", "Source", "Mode, device", "Max context", "Note"]
    out = []
    for model, gpus in sorted(setups, key=lambda s: (s[0] not in ("llama3-8b", "qwen3-32b"), s[0], s[1])):
        entries = []  # (family, order, row)
        for r in paper[(paper["model"] == model) & (paper["gpus"] == gpus)].itertuples():
            lb = "lower bound" in str(r.note)
            entries.append((family(r.method), 0, [model, gpus, display_name(r.method), "paper (Table 3, derived)",
                                                  PAPER_MODE.format(gpus=gpus), _max_ctx_text(r.max_seq_len, lb),
                                                  r.note]))
        for r in claims[(claims["model"] == model) & (claims["gpus"] == gpus)].itertuples():
            name = "USP-Hybrid 8×2" if r.method == "usp" else f"{display_name(r.method)} 8×2"
            entries.append((family(r.method), 1, [model, gpus, name, "paper (Fig. 5 text)",
                                                  PAPER_MODE.format(gpus=gpus), _max_ctx_text(r.seq_len, False),
                                                  r.note]))
        sub = ours[(ours["model"] == model) & (ours["world_size"] == gpus)] if len(ours) else ours
        for r in (sub.itertuples() if len(sub) else []):
            src = "ours (max-context search)" if r.kind == "search" else "ours (longest run without OOM)"
            if r.scope == "attention":
                src = src[:-1] + ", one attention block)"
            note = ("search ended at its upper limit" if r.kind == "search" and r.lower_bound else
                    "no OOM row above it: a lower bound" if r.kind == "runs" and r.lower_bound else "")
            if r.status == "error":
                note = "the search stopped at an error row (see its message)"
            entries.append((family(r.method), 2 if r.kind == "search" else 3,
                            [model, gpus, r.label, src, r.mode_label, max_ctx_cell(r._asdict()), note]))
        entries.sort(key=lambda e: (family_order(e[0]), e[1], e[2][2]))
        out += [e[2] for e in entries]
    notes = ["Paper: the longest Table 3 length each method ran (≥: the table's last column ran, so the true "
             "maximum may be higher); Fig. 5's text claims for the 8×2 mesh on 16 GPUs.",
             "Ours: `kind: max_context` rows (doubling then bisection on the sequence length) and, from trial "
             "rows with the paper's levers, the longest length that ran without OOM.",
             "Sizes: K = 1024 tokens, M = 1024² tokens."]
    if docs is not ONE_SEQUENCE:
        notes.append(f"Ours: the rows with packed documents {docs} (the paper's: one sequence).")
    used = rows[(rows["kind"] == "max_context")] if len(rows) else rows
    if len(rows):
        t = trials(rows, scope="model")
        used = pd.concat([used, t[has_paper_levers(t)]]) if len(t) else used
    title = "Maximum context length per method (paper vs ours)" + (
        f", ours with documents {docs}" if docs is not ONE_SEQUENCE else "")
    return Table("max_context", title, pd.DataFrame(out, columns=cols), notes, used)


# ----------------------------------------------------------------------------- Fig. 1 table

FIG1_CONFIGS = ["default", "fsdp", "fsdp+ulysses", "+ac", "+ao", "alst", "upipe"]
FIG1_NAMES = {"default": "Default", "fsdp": "FSDP", "fsdp+ulysses": "FSDP+Ulysses", "+ac": "+AC",
              "+ao": "+AO (offload)", "alst": "ALST", "upipe": "UPipe"}
MODEL_CATS = ("parameter", "buffer", "gradient", "optstate")


def split_categories(cats: dict | None) -> tuple[float, float, float] | None:
    """(model, activations, other) GiB from MemTracker's categories in ``peak_by_category``.

    model = parameters + buffers + gradients + optimizer state; activations = tensors saved in
    forward (MemTracker's ``activation``; the paper's bar is *attention* activations, which
    MemTracker cannot tell from the rest); other = temporaries of backward and the rest.
    A category named ``attention`` (if bench ever records one) is taken as the middle bar.
    """
    if not cats:
        return None
    g = {k: float(v) / 2**30 for k, v in cats.items()}
    model = sum(g.get(k, 0.0) for k in MODEL_CATS)
    middle = "attention" if "attention" in g else "activation"
    act = g.get(middle, 0.0)
    other = sum(v for k, v in g.items() if k not in MODEL_CATS and k != middle)
    return model, act, other


PAPER_FIG1 = ("llama3-8b", 3 * 2**20, 8)  # model, tokens, GPUs


def fig1_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Our Fig. 1 bars: rows with a recognised lever configuration (``fig1_config``) at the
    paper's setup (Llama3-8B, 3M, 8 GPUs), and at the paper's GPU count on a model the paper did
    not run (the ``fig1-memory-breakdown`` sweep's CPU-scale variant), never the hf stack's. Adds
    ``config`` (the bar) and ``setup`` (model, tokens, ranks)."""
    t = trials(rows, scope="model")
    if not len(t):
        return t.assign(config=pd.Series(dtype=object), setup=pd.Series(dtype=object))
    model, seq, ws = PAPER_FIG1
    at_point = (t["model"] == model) & (t["seq_len"] == seq) & (t["world_size"] == ws)
    other_scale = (t["world_size"] == ws) & ~t["model"].isin(PAPER_MODELS)
    # the Hugging Face stack's rows run ALST's recipe, not a rung of the paper's ladder (results/hf/)
    hf = t["lever.stack"].eq("hf") if "lever.stack" in t else pd.Series(False, index=t.index)
    t = t[(at_point | other_scale) & ~hf]
    if not len(t):
        return t.assign(config=pd.Series(dtype=object), setup=pd.Series(dtype=object))
    t = t.assign(config=t.apply(fig1_config, axis=1),
                 setup=pd.Series(list(zip(t["model"], t["seq_len"], t["world_size"], strict=True)), index=t.index,
                                 dtype=object))
    return t[t["config"].notna()]


def fig1_setups(ours: pd.DataFrame) -> list[tuple]:
    extra = sorted(set(ours["setup"]) - {PAPER_FIG1}) if len(ours) else []
    return [PAPER_FIG1] + extra


def setup_name(model: str, seq_len: int | None, ws: int) -> str:
    return f"{model}, {human_size(seq_len)} tokens, {ws} ranks" if seq_len else f"{model}, {ws} ranks"


def fig1_table(rows=None) -> Table:
    """Fig. 1's stacked bars as numbers: Llama3-8B, 3M tokens, 8 GPUs (then any smaller-scale
    variant of ours)."""
    rows = _rows(rows)
    paper = load_paper("fig1_memory_breakdown").set_index("config")
    ours = fig1_rows(rows)
    cols = ["Setup", "Config", "Implementation", "Source", "Mode, device", "Model GiB", "Activations GiB",
            "Other GiB", "Total GiB", "Result"]
    out = []
    for setup in fig1_setups(ours):
        name = setup_name(*setup)
        mine = ours[ours["setup"] == setup] if len(ours) else ours
        for cfg in FIG1_CONFIGS:
            if setup == PAPER_FIG1 and cfg in paper.index:
                p = paper.loc[cfg]
                result = f"OOM ({p['oom_required_gib']:g})" if p["status"] == "oom" else "fits"
                out.append([name, FIG1_NAMES[cfg], MISSING, "paper", "real, 8×H100-80GB (paper)",
                            fmt(p["model_gib"], 1), fmt(p["attn_act_gib"], 1), fmt(p["other_gib"], 1),
                            fmt(p["total_gib"], 1), result])
            for (label, ml), sub in (mine[mine["config"] == cfg].groupby(["label", "mode_label"])
                                     if len(mine) else []):
                r = sub.sort_values("time").iloc[-1]
                split = split_categories(r["peak_by_category"]) if r["status"] != "error" else None
                m, a, o = split if split else (None, None, None)
                digits = 1 if setup == PAPER_FIG1 else 3
                total = fmt(r["mem_gib"], digits) if r["status"] != "error" else MISSING
                # an OOM bar keeps the memory the run would have needed, as the paper labels its own
                result = {"ok": "fits", "oom": f"OOM ({total})", "error": "error"}[r["status"]]
                out.append([name, FIG1_NAMES[cfg], label, "ours", ml, fmt(m, digits), fmt(a, digits),
                            fmt(o, digits), total, result])
    notes = ["Per-GPU peak memory, Llama3-8B at 3M tokens on 8 GPUs. Paper: segments read off the figure; "
             "OOM (n): the number printed on the bar (probably GiB required).",
             "Ours: MemTracker categories at the peak — model = parameters + gradients + optimizer state; "
             "activations = tensors saved in forward (the paper's segment is attention activations only); "
             "other = backward temporaries and the rest. Real CUDA rows have a total only. Simulated rows count "
             "live tensors only (no CUDA context, NCCL buffers or fragmentation).",
             "OOM (n) of ours: the run did not fit the budget; n is the peak GiB it would have needed "
             "(the simulation keeps the peak past the budget). Implementation: the method that ran, with its "
             "non-default options; the rows at 3M are `python -m bench fidelity --anchors fig1-` (the ladder's "
             "levers: bench.stackmodel.fidelity.FIG1_RUNGS; FSDP = `no-cp`, FSDP over the 8 ranks with the whole "
             "sequence on each).",
             "Default (no FSDP) has no trial of ours: our step without FSDP keeps no fp32 master weights, "
             "unlike the paper's (119 GiB = 16 bytes per parameter). Other setups (the CPU-scale variant "
             "of the sweep) have no paper values: compare the bars' order and ratios, not GiB."]
    return Table("fig1_memory_breakdown", "Fig. 1 — peak memory breakdown, Llama3-8B, 3M tokens, 8 GPUs",
                 pd.DataFrame(out, columns=cols), notes, ours)


# ----------------------------------------------------------------------------- Fig. 5 table

PAPER_FIG5 = ("llama3-8b", 16)


def fig5_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """USP-Hybrid and UPipe on a Ulysses x Ring mesh: Llama3-8B on 16 GPUs with the paper's
    levers, and, on a model the paper did not run (the ``fig5-multinode`` sweeps' CPU variant),
    any setup where both series ran with the same levers in one mode. Adds ``setup`` (model, ranks)."""
    t = trials(rows, scope="model")
    if not len(t):
        return t.assign(setup=pd.Series(dtype=object), fig5_method=pd.Series(dtype=object))
    t = t.assign(fig5_method=t.apply(fig5_method, axis=1))
    t = t[t["fig5_method"].notna()]
    if not len(t):
        return t.assign(setup=pd.Series(dtype=object))
    paper_setup = (t["model"] == PAPER_FIG5[0]) & (t["world_size"] == PAPER_FIG5[1]) & has_paper_levers(t)
    together = t.groupby(["model", "world_size", "mode_label", "levers"])["fig5_method"].transform("nunique") == 2
    other_scale = together & ~t["model"].isin(PAPER_MODELS)
    t = t[other_scale | paper_setup]
    return t.assign(setup=pd.Series(list(zip(t["model"], t["world_size"], strict=False)), index=t.index, dtype=object))


def fig5_method(row: pd.Series) -> str | None:
    """Which of Fig. 5's two series a row is, by the paper's names: ``usp`` (USP-Hybrid: a mesh
    method of the Ulysses column, ours or yunchang's USP as the paper ran it, at a Ulysses degree
    below the world size) or ``upipe`` (a mesh method of the UPipe column: ``usp-upipe``); None
    otherwise (``MethodFacts.column`` and ``mesh``)."""
    facts = facts_of(row["method"])
    if not facts.mesh:
        return None
    if facts.column == "upipe":
        return "upipe"
    degree = option(row, "ulysses_degree")
    if facts.column == "ulysses" and degree is not None and 1 < int(degree) < int(row["world_size"]):
        return "usp"
    return None


def fig5_setups(ours: pd.DataFrame) -> list[tuple]:
    extra = sorted(set(ours["setup"]) - {PAPER_FIG5}) if len(ours) else []
    return [PAPER_FIG5] + extra


def fig5_table(rows=None) -> Table:
    """Figure 5 as numbers: peak memory and UPipe throughput / USP throughput, 16 GPUs (8×2),
    then any smaller-scale variant of ours."""
    rows = _rows(rows)
    paper = load_paper("fig5_multinode")
    paper = paper[paper["kind"] == "point"]
    ours = fig5_rows(rows)
    lengths = sorted(set(paper["seq_len"].astype(int)) | (set(ours["seq_len"]) if len(ours) else set()))
    cols = ["Setup", "Quantity", "Source", "Mode, device"] + _seq_cols(lengths)
    out = []
    for setup in fig5_setups(ours):
        name = setup_name(setup[0], None, setup[1])
        mine = ours[ours["setup"] == setup] if len(ours) else ours
        digits = 1 if setup == PAPER_FIG5 else 3
        for method, pname in (("usp", "USP-Hybrid 8×2"), ("upipe", "UPipe 8×2")):
            if setup == PAPER_FIG5:
                p = paper[paper["method"] == method].set_index("seq_len")
                out.append([name, f"{pname} peak GiB", "paper (by eye ±1 GiB)", PAPER_MODE.format(gpus=16)]
                           + [paper_cell(p.loc[s, "status"], p.loc[s, "peak_mem_gib"], 1) if s in p.index else MISSING
                              for s in lengths])
            m = mine[mine["fig5_method"] == method] if len(mine) else mine
            for (label, ml), sub in (m.groupby(["label", "mode_label"]) if len(m) else []):
                out.append([name, f"{label} peak GiB", "ours", ml]
                           + [cell(lookup(sub, s), "mem_gib", digits) for s in lengths])
        if setup == PAPER_FIG5:
            p = paper[paper["method"] == "upipe"].set_index("seq_len")
            out.append([name, "UPipe / USP throughput", "paper (by eye)", PAPER_MODE.format(gpus=16)]
                       + [paper_cell(p.loc[s, "status"], p.loc[s, "norm_throughput"], 3) if s in p.index else MISSING
                          for s in lengths])
        for ml, sub in (mine.groupby("mode_label") if len(mine) else []):
            u, b = sub[sub["fig5_method"] == "upipe"], sub[sub["fig5_method"] == "usp"]
            if len(u) and len(b):
                out.append([name, "UPipe / USP throughput", "ours", ml]
                           + [_ratio(number(lookup(u, s), "tokens_per_s_per_device"),
                                     number(lookup(b, s), "tokens_per_s_per_device")) for s in lengths])
    notes = ["Llama3-8B on 16 GPUs, 8 Ulysses × 2 Ring for both methods (ours: `usp` and `usp-upipe` with "
             "ulysses_degree=8). Paper values were read off the figure by eye (±1 GiB).",
             "Memory: reserved peak where measured (CUDA), else allocated (simulated/CPU).",
             "Paper text: UPipe reaches 8M where USP stops at 6M. Other setups (the CPU-scale variant) have no "
             "paper values: compare the ratio, not GiB or tokens/s."]
    return Table("fig5_multinode", "Figure 5 — UPipe vs USP-Hybrid, Llama3-8B, 16 GPUs (8×2)",
                 pd.DataFrame(out, columns=cols), notes, ours)


# ----------------------------------------------------------------------------- attention memory

ATTN_SHAPES = {"llama3-8b": (32, 8), "qwen3-32b": (64, 8)}  # H, G
PAPER_ATTN = (("llama3-8b", 8), ("qwen3-32b", 8))  # the paper's micro-benchmark setups: C = 8


def _with_u(t: pd.DataFrame) -> pd.DataFrame:
    """Rows of our own Ulysses and UPipe (``MethodFacts.reference`` of those columns, without a
    mesh) without other options, with ``u`` = UPipe's U (None: Ulysses)."""
    if not len(t):
        return t.assign(u=pd.Series(dtype=object))
    column = {name: facts_of(name).column for name in t["method"].unique()
              if facts_of(name).reference and not facts_of(name).mesh}
    t = t[t["method"].map(column).isin(["ulysses", "upipe"])]
    plain = [not (set(o) - {"chunk_heads", "kernel"}) for o in t["options_dict"]]
    t = t[pd.Series(plain, index=t.index, dtype=bool)]
    u = [None if column[m] == "ulysses" else (o.get("chunk_heads") or ws)
         for m, o, ws in zip(t["method"], t["options_dict"], t["world_size"], strict=False)]
    return t.assign(u=pd.Series(u, index=t.index, dtype=object))


def heads_of(rows: pd.DataFrame, model: str) -> tuple[int, int]:
    """(H, G) of a model: from the rows' ``arch.*`` columns, else the paper's shapes."""
    if len(rows) and "arch.n_heads" in rows:
        sub = rows[(rows["model"] == model) & rows["arch.n_heads"].notna()]
        if len(sub):
            return int(sub["arch.n_heads"].iloc[0]), int(sub["arch.n_kv_heads"].iloc[0])
    return ATTN_SHAPES.get(model, (0, 0))


def attn_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """One attention block (scope ``attention``), Ulysses and UPipe, any model and world size;
    not the probes of a max-context search (their lengths are the bisection's, not a grid)."""
    t = trials(rows, scope="attention")
    if len(t):
        t = t[~t["search_probe"].astype(bool)]
    return _with_u(t)


def attn_setups(ours: pd.DataFrame) -> list[tuple[str, int]]:
    """(model, world size) to show: the paper's two first (always), then any other with rows."""
    extra = sorted({(m, int(w)) for m, w in zip(ours["model"], ours["world_size"], strict=False)} - set(PAPER_ATTN)) \
        if len(ours) else []
    return list(PAPER_ATTN) + extra


def activation_gib(row: pd.Series | None) -> float | None:
    """Peak minus the block's weights (and their gradients): the attention block's own memory."""
    if row is None or row["status"] != "ok" or is_missing(row.get("peak_gib")):
        return None
    cats = row.get("peak_by_category") or {}
    weights = sum(float(cats.get(k, 0)) for k in MODEL_CATS) / 2**30
    return float(row["peak_gib"]) - weights


def variant_name(u, h: int, c: int) -> str:
    if u is None:
        return "Ulysses"
    tag = " (= C)" if u == c else " (= H, Ulysses' heads)" if u == h else ""
    return f"UPipe U={u}{tag}"


def attn_memory_table(rows=None) -> Table:
    """Attention-block micro-benchmark: per-rank peak (GiB) and the reduction against Ulysses
    of the block's own memory (peak − weights), next to the paper's 1 − U/H. The paper's two
    setups (C = 8) first, then any other (e.g. the CPU variant) in its own rows."""
    rows = _rows(rows)
    ours = attn_rows(rows)
    reduction = load_paper("attn_memory_reduction")
    lengths = sorted(ours["seq_len"].unique()) if len(ours) else []
    cols = ["Setup", "Variant", "Quantity", "Mode, device"] + _seq_cols(lengths) + ["paper"]
    out = []
    for model, ws in attn_setups(ours):
        h, g = heads_of(rows, model)
        setup = f"{model} (H={h}, G={g}), C={ws}"
        sub = ours[(ours["model"] == model) & (ours["world_size"] == ws)] if len(ours) else ours
        ref = reduction[(reduction["model"] == model) & (reduction["ulysses_degree"] == ws)]
        paper_red = float(ref["reduction"].iloc[0]) if len(ref) else None
        if not len(sub):
            out.append([setup, f"UPipe U=C={ws}", "reduction vs Ulysses", "paper", *([MISSING] * len(lengths)),
                        f"{paper_red:.1%} per-stage intermediates (1 − U/H)" if paper_red is not None else MISSING])
            continue
        for ml, msub in sub.groupby("mode_label"):
            base = msub[msub["u"].isna()]
            variants = sorted(msub["u"].unique(), key=lambda u: -1 if u is None else u)
            for u in variants:
                vs = msub[msub["u"].isna()] if u is None else msub[msub["u"] == u]
                out.append([setup, variant_name(u, h, ws), "peak GiB per rank", ml]
                           + [cell(lookup(vs, s), "peak_gib", 2) for s in lengths] + [""])
            for u in [v for v in variants if v is not None]:
                vs = msub[msub["u"] == u]
                vals = []
                for s in lengths:
                    a, b = activation_gib(lookup(vs, s)), activation_gib(lookup(base, s)) if len(base) else None
                    vals.append(MISSING if a is None or b is None or b <= 0 else f"{1 - a / b:.1%}")
                if u == ws and paper_red is not None:
                    note = f"{paper_red:.1%} per-stage intermediates (1 − U/H)"
                else:
                    note = f"formula 1 − U/H = {1 - u / h:.1%} (not a paper number)" if h else ""
                out.append([setup, variant_name(u, h, ws), "reduction vs Ulysses (peak − weights)", ml]
                           + vals + [note])
    notes = ["One attention block forward + backward, per-rank peak; C = the world size (the Ulysses degree).",
             "The paper's 75% (Llama3-8B, H = 32) and 87.5% (Qwen3-32B, H = 64) are the per-stage reduction of "
             "attention intermediates (1 − U/H at U = C = 8); ours is the reduction of the whole block's memory "
             "(peak minus weights), which also holds UPipe's persistent output buffer, so it is expected lower.",
             "U = H processes every head in one stage (Ulysses' working set through UPipe's code path)."]
    return Table("attn_memory", "Attention-block memory: Ulysses vs UPipe over sequence length and U",
                 pd.DataFrame(out, columns=cols), notes, ours)


# ----------------------------------------------------------------------------- U ablation

def u_ablation_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows of a U ablation (our Ulysses and UPipe, ``_with_u``): any Llama3-8B training step on
    4 GPUs with the paper's levers (the authors' rebuttal setup, the ``u-ablation`` sweep), and,
    on a model the paper did not run (the sweep's CPU-scale variant), any setup (model, world
    size, scope, levers, mode) where UPipe ran at more than one U."""
    t = _with_u(trials(rows))
    if not len(t):
        return t
    setup = ["model", "world_size", "scope", "levers", "mode_label"]
    u_values = t.assign(_u=t["u"].astype(str).where(t["u"].notna(), None)).groupby(setup)["_u"].transform("nunique")
    other_scale = (u_values > 1) & ~t["model"].isin(PAPER_MODELS)
    rebuttal = (t["model"] == "llama3-8b") & (t["world_size"] == 4) & (t["scope"] == "model")
    rebuttal &= has_paper_levers(t)
    return t[other_scale | rebuttal]


def u_setups(ours: pd.DataFrame) -> list[tuple[str, int, str]]:
    """(model, world size, scope) of the U ablation, the paper-scale one first."""
    if not len(ours):
        return []
    found = {(m, int(w), s) for m, w, s in zip(ours["model"], ours["world_size"], ours["scope"], strict=False)}
    return sorted(found, key=lambda k: (k != ("llama3-8b", 4, "model"), k))


def u_ablation_table(rows=None) -> Table:
    """UPipe vs chunk size U (and Ulysses): tokens/s per GPU and peak GiB per sequence length."""
    rows = _rows(rows)
    ours = u_ablation_rows(rows)
    lengths = sorted(set(ours["seq_len"])) if len(ours) else [128 * 2**10, 256 * 2**10, 512 * 2**10, 2**20]
    cols = ["Setup", "Variant", "Quantity", "Mode, device"] + _seq_cols(lengths)
    out = []
    for model, ws, scope in u_setups(ours):
        sub = ours[(ours["model"] == model) & (ours["world_size"] == ws) & (ours["scope"] == scope)]
        h, _ = heads_of(rows, model)
        setup = f"{model}, {ws} ranks, {'training step' if scope == 'model' else 'attention block'}"
        for ml, msub in sub.groupby("mode_label"):
            for u in sorted(msub["u"].unique(), key=lambda u: -1 if u is None else u):
                vs = msub[msub["u"].isna()] if u is None else msub[msub["u"] == u]
                name = variant_name(u, h, ws)
                out.append([setup, name, "tokens/s per device", ml]
                           + [cell(lookup(vs, s), "tokens_per_s_per_device") for s in lengths])
                out.append([setup, name, "peak GiB", ml] + [cell(lookup(vs, s), "mem_gib", 2) for s in lengths])
    notes = ["The paper (v1) has no U ablation; the authors' rebuttal branch ran one (CHUNK_SIZE, Llama3-8B, "
             "Ulysses degree 4, 128K–1M) — no numbers of it are transcribed, so this table is ours only.",
             "Setups: the `u-ablation` sweeps (the paper-scale one on 4 GPUs, its CPU variant) and any Llama3-8B "
             "training step on 4 GPUs with the paper's levers."]
    if not len(ours):
        notes.append("No rows yet: `python -m sweeps run sweeps/configs/u-ablation.yaml --executor slurm` "
                     "(or `u-ablation-cpu.yaml --executor local`).")
    return Table("u_ablation", "U ablation — UPipe chunk size U (ours only)",
                 pd.DataFrame(out, columns=cols), notes, ours)


# ----------------------------------------------------------------------------- memory vs length

def memory_vs_seq_table(rows=None) -> Table:
    """Peak memory per GPU vs sequence length for each method on Table 3's setups; the paper
    has only two 128K anchors (unconfirmed, probably UPipe)."""
    rows = _rows(rows)
    anchors = load_paper("memory_anchors")
    out = []
    used = []
    cols = ["Setup", "Method", "Source", "Mode, device"] + _seq_cols(PAPER_LENGTHS)
    for setup in TABLE3_SETUPS:
        for a in anchors[anchors["model"] == setup.model].itertuples():
            out.append([setup.title, display_name(a.method) + " (unconfirmed)", "paper [3P]",
                        PAPER_MODE.format(gpus=a.gpus)]
                       + [fmt(a.peak_mem_gib, 2) if s == a.seq_len else MISSING for s in PAPER_LENGTHS])
        ours = table3_rows(rows, setup)
        used.append(ours)
        for key, sub in groups(ours):
            cells = [cell(lookup(sub, s), "mem_gib", 1) for s in PAPER_LENGTHS]
            out.append([setup.title, key[0], "ours", key[1]] + cells)
    notes = ["GiB per GPU: reserved peak where measured (CUDA), else allocated (simulated and CPU rows).",
             "The paper's per-method memory curves were not retrievable; its two 128K values come from a "
             "third-party listing and are probably UPipe's."]
    used_df = pd.concat(used) if any(len(u) for u in used) else rows.iloc[0:0]
    return Table("memory_vs_seq", "Peak memory vs sequence length per method (Table 3 setups)",
                 pd.DataFrame(out, columns=cols), notes, used_df)


# ----------------------------------------------------------------------------- compare methods

METRICS = {
    "tokens_per_s_per_device": ("tokens/s per device", 2),
    "mem_gib": ("peak GiB per device", 2),
    "tflops_per_device": ("TFLOP/s per device", 2),
    "step_time_s": ("step time (s)", 3),
}


def compare_methods(rows=None, metric: str = "tokens_per_s_per_device", model: str | None = None,
                    world_size: int | None = None, scope: str | None = None, mode: str | None = None,
                    highlight: str | None = None, lengths="grid") -> Table:
    """Every method present, side by side: max context (search, and longest run without OOM)
    and ``metric`` at each sequence length, one row per method/options and mode/device.

    ``rows`` None: the committed rows and the user's own (``load.user_dirs()``: ``runs/``), so a
    method's sweep shows up beside every committed one; rows of one sequence (with packed documents:
    ``analysis.documents``). Filters (``model``, ``world_size``, ``scope``, ``mode``) narrow the rows; ``highlight``
    names a method whose rows are marked and listed first. ``lengths``: ``"grid"`` (the lengths
    of trial rows other than a max-context search's probes, so the bisection's lengths do not
    each get a column; all lengths if there are no others), ``"all"``, or a list of token counts.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {list(METRICS)}, got {metric!r}")
    rows = _rows(load_rows(quiet=True, user_dirs=user_dirs()) if rows is None else rows)
    sel = rows
    for col, value in (("model", model), ("world_size", world_size), ("scope", scope), ("mode", mode)):
        if value is not None and len(sel):
            sel = sel[sel[col] == value]
    t = sel[sel["kind"] == "trial"] if len(sel) else sel
    if isinstance(lengths, str):
        if lengths not in ("grid", "all"):
            raise ValueError(f"lengths must be 'grid', 'all' or a list of token counts, got {lengths!r}")
        every = sorted(t["seq_len"].unique()) if len(t) else []
        if lengths == "grid" and len(t):
            grid = sorted(t[~t["search_probe"].astype(bool)]["seq_len"].unique())
            every = grid or every
        lengths = every
    else:
        lengths = sorted(int(s) for s in lengths)
    mx = our_max_context(sel)
    what, digits = METRICS[metric]
    cols = ["", "Method", "Model", "Ranks", "Scope", "Mode, device", "Max context (search)", "Longest run w/o OOM"] \
        + _seq_cols(lengths)
    series = {}
    key_cols = ["label", "model", "world_size", "scope", "mode_label"]
    keys = zip(*(sel[c] for c in key_cols), strict=True) if len(sel) else ()
    for key, method in zip(keys, sel["method"] if len(sel) else (), strict=True):
        series.setdefault(key, method)
    # each series' rows, by one grouping instead of five comparisons over every row per series (the rows of a
    # group keep their order; a key with a missing value matches nothing, as an equality test would not)
    mx_by = dict(iter(mx.groupby(key_cols, sort=False))) if len(mx) else {}
    t_by = dict(iter(t.groupby(key_cols, sort=False))) if len(t) else {}
    out = []
    for key, method in sorted(series.items(), key=lambda kv: (kv[1] != highlight, family_order(family(kv[1])), kv[0])):
        label, mdl, ws, sc, ml = key
        m = mx_by.get(key, mx.iloc[:0])
        search = m[m["kind"] == "search"] if len(m) else m
        runs = m[m["kind"] == "runs"] if len(m) else m
        s_txt = MISSING if not len(search) else max_ctx_cell(search.iloc[0])
        r_txt = MISSING if not len(runs) or sc != "model" else _max_ctx_text(runs.iloc[0]["max_seq_len"],
                                                                            bool(runs.iloc[0]["lower_bound"]))
        sub = t_by.get(key, t.iloc[:0])
        out.append(["◀" if method == highlight else "", label, mdl, ws, sc, ml, s_txt, r_txt]
                   + [cell(lookup(sub, s), metric, digits) for s in lengths])
    notes = [f"Cells: {what} at each sequence length; OOM, error, fits (ran; not measured in that mode), — (no row)."
             " Columns: the lengths run outside max-context searches (their probes' lengths are left out).",
             "Max context: our max-context search rows, and the longest length trial rows with the paper's "
             "levers ran without OOM (≥: nothing longer was tried or it ran at the longest length).",
             "Rows in different modes or on different devices are not comparable number for number."]
    if metric == "mem_gib":  # which peak (analysis.load's mem_basis); the sweep's progress lines say it too
        notes.append("Peak GiB: the reserved peak where the row has one (CUDA's max_memory_reserved, or a "
                     "simulation's allocator model, as the paper stack's), else the allocated peak.")
    if highlight:
        notes.append(f"◀ marks {highlight!r}." + ("" if highlight in series.values() else
                                                  f" No rows of {highlight!r} match the filters."))
    title = f"Compare methods — {what}" + "".join(
        f", {k} {v}" for k, v in (("model", model), ("ranks", world_size), ("scope", scope), ("mode", mode)) if v)
    return Table("compare_methods" if metric == "tokens_per_s_per_device" else f"compare_methods_{metric}",
                 title, pd.DataFrame(out, columns=cols), notes, sel)
