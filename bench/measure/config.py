"""``MeasurementConfig``: how a trial's step is measured, apart from what the step does; ``StepConfig``: both.

A real GPU run measures what its device holds, so these levers exist only where the suite
stands in for the device: a simulation's memory accounting (concern ``simulation``: the
stack's model of the paper's runs, the modelled CUDA caching allocator and its pools, the
attention kernels' scratch, the fake device) and an emulated run's attention arithmetic
(concern ``emulation``). Away from its default, a simulation lever is refused outside
simulated mode (``Trial.validate``, from each field's ``does``/``instead``/``fix``). What the
step does is ``bench.training.config.TrainingConfig``. A trial holds both as ``StepConfig``
(``Trial.step``), whose ``levers()`` a row records and whose fields the CLI's flags and a
spec's ``step:`` keys are generated from (``lever_fields``).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from records.identity import V1_OMITTED_LEVERS

from ..levers import Concern, is_lever, lever, literal_choices, refuse_outside_choices
from ..training.config import CHOICES as TRAINING_CHOICES
from ..training.config import TrainingConfig

KernelWorkspace = Literal["none", "fa2", "fa3"]
AllocatorModel = Literal["none", "classic", "expandable"]
AllocatorPools = Literal["shared", "per-stream"]
SimDevice = Literal["auto", "cpu"]
Stack = Literal["lean", "paper", "hf"]
AttentionMath = Literal["compute", "skip"]
KERNEL_WORKSPACES: tuple[str, ...] = typing.get_args(KernelWorkspace)  # bench.stackmodel.workspace's models


@dataclass(frozen=True)
class MeasurementConfig:
    """How the step is measured: a simulation's accounting and an emulation's attention math."""

    kernel_workspace: KernelWorkspace = lever(
        "none", "the attention backward's scratch buffers modelled as FA2's or FA3's (bench.stackmodel.workspace)",
        concern="simulation", does="models the attention kernel's scratch memory under simulation",
        instead="the real kernel allocates its own")
    stack: Stack = lever(
        "lean", "the memory accounting (bench.stackmodel.stack): paper models what the paper's runs held, hf what "
        "the Hugging Face stack runs (Accelerate's sp_size/cp_size paths, bench.stackmodel.hfstack), lean counts "
        "live tensors against 90% of the device; a simulated trial that leaves it unset gets paper (bench.resolve)",
        concern="simulation", does="is an accounting of simulated memory",
        instead="the run's own memory is measured",
        fix="drop it (or use --stack lean)")
    sim_device: SimDevice = lever(
        "auto", "auto: fake tensors of the preset's device (GPU code path for a GPU preset, "
        "bench.stackmodel.simcuda); cpu: the CPU code path", concern="simulation",
        does="picks the fake device of a simulation", instead="the trial runs on its real device")
    allocator_model: AllocatorModel = lever(
        "none", "replay the step's allocations through a model of the CUDA caching allocator "
        "(bench.stackmodel.allocator) and record its reserved peak; expandable: as with "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", concern="simulation",
        does="models the CUDA caching allocator under simulation",
        instead="the real allocator reports its own reserved peak")
    allocator_pools: AllocatorPools = lever(
        "shared", "the modelled allocator's pools: per-stream (a pool per CUDA stream, as the caching allocator "
        "keys its blocks) or shared (one pool for every stream); a simulated trial that leaves it unset gets "
        "its stack's (bench.resolve)", concern="simulation",
        does="picks the pools of the simulated caching allocator",
        instead="the real allocator keeps its own per-stream pools")
    attention_math: AttentionMath = lever(
        "compute", "emulated mode: skip answers the attention kernels with zeros of their real shapes and holds "
        "their scratch (bench.measure.skipmath), so a long-context step's real memory is measured without "
        "hours of attention; values and the loss are then meaningless", concern="emulation")

    def __post_init__(self) -> None:
        refuse_outside_choices(self, _CHOICES)


_CHOICES = literal_choices(MeasurementConfig)  # the allowed values of each field


@dataclass(frozen=True)
class StepConfig(MeasurementConfig, TrainingConfig):
    """A trial's levers: what the step does (``TrainingConfig``) and how it is measured
    (``MeasurementConfig``). Its fields are the training levers, then the measurement ones."""

    def __post_init__(self) -> None:
        TrainingConfig.__post_init__(self)
        MeasurementConfig.__post_init__(self)
        if self.fsdp_offload and self.sim_device == "cpu":
            raise ValueError("fsdp_offload with sim_device='cpu': on the CPU code path the accelerator is the CPU, "
                             "so FSDP2's CPU offload would not leave it; drop sim_device='cpu'")

    @classmethod
    def plain(cls, **overrides) -> StepConfig:
        """No memory lever at all (replicated model, no AC, plain MLP, full logits)."""
        base = dict(fsdp=False, ac=False, ac_offload=False, tiled_mlp=False, tiled_norm=False,
                    chunked_loss=False)
        return cls(**{**base, **overrides})

    def levers(self) -> dict[str, Any]:
        """The levers as recorded in a result row: every field but scope, batch and dtype, which
        are trial keys of their own."""
        d = dataclasses.asdict(self)
        for k in ("scope", "batch", "dtype"):
            d.pop(k)
        return d

    def training(self) -> TrainingConfig:
        """What the step does: the training levers alone."""
        return TrainingConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TrainingConfig)})

    def measurement(self) -> MeasurementConfig:
        """How the step is measured: the simulation's accounting and the emulation's attention math."""
        return MeasurementConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MeasurementConfig)})

    def of_concern(self, concern: Concern) -> dict[str, Any]:
        """The fields of one concern (``training``, ``simulation``, ``emulation``) and their values."""
        return {f.name: getattr(self, f.name) for f in lever_fields() if f.metadata["concern"] == concern}

    @classmethod
    def from_levers(cls, scope: str, batch: int, dtype: str, levers: dict[str, Any]) -> StepConfig:
        """The step a row's ``levers`` describe (a schema-1 row's omitted levers at their defaults)."""
        return cls(scope=scope, batch=batch, dtype=dtype, **{**V1_OMITTED_LEVERS, **levers})


def lever_fields() -> tuple[dataclasses.Field, ...]:
    """The fields declared with ``bench.levers.lever`` (every field but scope, batch and dtype)."""
    return tuple(f for f in dataclasses.fields(StepConfig) if is_lever(f))


def choices(name: str) -> tuple[str, ...] | None:
    """The allowed values of a ``Literal`` field of ``StepConfig``, else None."""
    return _STEP_CHOICES.get(name)


_STEP_CHOICES = {**TRAINING_CHOICES, **_CHOICES}
# simulation-only settings: away from its default such a setting is refused outside simulated mode
# (Trial.validate): (field, what it does, what a real/emulated run does instead, the fix)
SIMULATION_ONLY = tuple((f.name, f.metadata["does"], f.metadata["instead"], f.metadata["fix"])
                        for f in lever_fields() if f.metadata["concern"] == "simulation")
