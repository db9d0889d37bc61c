"""``Trial``: the suite's one unit of work, from a sweep spec or the CLI to a result row.

A trial is pure data: a method with its **typed** options (the method's ``Options``
dataclass), a model, a sequence length, a world size, a mode, a device preset, the
training-step levers (``StepConfig``) and, for a max-context search, its ``Search``
parameters. The sweeps expand a spec into trials, send each to a job as JSON
(``to_json``/``from_json``), and decide whether it already ran by ``key()``, which is
``records.trial_key`` of the row fields the trial will write (``row_fields``).

Packed documents are the field ``docs`` (``records.workloads.DocsSpec``: a distribution and a
seed, or explicit lengths; None: one sequence): ``check`` refuses a method that does not honour
them, and lengths that do not tile the sequence, in one line before any work; the row records
them (``Row.docs``) and they are part of the trial's identity. The step runs them
(``bench.training.step``: every attention block keeps within the documents) in every mode.

Requests that are resolved before a trial runs are explicit fields, never option values:
``auto_chunk`` asks ``bench.search.autochunk`` to pick UPipe's ``chunk_heads`` by
simulation. Its spelling in ``--opt``, specs and rows is ``chunk_heads=auto``; ``make``
is the one place that reads it, and the methods never see it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

import methods
from methods.core.base import MethodOptions
from methods.core.kernels import default_kernel_name
from records import Kind, Mode, human, trial_key
from records.sizes import parse_size
from records.workloads import DocsSpec

from ..model.config import ModelConfig, get_config
from ..stackmodel import fake_flash_attn
from ..stackmodel.hardware import DevicePreset, LinkModel, get_device, get_link
from . import launch
from .config import SIMULATION_ONLY, StepConfig
from .timing import MIN_TIMED_STEPS

AUTO = "auto"  # how the auto-chunk request is written in --opt, sweep specs and rows
AUTO_OPTION = "chunk_heads"
AUTO_METHODS = ("upipe", "usp-upipe")
STACK_SUFFIX = "-stack"  # a stack's name among a resolution's presets ("paper-stack")
_POOLS_DEFAULT = StepConfig().allocator_pools  # what a trial that models no allocator leaves the pools at


@dataclass(frozen=True)
class AutoChunk:
    """Request: the largest ``chunk_heads`` whose simulated peak fits the device preset
    (resolved by ``bench.search.autochunk`` before the trial runs)."""

    option: str = AUTO_OPTION


@dataclass(frozen=True)
class Resolution:
    """What a trial runs once its presets have filled in what the request left open
    (``bench.resolve``): every lever as it runs, the presets that set them, a note per term."""

    step: StepConfig
    presets: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, step: StepConfig, method: str, presets: tuple[str, ...] = ()) -> Resolution:
        """The stack's terms applied to ``step`` (``bench.stackmodel.stack.apply``), after ``presets``
        that were resolved before the trial existed (a named configuration such as upipe-best)."""
        from ..stackmodel import stack  # the stack reads the trial's levers; it imports no trial

        ran, notes = stack.apply(step, method)
        stacks = (f"{step.stack}{STACK_SUFFIX}",) if step.stack != "lean" else ()
        return cls(ran, tuple(presets) + stacks, tuple(notes))


@dataclass(frozen=True)
class Search:
    """A max-context search: answer exact to ``granularity`` tokens (rounded up to the
    method's layout multiple), lengths up to ``max_seq_len``, first probe at ``start``."""

    granularity: int = 128 << 10
    max_seq_len: int = 16 << 20
    start: int | None = None

    def __post_init__(self) -> None:
        for name in ("granularity", "max_seq_len") + (("start",) if self.start is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"max-context {name} must be a positive number of tokens, got {value!r}")
        if self.start is not None and self.start > self.max_seq_len:
            raise ValueError(f"--start {self.start} is beyond --max-seq-len {self.max_seq_len}")

    @classmethod
    def parse(cls, raw: dict[str, Any], what: str = "max_context") -> Search:
        """From human sizes (``{"granularity": "256K", "max_seq_len": "16M"}``)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{what}: unknown key(s) {unknown}; allowed: {sorted(known)}")
        return cls(**{k: None if v is None else parse_size(v, f"{what}.{k}") for k, v in raw.items()})


def parse_options(method: str, raw: dict[str, Any] | MethodOptions | None) -> tuple[MethodOptions, AutoChunk | None]:
    """Typed options of ``method`` from a mapping, and the auto-chunk request if one is made.

    The one reader of ``chunk_heads=auto``; every other option goes through the method's
    ``parse_options`` (unknown names and wrong types are refused there)."""
    cls = methods.get_info(method).cls
    if isinstance(raw, MethodOptions):
        if not isinstance(raw, cls.Options):
            raise ValueError(f"options {raw!r} are not {method}'s ({cls.Options.__name__})")
        return raw, None
    raw = dict(raw or {})
    auto = None
    if raw.get(AUTO_OPTION) == AUTO:
        if method not in AUTO_METHODS:
            raise ValueError(f"{AUTO_OPTION}='{AUTO}' is only for {list(AUTO_METHODS)}, not {method!r}")
        raw.pop(AUTO_OPTION)
        auto = AutoChunk()
    return cls.parse_options(**raw), auto


def options_dict(options: MethodOptions) -> dict[str, Any]:
    """The options that differ from the method's defaults (what a row records)."""
    defaults = type(options)()
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
            if getattr(options, f.name) != getattr(defaults, f.name)}


