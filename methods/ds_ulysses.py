"""DeepSpeed's ``DistributedAttention`` (DeepSpeed-Ulysses) around our attention kernel.

A baseline and an external check of ``ulysses``: the projections, RoPE and QK-norm are ours
(same weights and names as every method), the two all-to-alls are DeepSpeed's
(``deepspeed.sequence.layer.DistributedAttention`` on ``[batch, seq, heads, head_dim]``,
``scatter_idx=2, gather_idx=1``), and the local attention between them is our kernel.
Layout: contiguous, like ``ulysses``.

Constraints. DeepSpeed splits heads evenly across ranks and asserts that there are at least
as many KV heads as ranks; like ``ulysses`` we replicate KV heads C/G times when G < C (the
weight gradients of the replicas are summed back), so the constraints are those of
``ulysses``: C divides H, and C and G divide one another.

DeepSpeed's collectives go through ``deepspeed.comm``, which must be initialised on top of
the existing ``torch.distributed`` group: ``init_deepspeed_comm`` does it once per process.
On CPU, DeepSpeed's first initialisation JIT-compiles a shared-memory all-reduce with g++
(docs/methods.md, section "ds-ulysses"); it is skipped by replacing ``build_shm_op`` with a
no-op for the duration of the call (the all-to-alls used here never touch it). The library is
imported lazily, in ``__init__``, never when ``methods`` is imported.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from .core.base import AttentionMethod, MethodOptions
from .core.kernels import attention
from .core.registry import MethodFacts, register
from .core.spec import AttnSpec
from .ulysses import replicated_kv_heads

DEEPSPEED_HINT = "pip install deepspeed (pin torch==<your version> in the same pip command)"


def init_deepspeed_comm():
    """Initialise ``deepspeed.comm`` over the running ``torch.distributed`` (once); return it."""
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if ds_comm.is_initialized():
        return ds_comm
    if not dist.is_initialized():
        raise ValueError(
            "DeepSpeed wrappers need torch.distributed initialised (init_process_group) before "
            "the block is built: deepspeed.comm is set up on top of it"
        )
    ds_torch = sys.modules["deepspeed.comm.torch"]  # `import deepspeed.comm.torch as m` binds torch itself
    original = ds_torch.build_shm_op
    if get_accelerator().device_name() == "cpu":
        ds_torch.build_shm_op = lambda: None  # skip the ~30 s g++ build of the CPU shm all-reduce
    try:
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    finally:
        ds_torch.build_shm_op = original
    return ds_comm


def require_group(group, who: str, library: str) -> None:
    if group is None:
        raise ValueError(
            f"{who} wraps {library}, which always communicates through a process group: build it "
            "with group=<a torch.distributed group> (a 1-rank group to run on one device)"
        )


class _LocalAttention(nn.Module):
    """The local attention DeepSpeed calls between its all-to-alls: our kernel, plain autograd."""

    def __init__(self, block: DeepSpeedUlysses) -> None:
        super().__init__()
        self.causal, self.kernel, self.scale = block.spec.causal, block.kernel, block.scale

    def forward(self, q, k, v):
        return attention(q, k, v, self.causal, self.kernel, self.scale)


@register(
    "ds-ulysses",
    "DeepSpeed's DistributedAttention (Ulysses all-to-alls) around our attention kernel",
    requires=("deepspeed",),
    install_hint=DEEPSPEED_HINT,
    facts=MethodFacts(column="ulysses", library="DeepSpeed"),
)
class DeepSpeedUlysses(AttentionMethod):
    rank_symmetric_reason = ("DeepSpeed's all-to-all gives every rank the whole sequence on H/C heads, so every "
                             "rank allocates the same shapes in the same order")
    documents_refusal = (
        "not yet: DeepSpeed's DistributedAttention hands its local attention q, k, v only, and the "
        "documents are not wired through it"
    )

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: MethodOptions) -> None:
        super().validate(spec, world_size, options)
        cls.check_head_split(spec, world_size, "ds-ulysses")

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        require_group(group, "ds-ulysses", "DeepSpeed's DistributedAttention")
        self.kv_heads = replicated_kv_heads(spec, self.check_head_split(spec, self.world_size, "ds-ulysses"))
        init_deepspeed_comm()
        from deepspeed.sequence.layer import DistributedAttention

        self.dist_attn = DistributedAttention(_LocalAttention(self), group, scatter_idx=2, gather_idx=1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions)
        q, k, v = self.project_qkv(x, cos, sin, self.kv_heads)
        out = self.dist_attn(q, k, v, 0)  # batch_dim_idx=0: [batch, seq, heads, head_dim]
        return self.wo(out.flatten(2))
