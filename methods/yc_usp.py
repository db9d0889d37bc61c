"""yunchang's USP hybrid (``LongContextAttention``, Ulysses x zigzag Ring) as a method.

A baseline from the paper's Table 3 and an external check of ``usp``. Projections, RoPE,
QK-norm and the output projection are ours; Q/K/V go to yunchang in ``[batch, seq/C, heads,
head_dim]`` with the real G KV heads (not repeated before communication, as the paper ran it).
``LongContextAttention(scatter_idx=2, gather_idx=1, ring_impl_type="zigzag", attn_type=...)``
does the all-to-all inside the Ulysses group, the zigzag ring (flash-attn blocks) across the
ring group and the all-to-all back.

Process groups. yunchang reads them from its ``PROCESS_GROUP`` globals when the class is
built (``set_seq_parallel_pg`` fills them from the global ranks, which would ignore our
``group``). The mesh is the one ``set_seq_parallel_pg(use_ulysses_low=True)`` builds, within
``group``: Ulysses groups of ``ulysses_degree`` consecutive group ranks, ring groups strided.
The subgroups come from ``usp.mesh_groups`` (created once per parent group and cached), and
the globals are set only while the class is built, then restored. The degenerate meshes go
to the class that does the same work without a one-rank group (which ``mesh_groups`` does
not create): ring degree 1 is yunchang's ``UlyssesAttention`` on the group, Ulysses degree 1
is yunchang's zigzag ring on the group (``yc-ring``'s path).

Layout: ``usp``'s (zigzag over the ring degree, split contiguously over the C ranks), which is
yunchang's ``zigzag_extract_local`` for this mesh.

Constraints (``validate``): causal only (its zigzag ring asserts ``causal=True``; non-causal
USP: ``usp``); ``ulysses_degree`` divides C, H and G (yunchang does not replicate KV heads;
unset: the largest such degree); ``kernel`` unset or ``"flash-attn"``; ``attn_type`` ``"fa"``
or ``"fa3"``; a process group. fp32: refused on CUDA; on CPU run in fp64 through the ring
(see ``yc_ulysses.compute_dtype``). ``attn_type="fa3"`` with a ring (degree > 1): the ring's
blocks get their causal flag through ``methods.core.yc_fa3`` (pip yunchang 0.6.4 drops it; the
paper's vendored copy passes it), and the rows say so (``run_notes``). On CPU the tests run it
on the flash-attn stand-in; real kernels and timings only on CUDA. yunchang is imported lazily.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .core import yc_fa3
from .core.base import AttentionMethod
from .core.kernels import get_kernel
from .core.registry import MethodFacts, PaperRun, register
from .core.spec import AttnSpec
from .ds_ulysses import require_group
from .usp import USP, mesh_groups
from .yc_ring import check_causal, ring_or_single
from .yc_ulysses import YUNCHANG_HINT, YunchangOptions, check_common, check_heads, compute_dtype, load_yunchang


@dataclass(frozen=True)
class YunchangUSPOptions(YunchangOptions):
    ulysses_degree: int | None = None  # ranks per Ulysses group; None: the largest dividing C, H and G


@register(
    "yc-usp",
    "yunchang's LongContextAttention: Ulysses x zigzag Ring (flash-attn, K/V heads not repeated; causal only)",
    requires=("yunchang", "flash_attn"),
    install_hint=YUNCHANG_HINT,
    # the paper's Ring (Ulysses degree 1) and Ulysses (degree 8: all Ulysses on one node, the 8 x 2
    # mesh on two; Fig. 5's USP-Hybrid; Fig. 1's ALST), with flash-attn 3, its ring code's barriers
    facts=MethodFacts(column="ulysses", mesh=True, paper_code=True, library="yunchang", library_kernels=True,
                      ring_barrier=True,
                      simulates=(PaperRun("ring", {"ulysses_degree": 1, "attn_type": "fa3"}),
                                 *(PaperRun(c, {"ulysses_degree": 8, "attn_type": "fa3"})
                                   for c in ("ulysses", "usp", "alst")))),
)
class YunchangUSP(USP):
    honours_documents = False
    documents_refusal = "yunchang's LongContextAttention takes no cu_seqlens (a library limit)"
    Options = YunchangUSPOptions
    calls_suite_kernel = False  # yunchang calls flash-attn itself

    @classmethod
    def fits(cls, spec: AttnSpec, ulysses_degree: int) -> bool:
        return spec.n_heads % ulysses_degree == 0 and spec.n_kv_heads % ulysses_degree == 0

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: YunchangUSPOptions) -> None:
        check_common("yc-usp", spec, options)
        super(USP, cls).validate(spec, world_size, options)  # skip usp.validate (its replication rule)
        check_causal("yc-usp", spec, "use 'usp' for non-causal attention")
        u, c = options.ulysses_degree, world_size
        if u is None:
            return
        if not isinstance(u, int) or u < 1 or c % u:
            divisors = [d for d in range(1, c + 1) if c % d == 0]
            raise ValueError(
                f"yc-usp: ulysses_degree={u} does not divide the world size {c} (the ranks form a "
                f"ulysses_degree x ring_degree mesh); use one of {divisors}"
            )
        check_heads("yc-usp", spec, u, "ulysses_degree")

    @classmethod
    def run_notes(cls, options: YunchangUSPOptions, world_size: int) -> list[str]:
        ring = options.ulysses_degree is None or world_size // options.ulysses_degree > 1
        return [yc_fa3.NOTE] if options.attn_type == "fa3" and ring and world_size > 1 else []

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        AttentionMethod.__init__(self, spec, group, **options)
        require_group(group, "yc-usp", "yunchang's LongContextAttention")
        self.kernel = get_kernel("flash-attn")
        u, r = self.degrees(spec, self.world_size, self.options)
        self.options = dataclasses.replace(self.options, ulysses_degree=u)
        self.ulysses_degree, self.ring_degree = u, r
        yunchang, self.attn_type = load_yunchang("yc-usp", self.options.attn_type)
        self.fa3_ring = self.options.attn_type == "fa3" and r > 1
        if self.fa3_ring:
            yc_fa3.check()
        self.yc_attn = None
        if r == 1:
            self.yc_attn = yunchang.UlyssesAttention(group, scatter_idx=2, gather_idx=1, attn_type=self.attn_type)
        elif u > 1:
            from yunchang.globals import PROCESS_GROUP

            saved = PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG
            PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = mesh_groups(group, u)
            try:
                self.yc_attn = yunchang.LongContextAttention(
                    scatter_idx=2, gather_idx=1, ring_impl_type="zigzag", attn_type=self.attn_type
                )
            finally:
                PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = saved

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions)
        dt = compute_dtype("yc-usp", x, ring=self.ring_degree > 1)
        q, k, v = (t.to(dt) for t in self.project_qkv(x, cos, sin))  # K/V with their G heads
        if self.yc_attn is None:  # Ulysses degree 1: the zigzag ring over the whole group
            out = ring_or_single(q, k, v, self.scale, self.attn_type, self.group, self.ring_degree)
        elif self.fa3_ring:
            out = yc_fa3.run(lambda q, k, v: self.yc_attn(q, k, v, softmax_scale=self.scale, causal=True), q, k, v)
        else:
            out = self.yc_attn(q, k, v, softmax_scale=self.scale, causal=True)
        return self.wo(out.to(x.dtype).flatten(2))
