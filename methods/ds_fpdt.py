"""DeepSpeed's ``FPDT_Attention`` (``deepspeed.sequence.fpdt_layer``) as a method.

A baseline and an external check of ``fpdt``. The whole attention block except the output
projection runs inside DeepSpeed: fused QKV projection per chunk, all-to-alls, RoPE on the
head layout, flash-attn calls merged by log-sum-exp, its own chunked backward. We hand it
``cat(wq, wk, wv)`` as its fused weight (a zero bias) and ``wo`` as its dense weight, so the
parameters are still ``wq, wk, wv, wo`` and load from any method's ``state_dict``; KV
heads fewer than C are replicated (DeepSpeed asserts G >= C) and their gradients summed
back. The RoPE tables are given for the global positions in FPDT's segment order.

Layout: FPDT's own, shared with ``fpdt`` (global chunk c on rank c % C, ``layouts.cyclic_shard``);
``num_chunks`` is the number of chunks per rank (DeepSpeed's ``chunk_size`` is S / num_chunks).

What it supports, and why (``validate``/``forward``):

* causal only, no QK-norm: FPDT_Attention has neither a non-causal mode nor a norm hook;
* the kernel is flash-attn, called by DeepSpeed (``kernel`` unset or ``"flash-attn"``);
* ``offload``: DeepSpeed's offloading path (``_FPDTGPUOffloadingAttentionImpl_``) creates
  streams with ``get_accelerator().Stream()``, which is ``None`` on DeepSpeed's CPU
  accelerator, so it cannot run on CPU. ``offload=None`` (default) means on when the input
  is on CUDA; ``offload=True`` with a CPU input raises a ``ValueError``. The non-offloading
  path (``_FPDTGPUAttentionImpl_``) runs on CPU with a flash_attn stand-in (tests);
* simulation (bench's simulated mode, ``methods.core.hostmem.simulated()`` set): the
  non-offloading path is what is simulated, whatever the fake device: ``offload=None`` means
  off and ``offload=True`` raises a ``ValueError`` (the offloading path needs accelerator
  streams, which no simulated device has). So a simulated ``ds-fpdt`` row is DeepSpeed's chunked
  Ulysses with every chunk kept on the device: its flash-attn calls (through
  ``bench.stackmodel.fake_flash_attn``: outputs and backward scratch), all-to-alls, QKV chunks and
  its own chunked backward are modelled; the host offload and its double buffering are not
  (the offloading path keeps fewer chunks on the device, so its real peak is lower);
* on CUDA flash-attn needs fp16/bf16 (fp32 raises a ``ValueError``);
* a process group is required (deepspeed.comm), also for one rank;
* the block input must require grad (FPDT saves activations only when it does).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .core.base import MethodOptions, head_rows
from .core.hostmem import simulated
from .core.kernels import get_kernel
from .core.registry import MethodFacts, register
from .core.spec import AttnSpec
from .ds_ulysses import DEEPSPEED_HINT, init_deepspeed_comm, require_group
from .fpdt import FPDT


@dataclass(frozen=True)
class DSFPDTOptions(MethodOptions):
    num_chunks: int = 2  # chunks per rank (DeepSpeed's chunk_size = S / num_chunks)
    offload: bool | None = None  # DeepSpeed's host offloading; None: on for CUDA inputs (not possible on CPU)


@register(
    "ds-fpdt",
    "DeepSpeed's FPDT_Attention (chunked Ulysses with host offload; flash-attn, causal only)",
    requires=("deepspeed", "flash_attn"),
    install_hint=DEEPSPEED_HINT + "; flash-attn: pip install flash-attn --no-build-isolation (CUDA only)",
    # the paper's FPDT (Megatron-DeepSpeed, not TorchTitan); DeepSpeed calls flash-attn 2 itself
    facts=MethodFacts(column="fpdt", paper_code=True, library="DeepSpeed", kernel="fa2", library_kernels=True,
                      torchtitan=False),
)
class DeepSpeedFPDT(FPDT):
    rank_symmetric_reason = ("DeepSpeed's FPDT all-to-alls each chunk to the whole chunk on H/C heads on every "
                             "rank, so every rank allocates the same shapes in the same order")
    honours_documents = False
    documents_refusal = "DeepSpeed's FPDT_Attention takes no document mask or cu_seqlens (a library limit)"
    Options = DSFPDTOptions
    accepts_input_norm = False  # DeepSpeed's layer takes the normed input; no fused_attn_norm
    calls_suite_kernel = False  # DeepSpeed's FPDT calls flash-attn itself
    simulated_cpu_path_reason = (
        "DeepSpeed picks its accelerator at import from torch.cuda.is_available(), which the simulated "
        "CUDA device leaves False, so FPDT makes its buffers on the CPU: simulated on the CPU code path")

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: DSFPDTOptions) -> None:
        if options.kernel not in (None, "flash-attn"):
            raise ValueError(
                f"ds-fpdt: kernel={options.kernel!r} cannot be used: FPDT_Attention calls flash-attn "
                "itself; leave kernel unset (or 'flash-attn')"
            )
        super(FPDT, cls).validate(spec, world_size, options)  # FPDT's own option checks differ
        cls.check_head_split(spec, world_size, "ds-fpdt")
        cls.check_num_chunks(options.num_chunks)
        if not spec.causal:
            raise ValueError("ds-fpdt: DeepSpeed's FPDT_Attention is causal only; use 'fpdt' for non-causal attention")
        if spec.qk_norm:
            raise ValueError("ds-fpdt: DeepSpeed's FPDT_Attention has no QK-norm; use 'fpdt' for QK-norm models")

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        require_group(group, "ds-fpdt", "DeepSpeed's FPDT_Attention")
        self.kernel = get_kernel("flash-attn")  # what DeepSpeed calls (recorded in result rows)
        init_deepspeed_comm()
        from deepspeed.sequence.fpdt_layer import FPDT_Attention

        self._fpdt_cls = FPDT_Attention

    def offload_for(self, x: torch.Tensor) -> bool:
        # simulation (the module docstring): the non-offloading path is what is simulated
        if simulated() is not None:
            if self.options.offload:
                raise ValueError(
                    "ds-fpdt: offload=True cannot be simulated: DeepSpeed's offloading path runs on "
                    "accelerator streams, which a simulated device lacks; simulate offload=False (or None), "
                    "or measure offload in real mode on CUDA"
                )
            return False
        offload = x.device.type == "cuda" if self.options.offload is None else self.options.offload
        if offload and x.device.type != "cuda":
            raise ValueError(
                "ds-fpdt: offload=True needs a CUDA input: DeepSpeed's offloading path creates "
                "accelerator streams, which its CPU accelerator does not have (Stream is None); "
                "use offload=False or None on CPU"
            )
        return offload

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        spec, d = self.spec, self.spec.head_dim
        b, n, _ = x.shape
        self.check_local_len(n)
        if x.device.type == "cuda" and x.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"ds-fpdt: flash-attn computes in float16/bfloat16 only, got {x.dtype}")
        if torch.is_grad_enabled() and self.wq.weight.requires_grad and not x.requires_grad:
            raise ValueError(
                "ds-fpdt: the block input must require grad when the weights do: FPDT_Attention "
                "saves its activations only when its input requires grad"
            )
        offload = self.offload_for(x)
        seq = n * self.world_size
        if positions is None:
            table = torch.arange(seq, device=x.device)
        elif positions.shape != (n,):
            raise ValueError(
                f"positions must be 1-D with one entry per local token ({n}), got shape {tuple(positions.shape)}"
            )
        else:
            table = self.unshard(positions, dim=0)  # FPDT's segments are contiguous in global order
        cos, sin = self.rope(table, x.dtype)  # [S, 1, d/2]; DeepSpeed wants [S, 1, 1, d], halves repeated
        rotary = tuple(torch.cat((t, t), dim=-1).unsqueeze(1) for t in (cos, sin))
        w_qkv = torch.cat(
            (self.wq.weight, head_rows(self.wk.weight, self.kv_heads, d), head_rows(self.wv.weight, self.kv_heads, d))
        )
        config = SimpleNamespace(
            kv_channels=d, num_attention_heads=spec.n_heads, num_key_value_heads=len(self.kv_heads),
            hidden_size=spec.dim, attention_dropout=0.0,
        )
        layer = self._fpdt_cls(
            config, w_qkv, w_qkv.new_zeros(w_qkv.shape[0]), self.wo.weight, None, self.group,
            return_bias=True, chunk_size=seq // self.options.num_chunks, enable_offloading=offload,
        )
        out, _ = layer(x.transpose(0, 1), None, None, rotary, cpu_offloading=offload)
        return out.transpose(0, 1)
