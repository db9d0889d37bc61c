"""What every method shares: the parameters, option parsing, layout and constraints.

``AttentionParams`` owns the block's weights with the names every method and the
reference use (``wq, wk, wv, wo`` and ``q_norm, k_norm`` with QK-norm), so a single
``state_dict`` loads into all of them. ``AttentionMethod`` adds the distributed part:
the process group, typed options (a dataclass per method, each value checked against its
field's annotation), ``validate`` (raising a ``ValueError`` that names the constraint and
the fix before any communication) and the sequence layout (``shard``/``unshard``),
contiguous unless a method overrides it with another layout of ``layouts``.

Packed documents (``methods.core.documents.Documents``, the global layout) are one keyword,
``docs=``, of ``shard``, ``unshard`` and the block call ``block(x, positions, docs=docs)``.
Whether a method takes them is one class attribute, ``honours_documents``; a method that does
not says why in ``documents_refusal`` (one line: the wrapped library's limit, or "not yet"),
and ``check_documents`` (called by ``methods.validate``, ``shard``/``unshard`` and the block call,
before any communication) refuses them with it. The block call hands ``docs`` to ``forward``
only when given, so a method that refuses them needs no ``docs`` parameter.
"""
from __future__ import annotations

import dataclasses
import inspect
import numbers
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from . import comm, layouts
from .documents import Documents
from .kernels import get_kernel, softmax_scale
from .rope import apply_rope, rope_cos_sin, rope_cos_sin_from_table
from .spec import AttnSpec

NORM_EPS = 1e-6


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index tensor on ``device``, made on the host and copied (what
    ``torch.tensor(values, device=device)`` does on a GPU anyway). Written this way because a
    tensor from Python data is first made real, which a simulated CUDA device cannot do
    (``bench.stackmodel.simcuda``): made on the CPU, it is fake from the copy on."""
    return torch.tensor(values).to(device)


def head_rows(weight: torch.Tensor, heads: list[int], head_dim: int) -> torch.Tensor:
    """Rows of a projection weight for the given heads, in that order.

    A contiguous ascending run of heads is a view (no copy); anything else (a GQA stage's
    strided heads, replicated KV heads) is gathered, and autograd sums the gradient of
    repeated rows back into the original ones (how replicated KV weights are reduced).
    """
    if heads == list(range(heads[0], heads[0] + len(heads))):
        return weight[heads[0] * head_dim : (heads[0] + len(heads)) * head_dim]
    return weight.view(-1, head_dim, weight.shape[-1])[index_tensor(heads, weight.device)].reshape(
        len(heads) * head_dim, weight.shape[-1]
    )


def project(
    x: torch.Tensor,
    weight: torch.Tensor,
    head_dim: int,
    norm_weight: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` split into heads, then optional per-head RMSNorm, then optional RoPE."""
    t = F.linear(x, weight).unflatten(-1, (-1, head_dim))
    if norm_weight is not None:
        t = F.rms_norm(t, (head_dim,), norm_weight, NORM_EPS)
    if cos is not None:
        t = apply_rope(t, cos, sin)
    return t


class AttentionParams(nn.Module):
    """The weights of one attention block (shared names across all methods)."""

    def __init__(self, spec: AttnSpec) -> None:
        super().__init__()
        self.spec = spec
        h, g, d, dim = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.dim
        self.wq = nn.Linear(dim, h * d, bias=False)
        self.wk = nn.Linear(dim, g * d, bias=False)
        self.wv = nn.Linear(dim, g * d, bias=False)
        self.wo = nn.Linear(h * d, dim, bias=False)
        if spec.qk_norm:
            self.q_norm = nn.RMSNorm(d, eps=NORM_EPS)
            self.k_norm = nn.RMSNorm(d, eps=NORM_EPS)
        else:
            self.q_norm = self.k_norm = None

    @property
    def q_norm_weight(self) -> torch.Tensor | None:
        return None if self.q_norm is None else self.q_norm.weight

    @property
    def k_norm_weight(self) -> torch.Tensor | None:
        return None if self.k_norm is None else self.k_norm.weight

    def project_qkv(self, x: torch.Tensor, cos, sin, kv_heads: list[int] | None = None):
        """Q, K, V of the local tokens (QK-norm and RoPE applied); ``kv_heads`` picks (and may
        repeat, for replication) the KV heads, default all of them in order."""
        d = self.spec.head_dim
        wk, wv = self.wk.weight, self.wv.weight
        if kv_heads is not None:
            wk, wv = head_rows(wk, kv_heads, d), head_rows(wv, kv_heads, d)
        q = project(x, self.wq.weight, d, self.q_norm_weight, cos, sin)
        return q, project(x, wk, d, self.k_norm_weight, cos, sin), project(x, wv, d)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """RoPE angles of ``positions``: looked up in ``rope_table`` when the model keeps one
        (``Decoder.set_rope_table``, TorchTitan's precomputed ``freqs_cis``), else computed."""
        table = getattr(self, "rope_table", None)
        if table is not None:
            return rope_cos_sin_from_table(table, positions, dtype)
        return rope_cos_sin(positions, self.spec.head_dim, self.spec.rope_theta, dtype)


