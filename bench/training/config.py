"""``StepConfig``: what one training step does and how it is measured, as typed fields.

Kept apart from the step itself (``bench.training.step``) so that a trial, a sweep spec and
the planner can hold and compare levers without building anything. Defaults are the paper's
record setup (``docs/paper.md``); ``levers()`` is what a result row records.

Every field is declared once, with :func:`lever`: its type (a ``Literal`` for a choice), its
default, one line of help, the concern it belongs to and, where another lever switches it off,
that lever. The CLI's flags (``bench.cli``) and a sweep spec's ``step:`` keys are generated
from these declarations, so a new lever is one field here, the code where it acts, and its
test. The concerns:

* ``training``: what the step does (FSDP, checkpointing, tiling, the loss, RoPE, barriers);
* ``simulation``: how a simulation accounts for memory (the stack, the allocator model and its
  pools, the kernels' scratch, the fake device); refused outside simulated mode;
* ``emulation``: an emulated run's attention arithmetic.

``tiled_mlp_impl`` and ``chunked_loss_impl`` pick whose code runs the tiled MLP and the
chunked loss: ours (``bench.model.decoder``) or DeepSpeed's ALST autograd functions
(``TiledMLP``, ``TiledFusedLogitsLoss``), so that the two can be compared on the same step;
DeepSpeed is then an optional dependency, checked here so that a missing install fails before
any work. The paper's loss is Liger's fused linear cross-entropy, which is CUDA/Triton only
and so not offered here: ``chunked_loss`` is its CPU-runnable stand-in.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import typing
from dataclasses import dataclass
from typing import Any, Literal

import torch

from methods.ds_ulysses import DEEPSPEED_HINT
from records import DType, Scope
from records.identity import V1_OMITTED_LEVERS

TORCH_DTYPES = {DType.BF16: torch.bfloat16, DType.FP32: torch.float32}

Concern = Literal["training", "simulation", "emulation"]
KernelWorkspace = Literal["none", "fa2", "fa3"]
AllocatorModel = Literal["none", "classic", "expandable"]
AllocatorPools = Literal["shared", "per-stream"]
Impl = Literal["ours", "deepspeed"]
SimDevice = Literal["auto", "cpu"]
Stack = Literal["lean", "paper", "hf"]
RopeTable = Literal["auto", "none", "checkpointed"]
OffloadKeep = Literal["first_last", "first", "none"]
AttentionMath = Literal["compute", "skip"]
KERNEL_WORKSPACES: tuple[str, ...] = typing.get_args(KernelWorkspace)  # bench.stackmodel.workspace's models


def lever(default: Any, help: str, *, concern: Concern = "training", flag: str | None = None,
          requires: str | None = None, does: str | None = None, instead: str | None = None,
          fix: str = "drop it", size: bool = False, metavar: str | None = None) -> Any:
    """A ``StepConfig`` field with what the CLI, the specs and the checks need to know of it.

    ``flag``: the CLI flag when it is not ``--<name>`` (a bool that defaults to True gets a
    ``--no-...`` flag); ``requires``: the bool lever that must be on for this one to act (set
    away from its default while that one is off, it is refused as a lever with no effect);
    ``does``/``instead``/``fix``: for a simulation-only field, what it does, what a real or
    emulated run does instead, and how to fix a trial that sets it outside simulated mode;
    ``size``: the CLI parses ``128K``-style sizes."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, concern=concern, flag=flag, requires=requires, does=does, instead=instead, fix=fix, size=size,
        metavar=metavar))


