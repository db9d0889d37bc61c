"""One training step with the paper's memory levers, on any process group.

``TrainingConfig`` holds the levers the step reads (defaults = the paper's setup, docs/paper.md, section
"Training stack"; how a step is measured is ``bench.measure.config``'s, and the step never reads it):

* ``fsdp``: FSDP2 (``fully_shard``) over the context-parallel ranks, one unit per block plus
  the root (embedding, final norm, LM head). With ``dtype="bf16"`` the sharded parameters
  are fp32 master weights and compute runs in bf16 (``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``); AdamW states are fp32. Without FSDP the model is replicated in the
  compute dtype (no fp32 master copy) and gradients are averaged with an all-reduce.
* ``fsdp_offload``: FSDP2's own ``CPUOffloadPolicy`` on every unit: the sharded fp32 master
  weights, their sharded gradients and the AdamW state live in host memory; each unit's shard
  is copied to the device before its all-gather, gradients are copied back after the
  reduce-scatter, and the optimizer step runs on the host. Adds host traffic every step (each
  shard to the device twice, forward and backward recompute, and each gradient shard back)
  and moves the optimizer step to the CPU. Pinned host memory when ``offload_pin`` (on CUDA).
* ``ac``: activation checkpointing per block (``torch.utils.checkpoint``, non-reentrant):
  only each block's input is saved, the block is recomputed in backward.
* ``ac_offload``: those saved block inputs go to host memory through saved-tensor hooks
  (``torch.autograd.graph.save_on_cpu``'s mechanism; pinned on CUDA when
  ``offload_pin``), for all blocks but the first and the last (``offload_keep="first_last"``,
  the paper's checkpoint wrapper), all but the first (``"first"``, what its scripts ran) or
  every block (``"none"``: no block input stays on the device; the first block's input, the
  embedding output, is then on the host from the forward until the very end of backward).
  A tensor already on the host stays where it is, so the lever does nothing on a CPU device.
* ``ac_group``: two-level checkpointing (``bench.training.nested``, Chen et al. 2016's
  sqrt(n) scheme): groups of ``ac_group`` blocks under an outer checkpoint, so the forward
  keeps only the group inputs (``offload_keep`` then applies to groups) and backward re-creates
  one group's block inputs at a time, on the host; costs up to one more forward per block.
* ``tiled_mlp``: RMSNorm + SwiGLU run over sequence tiles, recomputed in backward
  (``mlp_tiles=0``: the paper's ``ceil(local tokens / dim)`` tiles). ``tiled_norm``: the
  attention's RMSNorm and the final one tiled the same way (the paper's tiled RMSNorm).
  ``tiled_mlp_impl="deepspeed"``: the MLP tiles run through DeepSpeed's ``TiledMLP`` instead.
* ``fused_attn_norm``: the attention's RMSNorm runs inside the attention method (``upipe``),
  tile by tile wherever the method reads the normed input (``methods.core.normtile``): the
  method saves the block input instead of a full-length normed copy of it. Recomputes the
  norm once per projection (forward, and backward's recompute).
* ``chunked_loss``: cross-entropy over chunks of ``loss_chunk`` tokens; the
  ``[tokens, vocab]`` logits never exist. ``chunked_loss_impl="deepspeed"``: through
  DeepSpeed's ``TiledFusedLogitsLoss`` instead (LM-head gradients computed in forward).
* AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.1).
* ``ring_barrier``: a barrier after every ring step's wait, for the whole step (forward and
  backward), as the ring code the paper ran does (``methods.core.ringsync``); numerics unchanged.

Packed documents (``docs``, a ``methods.Documents`` of the global sequence; None: one sequence):
every attention block call gets them (``Decoder.set_documents``; the attention scope's block call)
and the batch's RoPE positions restart at every document. The batch is otherwise as without
documents: the same tokens and next-token labels (a document's last label, the next document's
first token, is kept, so every rank keeps its count of labelled tokens and averaging the ranks'
gradients still gives the global mean's), sharded by the method's layout; a layout that pads
documents (``doc-zigzag``) pads the tokens with zeros and their labels with the ignored index.

Two scopes: ``model`` (embedding -> blocks -> loss, backward, optimizer step) and
``attention`` (one attention block forward + backward on random input, weights in the
compute dtype, no optimizer).

Everything here takes an explicit device and group, so the same code runs on real ranks,
on one rank with a fake process group (emulated) and under FakeTensorMode (simulated).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import methods
from methods.core import comm, ringsync
from methods.core.documents import Documents

from ..model.config import ModelConfig
from ..model.decoder import Decoder
from .config import TrainingConfig
from .nested import CheckpointedGroup, FetchedCopies, group_bounds

# --------------------------------------------------------------------------- offload


class HostOffload:
    """Saved-tensor hooks that keep saved tensors in host memory until backward needs them.

    ``host`` is ``"cpu"`` on real devices. Under simulation the accelerator itself is a fake
    CPU device, so the host is modelled by the ``meta`` device: the tracker then counts
    offloaded bytes under ``meta`` (host memory) instead of the device.
    """

    def __init__(self, host: str = "cpu", pin: bool = False) -> None:
        self.host, self.pin = torch.device(host), pin
        # what ``unpack`` handed back -> the host copy it came from, while both live
        # (``bench.training.nested``: a group's recomputed input is stored as that copy again)
        self._fetched = FetchedCopies()

    def pack(self, t: torch.Tensor):
        if t.device == self.host or (self.host.type == "cpu" and t.device.type == "cpu"):
            return t
        if self.pin:
            packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
            packed.copy_(t, non_blocking=True)
        else:
            packed = t.to(self.host)
        return (t.device, packed)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, t = packed
        if t.device.type == "meta":  # simulation: the bytes come back, the values do not matter
            return torch.empty(t.shape, dtype=t.dtype, device=device)
        return t.to(device, non_blocking=self.pin)

    def host_copy(self, t: torch.Tensor) -> torch.Tensor | None:
        """The host tensor that ``t``'s data was unpacked from by these hooks (``None``: none)."""
        return self._fetched.get(t)

    def _unpack_remembering(self, packed):
        t = self.unpack(packed)
        if isinstance(packed, tuple) and t is not packed[1]:
            self._fetched.add(t, packed[1])
        return t

    def __call__(self, remember: bool = False):
        """The hooks; ``remember``: also record what ``unpack`` hands back (``host_copy``), which
        only a group's outer checkpoint needs (``bench.training.nested``)."""
        return torch.autograd.graph.saved_tensors_hooks(
            self.pack, self._unpack_remembering if remember else self.unpack)