def matches_type(value: Any, hint: Any) -> bool:
    """Whether ``value`` may be stored in a field annotated ``hint``.

    Options arrive from the CLI, YAML sweeps and Python callers, so a wrong type must be
    refused by name before it reaches a method's arithmetic (``2.5`` heads, ``"8"`` chunks).
    Rules: ``X | Y`` accepts either; ``None`` only None; ``int`` any integral number but not a
    bool (``True`` as a count is a mistake); ``float`` any real number but not a bool; any
    other class by ``isinstance``; a generic alias (``tuple[int, ...]``) by its container. An
    annotation this cannot read (a ``TypeVar``, ``Any``) accepts everything.
    """
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(matches_type(value, arg) for arg in typing.get_args(hint))
    if hint is None or hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    origin = typing.get_origin(hint)
    return isinstance(value, origin) if isinstance(origin, type) else True


def describe_type(hint: Any) -> str:
    """``int | None`` -> ``"an int or None"``: the expected type as an error message says it."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(describe_type(arg) for arg in typing.get_args(hint))
    if hint is None or hint is type(None):
        return "None"
    name = hint.__name__ if isinstance(hint, type) else str(hint)
    return ("an " if name[:1] in "aeiou" else "a ") + name


@dataclass(frozen=True)
class MethodOptions:
    """Options every method accepts. Subclass (as a frozen dataclass) to add a method's own."""

    kernel: str | None = None  # attention kernel (methods/core/kernels.py); None: process default


