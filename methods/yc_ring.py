"""yunchang's zigzag ring attention (``yunchang.ring.zigzag_ring_flash_attn_func``) as a method.

A baseline from the paper's Table 3 and an external check of ``ring``. Projections, RoPE,
QK-norm and the output projection are ours; Q/K/V go to yunchang in ``[batch, seq/C, heads,
head_dim]`` with the real G KV heads (not repeated before communication, as the paper ran it):
the ring passes K/V around with p2p and merges blockwise flash-attn calls (the private
``_flash_attn_forward``/``_flash_attn_backward`` its ``attn_type`` selects) by log-sum-exp.
This is what ``LongContextAttention(ring_impl_type="zigzag")`` runs at Ulysses degree 1, called
directly because that class needs a Ulysses process group even of one rank.

Layout: zigzag (``layouts.zigzag_shard``, ``ring``'s and yunchang's ``zigzag_extract_local``):
2C chunks, rank r holds chunks r and 2C-1-r.

Constraints: causal only (yunchang asserts ``causal == True`` for zigzag; use ``ring``); the
sequence a multiple of 2C; ``kernel`` unset or ``"flash-attn"``; ``attn_type`` ``"fa"`` or
``"fa3"``; a process group. With one rank the ring is one causal flash-attn call, made through
the function yunchang's ``attn_type`` selects for training: the ring's backward always posts a
send of dK/dV to the next rank, itself, which gloo refuses. fp32: see
``yc_ulysses.compute_dtype`` (refused on CUDA, fp64 through the ring on CPU).

``attn_type="fa3"``: pip yunchang 0.6.4's FA3 ring stages call flash-attn 3 with ``causal=False``
whatever the ring asks (its diagonal blocks would run unmasked); the ring runs with
``methods.core.yc_fa3`` bound, which passes ``causal`` as the paper's vendored yunchang did, and
the rows say so (``run_notes``).

On CPU the tests run it on the flash-attn stand-in (communication, layout, autograd vs the
reference); real kernels and timings only on CUDA. yunchang is imported lazily.
"""
from __future__ import annotations

import torch

from .core import yc_fa3
from .core.base import ZigzagLayoutMethod
from .core.kernels import get_kernel
from .core.registry import MethodFacts, register
from .core.spec import AttnSpec
from .ds_ulysses import require_group
from .yc_ulysses import YUNCHANG_HINT, YunchangOptions, check_common, compute_dtype, load_yunchang


def check_causal(who: str, spec: AttnSpec, fix: str) -> None:
    if not spec.causal:
        raise ValueError(f"{who}: yunchang's zigzag ring is causal only (it asserts causal=True); {fix}")


@register(
    "yc-ring",
    "yunchang's zigzag ring attention (flash-attn blocks, K/V heads not repeated; causal only)",
    requires=("yunchang", "flash_attn"),
    install_hint=YUNCHANG_HINT,
    # stands for the ring code the paper ran (the authors' vendored yunchang, a barrier after every ring step)
    facts=MethodFacts(column="ring", library="yunchang", library_kernels=True, ring_barrier=True),
)
class YunchangRing(ZigzagLayoutMethod):
    documents_refusal = "yunchang's zigzag ring takes no cu_seqlens (a library limit)"
    Options = YunchangOptions
    calls_suite_kernel = False  # yunchang calls flash-attn itself

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: YunchangOptions) -> None:
        check_common("yc-ring", spec, options)
        super().validate(spec, world_size, options)
        check_causal("yc-ring", spec, "use 'ring' for non-causal attention")

    @classmethod
    def seq_multiple(cls, world_size: int, options: YunchangOptions) -> int:
        return 2 * world_size

    @classmethod
    def run_notes(cls, options: YunchangOptions, world_size: int) -> list[str]:
        return [yc_fa3.NOTE] if options.attn_type == "fa3" and world_size > 1 else []

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        require_group(group, "yc-ring", "yunchang's zigzag ring")
        self.kernel = get_kernel("flash-attn")
        _, self.attn_type = load_yunchang("yc-ring", self.options.attn_type)
        if self.options.attn_type == "fa3":
            yc_fa3.check()

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions)
        dt = compute_dtype("yc-ring", x, ring=self.world_size > 1)
        q, k, v = (t.to(dt) for t in self.project_qkv(x, cos, sin))
        out = ring_or_single(q, k, v, self.scale, self.attn_type, self.group, self.world_size)
        return self.wo(out.to(x.dtype).flatten(2))


def ring_or_single(q, k, v, scale: float, attn_type, group, ring_size: int) -> torch.Tensor:
    """yunchang's causal zigzag ring over ``group``; one rank: the single causal flash-attn call.
    With ``AttnType.FA3`` the ring's blocks get their causal flag (``methods.core.yc_fa3``)."""
    from yunchang.kernels import AttnType, select_flash_attn_impl
    from yunchang.ring import zigzag_ring_flash_attn_func

    if ring_size == 1:
        out = select_flash_attn_impl(attn_type, stage="fwd-bwd")(q, k, v, softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out

    def ring(q, k, v):
        return zigzag_ring_flash_attn_func(q, k, v, softmax_scale=scale, causal=True, group=group,
                                           attn_type=attn_type)

    return yc_fa3.run(ring, q, k, v) if attn_type == AttnType.FA3 else ring(q, k, v)
