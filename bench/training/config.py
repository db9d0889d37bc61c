"""``TrainingConfig``: what one training step does, as typed fields.

Kept apart from the step itself (``bench.training.step``) so that a trial, a sweep spec and
the planner can hold and compare levers without building anything. Defaults are the paper's
record setup (``docs/paper.md``). How a step is measured (a simulation's accounting, an
emulation's attention math) is ``bench.measure.config.MeasurementConfig``; a trial holds both
as ``bench.measure.config.StepConfig``. Every field is declared once, with
``bench.levers.lever``: its type (a ``Literal`` for a choice), its default, one line of help
and, where another lever switches it off, that lever.

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
from dataclasses import dataclass
from typing import Literal

import torch

from methods.ds_ulysses import DEEPSPEED_HINT
from records import DType, Scope

from ..levers import is_lever, lever, literal_choices, refuse_outside_choices

TORCH_DTYPES = {DType.BF16: torch.bfloat16, DType.FP32: torch.float32}

Impl = Literal["ours", "deepspeed"]
RopeTable = Literal["auto", "none", "checkpointed"]
OffloadKeep = Literal["first_last", "first", "none"]


@dataclass(frozen=True)
class TrainingConfig:
    """What one step does, in every mode. Defaults are the paper's settings (batch 1, every
    lever on)."""

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
    rope_table: RopeTable = lever(
        "auto", "RoPE angles: none (computed for the local positions), checkpointed (TorchTitan's table of the "
        "whole sequence on every rank, a checkpoint input), auto (the stack decides, bench.resolve)")
    ac_group: int = lever(1, "two-level checkpointing (Chen et al. 2016): blocks in groups of K under an outer "
                          "checkpoint, so the host holds about n/K + K - 1 block inputs instead of n; up to one "
                          "more forward per block (1: one checkpoint per block)", metavar="K")
    ac_keep_attn: bool = lever(False, "selective checkpointing: each block keeps its attention kernel's outputs "
                               "(out and LSE) until its backward, so the recomputation does not run the attention "
                               "forward again (bench.training.step.keep_attention)", requires="ac")
    ring_barrier: bool = lever(False, "a barrier after every ring step, as the paper's ring code "
                               "(methods.core.ringsync)")
    def __post_init__(self) -> None:
        if self.scope not in Scope.values():
            raise ValueError(f"scope must be one of {list(Scope.values())}, got {self.scope!r}")
        if self.dtype not in DType.values():
            raise ValueError(f"dtype must be one of {list(DType.values())}, got {self.dtype!r}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a positive integer, got {self.batch!r}")
        refuse_outside_choices(self, CHOICES)
        if self.mlp_tiles < 0:
            raise ValueError(f"mlp_tiles must be >= 0 (0: automatic), got {self.mlp_tiles}")
        if self.loss_chunk < 0:
            raise ValueError(f"loss_chunk must be >= 1 token (or 0: Liger's rule), got {self.loss_chunk}")
        if self.fsdp_offload and not self.fsdp:
            raise ValueError("fsdp_offload offloads FSDP2's sharded state to the host: it needs fsdp=True")
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

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[DType(self.dtype)]


CHOICES = literal_choices(TrainingConfig)  # the allowed values of each Literal field
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainingConfig)}
_REQUIRES = {f.name: f.metadata["requires"] for f in dataclasses.fields(TrainingConfig)
             if is_lever(f) and f.metadata["requires"]}
# requirements __post_init__ words itself, since they are contradictions rather than no-ops
_CHECKED_ABOVE = ("ac_offload", "fsdp_offload")
