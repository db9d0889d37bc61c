"""USP hybrid (unified sequence parallelism): Ulysses inside groups, Ring across them.

The C ranks of the group form a ``ulysses_degree`` x ``ring_degree`` mesh (u x R = C).
Ulysses groups are contiguous group ranks [i*u, (i+1)*u); ring groups are strided,
{t, u+t, 2u+t, ...}. A rank projects Q/K/V for its tokens (RoPE at their global positions),
the sequence->head all-to-all inside its Ulysses group gives it all tokens of its Ulysses
group for H/u query heads (and G/u KV heads, or a replica when G < u, as in Ulysses), ring
attention runs across its ring group on those heads, and the head->sequence all-to-all
returns the output. Built on the Ulysses pieces (``comm.seq_to_head/head_to_seq``,
``ulysses.replicated_kv_heads``) and on ``ring.ring_attention`` unchanged.

Layout. The sequence is put in the zigzag order of ``ring_degree`` (2R chunks; ring rank j
gets chunks j and 2R-1-j) and that order is split contiguously into C parts, part j*u+t
going to group rank j*u+t. After the all-to-all, which concatenates in Ulysses-rank order,
ring rank j holds exactly chunks j and 2R-1-j: the zigzag layout ring attention's causal
blocks assume. u = C (R = 1) is Ulysses' contiguous layout; u = 1 is Ring's zigzag layout.
The sequence must be a multiple of lcm(2R, C) (of C when R = 1).
The layout is an option (``methods.core.seqlayout``: ``zigzag`` above, ``contiguous``, or
``doc-zigzag``, the same cut per document over the R ring ranks, padded where needed).

Packed documents (``docs=``): after the all-to-all a ring rank holds its layout's runs of the
global sequence for its heads, and the ring's schedule masks each step by document
(``ringloop.RunsSchedule``), as in ``ring``.

Subgroups. Created once per (group ranks, u) and cached. On a group spanning every rank,
every rank creates every subgroup in one order with ``new_group`` (all ranks must call it).
On a smaller group only its members build the method, so each creates just its own
subgroups with ``use_local_synchronization=True``; torch names those groups by hashing the
ranks *and the number of groups the process already has*, so this needs every member to
have created the same number of groups before (true of SPMD programs). Subgroups of one
rank are ``None``, and a subgroup equal to the whole group is the group itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from .core import comm
from .core.documents import Documents
from .core.registry import MethodFacts, register
from .core.ringloop import ring_attention
from .core.seqlayout import LayoutOptions, SequenceLayoutMethod
from .core.spec import AttnSpec
from .ulysses import replicated_kv_heads


@dataclass(frozen=True)
class USPOptions(LayoutOptions):
    ulysses_degree: int | None = None  # u, ranks per Ulysses group; None: largest that fits


_MESHES: dict[tuple, tuple] = {}


def mesh_groups(group, ulysses_degree: int):
    """``(ulysses_group, ring_group)`` of this rank (see "Subgroups" above)."""
    size, _ = comm.world(group)
    if size == 1:
        return None, None
    ranks = dist.get_process_group_ranks(group)  # global ranks, in group-rank order
    # the group object is part of the key: a cached subgroup must not outlive its parent
    # (simulations create and destroy a fake process group per trial in one process)
    key = (tuple(ranks), ulysses_degree, group)
    if key not in _MESHES:
        u = ulysses_degree
        ulysses = [ranks[i * u : (i + 1) * u] for i in range(size // u)]
        rings = [ranks[t::u] for t in range(u)]
        _MESHES[key] = (_my_group(group, ranks, ulysses), _my_group(group, ranks, rings))
    return _MESHES[key]


def _my_group(parent, parent_ranks: list[int], candidates: list[list[int]]):
    me, everyone = dist.get_rank(), len(parent_ranks) == dist.get_world_size()
    mine = None
    for ranks in candidates:
        if len(ranks) == 1 or len(ranks) == len(parent_ranks):
            sub = None if len(ranks) == 1 else parent
        elif everyone:
            sub = dist.new_group(ranks)
        elif me in ranks:
            sub = dist.new_group(ranks, use_local_synchronization=True)
        else:
            continue
        if me in ranks:
            mine = sub
    return mine


@register("usp", "USP hybrid: Ulysses all-to-all within groups of ulysses_degree ranks, zigzag Ring across",
          facts=MethodFacts(column="ulysses", mesh=True, reference=True))
class USP(SequenceLayoutMethod):
    honours_documents: ClassVar[bool] = True
    Options = USPOptions

    # ------------------------------------------------------------------ degrees and checks
    @classmethod
    def fits(cls, spec: AttnSpec, ulysses_degree: int) -> bool:
        """Whether Ulysses' head constraints hold at this degree."""
        try:
            cls.check_head_split(spec, ulysses_degree, "usp")
        except ValueError:
            return False
        return True

    @classmethod
    def default_ulysses_degree(cls, spec: AttnSpec, world_size: int) -> int:
        """The largest divisor of the world size that satisfies the head constraints."""
        return max(u for u in range(1, world_size + 1) if world_size % u == 0 and cls.fits(spec, u))

    @classmethod
    def degrees(cls, spec: AttnSpec, world_size: int, options: USPOptions) -> tuple[int, int]:
        u = options.ulysses_degree
        u = cls.default_ulysses_degree(spec, world_size) if u is None else u
        return u, world_size // u

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: USPOptions) -> None:
        super().validate(spec, world_size, options)
        u, c = options.ulysses_degree, world_size
        if u is None:
            return
        divisors = [d for d in range(1, c + 1) if c % d == 0]
        if not isinstance(u, int) or u < 1 or c % u:
            raise ValueError(
                f"usp: ulysses_degree={u} does not divide the world size {c} (the ranks form a "
                f"ulysses_degree x ring_degree mesh); use one of {divisors}"
            )
        if not cls.fits(spec, u):
            valid = [d for d in divisors if cls.fits(spec, d)]
            raise ValueError(
                f"usp: ulysses_degree={u} does not fit the heads: a Ulysses group of {u} ranks splits "
                f"n_heads={spec.n_heads} (which it must divide) and n_kv_heads={spec.n_kv_heads} "
                f"(which must divide it or be divisible by it); use ulysses_degree in {valid}"
            )

    @classmethod
    def ring_size_of(cls, world_size: int, options: USPOptions, spec: AttnSpec | None = None) -> int | None:
        if options.ulysses_degree is None and spec is None:
            return None  # the default degree depends on the spec
        return cls.degrees(spec, world_size, options)[1]

    @classmethod
    def deciding_ranks(cls, world_size: int, options: USPOptions, spec: AttnSpec | None = None,
                       docs: Documents | None = None) -> tuple[int, ...]:
        """One rank per ring position, the first of each Ulysses group (0, u, 2u, ...): the members of a
        Ulysses group hold equal contiguous parts of their ring rank's tokens, and after the all-to-all
        each holds all of them on its own heads, so they allocate the same shapes in the same order;
        ring positions differ (each meets other K/V blocks at each step). Every rank when the degree is
        not known (the default degree without the spec)."""
        if options.ulysses_degree is None and spec is None:
            return tuple(range(world_size))
        u, _ = cls.degrees(spec, world_size, options)
        return tuple(range(0, world_size, u))

    # ------------------------------------------------------------------ layout and forward
    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        u, r = self.degrees(spec, self.world_size, self.options)
        self.options = dataclasses.replace(self.options, ulysses_degree=u)
        self.ulysses_degree, self.ring_degree = u, r
        self.kv_heads = replicated_kv_heads(spec, self.check_head_split(spec, u, "usp"))
        self.ulysses_group, self.ring_group = mesh_groups(group, u)

    @property
    def ring_size(self) -> int:
        return self.ring_degree

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions, docs)
        q, k, v = self.project_qkv(x, cos, sin, self.kv_heads)
        q, k, v = (comm.seq_to_head(t, self.ulysses_group) for t in (q, k, v))
        schedule = self.ring_schedule(self.spec.causal, docs, x.shape[1] * self.world_size)
        out = ring_attention(q, k, v, self.spec.causal, self.kernel, self.scale, self.ring_group, schedule)
        out = comm.head_to_seq(out, self.ulysses_group)
        return self.wo(out.flatten(2))
