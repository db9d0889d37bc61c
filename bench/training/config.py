"""``StepConfig``: what one training step does, i.e. the paper's memory levers as data.

Kept apart from the step itself (``bench.training.step``) so that a trial, a sweep spec and
the planner can hold and compare levers without building anything. Defaults are the paper's
record setup (``docs/paper.md``); ``levers()`` is what a result row records.

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
from typing import Any

import torch

from methods.ds_ulysses import DEEPSPEED_HINT
from records import DType, Scope

TORCH_DTYPES = {DType.BF16: torch.bfloat16, DType.FP32: torch.float32}
# simulation only: how the attention backward's scratch buffers are modelled (bench.measure.workspace)
KERNEL_WORKSPACES = ("none", "fa2", "fa3")
# simulation only: replay the step's allocations through a model of the CUDA caching allocator
# (bench.measure.allocator) to add its reserved peak; classic segments or expandable_segments:True
ALLOCATOR_MODELS = ("none", "classic", "expandable")
# the allocator model's pools: "shared": one pool for every stream (the model before streams were
# tracked); "per-stream": a pool per stream, as CUDA's caching allocator keys its blocks
# (bench.measure.allocator, "Streams")
ALLOCATOR_POOLS = ("shared", "per-stream")
# whose implementation runs the tiled MLP / chunked loss (DeepSpeed's: runtime.sequence_parallel.ulysses_sp)
IMPLS = ("ours", "deepspeed")
# simulation only: which fake device runs the step (bench.measure.simcuda). "auto": the device
# preset's own (fake CUDA tensors for a GPU preset, fake CPU tensors for the CPU preset); "cpu":
# fake CPU tensors for a GPU preset too (the CPU code path, host memory modelled by `meta`)
SIM_DEVICES = ("auto", "cpu")
# simulation only: the accounting (bench.measure.stack): "lean" counts live tensors against 90% of
# the device; "paper" models what the paper's runs held (allocator reserved memory, kernel scratch,
# the authors' offload settings) against the device less what lives outside the allocator
STACKS = ("lean", "paper")
# RoPE angles: "none": computed for the local positions; "checkpointed": TorchTitan's precomputed
# table of the whole sequence on every rank, passed to each block (so checkpoint offload moves it
# with the block's input); "auto": "checkpointed" under the paper stack for the methods the paper ran
# in TorchTitan (bench.measure.stack), "none" otherwise
ROPE_TABLES = ("auto", "none", "checkpointed")
# which blocks keep their activation checkpoint on the device when ac_offload is on ("none": every
# block's checkpoint goes to the host, the first and the last included)
OFFLOAD_KEEPS = ("first_last", "first", "none")
# emulated only: "skip" answers the attention kernels with zeros of their real shapes and holds their
# scratch, so a long-context step's real memory is measured without its hours of attention
# (bench.measure.skipmath)
ATTENTION_MATHS = ("compute", "skip")


# fields added after rows were committed: a row records them only away from their default
LATE_FIELDS = ("kernel_workspace", "tiled_mlp_impl", "chunked_loss_impl", "sim_device", "allocator_model",
               "stack", "offload_keep", "fsdp_offload", "fused_attn_norm", "rope_table", "ac_group",
               "allocator_pools", "ring_barrier", "attention_math")
# simulation-only settings: (field, what it does, what a real/emulated run does instead, the fix);
# away from its default such a setting is refused outside simulated mode (Trial.validate)
SIMULATION_ONLY = (
    ("kernel_workspace", "models the attention kernel's scratch memory under simulation",
     "the real kernel allocates its own", "drop it"),
    ("stack", "is an accounting of simulated memory", "the run's own memory is measured",
     "drop it (or use --stack lean)"),
    ("sim_device", "picks the fake device of a simulation", "the trial runs on its real device", "drop it"),
    ("allocator_model", "models the CUDA caching allocator under simulation",
     "the real allocator reports its own reserved peak", "drop it"),
    ("allocator_pools", "picks the pools of the simulated caching allocator",
     "the real allocator keeps its own per-stream pools", "drop it"),
)


@dataclass(frozen=True)
class StepConfig:
    """What one step does. Defaults are the paper's settings (batch 1, every lever on)."""

    scope: str = "model"
    batch: int = 1
    dtype: str = "bf16"
    fsdp: bool = True
    ac: bool = True
    ac_offload: bool = True
    offload_pin: bool = True
    tiled_mlp: bool = True
    tiled_norm: bool = True
    mlp_tiles: int = 0  # tiles of the tiled MLP and norms; 0: ceil(local tokens / dim), the paper's rule
    chunked_loss: bool = True
    loss_chunk: int = 2048
    lr: float = 3e-4
    kernel_workspace: str = "none"  # simulation only: attention-kernel scratch model (bench.measure.workspace)
    tiled_mlp_impl: str = "ours"  # ours | deepspeed (DeepSpeed's TiledMLP), when tiled_mlp
    chunked_loss_impl: str = "ours"  # ours | deepspeed (DeepSpeed's TiledFusedLogitsLoss), when chunked_loss
    fsdp_offload: bool = False  # FSDP2 CPUOffloadPolicy: sharded fp32 masters, gradients, AdamW state on host
    fused_attn_norm: bool = False  # the attention's RMSNorm inside the method, tiled: its output never exists
    offload_keep: str = "first_last"  # checkpoints kept on the device: first_last | first (the authors' scripts) | none
    stack: str = "lean"  # simulation only: lean | paper (bench.measure.stack); the CLI and specs default to paper
    sim_device: str = "auto"  # simulation only: auto (the preset's device: GPU code path) | cpu (CPU code path)
    allocator_model: str = "none"  # simulation only: reserved-memory model (bench.measure.allocator)
    rope_table: str = "auto"  # auto (the stack decides) | none | checkpointed (TorchTitan's table, a block argument)
    ac_group: int = 1  # blocks per outer checkpoint (bench.training.nested); 1: one checkpoint per block
    allocator_pools: str = "shared"  # simulation only, with allocator_model: shared | per-stream (ALLOCATOR_POOLS)
    ring_barrier: bool = False  # a barrier after every ring step, as the paper's ring code (methods.core.ringsync)
    attention_math: str = "compute"  # emulated only: compute | skip (bench.measure.skipmath)

    def __post_init__(self) -> None:
        if self.scope not in Scope.values():
            raise ValueError(f"scope must be one of {list(Scope.values())}, got {self.scope!r}")
        if self.dtype not in DType.values():
            raise ValueError(f"dtype must be one of {list(DType.values())}, got {self.dtype!r}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a positive integer, got {self.batch!r}")
        if self.mlp_tiles < 0:
            raise ValueError(f"mlp_tiles must be >= 0 (0: automatic), got {self.mlp_tiles}")
        if self.loss_chunk < 1:
            raise ValueError(f"loss_chunk must be >= 1 token, got {self.loss_chunk}")
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
        if self.kernel_workspace not in KERNEL_WORKSPACES:
            raise ValueError(f"kernel_workspace must be one of {list(KERNEL_WORKSPACES)}, "
                             f"got {self.kernel_workspace!r}")
        if self.stack not in STACKS:
            raise ValueError(f"stack must be one of {list(STACKS)}, got {self.stack!r}")
        if self.rope_table not in ROPE_TABLES:
            raise ValueError(f"rope_table must be one of {list(ROPE_TABLES)}, got {self.rope_table!r}")
        if self.offload_keep not in OFFLOAD_KEEPS:
            raise ValueError(f"offload_keep must be one of {list(OFFLOAD_KEEPS)}, got {self.offload_keep!r}")
        if self.sim_device not in SIM_DEVICES:
            raise ValueError(f"sim_device must be one of {list(SIM_DEVICES)}, got {self.sim_device!r}")
        if self.allocator_pools not in ALLOCATOR_POOLS:
            raise ValueError(f"allocator_pools must be one of {list(ALLOCATOR_POOLS)}, got {self.allocator_pools!r}")
        if self.attention_math not in ATTENTION_MATHS:
            raise ValueError(f"attention_math must be one of {list(ATTENTION_MATHS)}, got {self.attention_math!r}")
        if self.allocator_model not in ALLOCATOR_MODELS:
            raise ValueError(f"allocator_model must be one of {list(ALLOCATOR_MODELS)}, "
                             f"got {self.allocator_model!r}")
        for name, lever in (("tiled_mlp_impl", "tiled_mlp"), ("chunked_loss_impl", "chunked_loss")):
            value = getattr(self, name)
            if value not in IMPLS:
                raise ValueError(f"{name} must be one of {list(IMPLS)}, got {value!r}")
            if value != "ours" and not getattr(self, lever):  # else a row records a choice that did nothing
                raise ValueError(f"{name}={value!r} picks the implementation of {lever}, which is off")
            if value == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
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
        """The levers as recorded in a result row (everything but scope, batch and dtype,
        which are trial keys of their own)."""
        d = dataclasses.asdict(self)
        for k in ("scope", "batch", "dtype"):
            d.pop(k)
        # fields added after rows were committed are left out at their default, so that the
        # trial identity (and the key) of every earlier row stays what it was
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in LATE_FIELDS:
            if d[name] == defaults[name]:
                d.pop(name)
        return d

    @classmethod
    def from_levers(cls, scope: str, batch: int, dtype: str, levers: dict[str, Any]) -> StepConfig:
        return cls(scope=scope, batch=batch, dtype=dtype, **levers)
