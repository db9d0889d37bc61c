"""Sweep specs: a YAML file crossing methods, models, sequence lengths and world sizes.

A spec is validated on load and expands into ``bench.measure.trial.Trial`` objects, the same
trials ``python -m bench`` runs, with typed method options; every error names the bad key and
what is allowed. Example::

    name: table3-llama3-8b          # rows go to runs/sweeps/<name>.jsonl unless `out:` says otherwise
    kind: trial                     # trial (one row per trial) | max_context (a search per trial)
    mode: real                      # real | emulated | simulated
    scope: model                    # model | attention
    dtype: bf16
    device: h100-80g                # device preset (python -m bench list)
    models: [llama3-8b]
    seq_lens: [128K, 256K, 1M]      # human sizes, K = 1024
    world_sizes: [8]                # ranks (GPUs) per trial
    methods:
      - upipe                       # a bare name: default options
      - {name: upipe, options: {chunk_heads: 16}}
    step: {ac: true, ac_offload: true, tiled_mlp: true}        # training-step levers (StepConfig), warmup, iters, smoke
    max_context: {granularity: 256K, max_seq_len: 16M}         # kind: max_context only (Search, and layers:)
    docs: [none, prolong64k:1, {distribution: pile, seed: 2}, {lengths: [64K, 64K]}, {lengths_file: f.txt}]
    slurm: {partition: gpu, account: null, time_min: 60, gpus_per_node: 8, constraint: h100}

``max_context.layers`` says how a simulated search's probes of a model deeper than 4 layers
are simulated: ``extrapolate`` (the default) from 3- and 4-layer simulations extrapolated over
the layers (``bench.search.extrapolate``, as ``python -m bench max-context
--extrapolate-layers``: several times faster, exact in the live bytes, and the rows say so in
their notes), or ``full`` (the whole model, each probe in its own process). The default falls
back to ``full`` where the rule does not hold (two-level checkpoints, ``ac_group`` > 1) and
does nothing outside simulated mode; ``layers: extrapolate`` written there is an error. A
``kind: trial`` spec says the same in a top-level ``layers:`` key, whose default is ``full``
(``extrapolate``: as ``python -m bench run --extrapolate-layers``).

``docs`` (optional) lists the packed documents to cross with everything else
(``records.workloads.DocsSpec``): ``none`` is one sequence (the default, ``[none]``), a string
``NAME[:SEED]`` a distribution (``records/workloads/data/README.md``) and a seed, a mapping
explicit lengths or a file of them. Each entry is checked on load, one line per bad entry.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.measure.config import StepConfig
from bench.measure.trial import Search, Trial
from bench.resolve import Request, resolve
from bench.training.presets import expand
from records import DType, Kind, Mode, Scope
from records import parse_size as parse_tokens
from records.outputs import OutputError, check_file, runs_dir
from records.workloads import DocsSpec

TOP_KEYS = {
    "name", "kind", "mode", "scope", "dtype", "device", "models", "seq_lens", "world_sizes",
    "methods", "step", "max_context", "slurm", "out", "description", "docs", "layers",
}
SLURM_KEYS = {
    "partition", "account", "time_min", "gpus_per_node", "cpus_per_task", "mem_gb",
    "constraint", "qos", "max_parallel", "tasks_per_gpu",
}
TRIAL_KEYS = {"warmup", "iters", "smoke"}  # per-trial settings a spec's `step:` may also set
STEP_KEYS = {f.name for f in dataclasses.fields(StepConfig)} - {"scope", "dtype"} | TRIAL_KEYS
OLD_KINDS = {"run": Kind.TRIAL, "max-context": Kind.MAX_CONTEXT}
REQUIRED_KEYS = ("name", "mode", "models", "world_sizes", "methods")  # and seq_lens for kind: trial
LAYERS = ("extrapolate", "full")  # layers (max_context.layers): how a simulated trial (search) simulates a deep model
DEEP = 4  # models deeper than this are extrapolated (bench.search.extrapolate simulates 3 and 4 layers)


class SpecError(ValueError):
    """A sweep spec is invalid; the message names the key and the allowed values."""


def parse_size(value: Any, key: str = "size") -> int:
    """``128K`` -> 131072, ``1.5M`` -> 1572864, ``4096`` -> 4096 (K = 1024): ``records.sizes``."""
    try:
        return parse_tokens(value, key)
    except ValueError as err:
        raise SpecError(str(err)) from None


@dataclass(frozen=True)
class MethodEntry:
    name: str
    options: tuple[tuple[str, Any], ...] = ()
    step: tuple[tuple[str, Any], ...] = ()  # training-step levers for this entry, over the spec's
    preset: str | None = None  # the named configuration this entry was written as (upipe-best), if any

    @property
    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)


@dataclass
class SweepSpec:
    name: str
    kind: str
    mode: str
    scope: str
    dtype: str
    device: str
    models: list[str]
    seq_lens: list[int]
    world_sizes: list[int]
    methods: list[MethodEntry]
    step: dict[str, Any] = field(default_factory=dict)
    max_context: dict[str, Any] = field(default_factory=dict)
    slurm: dict[str, Any] = field(default_factory=dict)
    out: str | None = None
    source: str = ""
    layers: str | None = None  # layers (kind trial; None: full) or max_context.layers (None: extrapolate where exact)
    docs: list[DocsSpec | None] = field(default_factory=lambda: [None])  # packed documents; None: one sequence

    @property
    def rows_path(self) -> Path:
        """``out:`` if the spec (or ``--set out=...``) names one, else ``runs/sweeps/<name>.jsonl``
        under the working directory (``records.outputs.runs_dir``): a user's sweep never writes
        into the committed ``results/`` unless asked."""
        return Path(self.out) if self.out else runs_dir() / "sweeps" / f"{self.name}.jsonl"

    def extrapolates(self, trial: Trial) -> bool:
        """Whether this trial (or this search's probes) is extrapolated over layers: simulated, a model
        deeper than 4 layers, one checkpoint per block, and ``layers: extrapolate`` for a trial (the
        default simulates the whole model) or not ``max_context.layers: full`` for a search."""
        wanted = self.layers != "full" if trial.kind == Kind.MAX_CONTEXT else self.layers == "extrapolate"
        return (wanted and trial.mode == "simulated" and trial.step.ac_group == 1
                and trial.config().n_layers > DEEP)

    def problems(self, libraries: bool = False) -> list[str]:
        """Every reason a trial of this spec would be refused, one line each, found before anything
        is submitted: unknown method, model, device or link, a method option or constraint that a
        model and world size of the spec violate, a length the layout cannot split, an output
        path that cannot be written. Checks that need the compute node (CUDA, GPU count) wait, and
        so do the methods' optional libraries (``Trial.needs``) unless ``libraries``: a local
        executor runs the trials here, so this machine is the compute node."""
        out: list[str] = []
        seen: set[str] = set()
        try:
            check_file(self.rows_path, "rows file (out:)")
        except OutputError as err:
            out.append(str(err))
        for trial in self.trials():
            try:
                trial.validate(here=False, libraries=libraries)
            except ValueError as err:
                opts = ",".join(f"{k}={v}" for k, v in sorted(trial.requested_opts().items()))
                where = f"{trial.method}{f'[{opts}]' if opts else ''} on {trial.model} x{trial.world_size}"
                if trial.docs is not None:
                    where += f" with docs {trial.docs.label}"
                message = str(err).splitlines()[0]
                line = f"{where}: {message}"
                if trial.kind == Kind.TRIAL and "sequence length" in message:
                    line = f"{where} at {trial.seq_len}: {message}"
                if line not in seen:
                    seen.add(line)
                    out.append(line)
        return out

    def trial(self, entry: MethodEntry, model: str, world_size: int, seq_len: int,
              docs: DocsSpec | None = None) -> Trial:
        """One trial of the spec (``ValueError`` when the entry's options or levers are invalid)."""
        levers = {**self.step, **dict(entry.step), "scope": self.scope, "dtype": self.dtype}
        per_trial = {k: levers.pop(k) for k in TRIAL_KEYS if k in levers}
        search = Search(**self.max_context) if self.kind == Kind.MAX_CONTEXT else None
        request = Request(entry.preset or entry.name, model, search.granularity if search else seq_len, world_size,
                          entry.options_dict, mode=self.mode, device=self.device, levers=levers, search=search,
                          docs=docs, **per_trial)
        return resolve(request, validate=False)  # problems() validates every trial, for the submitting side

    def trials(self) -> list[Trial]:
        """The cross product, in a stable order (methods outermost, then models, sizes, lengths, documents)."""
        lengths = self.seq_lens if self.kind == Kind.TRIAL else [0]
        return [self.trial(m, model, ws, seq, docs) for m, model, ws, seq, docs
                in itertools.product(self.methods, self.models, self.world_sizes, lengths, self.docs)]


def _choice(raw: dict, key: str, allowed: tuple[str, ...], default: str | None = None) -> str:
    value = raw.get(key, default)
    if value not in allowed:
        raise SpecError(f"{key}: {value!r} is not allowed; choose one of {list(allowed)}")
    return value


def _list(raw: dict, key: str) -> list:
    value = raw.get(key)
    if value is None:
        raise SpecError(f"{key}: missing (a list is required)")
    if not isinstance(value, list) or not value:
        raise SpecError(f"{key}: expected a non-empty list, got {value!r}")
    return value


def _methods(raw: list) -> list[MethodEntry]:
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            out.append(MethodEntry(item))
        elif isinstance(item, dict) and set(item) <= {"name", "options", "step"} and "name" in item:
            for key in ("options", "step"):
                if not isinstance(item.get(key) or {}, dict):
                    raise SpecError(f"methods[{i}].{key}: expected a mapping, got {item[key]!r}")
            out.append(MethodEntry(str(item["name"]), tuple(sorted((item.get("options") or {}).items())),
                                   tuple(sorted((item.get("step") or {}).items()))))
        else:
            out.append(None)
        if out[-1] is not None:  # a named configuration (bench.training.presets, e.g. upipe-best)
            e = out[-1]
            try:
                name, opts, step = expand(e.name, e.options_dict, dict(e.step))
            except ValueError as err:
                raise SpecError(f"methods[{i}]: {err}") from None
            out[-1] = MethodEntry(name, tuple(sorted(opts.items())), tuple(sorted(step.items())),
                                  preset=e.name if name != e.name else None)
        if out[-1] is None:
            raise SpecError(
                f"methods[{i}]: expected a method name or {{name: ..., options: {{...}}, step: {{...}}}}, "
                f"got {item!r}"
            )
    return out


def _docs(raw: dict) -> list[DocsSpec | None]:
    """The spec's ``docs`` entries (``[None]``, one sequence, when it has none)."""
    if "docs" not in raw:
        return [None]
    value = raw["docs"]
    entries = value if isinstance(value, list) else [value]
    if not entries:
        raise SpecError("docs: expected a non-empty list (none, NAME[:SEED], {lengths: [...]}, ...) or leave it out")
    out = []
    for i, entry in enumerate(entries):
        try:
            out.append(DocsSpec.from_value(entry, f"docs[{i}]" if isinstance(value, list) else "docs"))
        except ValueError as err:
            raise SpecError(str(err)) from None
    if len(set(out)) != len(out):
        raise SpecError(f"docs: an entry is repeated ({[d.label if d else 'none' for d in out]}); list each once")
    return out


def _missing_keys(raw: dict) -> str:
    """The required keys ``raw`` lacks, written as keys (``name:, mode:``); empty when none."""
    kind = raw.get("kind", Kind.TRIAL.value)
    kind = OLD_KINDS.get(kind, kind) if isinstance(kind, str) else kind
    required = REQUIRED_KEYS + (("seq_lens",) if kind == Kind.TRIAL else ())
    return ", ".join(f"{key}:" for key in required if key not in raw)


def parse_spec(raw: Any, source: str = "<spec>") -> SweepSpec:
    """Validate a loaded YAML mapping into a ``SweepSpec``."""
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: a sweep spec is a mapping of keys, got {type(raw).__name__}")
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise SpecError(f"{source}: unknown key(s) {unknown}; allowed keys: {sorted(TOP_KEYS)}")
    missing = _missing_keys(raw)
    if missing:
        raise SpecError(f"{source}: missing required key(s) {missing} (see sweeps/configs/ for complete specs)")
    name = raw.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name or ""):
        raise SpecError(f"name: expected a file-name-safe string (letters, digits, . _ -), got {name!r}")
    if raw.get("kind") in OLD_KINDS:
        raise SpecError(f"kind: {raw['kind']!r} is now spelled {OLD_KINDS[raw['kind']].value!r} "
                        f"(as in result rows); choose one of {list(Kind.values())}")
    kind = _choice(raw, "kind", Kind.values(), Kind.TRIAL.value)
    world_sizes = []
    for ws in _list(raw, "world_sizes"):
        if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
            raise SpecError(f"world_sizes: each entry must be a positive int, got {ws!r}")
        world_sizes.append(ws)
    seq_lens = [parse_size(s, "seq_lens") for s in raw.get("seq_lens") or []]
    if kind == Kind.TRIAL and not seq_lens:
        raise SpecError("seq_lens: missing (kind: trial needs at least one sequence length)")
    maxctx_keys = {f.name for f in dataclasses.fields(Search)} | {"layers"}
    for key, allowed in (("slurm", SLURM_KEYS), ("max_context", maxctx_keys)):
        sub = raw.get(key) or {}
        if not isinstance(sub, dict):
            raise SpecError(f"{key}: expected a mapping, got {sub!r}")
        bad = sorted(set(sub) - allowed)
        if bad:
            raise SpecError(f"{key}: unknown key(s) {bad}; allowed: {sorted(allowed)}")
    max_context = {k: parse_size(v, f"max_context.{k}") for k, v in (raw.get("max_context") or {}).items()
                   if k != "layers"}
    layers_key = "max_context.layers" if kind == Kind.MAX_CONTEXT else "layers"
    if kind == Kind.MAX_CONTEXT and "layers" in raw:
        raise SpecError("layers: a max_context spec says how its probes are simulated in max_context.layers; "
                        "move it there")
    layers = (raw.get("max_context") or {}).get("layers") if kind == Kind.MAX_CONTEXT else raw.get("layers")
    if layers is not None and layers not in LAYERS:
        raise SpecError(f"{layers_key}: {layers!r} is not allowed; choose one of {list(LAYERS)}")
    step = raw.get("step") or {}
    if not isinstance(step, dict):
        raise SpecError(f"step: expected a mapping of training-step levers, got {step!r}")
    entries = _methods(_list(raw, "methods"))
    for where, levers in [("step", step)] + [(f"methods[{i}].step", dict(e.step)) for i, e in enumerate(entries)]:
        bad = sorted(set(levers) - STEP_KEYS)
        if bad:
            raise SpecError(f"{where}: unknown lever(s) {bad}; allowed: {sorted(STEP_KEYS)}")
    models = [str(m) for m in _list(raw, "models")]
    docs = _docs(raw)
    spec = SweepSpec(
        name=name, kind=kind, mode=_choice(raw, "mode", Mode.values()),
        scope=_choice(raw, "scope", Scope.values(), Scope.MODEL.value),
        dtype=_choice(raw, "dtype", DType.values(), DType.BF16.value), device=str(raw.get("device", "cpu")),
        models=models, seq_lens=seq_lens, world_sizes=world_sizes, methods=entries, step=step,
        max_context=max_context, slurm=dict(raw.get("slurm") or {}), out=raw.get("out"), source=source,
        layers=layers, docs=docs,
    )
    if layers == "extrapolate" and spec.mode != "simulated":
        raise SpecError(f"{layers_key}: extrapolate extrapolates simulations, and this spec's mode is "
                        f"{spec.mode}: drop it or use mode: simulated")
    for i, entry in enumerate(entries):  # typed options and levers: refused here, before anything runs
        try:
            trial = spec.trial(entry, models[0], world_sizes[0], seq_lens[0] if seq_lens else 1)
        except (ValueError, TypeError) as err:
            raise SpecError(f"methods[{i}] ({entry.name}): {err}") from None
        if layers == "extrapolate" and trial.step.ac_group > 1:
            raise SpecError(f"methods[{i}] ({entry.name}): {layers_key}: extrapolate is linear in the "
                            f"layers and ac_group {trial.step.ac_group}'s host peak is not; drop one of them")
    return spec


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> SweepSpec:
    """Read and validate a YAML spec; ``overrides`` replace top-level or ``slurm.*`` keys."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such sweep spec (see sweeps/configs/ for the paper's)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(f"{where}: not valid YAML: {problem}") from None
    empty = raw is None  # an empty file (or only comments)
    if empty:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a sweep spec is a mapping of keys, got {type(raw).__name__}")
    for key, value in (overrides or {}).items():
        if key.startswith("slurm."):
            slurm = raw.setdefault("slurm", {})
            if not isinstance(slurm, dict):
                raise SpecError(f"{path}: slurm: expected a mapping, got {slurm!r}")
            slurm[key[len("slurm."):]] = value
        else:
            raw[key] = value
    if empty and _missing_keys(raw):
        raise SpecError(f"{path}: the spec is empty; write its required key(s) {_missing_keys(raw)} "
                        f"(see sweeps/configs/ for complete specs)")
    return parse_spec(raw, str(path))
