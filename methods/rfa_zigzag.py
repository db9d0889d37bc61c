"""ring-flash-attention's zigzag ring as a method: ``zigzag_ring_flash_attn_func``, and with packed
documents ``zigzag_ring_flash_attn_varlen_func``.

A baseline and an external check of ``ring``: projections, RoPE and QK-norm are ours, the
ring (K/V passed around with p2p, blockwise flash-attn calls merged by log-sum-exp, zigzag
schedule) is the library's. GQA goes through as is: the ring carries the real KV heads.

Layout (``shard``/``unshard``): zigzag, the library's and ``ring``'s (``layouts.zigzag_shard``).
The sequence is cut into 2C chunks and rank r holds chunks r and 2C-1-r, which balances
causal work across ranks.

Packed documents (``docs=``): the per-document zigzag, ``ring``'s ``doc-zigzag`` layout with
padding (``layouts.plan_layout``): every document cut into 2C chunks, rank r holding chunks r and
2C-1-r of each, document after document. That is what the varlen function expects: its local
``cu_seqlens`` are the global ones divided by C, and it reads the first half of each local
document as chunk r and the second as chunk 2C-1-r, so every document's length must be a
multiple of 2C. A document that is not is padded with zeros to the next multiple, as ``ring``
pads: ``ring`` keeps the padding in a document of its own, which the library cannot take (it is
shorter than 2C), so the library gets each document and its padding as one sequence. The
padding comes after the document's tokens, so under the causal mask no real token sees it; the
padding tokens' outputs (they saw the real tokens) are set to zero, so nothing of them reaches
the block's output or flows back into the real tokens' gradients, and ``unshard`` drops them.
``padding(docs)`` says how many there are. The positions restart at every document (RoPE), as
for every method that honours documents.

Constraints and decisions (``validate`` and ``forward``):

* causal only: the library asserts ``causal=True`` for zigzag (a non-causal ring needs no
  load balancing; use ``ring``), with documents too;
* the attention kernel is flash-attn, called by the library: ``kernel`` may only be left
  unset or be ``"flash-attn"``;
* the global sequence length must be a multiple of 2C; with documents, each document's length
  (the padding makes it one);
* dtypes: flash-attn computes in fp16/bf16 only, so fp32 on CUDA is refused with a
  ``ValueError``. On CPU flash_attn can only be a plain-torch implementation (a test
  stand-in); there fp32 inputs are run through the library in fp64 because ring-flash-attn
  0.1.8's backward is wrong for fp32, in both functions: ``dq = dq_buffer.to(torch.float32)``
  (and the same for dk, dv) is then the buffer itself, which the next block's kernel call
  overwrites (real flash-attn never gets there since it rejects fp32). The library still
  accumulates outputs in fp32, so results have fp32 accuracy;
* a process group is required (the library's ring needs one, also for one rank). With one
  rank the ring is a single causal flash-attn call, made directly (``kernels.attention``
  with the flash-attn kernel, with ``docs`` its varlen call): the library's backward always
  posts a send of dK/dV to the next rank, i.e. to itself, which gloo refuses ("Pair is not
  connected");
* simulated mode cannot run the varlen function: it reads ``cu_seqlens`` on the host
  (``.item()``), which fake tensors do not have, and the simulated flash-attn does not model
  the varlen kernels. ``simulated_documents_refusal`` says so, and a simulated trial with
  documents is refused with it before any work (``bench.measure.trial``).

``import ring_flash_attn`` also imports its Hugging Face adapters, which need
``transformers`` and, in ring-flash-attn 0.1.8, fail to import under transformers 5
(``is_flash_attn_greater_or_equal_2_10`` is gone from it); the zigzag functions need neither.
So the package's ``__init__`` is bypassed unless something imported the package already: it is
registered bare and only the zigzag submodules are imported. The library is imported lazily
(in ``__init__``).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import itertools
import sys
from typing import ClassVar

import torch

from .core import layouts
from .core.base import MethodOptions, ZigzagLayoutMethod
from .core.documents import Documents
from .core.kernels import attention, flash_attn_dtype, get_kernel
from .core.layouts import LayoutPlan
from .core.registry import MethodFacts, register
from .core.spec import AttnSpec
from .ds_ulysses import require_group

NAME = "rfa-zigzag"


def load_library_func(module: str, name: str):
    """``ring_flash_attn.<module>.<name>``, without the package's Hugging Face adapters (see the
    module docstring)."""
    if "ring_flash_attn" not in sys.modules:
        spec = importlib.util.find_spec("ring_flash_attn")
        if spec is None:
            raise ValueError(f"{NAME} needs ring_flash_attn: pip install ring-flash-attn")
        sys.modules["ring_flash_attn"] = importlib.util.module_from_spec(spec)  # __init__ not run
    return getattr(importlib.import_module(f"ring_flash_attn.{module}"), name)


def per_document_plan(docs: Documents, world_size: int) -> LayoutPlan:
    """The per-document zigzag of ``docs`` over ``world_size`` ranks, padded (``ring``'s ``doc-zigzag``)."""
    return layouts.plan_layout("doc-zigzag", docs.seq_len, world_size, world_size, docs, True, NAME, interleaved=True)


@functools.lru_cache(maxsize=64)
def local_sequences(docs: Documents, world_size: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What the varlen function needs on ``rank``, for one batch row: the local lengths of its
    sequences (each document with its padding: a multiple of 2C globally, C times the local length),
    and the local indices of the padding tokens (whose outputs are zeroed; module docstring).
    Cached: every layer makes the same call in the forward and the backward."""
    plan = per_document_plan(docs, world_size)
    sequences: list[int] = []
    for n, first in zip(plan.docs.lengths, plan.real, strict=True):
        if first < 0:  # a padding document joins the document it pads
            sequences[-1] += n
        else:
            sequences.append(n)
    local = plan.source_index().chunk(world_size)[rank].tolist()
    padding = tuple(i for i, source in enumerate(local) if source == docs.seq_len)
    return tuple(n // world_size for n in sequences), padding


@register(
    NAME,
    "ring-flash-attention's zigzag ring attention (flash-attn kernels, causal only)",
    requires=("ring_flash_attn", "flash_attn"),
    install_hint="pip install ring-flash-attn flash-attn --no-build-isolation (CUDA only)",
    facts=MethodFacts(column="ring", library="ring-flash-attn", kernel="fa2", library_kernels=True),
)
class RingFlashAttnZigzag(ZigzagLayoutMethod):
    honours_documents: ClassVar[bool] = True
    simulated_documents_refusal = (
        "ring-flash-attn's varlen zigzag reads cu_seqlens on the host (.item()), which fake tensors do not have, "
        "and the simulated flash-attn does not model the varlen kernels")
    calls_suite_kernel = False  # ring_flash_attn calls flash-attn itself

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: MethodOptions) -> None:
        if options.kernel not in (None, "flash-attn"):
            raise ValueError(
                f"{NAME}: kernel={options.kernel!r} cannot be used: ring_flash_attn calls "
                "flash-attn itself; leave kernel unset (or 'flash-attn')"
            )
        super().validate(spec, world_size, options)
        if not spec.causal:
            raise ValueError(
                f"{NAME}: ring_flash_attn's zigzag ring is causal only (it asserts causal=True); "
                "use 'ring' for non-causal attention"
            )

    @classmethod
    def seq_multiple(cls, world_size: int, options: MethodOptions) -> int:
        return 2 * world_size

    @classmethod
    def validate_documents(cls, spec: AttnSpec, world_size: int, options: MethodOptions, docs: Documents) -> None:
        per_document_plan(docs, world_size)

    @classmethod
    def documents_plan(cls, world_size: int, docs: Documents) -> LayoutPlan:
        """Where the tokens of ``docs`` sit (``bench.stackmodel.docwork`` counts each rank's work by it). Its
        padding is in documents of its own, as ``ring``'s: the pairs the padding makes with its document's
        keys inside the library (fewer than 2C queries per document) are not in that count."""
        return per_document_plan(docs, world_size)

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        require_group(group, NAME, "ring_flash_attn's zigzag ring")
        self.kernel = get_kernel("flash-attn")  # what the library calls (recorded in result rows)
        self._zigzag = load_library_func("zigzag_ring_flash_attn", "zigzag_ring_flash_attn_func")
        self._zigzag_varlen = load_library_func("zigzag_ring_flash_attn_varlen", "zigzag_ring_flash_attn_varlen_func")

    # ------------------------------------------------------------------ layout with documents
    def plan(self, seq_len: int, docs: Documents | None = None) -> LayoutPlan:
        """The layout's plan: zigzag, or with documents the padded per-document zigzag."""
        if docs is None:
            return layouts.plan_layout("zigzag", seq_len, self.world_size, self.world_size, None, True, NAME)
        return per_document_plan(docs, self.world_size)

    def padding(self, docs: Documents | None, seq_len: int | None = None) -> int:
        """How many padding tokens the layout adds to the sequence of these documents."""
        return self.plan(docs.seq_len if docs is not None else seq_len, docs).padding

    def check_local_documents(self, docs: Documents | None, local_len: int) -> None:
        """The block call's check: ``local_len`` tokens on this rank are the layout's share of ``docs``."""
        if docs is None:
            return super().check_local_documents(docs, local_len)
        self.check_documents(docs)
        layouts.check_local_share(NAME, "per-document zigzag", self.plan(docs.seq_len, docs), docs, local_len)

    def shard(self, x: torch.Tensor, dim: int, docs: Documents | None = None) -> torch.Tensor:
        """Rank r's tokens: chunks r and 2C-1-r of the sequence, or with documents of every document."""
        if docs is None:
            return super().shard(x, dim)
        self.check_documents(docs, x.shape[dim])
        return self.plan(x.shape[dim], docs).shard(x, dim, self.rank)

    def unshard(self, x: torch.Tensor, dim: int, docs: Documents | None = None) -> torch.Tensor:
        """Inverse of ``shard`` (padding dropped): the full sequence on every rank."""
        if docs is None:
            return super().unshard(x, dim)
        self.check_local_documents(docs, x.shape[dim])
        return self.plan(docs.seq_len, docs).unshard(x, dim, self.group)

    # ------------------------------------------------------------------ attention
    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        if docs is None and x.shape[1] % 2:
            raise ValueError(f"{NAME}: local sequence length {x.shape[1]} must be even (two zigzag chunks)")
        cos, sin = self.rope_for(x, positions, docs)
        # fp64 on CPU: ring_flash_attn's fp32 backward aliases a buffer (CUDA flash-attn refuses fp32)
        dt = flash_attn_dtype(NAME, x, torch.float64)
        q, k, v = self.project_qkv(x, cos, sin)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if self.world_size == 1:  # see the module docstring: no self-send on gloo
            out = attention(q, k, v, True, self.kernel, self.scale, docs=docs)
        elif docs is None:
            out = self._zigzag(q, k, v, dropout_p=0.0, softmax_scale=self.scale, causal=True, group=self.group)
        else:
            out = self._varlen(q, k, v, docs)
        return self.wo(out.to(x.dtype).flatten(2))

    def _varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents) -> torch.Tensor:
        """The varlen zigzag on the batch packed row after row (``[B * S/C, heads, dim]``, each row's
        sequences after the previous row's); the padding tokens' outputs zeroed."""
        b, n = q.shape[:2]
        lengths, padding = local_sequences(docs, self.world_size, self.rank)
        cu = list(itertools.accumulate(lengths * b, initial=0))
        cu_seqlens = torch.tensor(cu, dtype=torch.int32).to(q.device)  # made on the host, as index_tensor
        out = self._zigzag_varlen(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, max(lengths),
            dropout_p=0.0, softmax_scale=self.scale, causal=True, group=self.group,
        ).unflatten(0, (b, n))
        if padding:
            pad = torch.zeros(n, dtype=torch.bool)
            pad[list(padding)] = True
            out = out.masked_fill(pad.to(out.device)[:, None, None], 0.0)
        return out
