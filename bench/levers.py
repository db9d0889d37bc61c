"""Declaring a lever: a dataclass field with what the CLI, the specs and the checks need to know of it.

The step's levers are declared in two dataclasses, one per concern of a trial:

* ``bench.training.config.TrainingConfig``: what the step does (FSDP, checkpointing, tiling, the
  loss, RoPE, barriers), in every mode;
* ``bench.measure.config.MeasurementConfig``: how the step is measured, which a real GPU run does
  not choose: a simulation's memory accounting (concern ``simulation``: the stack, the allocator
  model and its pools, the kernels' scratch, the fake device) and an emulated run's attention
  arithmetic (concern ``emulation``).

``bench.measure.config.StepConfig`` is the two together: a trial's levers, as a row records them.
The CLI's flags (``bench.cli``) and a sweep spec's ``step:`` keys are generated from these
declarations, so a new lever is one field, the code where it acts, and its test.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

Concern = Literal["training", "simulation", "emulation"]


def lever(default: Any, help: str, *, concern: Concern = "training", flag: str | None = None,
          requires: str | None = None, does: str | None = None, instead: str | None = None,
          fix: str = "drop it", size: bool = False, metavar: str | None = None) -> Any:
    """A lever field.

    ``flag``: the CLI flag when it is not ``--<name>`` (a bool that defaults to True gets a
    ``--no-...`` flag); ``requires``: the bool lever that must be on for this one to act (set
    away from its default while that one is off, it is refused as a lever with no effect);
    ``does``/``instead``/``fix``: for a simulation-only field, what it does, what a real or
    emulated run does instead, and how to fix a trial that sets it outside simulated mode;
    ``size``: the CLI parses ``128K``-style sizes."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, concern=concern, flag=flag, requires=requires, does=does, instead=instead, fix=fix, size=size,
        metavar=metavar))


def is_lever(f: dataclasses.Field) -> bool:
    """Whether ``f`` was declared with :func:`lever`."""
    return "concern" in f.metadata


def literal_choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The allowed values of each ``Literal`` field of the dataclass ``cls``, read once where the
    class is defined (``typing.get_type_hints`` evaluates every annotation)."""
    return {name: typing.get_args(a) for name, a in typing.get_type_hints(cls).items()
            if typing.get_origin(a) is Literal}


def refuse_outside_choices(config: Any, table: dict[str, tuple[Any, ...]]) -> None:
    """A one-line ``ValueError`` for the first field of ``config`` whose value is not among its ``table`` choices."""
    for name, allowed in table.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(config, name)!r}")