# the attention forward ops of ``methods.core.kernels.TorchKernel`` (CPU, CUDA); a simulation dispatches
# the same ops (their fake implementations, on fake CPU or CUDA tensors), so it sees the same saving
ATTENTION_FORWARD_OPS = frozenset({torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                                   torch.ops.aten._scaled_dot_product_flash_attention.default})


def _keep_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_FORWARD_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention():
    """``TrainingConfig.ac_keep_attn``: the checkpoint's contexts (``context_fn``) of torch's selective
    activation checkpointing. The forward keeps what each attention forward kernel call returns
    (out and LSE, on the device, whatever ``ac_offload`` does with the block's input) until the
    block's recomputation, which takes them instead of running the kernel again; everything else is
    recomputed as before. Every call's outputs are kept: where a method calls the kernel on parts
    of the block's attention (a ring's steps, FPDT's chunk pairs), the partial outputs, which can
    exceed the block's merged output. Only methods that call the suite's torch kernel run these ops
    (``bench.measure.trial.Trial.validate`` refuses the others)."""
    return create_selective_checkpoint_contexts(_keep_attention_policy)


class CheckpointedBlock(nn.Module):
    """A block run under non-reentrant activation checkpointing; its saved input (the only
    tensor a checkpoint keeps) optionally offloaded to the host."""

    def __init__(self, block: nn.Module, offload: HostOffload | None = None, keep_attn: bool = False) -> None:
        super().__init__()
        self.block = block
        self.offload = offload
        self.keep_attn = keep_attn

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *rope_table: torch.Tensor) -> torch.Tensor:
        # rope_table (when the model keeps one) is a checkpoint input like x: offloaded with it
        if not torch.is_grad_enabled():
            return self.block(x, positions, *rope_table)
        ctx = self.offload() if self.offload is not None else contextlib.nullcontext()
        # keep_attn: the attention kernels' outputs are kept too (keep_attention)
        extra = {"context_fn": keep_attention} if self.keep_attn else {}
        with ctx:
            return checkpoint(self.block, x, positions, *rope_table, use_reentrant=False, **extra)


