"""What the suite knows about each attention method, readable without torch.

Each method declares its facts where it registers, in its own file under ``methods/``
(``@register(name, description, facts=MethodFacts(...))``; ``methods.core.registry.MethodInfo.facts``).
This module holds their type, :class:`MethodFacts`, the vocabulary its fields take, and the
committed table ``records/method_facts.json`` through which the readers that must not import
torch (``analysis``) see them: :func:`facts_of`. The table is generated from the registry
(``python -m methods --write-facts``) and ``tests/methods/test_registry_facts.py`` checks that it
is current. A method absent from it has the defaults, so a new method that declares nothing
needs no entry; the benchmark (``bench``), which imports the methods anyway, reads the registry.

The paper's names (its tables' columns and bars, ``results/paper/``) are vocabulary of their own:
several coincide with our methods' names (the paper's UPipe column and our ``upipe``), which is
why a fact names a column rather than a method.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Table 3's columns in the paper's row order (Native PyTorch, Ring, Ulysses, FPDT, UPipe)
TABLE3_COLUMNS = ("torch-cp", "ring", "ulysses", "fpdt", "upipe")
# every name of the paper a method can implement or stand for: Table 3's columns, Fig. 5's
# USP-Hybrid (``usp``), and Fig. 1's FSDP bar (no context parallelism) and ALST bar (Ulysses with
# every lever)
PAPER_COLUMNS = TABLE3_COLUMNS + ("usp", "fsdp", "alst")
OURS = "ours"
# whose code runs the attention: ours, or the library a method wraps (the name a label shows)
LIBRARIES = (OURS, "PyTorch", "yunchang", "DeepSpeed", "ring-flash-attn")
# the attention kernel's flash-attention generation: fa3 (FlashAttention 3, what the paper's runs
# used), fa2 (FlashAttention 2's code: flash-attn 2 itself, or torch's SDPA flash kernel)
KERNELS = ("fa3", "fa2")
TABLE = Path(__file__).with_name("method_facts.json")


@dataclass(frozen=True)
class PaperRun:
    """How ``bench fidelity`` simulates one of the paper's columns with a method: the options it
    runs the method with and the GPU counts it stands for the column on (``max_gpus`` None: any)."""

    column: str
    options: Mapping[str, Any] = field(default_factory=dict)
    min_gpus: int = 1
    max_gpus: int | None = None

    def covers(self, gpus: int) -> bool:
        return self.min_gpus <= gpus and (self.max_gpus is None or gpus <= self.max_gpus)

    def __hash__(self) -> int:  # options are a mapping: hash its JSON (equal runs, equal hashes)
        return hash(json.dumps(_run_dict(self), sort_keys=True, default=str))


@dataclass(frozen=True)
class MethodFacts:
    """What a method is, for everything that compares methods (the defaults: a method of ours
    that implements none of the paper's columns, runs our FA3-modelled kernel in TorchTitan's model).

    * ``column``: the paper's column (family) it implements (:data:`PAPER_COLUMNS`); None: none,
      tables group it under its own name.
    * ``mesh``: it runs on a Ulysses x Ring mesh set by its ``ulysses_degree`` option (degree =
      the world size: all Ulysses; degree 1: all ring).
    * ``reference``: our own implementation of its column (one per column and mesh): the
      baseline of ratios and of the Ulysses/UPipe micro-benchmarks.
    * ``paper_code``: the code the paper ran for its column, or ours where it is the paper's
      method (UPipe): where a figure has room for one bar of a column, this one wins.
    * ``library``: whose code it runs (:data:`LIBRARIES`; ``ours`` for our own).
    * ``kernel``: its attention kernel as the paper ran it (:data:`KERNELS`): the model of its
      backward scratch under the paper stack unless ``library_kernels``.
    * ``library_kernels``: its library calls flash-attn itself (in simulation the stand-in
      flash-attn allocates the kernels' scratch).
    * ``ring_barrier``: it stands for the paper's ring code, which synchronises every ring step.
    * ``torchtitan``: the paper ran its column inside TorchTitan (TorchTitan's RoPE table).
    * ``levers``: the training levers the paper ran its column with where they differ from the
      paper's (Native PyTorch had no tiled MLP or norms).
    * ``simulates``: the paper's columns ``bench fidelity`` simulates with it (:class:`PaperRun`).
    """

    column: str | None = None
    mesh: bool = False
    reference: bool = False
    paper_code: bool = False
    library: str = OURS
    kernel: str = "fa3"
    library_kernels: bool = False
    ring_barrier: bool = False
    torchtitan: bool = True
    levers: Mapping[str, bool] = field(default_factory=dict)
    simulates: tuple[PaperRun, ...] = ()

    def problems(self) -> list[str]:
        """What is inconsistent in these facts (empty: nothing), each naming the field and the fix."""
        out = []
        if self.column is not None and self.column not in PAPER_COLUMNS:
            out.append(f"column={self.column!r} is not a paper column; use one of {list(PAPER_COLUMNS)} or None")
        if self.library not in LIBRARIES:
            out.append(f"library={self.library!r}; use one of {list(LIBRARIES)}")
        if self.kernel not in KERNELS:
            out.append(f"kernel={self.kernel!r}; use one of {list(KERNELS)}")
        if self.library_kernels and self.library == OURS:
            out.append("library_kernels=True needs the library that calls the kernels (library is 'ours')")
        if self.reference and (self.library != OURS or self.column is None):
            out.append("reference=True is for our own implementation of a paper column (library 'ours', a column)")
        for run in self.simulates:
            if run.column not in PAPER_COLUMNS:
                out.append(f"simulates {run.column!r}, not a paper column; use one of {list(PAPER_COLUMNS)}")
            if run.min_gpus < 1 or (run.max_gpus is not None and run.max_gpus < run.min_gpus):
                out.append(f"simulates {run.column!r} on no GPU count (min_gpus={run.min_gpus}, "
                           f"max_gpus={run.max_gpus})")
        if not all(isinstance(v, bool) for v in self.levers.values()):
            out.append(f"levers={dict(self.levers)!r}: every value must be True or False")
        return out

    def __hash__(self) -> int:  # levers are a mapping: hash the JSON (equal facts, equal hashes)
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=str))

    @property
    def library_name(self) -> str | None:
        """The wrapped library's name for labels (None for our own methods)."""
        return None if self.library == OURS else self.library

    def to_dict(self) -> dict[str, Any]:
        """The facts that differ from the defaults, as JSON-ready values."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == getattr(DEFAULT, f.name):
                continue
            if f.name == "simulates":
                value = [_run_dict(r) for r in value]
            elif f.name == "levers":
                value = dict(sorted(value.items()))
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MethodFacts:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown method facts {unknown}; known: {sorted(known)}")
        values = dict(data)
        if "simulates" in values:
            values["simulates"] = tuple(PaperRun(**r) for r in values["simulates"])
        return cls(**values)


def _run_dict(run: PaperRun) -> dict[str, Any]:
    out: dict[str, Any] = {"column": run.column}
    if run.options:
        out["options"] = dict(sorted(run.options.items()))
    if run.min_gpus != 1:
        out["min_gpus"] = run.min_gpus
    if run.max_gpus is not None:
        out["max_gpus"] = run.max_gpus
    return out


DEFAULT = MethodFacts()


def encode_table(facts: Mapping[str, MethodFacts]) -> str:
    """The committed table's text: one entry per method whose facts are not the defaults, sorted."""
    entries = {name: f.to_dict() for name, f in sorted(facts.items()) if f != DEFAULT}
    return json.dumps(entries, indent=1, sort_keys=True) + "\n"


@functools.cache
def table(path: Path = TABLE) -> dict[str, MethodFacts]:
    """The committed table (method name -> facts), as generated from the registry."""
    if not path.is_file():
        raise ValueError(f"no method facts table at {path}; generate it: python -m methods --write-facts")
    return {name: MethodFacts.from_dict(data) for name, data in json.loads(path.read_text()).items()}


def facts_of(method: str) -> MethodFacts:
    """A method's facts from the committed table (the defaults for a method it does not list)."""
    return table().get(method, DEFAULT)


def implementing(column: str) -> list[str]:
    """The methods of the committed table whose column is ``column``, by name."""
    return sorted(name for name, f in table().items() if f.column == column)