class AttentionMethod(AttentionParams):
    """Base of every context-parallel method: sequence-sharded ``[B, S/C, dim]`` in and out."""

    method_name: ClassVar[str] = "?"
    Options: ClassVar[type] = MethodOptions
    # simulation: None runs on the trial's fake device; "cpu" pins the method to the CPU code
    # path (a wrapped library that picks its device by asking torch.cuda.is_available(), which
    # the simulated CUDA device leaves False, would mix devices); the reason goes in the row
    simulated_cpu_path_reason: ClassVar[str | None] = None
    # a method that honours documents but cannot run them in simulation (fake tensors, the simulated
    # flash-attn): why, in one line; ``bench.measure.trial`` refuses such a trial with it before any work
    simulated_documents_refusal: ClassVar[str | None] = None
    # a method whose kernels exist only on CUDA (no CPU path): why, for `python -m methods`
    cuda_only_reason: ClassVar[str | None] = None
    # False for a method that splits no sequence (``no-cp``): every rank holds all tokens and the
    # full weight gradient, so a per-rank figure is the whole sequence's, not a 1/C share of it
    splits_sequence: ClassVar[bool] = True
    # False for a method whose wrapped library calls its attention kernel itself (flash-attn, torch's
    # SDPA): the levers that act on the kernels of ``methods.core.kernels`` (``ac_keep_attn``) refuse it
    calls_suite_kernel: ClassVar[bool] = True
    # packed documents (``docs=``): True where shard/unshard and forward keep attention within each
    # document; otherwise ``documents_refusal`` says why not in one line (``check_documents``)
    honours_documents: ClassVar[bool] = False
    documents_refusal: ClassVar[str] = "not yet: its attention does not mask documents"
    # why every rank of this method allocates the same shapes in the same order (so simulating rank 0
    # measures every rank: ``deciding_ranks``); None: its ranks differ (the ring family: each rank holds
    # other chunks of the sequence and meets other K/V blocks at each step), or that is not known
    rank_symmetric_reason: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs) -> None:
        """A subclass that overrides ``forward`` without a ``docs`` parameter cannot pass documents on,
        so it does not inherit its parent's ``honours_documents`` unless it declares it itself."""
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if (forward is not None and "honours_documents" not in cls.__dict__ and cls.honours_documents
                and "docs" not in inspect.signature(forward).parameters):
            cls.honours_documents = False
            cls.documents_refusal = ("its forward takes no docs= (it overrides the forward of a method that "
                                     "honours documents); add docs=None to forward and pass it on")

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec)
        self.group = group
        self.world_size, self.rank = comm.world(group)
        self.options = self.parse_options(**options)
        self.validate(spec, self.world_size, self.options)
        self.kernel = get_kernel(self.options.kernel)
        self.scale = softmax_scale(spec.head_dim)

    # ------------------------------------------------------------------ options and checks
    @classmethod
    def parse_options(cls, **options) -> MethodOptions:
        """Typed options. An unknown name is refused with the list of valid ones, a value whose
        type does not match its field's annotation (``matches_type``) with the option, the
        expected type and the value; each method's ``validate`` then checks ranges and
        combinations knowing the types are right."""
        valid = [f.name for f in dataclasses.fields(cls.Options)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown option(s) {unknown} for method {cls.method_name!r}; valid options: {valid}"
            )
        hints = typing.get_type_hints(cls.Options)
        for name, value in options.items():
            if not matches_type(value, hints[name]):
                raise ValueError(
                    f"option {name} of method {cls.method_name!r} must be {describe_type(hints[name])}, "
                    f"got {value!r} ({type(value).__name__})"
                )
        return cls.Options(**options)

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: MethodOptions) -> None:
        """Raise ``ValueError`` naming the violated constraint and the fix. Override and extend."""
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        if options.kernel is not None:
            get_kernel(options.kernel)

    @classmethod
    def check_documents(cls, docs: Documents | None, seq_len: int | None = None) -> None:
        """Refuse documents this method does not honour, anything that is not a ``Documents``, and
        documents that do not tile a global sequence of ``seq_len`` tokens (when given)."""
        if docs is None:
            return
        if not isinstance(docs, Documents):
            raise ValueError(
                f"docs must be a methods.Documents (Documents.from_lengths([...])), got {type(docs).__name__}"
            )
        if not cls.honours_documents:
            from .registry import all_infos

            honouring = [i.name for i in all_infos() if getattr(i.cls, "honours_documents", False)]
            raise ValueError(
                f"method {cls.method_name!r} refuses packed documents (docs=): {cls.documents_refusal}; "
                f"run it without docs, or use one of {honouring}"
            )
        if seq_len is not None:
            docs.check_seq_len(seq_len, f"the global sequence of method {cls.method_name!r}")

    @classmethod
    def validate_documents(cls, spec: AttnSpec, world_size: int, options: MethodOptions, docs: Documents) -> None:
        """What a method's layout needs of these documents (``methods.validate`` with ``docs``); nothing
        by default. A layout that cuts documents overrides it (``methods.core.seqlayout``)."""

    def __call__(self, x: torch.Tensor, *args, docs: Documents | None = None, **kwargs) -> torch.Tensor:
        """The block call; ``docs`` (the global documents) is checked against the global length of
        ``x`` here, before any communication, and reaches ``forward`` only when given."""
        if docs is None:
            return super().__call__(x, *args, **kwargs)
        self.check_local_documents(docs, x.shape[1])
        return super().__call__(x, *args, docs=docs, **kwargs)

    def check_local_documents(self, docs: Documents | None, local_len: int) -> None:
        """Refuse documents that do not tile the global sequence of which this rank holds
        ``local_len`` tokens (``world_size`` times that; a padding layout overrides this)."""
        self.check_documents(docs, local_len * self.world_size)

    @classmethod
    def run_notes(cls, options: MethodOptions, world_size: int) -> list[str]:
        """What a result row of this method should say about how it ran with these options (a
        wrapped library patched for the run, say); none by default."""
        return []

    @classmethod
    def deciding_ranks(cls, world_size: int, options: MethodOptions, spec: AttnSpec | None = None,
                       docs: Documents | None = None) -> tuple[int, ...]:
        """The ranks whose memory can be the job's largest: the ranks a simulation must measure
        (``bench.measure.run.measure_worst_rank``), the worst of them deciding whether a trial fits.

        Every rank by default: a rank's shapes and their order may depend on which part of the
        sequence it holds (the ring family's layouts, its per-step K/V pairs, packed documents cut
        differently on each rank), and what the caching allocator reserves depends on that order.
        Rank 0 alone where ``rank_symmetric_reason`` says why every rank allocates the same."""
        if cls.rank_symmetric_reason is not None:
            return (0,)
        return tuple(range(world_size))

    @classmethod
    def seq_multiple(cls, world_size: int, options: MethodOptions) -> int:
        """The global sequence length must be a multiple of this (the layout's granularity)."""
        return world_size

    @classmethod
    def check_seq_len(cls, seq_len: int, world_size: int, options: MethodOptions) -> None:
        multiple = cls.seq_multiple(world_size, options)
        if seq_len % multiple:
            lower = seq_len - seq_len % multiple
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {multiple}, which method "
                f"{cls.method_name!r} needs at world size {world_size} (its sequence layout); "
                f"pad or trim the sequence to a multiple of {multiple}, e.g. {lower or multiple}"
            )

    # ------------------------------------------------------------------ sequence layout
    def shard(self, x: torch.Tensor, dim: int, docs: Documents | None = None) -> torch.Tensor:
        """This rank's part of a full-sequence tensor (contiguous chunk by default); ``docs``, the
        global documents, are checked (this layout does not depend on them)."""
        self.check_documents(docs, x.shape[dim])
        self.check_seq_len(x.shape[dim], self.world_size, self.options)
        return layouts.contiguous_shard(x, dim, self.rank, self.world_size)

    def unshard(self, x: torch.Tensor, dim: int, docs: Documents | None = None) -> torch.Tensor:
        """Inverse of ``shard``: the full sequence on every rank (all-gather; no autograd)."""
        self.check_documents(docs, x.shape[dim] * self.world_size)
        return layouts.contiguous_unshard(x, dim, self.group)

    def default_positions(self, local_len: int, device, docs: Documents | None = None) -> torch.Tensor:
        """This rank's RoPE positions: its tokens' global positions, or with documents their
        positions inside their documents (restarting at 0 at each, as Transformers' packed
        ``position_ids``)."""
        if docs is not None:
            return self.shard(docs.positions(device), dim=0, docs=docs)
        return self.shard(torch.arange(local_len * self.world_size, device=device), dim=0)

    def rope_for(self, x: torch.Tensor, positions: torch.Tensor | None, docs: Documents | None = None):
        """RoPE tables for the local tokens (global positions; default: this layout's, or the
        per-document positions with ``docs``)."""
        if positions is None:
            positions = self.default_positions(x.shape[1], x.device, docs)
        if positions.shape != (x.shape[1],):
            raise ValueError(
                f"positions must be 1-D with one entry per local token ({x.shape[1]}), "
                f"got shape {tuple(positions.shape)}"
            )
        return self.rope(positions, x.dtype)

    # ------------------------------------------------------------------ shared constraints
    @staticmethod
    def check_head_split(spec: AttnSpec, world_size: int, who: str) -> int:
        """Head-sharded (Ulysses-style) constraints; returns the KV replication factor."""
        h, g, c = spec.n_heads, spec.n_kv_heads, world_size
        if h % c:
            raise ValueError(
                f"{who}: n_heads={h} is not divisible by the world size {c}; each rank attends "
                f"H/C heads, so use a head-parallel degree that divides {h} (or a ring-based method)"
            )
        if g % c and c % g:
            raise ValueError(
                f"{who}: n_kv_heads={g} and world size {c} do not divide one another; KV heads are "
                f"split across ranks (C | G) or replicated C/G times (G | C): choose such a world size"
            )
        return c // g if g < c else 1