_VALIDATED: set[tuple] = set()  # (trial, checks) that passed Trial.validate in this process


@dataclass(frozen=True)
class Trial:
    method: str
    model: str  # a named config or a JSON/YAML path
    seq_len: int  # tokens; for a max-context search, its current probe (ignored by the key)
    world_size: int
    options: MethodOptions = field(default=None)  # type: ignore[assignment]  # None: the defaults
    mode: str = Mode.SIMULATED
    device: str = "h100-80g"
    step: StepConfig = StepConfig()
    link: str | None = None  # None: the device preset's default
    warmup: int = 1
    iters: int = MIN_TIMED_STEPS  # timed steps (real/emulated): their median, min and max are recorded
    smoke: bool = False  # allows fewer than MIN_TIMED_STEPS timed steps (a wiring check; the row says so)
    seed: int = 0
    threads: int | None = None  # torch CPU threads per rank (real/emulated); None: as launched
    kind: str = Kind.TRIAL
    search: Search | None = None  # kind max_context only
    auto_chunk: AutoChunk | None = None
    resolution: Resolution | None = None  # set by bench.resolve; None: the stack's terms only (resolved())
    docs: DocsSpec | None = None  # packed documents (records.workloads); None: one sequence

    def __post_init__(self) -> None:
        if self.options is None:
            object.__setattr__(self, "options", methods.get_info(self.method).cls.Options())
        if self.kind not in Kind.values():
            raise ValueError(f"kind must be one of {list(Kind.values())}, got {self.kind!r}")
        if (self.kind == Kind.MAX_CONTEXT) != (self.search is not None):
            raise ValueError("a max_context trial needs its Search parameters, and only it has them")
        if self.docs is not None and not isinstance(self.docs, DocsSpec):
            raise ValueError(f"docs must be a records.workloads.DocsSpec, got {type(self.docs).__name__}")

    @classmethod
    def make(cls, method: str, model: str, seq_len: int, world_size: int,
             options: dict[str, Any] | MethodOptions | None = None, **kwargs) -> Trial:
        """A trial from an options mapping as a user writes it (``chunk_heads: auto`` included)."""
        typed, auto = parse_options(method, options)
        return cls(method, model, seq_len, world_size, options=typed, auto_chunk=auto, **kwargs)

    # ------------------------------------------------------------------ views
    @property
    def opts(self) -> dict[str, Any]:
        """The options that differ from the defaults, as ``methods.build`` takes them."""
        return options_dict(self.options)

    def requested_opts(self) -> dict[str, Any]:
        """``opts`` plus the requests (``chunk_heads: auto``): the options as the user asked."""
        return {**self.opts, AUTO_OPTION: AUTO} if self.auto_chunk else self.opts

    def with_seq_len(self, seq_len: int) -> Trial:
        return dataclasses.replace(self, seq_len=seq_len)

    def probe(self, seq_len: int) -> Trial:
        """One trial of a max-context search at ``seq_len``."""
        return dataclasses.replace(self, kind=Kind.TRIAL, search=None, seq_len=seq_len)

    def with_options(self, options: MethodOptions) -> Trial:
        return dataclasses.replace(self, options=options, auto_chunk=None)

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.requested_opts().items()))
        what = f"{self.method}[{opts}]" if opts else self.method
        size = "max-context" if self.kind == Kind.MAX_CONTEXT else human(self.seq_len)
        docs = f" docs={self.docs.label}" if self.docs is not None else ""
        return f"{what} {self.model} {size}{docs} x{self.world_size} {self.mode}"

    # ------------------------------------------------------------------ resolution
    def resolved(self) -> Resolution:
        """What this trial runs: its resolution, or for a trial built without the resolver (a test,
        a library caller) the stack's terms applied to its levers."""
        return self.resolution or Resolution.of(self.step, self.method)

    def config(self) -> ModelConfig:
        return get_config(self.model)

    def preset(self) -> DevicePreset:
        return get_device(self.device)

    def link_model(self) -> LinkModel:
        return get_link(self.link or self.preset().link)

    def method_cls(self):
        return methods.get_info(self.method).cls

    def seq_multiple(self) -> int:
        return self.method_cls().seq_multiple(self.world_size, self.options)

    def search_step(self) -> int:
        """A search's length step: its granularity rounded up to the layout multiple."""
        return math.lcm(self.search.granularity, self.seq_multiple())

    def kernel_name(self) -> str:
        return self.options.kernel or default_kernel_name()

    def documents(self):
        """The ``methods.Documents`` of this trial's sequence (None: one sequence); a max-context
        search's are those of its current probe length."""
        return None if self.docs is None else self.docs.documents(self.seq_len)

    # ------------------------------------------------------------------ checks
    def supplies(self) -> tuple[str, ...]:
        """Optional modules this trial supplies itself: simulated mode (and an emulated run that
        skips the attention arithmetic) supplies a memory-faithful flash-attn where none is installed."""
        skip_math = self.step.attention_math == "skip"
        return fake_flash_attn.PROVIDES if self.mode == Mode.SIMULATED or skip_math else ()

    def needs(self) -> tuple[str, ...]:
        """The optional modules the machine that runs this trial must import (its own supplies aside)."""
        return tuple(m for m in methods.get_info(self.method).requires if m not in self.supplies())

    def validate(self, check_seq_len: bool = True, here: bool = True, libraries: bool = True) -> None:
        """:meth:`check`, once per process for each trial and set of checks: the resolver
        (``bench.resolve``) validates, and the layers a trial passes through afterwards (the run,
        a search, its probes) ask again at no cost. Only a trial that passed is remembered."""
        memo = (self, check_seq_len, here, libraries)
        try:
            if memo in _VALIDATED:
                return
        except TypeError:  # options a method made unhashable: checked every time
            self.check(check_seq_len, here, libraries)
            return
        self.check(check_seq_len, here, libraries)
        _VALIDATED.add(memo)

    def check(self, check_seq_len: bool = True, here: bool = True, libraries: bool = True) -> None:
        """Every check that needs no computation; raises ``ValueError`` saying what to fix.

        ``here=False`` leaves out what only the machine that runs the trial can answer (CUDA
        present, enough GPUs): a sweep checks its trials on a login node before submitting.
        ``libraries=False`` leaves out whether the method's optional libraries (``needs``) import
        here: a sweep submitted to other machines leaves that to them, as CUDA."""
        Mode.parse(self.mode, "mode")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world size must be a positive integer, got {self.world_size!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"sequence length must be a positive integer, got {self.seq_len!r}")
        cfg = self.config()
        preset = self.preset()
        self.link_model()
        simulated = self.mode == Mode.SIMULATED
        skip_math = self.step.attention_math == "skip"
        if skip_math and self.mode != Mode.EMULATED:
            raise ValueError(f"attention_math='skip' skips the attention kernels' arithmetic to measure an emulated "
                             f"rank's memory; in {self.mode} mode it would falsify the run: use --mode emulated, "
                             f"or drop --attention-math skip")
        provided = self.supplies() if libraries else self.supplies() + self.needs()
        if self.docs is not None and self.docs.lengths is not None and self.kind == Kind.MAX_CONTEXT:
            raise ValueError("explicit document lengths fix the sequence length, which a max-context search varies; "
                             "give a distribution (--docs NAME[:SEED]) or run single trials")
        methods.validate(self.method, cfg.attn_spec(), self.world_size, provided=provided,
                         docs=self.documents(), **self.opts)
        refusal = self.method_cls().simulated_documents_refusal
        if (simulated or skip_math) and self.docs is not None and refusal:
            where = "simulated mode" if simulated else "an emulated run that skips the attention arithmetic"
            raise ValueError(f"method {self.method!r} cannot run packed documents in {where}: {refusal}; "
                             f"run it in real mode (or emulated, computing its attention), or without --docs")
        if (simulated or skip_math) and fake_flash_attn.needs_it(methods.get_info(self.method).requires):
            fake_flash_attn.check_fresh()
        if check_seq_len and self.kind == Kind.TRIAL:
            self.method_cls().check_seq_len(self.seq_len, self.world_size, self.options)
        if here and self.mode in (Mode.REAL, Mode.EMULATED) and preset.kind == "cuda" \
                and not torch.cuda.is_available():
            raise ValueError(
                f"mode {self.mode!r} on device preset {self.device!r} needs CUDA, which this machine "
                f"lacks; use --device cpu, or --mode simulated"
            )
        if here and self.mode == Mode.REAL and preset.kind == "cuda" and launch.launched_env() is None \
                and self.world_size > torch.cuda.device_count():
            raise ValueError(
                f"real mode with {self.world_size} ranks needs {self.world_size} GPUs here "
                f"({torch.cuda.device_count()} found); launch with torchrun/submitit across nodes, "
                f"or use --mode emulated/simulated"
            )
        if self.step.ac_group > cfg.n_layers:
            raise ValueError(f"ac_group={self.step.ac_group} blocks per outer checkpoint, but {cfg.name} has "
                             f"{cfg.n_layers} layers; use --ac-group 1..{cfg.n_layers}")
        if self.step.fused_attn_norm and not getattr(self.method_cls(), "accepts_input_norm", False):
            raise ValueError(f"fused_attn_norm: method {self.method!r} cannot run the block's RMSNorm inside its "
                             f"projections (only upipe and fpdt can); drop fused_attn_norm")
        if self.step.ac_keep_attn and not (self.method_cls().calls_suite_kernel and self.kernel_name() == "torch"):
            why = (f"kernel {self.kernel_name()!r} runs no torch flash-attention op (use kernel torch)"
                   if self.method_cls().calls_suite_kernel else "its library calls its attention kernel itself")
            raise ValueError(f"ac_keep_attn keeps the outputs of the suite's torch attention kernel, which method "
                             f"{self.method!r} does not call: {why}; drop ac_keep_attn")
        if self.mode != Mode.SIMULATED:
            defaults = {f.name: f.default for f in dataclasses.fields(StepConfig)}
            for name, what, instead, fix in SIMULATION_ONLY:
                value = getattr(self.step, name)
                if value != defaults[name]:
                    raise ValueError(f"{name}={value!r} {what}; in {self.mode} mode {instead}: {fix}")
        elif self.step.allocator_pools != _POOLS_DEFAULT and self.resolved().step.allocator_model == "none":
            raise ValueError(f"allocator_pools={self.step.allocator_pools!r} picks the pools of the simulated caching "
                             f"allocator, which this trial does not model (allocator_model 'none' under the "
                             f"{self.step.stack} stack): add --allocator-model expandable (or classic), or drop it")
        if self.step.chunked_loss_impl == "deepspeed" and self.mode == Mode.SIMULATED:
            # its backward branches on `grads[0] != 1.0`, a value (.item()) fake tensors do not have
            raise ValueError(
                "chunked_loss_impl='deepspeed' cannot be simulated: DeepSpeed's TiledFusedLogitsLoss.backward "
                "tests the incoming gradient's value (grads[0] != 1.0), which FakeTensorMode does not know; "
                "use --mode real/emulated, or chunked_loss_impl='ours'"
            )
        if self.iters < 1 or self.warmup < 1:
            raise ValueError("iters and warmup must both be >= 1 (the first step is never timed)")
        if self.mode != Mode.SIMULATED and self.iters < MIN_TIMED_STEPS and not self.smoke:
            article = "an" if str(self.mode)[0] in "aeiou" else "a"
            raise ValueError(
                f"iters={self.iters}: {article} {self.mode} trial times at least {MIN_TIMED_STEPS} steps so that its "
                f"median and range mean something; use --iters {MIN_TIMED_STEPS} or more, or --smoke for a "
                f"wiring check whose row says it is one"
            )
        if self.search is not None and self.search.max_seq_len < self.search_step():
            raise ValueError(
                f"--max-seq-len {self.search.max_seq_len} is below one step of {self.search_step()} tokens "
                f"(lcm of granularity {self.search.granularity} and the layout multiple {self.seq_multiple()})"
            )

    # ------------------------------------------------------------------ identity and transport
    def search_fields(self) -> dict[str, Any] | None:
        """The ``search`` of the row this trial writes (None for a single trial)."""
        if self.search is None:
            return None
        return {"granularity": self.search.granularity, "step": self.search_step(),
                "max_seq_len": self.search.max_seq_len, "start": self.search.start}

    def row_fields(self) -> dict[str, Any]:
        """The trial-key fields of the row this trial writes (``records.schema.Row``)."""
        return dict(
            kind=str(self.kind), method=self.method, options=self.requested_opts(), model=self.config().name,
            scope=str(self.step.scope),
            seq_len=self.search.max_seq_len if self.search is not None else self.seq_len,
            batch=self.step.batch, world_size=self.world_size, mode=str(self.mode), dtype=str(self.step.dtype),
            device=self.device, levers=self.step.levers(),
            link=self.link_model().to_dict() if self.mode in (Mode.EMULATED, Mode.SIMULATED) else None,
            search=self.search_fields(), docs=self.docs_fields(),
        )

    def docs_fields(self) -> dict[str, Any] | None:
        """The ``docs`` of the row this trial writes: the documents' identity, with the lengths'
        summary for a single trial (a search's lengths change with every probe). None: one sequence."""
        if self.docs is None:
            return None
        return self.docs.fields(self.seq_len if self.kind == Kind.TRIAL else None)

    def key(self) -> tuple:
        """``records.trial_key`` of this trial's row: equal keys, same trial."""
        return trial_key(self.row_fields())

    def to_json(self) -> str:
        """The trial as JSON (what crosses the boundary to a sweep's job)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(options=self.requested_opts(), step=dataclasses.asdict(self.step),
                 search=dataclasses.asdict(self.search) if self.search else None,
                 mode=str(self.mode), kind=str(self.kind))
        d.pop("auto_chunk")
        d.pop("resolution")  # the receiving process applies the stack again; the named presets travel
        if self.docs is None:  # absent, so that a trial of one sequence serialises as before documents
            d.pop("docs")
        else:
            d["docs"] = self.docs.identity()
        presets = [p for p in self.resolved().presets if not p.endswith(STACK_SUFFIX)]
        if presets:
            d["presets"] = presets
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Trial:
        try:
            d = json.loads(text)
            step = StepConfig(**d.pop("step"))
            search = Search(**d.pop("search")) if d.get("search") else d.pop("search", None)
            presets = tuple(d.pop("presets", ()))
            docs = DocsSpec.from_fields(d.pop("docs")) if d.get("docs") is not None else d.pop("docs", None)
            trial = cls.make(d.pop("method"), d.pop("model"), d.pop("seq_len"), d.pop("world_size"),
                             d.pop("options"), step=step, search=search, docs=docs, **d)
            resolution = Resolution.of(step, trial.method, presets)
            return dataclasses.replace(trial, resolution=resolution)
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"not a serialised trial: {type(err).__name__}: {err}") from None