@dataclass(frozen=True)
class StepConfig:
    """What one step does and how it is measured. Defaults are the paper's settings (batch 1,
    every lever on)."""

    scope: str = "model"
    batch: int = 1
    dtype: str = "bf16"
    fsdp: bool = lever(True, "FSDP2 over the ranks (off: the model replicated on every rank)")
    ac: bool = lever(True, "activation checkpointing, one checkpoint per block")
    ac_offload: bool = lever(True, "activation checkpoints offloaded to host memory", flag="--no-offload",
                             requires="ac")
    offload_pin: bool = lever(True, "offloaded checkpoints in pinned host memory (off: pageable)",
                              requires="ac_offload")
    tiled_mlp: bool = lever(True, "the MLP run in tiles of the sequence (the paper's TiledMLP)")
    tiled_norm: bool = lever(True, "the RMSNorms run in tiles of the sequence")
    mlp_tiles: int = lever(0, "tiles of the tiled MLP and norms (0: ceil(local tokens / dim), the paper's rule)",
                           flag="--tiles")
    chunked_loss: bool = lever(True, "the loss computed in chunks of tokens (never the whole logits)")
    loss_chunk: int = lever(2048, "tokens per loss chunk (0: Liger's fused linear cross-entropy rule, "
                            "next_pow2(ceil(local tokens / ceil(vocab / dim))))", requires="chunked_loss", size=True)
    lr: float = lever(3e-4, "AdamW learning rate of the optimizer step")
    kernel_workspace: KernelWorkspace = lever(
        "none", "the attention backward's scratch buffers modelled as FA2's or FA3's (bench.stackmodel.workspace)",
        concern="simulation", does="models the attention kernel's scratch memory under simulation",
        instead="the real kernel allocates its own")
    tiled_mlp_impl: Impl = lever("ours", "whose tiled MLP: ours or DeepSpeed's TiledMLP (needs deepspeed)",
                                 requires="tiled_mlp")
    chunked_loss_impl: Impl = lever(
        "ours", "whose chunked loss: ours or DeepSpeed's TiledFusedLogitsLoss (needs deepspeed)",
        requires="chunked_loss")
    fsdp_offload: bool = lever(False, "FSDP2 CPUOffloadPolicy: sharded fp32 masters, gradients and AdamW state "
                               "on the host, optimizer step on the host", requires="fsdp")
    fused_attn_norm: bool = lever(False, "the attention's RMSNorm inside the method's projections, tiled "
                                  "(upipe, fpdt): the normed input is never stored")
    offload_keep: OffloadKeep = lever(
        "first_last", "with checkpoint offload, the blocks whose checkpoint stays on the device: first_last, "
        "first (the authors' scripts), or none (every block's on the host)", requires="ac_offload")
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
    rope_table: RopeTable = lever(
        "auto", "RoPE angles: none (computed for the local positions), checkpointed (TorchTitan's table of the "
        "whole sequence on every rank, a checkpoint input), auto (the stack decides, bench.resolve)")
    ac_group: int = lever(1, "two-level checkpointing (Chen et al. 2016): blocks in groups of K under an outer "
                          "checkpoint, so the host holds about n/K + K - 1 block inputs instead of n; up to one "
                          "more forward per block (1: one checkpoint per block)", metavar="K")
    ac_keep_attn: bool = lever(False, "selective checkpointing: each block keeps its attention kernel's outputs "
                               "(out and LSE) until its backward, so the recomputation does not run the attention "
                               "forward again (bench.training.step.keep_attention)", requires="ac")
    allocator_pools: AllocatorPools = lever(
        "shared", "the modelled allocator's pools: per-stream (a pool per CUDA stream, as the caching allocator "
        "keys its blocks) or shared (one pool for every stream); a simulated trial that leaves it unset gets "
        "its stack's (bench.resolve)", concern="simulation",
        does="picks the pools of the simulated caching allocator",
        instead="the real allocator keeps its own per-stream pools")
    ring_barrier: bool = lever(False, "a barrier after every ring step, as the paper's ring code "
                               "(methods.core.ringsync)")
    attention_math: AttentionMath = lever(
        "compute", "emulated mode: skip answers the attention kernels with zeros of their real shapes and holds "
        "their scratch (bench.measure.skipmath), so a long-context step's real memory is measured without "
        "hours of attention; values and the loss are then meaningless", concern="emulation")

    def __post_init__(self) -> None:
        if self.scope not in Scope.values():
            raise ValueError(f"scope must be one of {list(Scope.values())}, got {self.scope!r}")
        if self.dtype not in DType.values():
            raise ValueError(f"dtype must be one of {list(DType.values())}, got {self.dtype!r}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a positive integer, got {self.batch!r}")
        for name, annotation in _HINTS.items():
            choices = typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None
            if choices is not None and getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {list(choices)}, got {getattr(self, name)!r}")
        if self.mlp_tiles < 0:
            raise ValueError(f"mlp_tiles must be >= 0 (0: automatic), got {self.mlp_tiles}")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 1 token (or 0: Liger's rule), got {self.loss_chunk}")
        if self.fsdp_offload and not self.fsdp:
            raise ValueError("fsdp_offload offloads FSDP2's sharded state to the host: it needs fsdp=True")
        if self.fsdp_offload and self.sim_device == "cpu":
            raise ValueError("fsdp_offload with sim_device='cpu': on the CPU code path the accelerator is the CPU, "
                             "so FSDP2's CPU offload would not leave it; drop sim_device='cpu'")
        if self.ac_offload and not self.ac:
            raise ValueError("ac_offload offloads activation checkpoints: it needs ac=True")
        if not isinstance(self.ac_group, int) or self.ac_group < 1:
            raise ValueError(f"ac_group must be an integer >= 1 (blocks per outer checkpoint), got {self.ac_group!r}")
        if self.ac_group > 1 and not self.ac:
            raise ValueError(f"ac_group={self.ac_group} groups activation checkpoints: it needs ac=True")
        if self.ac_keep_attn and self.ac_group > 1:
            raise ValueError(f"ac_keep_attn with ac_group={self.ac_group}: a group's recomputation runs its blocks' "
                             f"attention again, so the outputs kept in forward would go unused; use ac_group=1 or "
                             f"drop ac_keep_attn")
        for name, needed in _REQUIRES.items():  # a lever another lever switched off would do nothing
            value = getattr(self, name)
            if getattr(self, needed) or value == _DEFAULTS[name] or name in _CHECKED_ABOVE:
                continue
            if name in ("tiled_mlp_impl", "chunked_loss_impl"):
                raise ValueError(f"{name}={value!r} picks the implementation of {needed}, which is off")
            raise ValueError(f"{name}={value!r} has no effect with {needed}=False: drop it or turn {needed} on")
        for name in ("tiled_mlp_impl", "chunked_loss_impl"):
            if getattr(self, name) == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
                raise ValueError(f"{name}='deepspeed' needs DeepSpeed, which is not installed: {DEEPSPEED_HINT}")

    @classmethod
    def plain(cls, **overrides) -> StepConfig:
        """No memory lever at all (replicated model, no AC, plain MLP, full logits)."""
        base = dict(fsdp=False, ac=False, ac_offload=False, tiled_mlp=False, tiled_norm=False,
                    chunked_loss=False)
        return cls(**{**base, **overrides})

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[DType(self.dtype)]

    def levers(self) -> dict[str, Any]:
        """The levers as recorded in a result row: every field but scope, batch and dtype, which
        are trial keys of their own."""
        d = dataclasses.asdict(self)
        for k in ("scope", "batch", "dtype"):
            d.pop(k)
        return d

    def of_concern(self, concern: Concern) -> dict[str, Any]:
        """The fields of one concern (``training``, ``simulation``, ``emulation``) and their values."""
        return {f.name: getattr(self, f.name) for f in lever_fields() if f.metadata["concern"] == concern}

    @classmethod
    def from_levers(cls, scope: str, batch: int, dtype: str, levers: dict[str, Any]) -> StepConfig:
        """The step a row's ``levers`` describe (a schema-1 row's omitted levers at their defaults)."""
        return cls(scope=scope, batch=batch, dtype=dtype, **{**V1_OMITTED_LEVERS, **levers})


def lever_fields() -> tuple[dataclasses.Field, ...]:
    """The fields declared with :func:`lever` (every field but scope, batch and dtype)."""
    return tuple(f for f in dataclasses.fields(StepConfig) if "concern" in f.metadata)


def choices(name: str) -> tuple[str, ...] | None:
    """The allowed values of a ``Literal`` field, else None."""
    annotation = _HINTS[name]
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None


_HINTS = typing.get_type_hints(StepConfig)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(StepConfig)}
_REQUIRES = {f.name: f.metadata["requires"] for f in lever_fields() if f.metadata["requires"]}
# requirements __post_init__ words itself, since they are contradictions rather than no-ops
_CHECKED_ABOVE = ("ac_offload", "fsdp_offload")
# simulation-only settings: away from its default such a setting is refused outside simulated mode
# (Trial.validate): (field, what it does, what a real/emulated run does instead, the fix)
SIMULATION_ONLY = tuple((f.name, f.metadata["does"], f.metadata["instead"], f.metadata["fix"])
                        for f in lever_fields() if f.metadata["concern"] == "simulation")