class ZigzagLayoutMethod(AttentionMethod):
    """A method whose tokens sit in the zigzag layout over all its ranks (rank r holds chunks r
    and 2C-1-r of 2C, so causal work is balanced around a ring): the wrappers ``rfa-zigzag``,
    ``yc-ring``, ``torch-cp``, whose libraries fix it (our own ring methods take the layout as an
    option, ``methods.core.seqlayout``). The layout lives once here; a method overrides ``seq_multiple`` where its
    library needs more than ``layouts.zigzag_multiple``."""

    @classmethod
    def seq_multiple(cls, world_size: int, options: MethodOptions) -> int:
        return layouts.zigzag_multiple(world_size)

    def shard(self, x: torch.Tensor, dim: int, docs: Documents | None = None) -> torch.Tensor:
        """Rank r's tokens: global chunks r and 2C-1-r of 2C (zigzag)."""
        self.check_documents(docs, x.shape[dim])
        self.check_seq_len(x.shape[dim], self.world_size, self.options)
        return layouts.zigzag_shard(x, dim, self.rank, self.world_size)

    def unshard(self, x: torch.Tensor, dim: int, docs: Documents | None = None) -> torch.Tensor:
        self.check_documents(docs, x.shape[dim] * self.world_size)
        return layouts.zigzag_unshard(x, dim, self.group)
