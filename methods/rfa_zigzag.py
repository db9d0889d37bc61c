"""ring-flash-attention's zigzag ring (``zigzag_ring_flash_attn_func``) as a method.

A baseline and an external check of ``ring``: projections, RoPE and QK-norm are ours, the
ring (K/V passed around with p2p, blockwise flash-attn calls merged by log-sum-exp, zigzag
schedule) is the library's. GQA goes through as is: the ring carries the real KV heads.

Layout (``shard``/``unshard``): zigzag, the library's and ``ring``'s (``layouts.zigzag_shard``).
The sequence is cut into 2C chunks and rank r holds chunks r and 2C-1-r, which balances
causal work across ranks.

Constraints and decisions (``validate`` and ``forward``):

* causal only: the library asserts ``causal=True`` for zigzag (a non-causal ring needs no
  load balancing; use ``ring``);
* the attention kernel is flash-attn, called by the library: ``kernel`` may only be left
  unset or be ``"flash-attn"``;
* the global sequence length must be a multiple of 2C;
* dtypes: flash-attn computes in fp16/bf16 only, so fp32 on CUDA is refused with a
  ``ValueError``. On CPU flash_attn can only be a plain-torch implementation (a test
  stand-in); there fp32 inputs are run through the library in fp64 because ring-flash-attn
  0.1.8's backward is wrong for fp32: ``dq = dq_buffer.to(torch.float32)`` is then the
  buffer itself, which the next block's kernel call overwrites (real flash-attn never gets
  there since it rejects fp32). The library still accumulates outputs in fp32, so results
  have fp32 accuracy;
* a process group is required (the library's ring needs one, also for one rank). With one
  rank the ring is a single causal flash-attn call, made directly (``kernels.attention``
  with the flash-attn kernel): the library's backward always posts a send of dK/dV to the
  next rank, i.e. to itself, which gloo refuses ("Pair is not connected").

``import ring_flash_attn`` also imports its Hugging Face adapters, which need
``transformers`` and, in ring-flash-attn 0.1.8, fail to import under transformers 5
(``is_flash_attn_greater_or_equal_2_10`` is gone from it); the zigzag function needs neither.
So the package's ``__init__`` is bypassed unless something imported the package already: it is
registered bare and only the zigzag submodule is imported. The library is imported lazily
(in ``__init__``).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

import torch

from .core.base import MethodOptions, ZigzagLayoutMethod
from .core.kernels import attention, flash_attn_dtype, get_kernel
from .core.registry import MethodFacts, register
from .core.spec import AttnSpec
from .ds_ulysses import require_group


def load_zigzag_func():
    """``ring_flash_attn.zigzag_ring_flash_attn.zigzag_ring_flash_attn_func``, without the
    package's Hugging Face adapters (see the module docstring)."""
    name = "ring_flash_attn.zigzag_ring_flash_attn"
    if "ring_flash_attn" not in sys.modules:
        spec = importlib.util.find_spec("ring_flash_attn")
        if spec is None:
            raise ValueError("rfa-zigzag needs ring_flash_attn: pip install ring-flash-attn")
        sys.modules["ring_flash_attn"] = importlib.util.module_from_spec(spec)  # __init__ not run
    return importlib.import_module(name).zigzag_ring_flash_attn_func


@register(
    "rfa-zigzag",
    "ring-flash-attention's zigzag ring attention (flash-attn kernels, causal only)",
    requires=("ring_flash_attn", "flash_attn"),
    install_hint="pip install ring-flash-attn flash-attn --no-build-isolation (CUDA only)",
    facts=MethodFacts(column="ring", library="ring-flash-attn", kernel="fa2", library_kernels=True),
)
class RingFlashAttnZigzag(ZigzagLayoutMethod):
    documents_refusal = "not yet: ring-flash-attention's varlen zigzag function is not wired in"
    calls_suite_kernel = False  # ring_flash_attn calls flash-attn itself

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: MethodOptions) -> None:
        if options.kernel not in (None, "flash-attn"):
            raise ValueError(
                f"rfa-zigzag: kernel={options.kernel!r} cannot be used: ring_flash_attn calls "
                "flash-attn itself; leave kernel unset (or 'flash-attn')"
            )
        super().validate(spec, world_size, options)
        if not spec.causal:
            raise ValueError(
                "rfa-zigzag: ring_flash_attn's zigzag ring is causal only (it asserts causal=True); "
                "use 'ring' for non-causal attention"
            )

    @classmethod
    def seq_multiple(cls, world_size: int, options: MethodOptions) -> int:
        return 2 * world_size

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        require_group(group, "rfa-zigzag", "ring_flash_attn's zigzag ring")
        self.kernel = get_kernel("flash-attn")  # what the library calls (recorded in result rows)
        self._zigzag = load_zigzag_func()


    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[1] % 2:
            raise ValueError(f"rfa-zigzag: local sequence length {x.shape[1]} must be even (two zigzag chunks)")
        cos, sin = self.rope_for(x, positions)
        # fp64 on CPU: ring_flash_attn's fp32 backward aliases a buffer (CUDA flash-attn refuses fp32)
        dt = flash_attn_dtype("rfa-zigzag", x, torch.float64)
        q, k, v = self.project_qkv(x, cos, sin)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
        if self.world_size == 1:  # see the module docstring: no self-send on gloo
            out = attention(q, k, v, True, self.kernel, self.scale)
        else:
            out = self._zigzag(q, k, v, dropout_p=0.0, softmax_scale=self.scale, causal=True, group=self.group)
        return self.wo(out.to(x.dtype).flatten(2))
