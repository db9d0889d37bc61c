"""yunchang's ``UlyssesAttention`` (its all-to-alls around flash-attn) as a method.

A baseline from the paper's Table 3 and an external check of ``ulysses``. Projections, RoPE,
QK-norm and the output projection are ours (same parameters as every method); Q/K/V go to
``yunchang.UlyssesAttention(group, scatter_idx=2, gather_idx=1, attn_type=...)`` in its
layout ``[batch, seq/C, heads, head_dim]``, which does the sequence->head all-to-all
(``SeqAllToAll4D``), calls the attention function its ``attn_type`` selects for training
(``AttnType.FA``: ``flash_attn.flash_attn_func``; ``AttnType.FA3``: flash-attn 3's
``flash_attn_interface.flash_attn_func``) and the head->sequence all-to-all. Layout: contiguous.

Configured as the paper ran it: K/V are handed over with their real G heads, not repeated to
H before the all-to-all, so each rank receives G/C KV heads and flash-attn does the GQA
grouping. yunchang has no KV-head replication, so G must be divisible by C (``ulysses``
replicates instead and accepts C a multiple of G).

Constraints (``validate``, before any communication): C divides H and G; ``kernel`` unset or
``"flash-attn"`` (yunchang calls flash-attn itself); ``attn_type`` is ``"fa"`` or ``"fa3"``; a
process group is required (also for one rank). On CUDA fp32 is refused in ``forward``
(flash-attn computes in fp16/bf16 only).

What is checked where. On CPU, flash-attn can only be the plain-torch stand-in of the tests
(``tests/flash_attn_standin.py``, which provides flash-attn 2's ``flash_attn_func`` and the
private functions yunchang's ring calls), so the tests check yunchang's communication,
layouts and autograd against the reference in fp32 and bf16; the real kernels, ``fa3`` and
the timings only run on CUDA. Simulated mode (``bench run --mode simulated``) runs it, ``fa3``
included, on ``bench.stackmodel.fake_flash_attn`` where no flash-attn is installed (memory only).
yunchang is imported lazily (in ``__init__``), never when ``methods`` is imported; it decides
at its first import whether flash-attn is there (so simulation installs its flash-attn first).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from .core.base import AttentionMethod, MethodOptions
from .core.kernels import flash_attn_dtype, get_kernel
from .core.registry import MethodFacts, register
from .core.spec import AttnSpec
from .ds_ulysses import require_group

YUNCHANG_HINT = ("pip install -e '.[yunchang]'; pip install flash-attn --no-build-isolation "
                 "(CUDA only; fa3: flash-attn 3)")
ATTN_TYPES = ("fa", "fa3")


@dataclass(frozen=True)
class YunchangOptions(MethodOptions):
    attn_type: str = "fa"  # yunchang's AttnType: "fa" (flash-attn 2) or "fa3" (flash-attn 3, Hopper)


def check_common(who: str, spec: AttnSpec, options: YunchangOptions) -> None:
    """The kernel and attn_type options of every yunchang wrapper."""
    if options.kernel not in (None, "flash-attn"):
        raise ValueError(
            f"{who}: kernel={options.kernel!r} cannot be used: yunchang calls flash-attn itself; "
            "leave kernel unset (or 'flash-attn')"
        )
    if options.attn_type not in ATTN_TYPES:
        raise ValueError(f"{who}: attn_type={options.attn_type!r} is not supported; use one of {list(ATTN_TYPES)}")


def check_heads(who: str, spec: AttnSpec, degree: int, what: str) -> None:
    """C | H and C | G for a Ulysses degree: yunchang splits K/V heads as they are."""
    if spec.n_heads % degree:
        raise ValueError(
            f"{who}: n_heads={spec.n_heads} is not divisible by the {what} {degree}; yunchang's all-to-all "
            f"splits heads evenly, so use a {what} that divides {spec.n_heads}"
        )
    if spec.n_kv_heads % degree:
        raise ValueError(
            f"{who}: n_kv_heads={spec.n_kv_heads} is not divisible by the {what} {degree}; yunchang sends K/V "
            f"with their own heads (no replication), so use a {what} that divides {spec.n_kv_heads} "
            "(or 'ulysses'/'usp', which replicate KV heads)"
        )


def load_yunchang(who: str, attn_type: str):
    """``(yunchang, AttnType member)``; refuses when yunchang found no flash-attn of that type."""
    try:
        import yunchang
        from yunchang import globals as yc_globals
        from yunchang.kernels import AttnType
    except ImportError as err:
        raise ValueError(f"{who} needs yunchang: {YUNCHANG_HINT} ({err})") from err
    found = yc_globals.HAS_FLASH_ATTN_HOPPER if attn_type == "fa3" else yc_globals.HAS_FLASH_ATTN
    if not found:
        lib = "flash-attn 3 (flash_attn_interface)" if attn_type == "fa3" else "flash-attn"
        module = sys.modules.get("flash_attn_interface" if attn_type == "fa3" else "flash_attn")
        if getattr(module, "__cpab_simulated__", False):  # bench's simulated flash-attn came after yunchang
            raise ValueError(
                f"{who}: yunchang was imported in this process before the simulated {lib} was installed and "
                "keeps what it found then (none); run the simulation in a fresh process: "
                "python -m bench run --mode simulated ..."
            )
        raise ValueError(f"{who}: attn_type={attn_type!r} needs {lib}, which yunchang did not find; {YUNCHANG_HINT}")
    return yunchang, AttnType.from_string(attn_type)


def compute_dtype(who: str, x: torch.Tensor, ring: bool) -> torch.dtype:
    """The dtype handed to yunchang. fp16/bf16 as is; fp32 refused on CUDA (flash-attn); on CPU
    (the stand-in) fp32 as is, except through yunchang's zigzag ring (``ring``), whose backward
    takes ``dq = dq_buffer.to(torch.float32)``, the buffer itself in fp32, which the next block's
    call overwrites: there fp64 (the ring still accumulates its output in fp32)."""
    return flash_attn_dtype(who, x, torch.float64 if ring else x.dtype)


@register(
    "yc-ulysses",
    "yunchang's UlyssesAttention (all-to-alls around flash-attn; K/V heads not repeated)",
    requires=("yunchang", "flash_attn"),
    install_hint=YUNCHANG_HINT,
    facts=MethodFacts(column="ulysses", library="yunchang", library_kernels=True),
)
class YunchangUlysses(AttentionMethod):
    rank_symmetric_reason = ("yunchang's all-to-all gives every rank the whole sequence on H/C heads, so every "
                             "rank allocates the same shapes in the same order")
    documents_refusal = "yunchang's UlyssesAttention calls flash_attn_func, which takes no cu_seqlens (a library limit)"
    Options = YunchangOptions
    calls_suite_kernel = False  # yunchang calls flash-attn itself

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: YunchangOptions) -> None:
        check_common("yc-ulysses", spec, options)
        super().validate(spec, world_size, options)
        check_heads("yc-ulysses", spec, world_size, "world size")

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        require_group(group, "yc-ulysses", "yunchang's UlyssesAttention")
        self.kernel = get_kernel("flash-attn")  # what yunchang calls (recorded in result rows)
        yunchang, attn_type = load_yunchang("yc-ulysses", self.options.attn_type)
        self.yc_attn = yunchang.UlyssesAttention(group, scatter_idx=2, gather_idx=1, attn_type=attn_type)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions)
        dt = compute_dtype("yc-ulysses", x, ring=False)
        q, k, v = (t.to(dt) for t in self.project_qkv(x, cos, sin))  # K/V with their G heads
        out = self.yc_attn(q, k, v, softmax_scale=self.scale, causal=self.spec.causal)
        return self.wo(out.to(x.dtype).flatten(2))
