"""Method registry: methods register themselves by decorator in their own module.

Adding a method means adding one file in ``methods/`` that uses ``@register``;
``methods/__init__.py`` imports every module of the package, so the registry is
complete as soon as ``methods`` is imported. A method whose optional library is
missing still registers (so ``python -m methods`` can say what it needs) but is
marked unusable and ``build`` refuses it with the install command.

What the suite knows about a method (which paper column it implements, which library and kernel
it calls, ...) is declared there too, as ``facts=records.facts.MethodFacts(...)``: the paper stack,
``bench fidelity`` and the analysis read it from the entry, never from name lists of their own.
The analysis, which does not import torch, reads the committed table generated from these entries
(``records/method_facts.json``, :func:`write_facts_table`).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from records.facts import TABLE, MethodFacts, PaperRun, encode_table

__all__ = ["MethodFacts", "MethodInfo", "PaperRun", "all_infos", "get_info", "package_infos", "register",
           "unregister", "write_facts_table"]

T = TypeVar("T", bound=type)


@dataclass(frozen=True)
class MethodInfo:
    """One registered method: its class, a one-line description, what it needs and its facts."""

    name: str
    cls: type
    description: str
    requires: tuple[str, ...] = field(default=())
    install_hint: str = ""
    facts: MethodFacts = field(default_factory=MethodFacts)

    def missing(self, provided: tuple[str, ...] = ()) -> list[str]:
        """The optional modules this method needs that cannot be imported here; ``provided``:
        modules the caller supplies itself (simulated mode's flash-attn) and are not missing."""
        return [mod for mod in self.requires if mod not in provided and not _importable(mod)]

    @property
    def usable(self) -> bool:
        return not self.missing()

    @property
    def status(self) -> str:
        """``ok``; ``simulated only`` (with why) when simulation can run it here but real runs
        cannot; or ``needs ...`` with the modules to install."""
        missing = self.missing()
        if missing and not self.missing(SIMULATION_PROVIDES):
            return "simulated only (real: needs " + ", ".join(missing) + ")"
        if missing:
            return "needs " + ", ".join(missing)
        if getattr(self.cls, "cuda_only_reason", None) and not torch.cuda.is_available():
            return "simulated only (real: CUDA)"
        return "ok"


_REGISTRY: dict[str, MethodInfo] = {}
# modules bench's simulated mode supplies itself when they are missing (bench.stackmodel.fake_flash_attn)
SIMULATION_PROVIDES = ("flash_attn", "flash_attn_interface")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def register(
    name: str, description: str, requires: tuple[str, ...] = (), install_hint: str = "",
    facts: MethodFacts | None = None,
) -> Callable[[T], T]:
    """Class decorator adding a method to the registry under ``name``, with its ``facts``
    (``records.facts.MethodFacts``; None: the defaults, a method of ours outside the paper's columns)."""
    facts = MethodFacts() if facts is None else facts
    problems = facts.problems()
    if problems:
        raise ValueError(f"method {name!r}: inconsistent facts: {'; '.join(problems)}")

    def deco(cls: T) -> T:
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"method name {name!r} is already registered by {_REGISTRY[name].cls}")
        cls.method_name = name
        _REGISTRY[name] = MethodInfo(name, cls, description, tuple(requires), install_hint, facts)
        return cls

    return deco


def unregister(name: str) -> None:
    """Remove a method (tests register throw-away methods and clean up after)."""
    _REGISTRY.pop(name, None)


def get_info(name: str) -> MethodInfo:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise ValueError(f"unknown method {name!r}; available methods: {known}") from None


def all_infos() -> list[MethodInfo]:
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


def package_infos() -> list[MethodInfo]:
    """The methods of the ``methods`` package itself (not those a test or a user registers from elsewhere)."""
    return [info for info in all_infos() if info.cls.__module__.split(".")[0] == "methods"]


def facts_table_text() -> str:
    """The text ``records/method_facts.json`` must have: the facts of the package's methods."""
    return encode_table({info.name: info.facts for info in package_infos()})


def write_facts_table(path: Path = TABLE) -> Path:
    """Write the facts table the analysis reads (``python -m methods --write-facts``)."""
    Path(path).write_text(facts_table_text())
    return Path(path)