# --------------------------------------------------------------------------- building


def world_size_of(group) -> int:
    return comm.world(group)[0]


def build_model(
    cfg: ModelConfig,
    method: str,
    options: dict[str, Any],
    group,
    step: TrainingConfig,
    device: torch.device | str,
    host: str = "cpu",
    seed: int | None = 0,
    seq_len: int | None = None,
    meta_init: bool = False,
    docs: Documents | None = None,
) -> tuple[Decoder, torch.optim.Optimizer]:
    """The decoder with every lever of ``step`` applied, and its AdamW.

    Parameters are created on ``device`` in fp32 when FSDP keeps fp32 masters (bf16 compute)
    and in the compute dtype otherwise, then initialised from ``seed`` (identical on every
    rank). Under FakeTensorMode pass ``seed=None`` and call inside
    ``bench.measure.simulate.no_param_init()`` (random init is not possible on fake tensors).
    ``seq_len`` (global tokens) sizes the RoPE table of ``step.rope_table``. ``docs``: the packed
    documents every attention block keeps within (``Decoder.set_documents``).

    ``meta_init``: build on the meta device, shard with FSDP, then materialise only each rank's
    shards on ``device`` (``init_local_shards``: random values, not ``init_weights``' model), as
    TorchTitan builds a model. For an emulated rank of a model whose whole fp32 weights do not
    fit one device (Qwen3-32B: 128 GB); its values differ from the other paths'.
    """
    table = step.rope_table == "checkpointed"
    if table and seq_len is None:
        raise ValueError("rope_table='checkpointed' keeps a RoPE table of the whole sequence: "
                         "pass build_model(seq_len=...)")
    if meta_init and (not step.fsdp or step.fsdp_offload):
        raise ValueError("meta_init materialises FSDP's shards on the device: it needs fsdp=True and "
                         "fsdp_offload=False")
    device = torch.device(device)
    master = torch.float32 if step.fsdp else step.torch_dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(master)
    try:
        with torch.device("meta" if meta_init else device):
            model = Decoder(cfg, method, group=group, **options)
    finally:
        torch.set_default_dtype(previous)
    model.set_documents(docs)
    if seed is not None and not meta_init:
        init_weights(model, seed)
    if table and not meta_init:
        with torch.device(device):
            model.set_rope_table(seq_len)
    model.set_mlp_tiles(step.mlp_tiles if step.tiled_mlp else None, step.tiled_mlp_impl)
    model.set_norm_tiles(step.mlp_tiles if step.tiled_norm else None)
    model.set_loss_chunk(step.loss_chunk if step.chunked_loss else None, step.chunked_loss_impl)
    model.set_fused_attn_norm(step.fused_attn_norm)
    if step.ac:
        offload = HostOffload(host, pin=step.offload_pin and device.type == "cuda") if step.ac_offload else None
        n = len(model.layers)
        if step.ac_group == 1:
            for i in range(n):
                use = offload if not kept_on_device(i, n, step.offload_keep) else None
                model.layers[i] = CheckpointedBlock(model.layers[i], use, keep_attn=step.ac_keep_attn)
        else:  # bench.training.nested: the block inputs are saved to their group's checkpoint
            for i in range(n):
                model.layers[i] = CheckpointedBlock(model.layers[i], None)
            bounds = group_bounds(n, step.ac_group)
            # offload_keep applies to the group inputs as it does to the block inputs at ac_group=1
            model.set_layer_groups([
                CheckpointedGroup(tuple(model.layers[i] for i in r), inner=offload,
                                  outer=offload if not kept_on_device(j, len(bounds), step.offload_keep) else None)
                for j, r in enumerate(bounds)])
    if step.fsdp:
        if group is None:
            raise ValueError("fsdp=True needs a process group (use fsdp=False on one device)")

        with unset_fake_temporarily():  # the mesh holds real rank ids, even under simulation
            mesh = DeviceMesh.from_group(group, device_type=device.type)
        mp = MixedPrecisionPolicy(param_dtype=step.torch_dtype, reduce_dtype=torch.float32)
        # pinned on a real GPU; under simulation the host copies are fake CPU tensors either way
        # (FakeTensorMode has no ``Tensor.pin_memory``, and pinned or not the bytes are host bytes)
        pin = step.offload_pin and device.type == "cuda" and detect_fake_mode() is None
        off = CPUOffloadPolicy(pin_memory=pin) if step.fsdp_offload else OffloadPolicy()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=off)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off)
    if meta_init:
        model.to_empty(device=device)
        init_local_shards(model, 0 if seed is None else seed)
        if table:
            with torch.device(device):
                model.set_rope_table(seq_len)
    # foreach: what torch picks by default on CUDA (one fused op per step over all tensors)
    opt = torch.optim.AdamW(model.parameters(), lr=step.lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    return model, opt


def kept_on_device(i: int, n: int, keep: str) -> bool:
    """Whether checkpoint ``i`` of ``n`` keeps its input on the device under ``offload_keep``.

    The paper's checkpoint wrapper exempts the first and the last block; its scripts'
    full-checkpointing path passes no "last layer" flag, so only the first stays there
    (``"first"``; docs/paper.md, "Training stack"); ``"none"`` exempts none. With two
    checkpoints or fewer nothing is exempt."""
    kept = {"first": {0}, "first_last": {0, n - 1}, "none": set()}[keep]
    return n > 2 and i in kept


def init_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights, identical on every rank for the same seed: each tensor
    is drawn on the CPU from one generator in parameter order, normal(0, std) for matrices
    and ones for norm weights. Call before sharding or wrapping."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            full = torch.ones(p.shape) if p.dim() == 1 else torch.randn(p.shape, generator=gen) * std
            p.copy_(full.to(p.dtype))


def init_local_shards(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights drawn on the device, shard by shard (each rank its own values): normal(0,
    std) for matrices, ones for norm weights. For a model built with ``meta_init``, whose whole
    weights never exist on one device; use ``init_weights`` where the values must match."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.device not in generators:
                generators[local.device] = torch.Generator(device=local.device).manual_seed(seed)
            gen = generators[local.device]
            if p.dim() == 1:
                local.fill_(1.0)
            else:
                local.normal_(0.0, std, generator=gen)


def maybe_prime_optimizer(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Run one optimizer step with zero gradients, learning rate and weight decay, so that
    the optimizer state exists (as in every step after the first) and weights are unchanged.

    A real step, not hand-made state: under simulation the first AdamW step over DTensors
    also runs DTensor's sharding propagation on global-shaped fake tensors, which torch's
    MemTracker would count as optimizer memory; after this step that propagation is cached.
    """
    saved = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, (lr, wd) in zip(opt.param_groups, saved, strict=False):
        g["lr"], g["weight_decay"] = lr, wd


IGNORE_INDEX = -100  # a label the loss ignores (bench.model.decoder's cross-entropies)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S/C] in the method's layout
    labels: torch.Tensor
    positions: torch.Tensor  # [S/C] RoPE positions of the local tokens: global, or inside their documents


def local_len(attn: nn.Module, seq_len: int, docs: Documents | None) -> int:
    """Tokens per rank under the method's layout: ``seq_len / C``, or with documents the layout's
    share of them, padding included (``doc-zigzag``; ``methods.core.seqlayout``)."""
    plan = getattr(attn, "plan", None)
    if docs is not None and plan is not None:
        return plan(seq_len, docs).local_len
    return seq_len // attn.world_size


def make_batch(model: Decoder, seq_len: int, batch: int, device, seed: int = 1, fake: bool = False,
               docs: Documents | None = None) -> Batch:
    """Random tokens for the full sequence (same on every rank for a seed), next-token labels,
    and this rank's part of all three in the method's layout. With ``docs`` the positions restart
    at every document (module docstring)."""
    vocab = model.cfg.vocab_size
    attn = model.attention_module()
    attn.check_seq_len(seq_len, attn.world_size, attn.options)
    attn.check_documents(docs, seq_len)
    if fake:  # simulated: the values do not matter; avoid a data-dependent generator
        n = local_len(attn, seq_len, docs)
        tokens = torch.zeros(batch, n, dtype=torch.long, device=device)
        return Batch(tokens, tokens.clone(), torch.zeros(n, dtype=torch.long, device=device))
    gen = torch.Generator().manual_seed(seed)
    full = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
    tokens, labels = full[:, :-1], full[:, 1:]
    if docs is None:
        return Batch(attn.shard(tokens, dim=1).to(device), attn.shard(labels, dim=1).to(device),
                     attn.shard(torch.arange(seq_len), dim=0).to(device))
    labels = attn.shard(labels, dim=1, docs=docs)
    real = attn.shard(torch.ones(1, seq_len, dtype=torch.bool), dim=1, docs=docs)  # False: a padding token
    return Batch(
        attn.shard(tokens, dim=1, docs=docs).to(device),
        torch.where(real, labels, IGNORE_INDEX).to(device),
        attn.shard(docs.positions(), dim=0, docs=docs).to(device),
    )


def model_step(model: Decoder, opt: torch.optim.Optimizer, batch: Batch, step: TrainingConfig, group) -> torch.Tensor:
    """Forward, backward and optimizer step; returns the local loss (detached)."""
    loss = model(batch.tokens, batch.positions, batch.labels)
    loss.backward()
    if not step.fsdp and world_size_of(group) > 1:
        size = world_size_of(group)
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(size)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# --------------------------------------------------------------------------- attention scope


@dataclass
class AttentionCase:
    block: nn.Module
    x: torch.Tensor
    dy: torch.Tensor
    positions: torch.Tensor
    docs: Documents | None = None


def build_attention(cfg: ModelConfig, method: str, options: dict[str, Any], group, step: TrainingConfig,
                    seq_len: int, device, fake: bool = False, seed: int = 0,
                    docs: Documents | None = None) -> AttentionCase:
    """One attention block in the compute dtype with random input and output gradient (with ``docs``,
    attention within those documents, at their per-document positions)."""
    device = torch.device(device)
    spec = cfg.attn_spec(causal=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(step.torch_dtype)
    try:
        with torch.device(device):
            block = methods.build(method, spec, group=group, **options)
    finally:
        torch.set_default_dtype(previous)
    block.check_seq_len(seq_len, block.world_size, block.options)
    block.check_documents(docs, seq_len)
    n = local_len(block, seq_len, docs)
    shape = (step.batch, n, cfg.dim)
    if fake:
        x = torch.empty(shape, dtype=step.torch_dtype, device=device)
        dy = torch.empty(shape, dtype=step.torch_dtype, device=device)
        positions = torch.zeros(n, dtype=torch.long, device=device)
    else:
        init_weights(block, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(shape, generator=gen).to(device, step.torch_dtype)
        dy = torch.randn(shape, generator=gen).to(device, step.torch_dtype)
        where = docs.positions() if docs is not None else torch.arange(seq_len)
        positions = block.shard(where, dim=0, docs=docs).to(device)
    return AttentionCase(block, x.requires_grad_(), dy, positions, docs)


def attention_step(case: AttentionCase) -> None:
    """Forward + backward of one attention block; gradients are dropped afterwards."""
    docs = {"docs": case.docs} if case.docs is not None else {}
    y = case.block(case.x, positions=case.positions, **docs)
    y.backward(case.dy)
    del y
    case.x.grad = None
    for p in case.block.parameters():
        p.grad = None


def step_fn(scope: str, built, batch: Batch | None, step: TrainingConfig, group) -> Callable[[], Any]:
    """A zero-argument callable that runs one step of either scope."""
    if scope == "attention":
        run = functools.partial(attention_step, built)
    else:
        model, opt = built
        run = functools.partial(model_step, model, opt, batch, step, group)
    if not step.ring_barrier:
        return run

    def synchronised():  # the whole step, so that the backward's ring steps are covered too
        with ringsync.ring_step_barriers():
            return run()

    return synchronised
