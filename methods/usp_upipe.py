"""UPipe inside USP: headwise stages on the Ulysses dimension, a zigzag ring across the other.

The paper's multi-node configuration (UPipe 8x2 on 16 GPUs): the C ranks form USP's
``ulysses_degree`` x ``ring_degree`` mesh and layout (``usp.USP``); UPipe's stage schedule
runs over the Ulysses group (chunk_heads U a multiple of the Ulysses degree u), and each
stage's attention is ring attention over the ring group, through ``ring.RingKernel``. So
the per-stage buffers stay U/H of Ulysses' while the sequence spans nodes. With
``ulysses_degree = C`` it is UPipe; with ``chunk_heads = H`` it is USP.

The layout option and packed documents are USP's: every stage's ring kernel takes the call's
documents and runs the ring with the layout's schedule (``USP.ring_kernel_schedule``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from .core.documents import Documents
from .core.registry import MethodFacts, PaperRun, register
from .core.ringloop import RingKernel
from .core.spec import AttnSpec
from .upipe import UPipe, UPipeOptions, plan_stages, upipe_block
from .usp import USP, USPOptions


@dataclass(frozen=True)
class USPUPipeOptions(USPOptions):
    chunk_heads: int | None = None  # U, query heads per stage (multiple of ulysses_degree); None: U = u


@register("usp-upipe", "UPipe on the Ulysses dimension of a USP mesh, zigzag Ring across (multi-node UPipe)",
          # the paper's UPipe on two nodes: 8 Ulysses x 2 Ring, UPipe's ring code synchronising every step
          facts=MethodFacts(column="upipe", mesh=True, reference=True, paper_code=True, ring_barrier=True,
                            simulates=(PaperRun("upipe", {"ulysses_degree": 8}, min_gpus=9),)))
class USPUPipe(USP):
    Options = USPUPipeOptions

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: USPUPipeOptions) -> None:
        super().validate(spec, world_size, options)
        u, _ = cls.degrees(spec, world_size, options)
        try:
            UPipe.validate(spec, u, UPipeOptions(kernel=options.kernel, chunk_heads=options.chunk_heads))
        except ValueError as err:
            raise ValueError(f"usp-upipe (stages run over the Ulysses degree {u}, so read 'world size' "
                             f"as {u}): {err}") from None

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        u = self.ulysses_degree
        chunk = u if self.options.chunk_heads is None else self.options.chunk_heads
        self.options = replace(self.options, chunk_heads=chunk)
        self.schedule = SimpleNamespace(
            spec=spec, group=self.ulysses_group,
            kernel=RingKernel(self.kernel, self.ring_group, self.ring_kernel_schedule),
            scale=self.scale, stages=plan_stages(spec, u, chunk),
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions, docs)
        return upipe_block(self, x, cos, sin, self.schedule, None, docs)
