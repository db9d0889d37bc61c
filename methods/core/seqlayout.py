"""The sequence layout as an option of the methods that shard the sequence over a ring.

``LayoutOptions`` adds two options: ``layout`` (``layouts.SEQUENCE_LAYOUTS``) and ``pad``.

* ``contiguous``: rank r holds tokens ``[r*S/C, (r+1)*S/C)``; under a causal mask the last ring rank
  does the most work;
* ``zigzag`` (the default): the global head-tail layout, 2R chunks of the whole sequence, ring rank j
  holding chunks j and 2R-1-j: balanced for one causal sequence, unbalanced under documents
  (a causal document mask removes work unevenly across ranks);
* ``doc-zigzag``: per-document head-tail, each document cut into 2R chunks so every ring rank holds
  a head and a tail of every document; a document whose length is not a multiple of 2R is padded
  (``pad=True``, the default) or refused (``pad=False``). Padding tokens are zeros in documents of
  their own, masked from every real token, and dropped by ``unshard``; ``padding(docs)`` reports
  how many there are. Without documents it is ``zigzag``.

``SequenceLayoutMethod`` implements ``shard``/``unshard``, ``seq_multiple`` and the ring schedule of
the chosen layout (``ring_schedule``: the zigzag schedule for one sequence in the zigzag layout,
``ringloop.RunsSchedule`` otherwise). Every refusal (an unknown layout, a length the layout cannot
divide without padding, an input not sharded by this layout) is one line, before any communication.
A subclass whose options lack ``layout`` (``yc-usp``: yunchang's layout is fixed) is ``zigzag``.
A method sets ``ring_size`` (its ring's rank count; the whole group by default): a ring rank's part is
split contiguously over ``world_size / ring_size`` ranks (USP's Ulysses groups).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from . import layouts
from .base import AttentionMethod, MethodOptions
from .documents import Documents
from .layouts import LayoutPlan
from .ringloop import RingSchedule, RunsSchedule, ZigzagSchedule
from .spec import AttnSpec


@dataclass(frozen=True)
class LayoutOptions(MethodOptions):
    layout: str = "zigzag"  # sequence layout: contiguous, zigzag (global head-tail) or doc-zigzag (per document)
    pad: bool = True  # doc-zigzag: pad documents to a multiple of 2R (False: refuse lengths that need it)


def layout_of(options: MethodOptions) -> str:
    """The options' layout; ``zigzag`` for a subclass whose options have none (a wrapped library's fixed layout)."""
    return getattr(options, "layout", "zigzag")


def pad_of(options: MethodOptions) -> bool:
    return getattr(options, "pad", True)


@functools.lru_cache(maxsize=64)
def _runs_schedule(plan_args: tuple, causal: bool, pack: bool, gathered_rank: int | None = None) -> RunsSchedule:
    """The schedule of the plan ``layouts.plan_layout(*plan_args)``, one object per plan and mask: every layer,
    stage, recompute and backward of a step asks for the same one, and its pairs and packed calls (cached on it)
    are then found once (at a million tokens of documents, a step's packing is thousands of blocks). The ring's
    schedule; with ``gathered_rank``, that rank's queries against the all-gathered K/V in layout order (one step)."""
    plan = layouts.plan_layout(*plan_args)
    if gathered_rank is not None:
        return RunsSchedule([plan.rank_runs(gathered_rank)], causal, plan.docs,
                            keys=layouts.merge_runs(list(plan.order)), pack=pack)
    _, _, ring, *_ = plan_args
    return RunsSchedule([plan.rank_runs(j, ring) for j in range(ring)], causal, plan.docs, pack=pack)


class SequenceLayoutMethod(AttentionMethod):
    """A ring method whose sequence layout is an option (module docstring)."""

    Options = LayoutOptions
    # True: K/V travel round the ring step by step (rank j meets rank j - t's part at step t);
    # False: every rank gathers all K/V at once (``allgather-kv``), so there are no per-step pairs
    passes_kv_by_steps: ClassVar[bool] = True

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: LayoutOptions) -> None:
        super().validate(spec, world_size, options)
        layouts.check_layout(layout_of(options), cls.method_name)

    @classmethod
    def ring_size_of(cls, world_size: int, options: LayoutOptions, spec: AttnSpec | None = None) -> int | None:
        """The ring's rank count at these options (None: not known without the spec)."""
        return world_size

    @classmethod
    def validate_documents(cls, spec: AttnSpec, world_size: int, options: LayoutOptions, docs: Documents) -> None:
        """The layout's refusals of these documents (``doc-zigzag`` without padding), before any communication."""
        layouts.plan_layout(layout_of(options), docs.seq_len, cls.ring_size_of(world_size, options, spec), world_size,
                            docs, pad_of(options), cls.method_name)

    @classmethod
    def seq_multiple(cls, world_size: int, options: LayoutOptions) -> int:
        ring = cls.ring_size_of(world_size, options)
        if ring is None:  # every ring size divides the world size: 2C covers every zigzag layout
            return world_size if layout_of(options) == "contiguous" else 2 * world_size
        return layouts.layout_multiple(layout_of(options), ring, world_size)

    @property
    def ring_size(self) -> int:
        return self.ring_size_of(self.world_size, self.options)

    # ------------------------------------------------------------------ the plan
    def plan(self, seq_len: int, docs: Documents | None = None) -> LayoutPlan:
        """This layout's plan for a global sequence of ``seq_len`` tokens (with ``docs``, its documents)."""
        return layouts.plan_layout(*self._plan_args(seq_len, docs))

    def _plan_args(self, seq_len: int, docs: Documents | None) -> tuple:
        """``layouts.plan_layout``'s arguments for this layout (hashable: the key of ``_runs_schedule``). Both
        ``plan`` and ``ring_schedule`` build from them, so a subclass changes its plan here."""
        return (layout_of(self.options), seq_len, self.ring_size, self.world_size, docs, pad_of(self.options),
                self.method_name)

    def padding(self, docs: Documents | None, seq_len: int | None = None) -> int:
        """How many padding tokens this layout adds to the sequence of these documents."""
        return self.plan(docs.seq_len if docs is not None else seq_len, docs).padding

    def _padded(self, docs: Documents | None) -> bool:
        return docs is not None and layout_of(self.options) == "doc-zigzag"

    def check_local_documents(self, docs: Documents | None, local_len: int) -> None:
        """The block call's check: ``local_len`` tokens on this rank are this layout's share of ``docs``."""
        if not self._padded(docs):
            return super().check_local_documents(docs, local_len)
        self.check_documents(docs)
        layouts.check_local_share(self.method_name, "'doc-zigzag' layout", self.plan(docs.seq_len, docs), docs,
                                  local_len)

    def shard(self, x: torch.Tensor, dim: int, docs: Documents | None = None) -> torch.Tensor:
        """Rank r's tokens under the layout; with ``doc-zigzag`` and documents, padding included."""
        self.check_documents(docs, x.shape[dim])
        if self._padded(docs):
            return self.plan(x.shape[dim], docs).shard(x, dim, self.rank)
        self.check_seq_len(x.shape[dim], self.world_size, self.options)
        if layout_of(self.options) == "contiguous":
            return layouts.contiguous_shard(x, dim, self.rank, self.world_size)
        return layouts.zigzag_shard(x, dim, self.rank, self.world_size, self.ring_size)

    def unshard(self, x: torch.Tensor, dim: int, docs: Documents | None = None) -> torch.Tensor:
        """Inverse of ``shard`` (padding dropped): the full sequence on every rank."""
        if self._padded(docs):
            self.check_local_documents(docs, x.shape[dim])
            return self.plan(docs.seq_len, docs).unshard(x, dim, self.group)
        self.check_documents(docs, x.shape[dim] * self.world_size)
        if layout_of(self.options) == "contiguous":
            return layouts.contiguous_unshard(x, dim, self.group)
        return layouts.zigzag_unshard(x, dim, self.group, self.ring_size)

    def ring_schedule(self, causal: bool, docs: Documents | None, seq_len: int) -> RingSchedule | None:
        """The ring's schedule for this layout (``seq_len``: the global sequence's length, used without
        documents); None: the zigzag schedule ``ringloop.ring_attention`` picks itself."""
        if docs is None and layout_of(self.options) != "contiguous":
            return None
        plan_args = self._plan_args(docs.seq_len if docs is not None else seq_len, docs)
        return _runs_schedule(plan_args, causal, self._padded(docs))

    def gathered_schedule(self, causal: bool, docs: Documents | None, seq_len: int) -> RunsSchedule:
        """This rank's queries against the whole sequence's K/V gathered in layout order (one step)."""
        plan_args = self._plan_args(docs.seq_len if docs is not None else seq_len, docs)
        return _runs_schedule(plan_args, causal, self._padded(docs), self.rank)

    def ring_kernel_schedule(self, causal: bool, docs: Documents | None, ring_local_len: int) -> RingSchedule:
        """``ring_schedule`` for a ``ringloop.RingKernel`` call on ``ring_local_len`` tokens per ring rank,
        with the zigzag schedule where it says None."""
        return self.ring_schedule(causal, docs, ring_local_len * self.ring_size) or ZigzagSchedule(causal)
