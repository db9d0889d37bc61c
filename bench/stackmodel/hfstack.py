"""The ``hf`` accounting stack: Ulysses and context parallelism as the Hugging Face stack runs them.

Two paths, as Accelerate's ``ParallelismConfig`` drives them (Transformers' Trainer and TRL's
SFTTrainer sit on top of both):

* ``sp_size``: DeepSpeed's ALST (``UlyssesSPAttentionHF``) under ZeRO-3, as ALST's published recipes
  run it (ArcticTraining ``projects/sequence-parallelism/run-h100-sp{1,8,32}-llama-8b.yml``, the
  runs behind the ALST paper's Llama-8B figures, arXiv 2506.13996): methods ``ds-ulysses-hf`` and,
  through ``methods.integrations.transformers`` (UPipe registered as a Transformers attention
  function over the same sequence-parallel group, with ALST's sharding), ``upipe``. UPipe under
  ``hf`` therefore means ALST's recipe with UPipe's attention in place of ``UlyssesSPAttentionHF``:
  every lever below is ALST's, only the attention differs.
* ``cp_size``: PyTorch's context parallel under FSDP2 (Accelerate ``Accelerator._prepare_cp``),
  as Accelerate's example configuration runs it
  (``examples/torch_native_parallelism/configs/cp.yaml``), with TRL's default loss: method
  ``torch-cp``.

Every other method is refused under ``hf`` (:func:`check`): the Hugging Face stack has no
integration of our Ring, USP, FPDT or offload methods, of yunchang or of ring-flash-attention.

The terms (:data:`HF_TERMS`), each a setting of the step (``StepConfig``) or of ``torch-cp``'s
options that :func:`apply` and :func:`options` fill in where the trial left them at their defaults:

1. ``checkpoint_offload`` (sp path): ALST's recipes set ``activation_checkpoint_cpu_offload: true``,
   which installs ArcticTraining's ``CheckpointFunctionWithCPUOffload`` (``arctic_training/
   monkey_patches.py``, ``forward``): the first tensor argument of every checkpointed decoder layer
   (its input hidden states) goes to the host with ``arg.detach().to("cpu")``, pageable and
   synchronous, for every layer, first and last included: ``ac_offload``, ``offload_pin=False``,
   ``offload_keep="none"``. The cp path checkpoints without offload (Accelerate's
   ``fsdp_activation_checkpointing: true``, ``fsdp2_apply_ac``): ``ac_offload=False``.
2. ``chunked_loss``: the sp path runs Liger's fused linear cross-entropy (the recipes' ``model:
   type: liger``), which never holds the whole logits and cuts the tokens into chunks of
   ``next_power_of_2(ceil(tokens / ceil(vocab / dim)))`` (Liger-Kernel ``liger_kernel/ops/
   fused_linear_cross_entropy.py``, ``fused_linear_cross_entropy_forward``): the suite's chunked
   loss with ``loss_chunk=0``, that rule. The cp path under TRL's SFTTrainer gets TRL's default
   ``loss_type="chunked_nll"`` (``trl/trainer/sft_config.py``), chunks of 256 valid tokens
   (``trl/trainer/sft_trainer.py``, ``_CHUNKED_LM_HEAD_CHUNK_SIZE``), each chunk's logits
   checkpointed: ``loss_chunk=256``. Liger also fuses RMSNorm, RoPE and SwiGLU into Triton kernels;
   their memory is not modelled apart from the suite's eager ops (untiled norms:
   ``tiled_norm=False``).
3. ``tiled_mlp``: the sp recipes set ``tiled_mlp_compute: true``: DeepSpeed's ``TiledMLP``
   (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``) with ``ceil(seqlen / hidden)`` shards (the
   DeepSpeed ALST tutorial's ``tiled_mlp_forward_common``): ``tiled_mlp_impl="deepspeed"`` and
   ``mlp_tiles=0``, the suite's same rule. Accelerate's CP path has no tiled MLP.
4. ``sdpa_backend`` (cp path): Accelerate's CP runs only with ``attn_implementation="sdpa"``
   (huggingface/accelerate:docs/source/concept_guides/context_parallelism.md). On an H100 (sm90)
   PyTorch puts cuDNN first in SDPA's priority order when ``check_prefer_cudnn_attention`` holds
   (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: sm90/sm100 with a recent cuDNN, unless the environment
   deprioritises it), so a bf16 causal call without a mask goes to
   ``_scaled_dot_product_cudnn_attention``, which torch's CP handler intercepts like the flash op:
   ``torch-cp`` option ``backend="cudnn"``. The suite has **no model of cuDNN's scratch** (its
   workspace, allocated per call through the caching allocator, is sized by cuDNN's own heuristics,
   ``aten/src/ATen/native/cudnn/MHA.cpp``): none is assumed (``kernel_workspace="none"``), so the
   peak is a lower bound by that workspace. The sp path runs ``attn_implementation:
   flash_attention_2`` (the recipes): the FA2 scratch model (``kernel_workspace="fa2"``).
5. ``gqa`` (cp path): Transformers' ``sdpa_attention_forward`` (``transformers/integrations/
   sdpa_attention.py``) passes ``enable_gqa=True`` when ``use_gqa_in_sdpa`` holds (on CUDA: no
   mask and a head dim up to 256, which CP's unmasked causal calls meet) instead of ``repeat_kv``,
   so K/V reach SDPA, and torch's ring, at their G KV heads: ``torch-cp`` option
   ``repeat_kv=False``. Accelerate's rotate method is ``cp_comm_strategy``, default ``allgather``
   (``accelerate/utils/dataclasses.py``, ``TorchContextParallelConfig.__post_init__``; set by
   ``Accelerator._prepare_cp`` with ``set_rotate_method``), and torch's own head-tail load balancer
   stays on (``context_parallel``'s default ``_cp_options.enable_load_balance``; causal only):
   ``torch-cp``'s defaults already.
6. ``sharding``: ZeRO-3 for the sp path, FSDP2 for the cp path, both stood in for by the suite's
   FSDP2 (``fsdp=True``: parameters sharded, all-gathered per block with one block of prefetch,
   gradients reduce-scattered). ALST's recipes offload the optimizer (``offload_optimizer: device:
   cpu``, DeepSpeedCPUAdam): ``fsdp_offload=True``, FSDP2's CPU offload, which also keeps the
   parameter shards on the host (what the 1-GPU recipe's ``offload_param: cpu`` does; on 8 and 32
   GPUs the recipes keep the bf16 shards, 1/C of the model, on the device: approximated). Not
   modelled: ZeRO-3's own buffers (the contiguous gradient bucket of ``reduce_bucket_size``
   elements, the prefetch bucket, ``stage3_max_live_parameters``), DeepSpeedCPUAdam's pinned
   buffers, FSDP2's all-gather buffers beyond what its code path holds.
7. ``allocator``: the caching allocator with PyTorch's defaults: expandable segments only on the sp
   path, whose recipes export ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
   (``snowflakedb/ArcticTraining:projects/sequence-parallelism/README.md``; the DeepSpeed ALST
   tutorial); Accelerate's CP example sets nothing, so ``classic`` segments there. A pool per
   stream, as the real allocator keeps them.
8. ``rope``: Transformers' rotary embedding computes cos/sin for the positions it is given, the
   local ones (``rope_table="none"``); no barrier after ring steps (``ring_barrier`` stays off).

As the paper stack, the fit compares the modelled allocator's reserved peak with the device less
the CUDA context and NCCL's buffers, and the cuBLAS workspaces are held (``bench.stackmodel.stack``
terms 6-8, which are PyTorch's and NCCL's, not TorchTitan's). The step time is the step-time model
with the kernel that runs (``bench.stackmodel.steptime.stack_constants``): FlashAttention 2's code
at the measured rate of torch's SDPA flash kernel on an H100, which also stands for cuDNN (no
measured cuDNN rate exists here). No constant of this stack is fitted.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from ..measure.config import StepConfig

NAME = "hf"
SP_METHODS = ("ds-ulysses-hf", "upipe")  # Accelerate sp_size: DeepSpeed ALST (UPipe through the integration)
CP_METHODS = ("torch-cp",)  # Accelerate cp_size: PyTorch's context parallel under FSDP2
METHODS = SP_METHODS + CP_METHODS
TRL_LOSS_CHUNK = 256  # trl/trainer/sft_trainer.py _CHUNKED_LM_HEAD_CHUNK_SIZE
LIGER_LOSS_CHUNK = 0  # StepConfig.loss_chunk 0: Liger's fused linear cross-entropy chunk rule


@dataclasses.dataclass(frozen=True)
class Term:
    """One named term of the hf stack: what it sets, on which path, and where that comes from."""

    name: str
    mechanism: str
    source: str


HF_TERMS: tuple[Term, ...] = (
    Term("checkpoint_offload", "sp: every layer's input hidden states to pageable host memory "
         "(ac_offload, offload_pin=False, offload_keep=none); cp: checkpoints kept on the device",
         "ArcticTraining arctic_training/monkey_patches.py (CheckpointFunctionWithCPUOffload.forward: "
         "arg.detach().to('cpu')); ALST recipes activation_checkpoint_cpu_offload; Accelerate fsdp2_apply_ac"),
    Term("chunked_loss", "sp: Liger's fused linear cross-entropy, chunks of next_pow2(ceil(tokens/ceil(V/dim))) "
         "(loss_chunk=0); cp: TRL's chunked_nll, 256 tokens per chunk",
         "liger_kernel/ops/fused_linear_cross_entropy.py (fused_linear_cross_entropy_forward); "
         "trl/trainer/sft_trainer.py (_CHUNKED_LM_HEAD_CHUNK_SIZE), trl/trainer/sft_config.py (loss_type)"),
    Term("tiled_mlp", "sp: DeepSpeed's TiledMLP, ceil(seqlen/hidden) shards; cp: no tiling",
         "deepspeed/runtime/sequence_parallel/ulysses_sp.py (TiledMLP); ALST recipes tiled_mlp_compute"),
    Term("sdpa_backend", "cp: cuDNN attention (scratch not modelled); sp: flash_attention_2 (FA2 scratch model)",
         "pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (check_prefer_cudnn_attention, "
         "priority_order); ALST recipes attn_implementation"),
    Term("gqa", "cp: K/V handed to SDPA at their G heads (enable_gqa=True), not repeated; rotate allgather, "
         "head-tail load balancer",
         "transformers/integrations/sdpa_attention.py (sdpa_attention_forward, use_gqa_in_sdpa); "
         "accelerate Accelerator._prepare_cp, TorchContextParallelConfig (cp_comm_strategy)"),
    Term("sharding", "ZeRO-3 (sp, optimizer on the host) and FSDP2 (cp) as the suite's FSDP2; ZeRO-3's buckets "
         "not modelled",
         "ALST recipes zero_optimization stage 3, offload_optimizer cpu; Accelerate configs/cp.yaml (fsdp_version 2)"),
    Term("allocator", "caching allocator, expandable segments on the sp path only, a pool per stream",
         "snowflakedb/ArcticTraining:projects/sequence-parallelism/README.md (PYTORCH_CUDA_ALLOC_CONF); "
         "c10/cuda/CUDACachingAllocator.cpp"),
    Term("rope", "cos/sin of the local positions (no TorchTitan table), no ring barrier",
         "transformers/models/llama/modeling_llama.py (LlamaRotaryEmbedding)"),
)


def path_of(method: str) -> str:
    """``sp`` or ``cp``: the Accelerate path ``method`` runs on under the hf stack."""
    check(method)
    return "sp" if method in SP_METHODS else "cp"


def check(method: str) -> None:
    """Refuse, in one line, a method the Hugging Face stack cannot run."""
    if method not in METHODS:
        raise ValueError(
            f"--stack hf runs only {list(METHODS)} (Accelerate's sp_size path: DeepSpeed ALST's ds-ulysses-hf, and "
            f"upipe through methods.integrations.transformers; its cp_size path: torch-cp); {method!r} has no "
            f"Hugging Face integration: use --stack paper or lean, or one of those methods")


def levers(method: str) -> dict[str, Any]:
    """The levers the hf stack sets for ``method`` (before the user's own, which win)."""
    if path_of(method) == "sp":
        return dict(fsdp=True, fsdp_offload=True, ac=True, ac_offload=True, offload_pin=False, offload_keep="none",
                    tiled_mlp=True, tiled_mlp_impl="deepspeed", mlp_tiles=0, tiled_norm=False, chunked_loss=True,
                    loss_chunk=LIGER_LOSS_CHUNK, kernel_workspace="fa2", allocator_model="expandable",
                    allocator_pools="per-stream", rope_table="none", ring_barrier=False)
    return dict(fsdp=True, fsdp_offload=False, ac=True, ac_offload=False, tiled_mlp=False, tiled_norm=False,
                chunked_loss=True, loss_chunk=TRL_LOSS_CHUNK, kernel_workspace="none", allocator_model="classic",
                allocator_pools="per-stream", rope_table="none", ring_barrier=False)


# torch-cp's options as Accelerate's cp_size path runs it (term 5 and term 4's backend)
CP_OPTIONS = {"rotate": "allgather", "backend": "cudnn", "repeat_kv": False}


def options(method: str, requested: dict[str, Any]) -> dict[str, Any]:
    """``method``'s options under the hf stack: ``requested`` with what the stack sets filled in
    where the user set nothing (``torch-cp``: :data:`CP_OPTIONS`)."""
    check(method)
    return {**CP_OPTIONS, **requested} if method in CP_METHODS else dict(requested)


def apply(step: StepConfig, method: str) -> tuple[StepConfig, list[str]]:
    """The step as the hf stack runs it and a note per term: each lever of :func:`levers` that the
    trial left at its default is set (a lever the user moved away from its default wins)."""
    path = path_of(method)
    defaults = StepConfig()
    want = levers(method)
    if want.get("tiled_mlp_impl") == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        want["tiled_mlp_impl"] = "ours"
    values = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
    values.update({k: v for k, v in want.items() if getattr(step, k) == getattr(defaults, k)})
    # a lever the trial switched off (e.g. --no-offload) leaves the levers it governs at their defaults
    values.update(_consistent(values, step))
    ran = StepConfig(**values)
    where = "sp_size (DeepSpeed ALST under ZeRO-3)" if path == "sp" else "cp_size (PyTorch CP under FSDP2)"
    notes = [f"hf stack: Accelerate's {where} for {method}"]
    if path == "sp":
        notes += [
            "hf stack: checkpoint_offload (every layer's input to pageable host memory, first and last included: "
            "ArcticTraining CheckpointFunctionWithCPUOffload)" if ran.ac_offload else
            "hf stack: checkpoint offload off (set by the trial)",
            "hf stack: chunked_loss (Liger's fused linear cross-entropy, chunk next_pow2(ceil(tokens/ceil(V/dim))))"
            if ran.chunked_loss and ran.loss_chunk == 0 else "hf stack: the trial's own loss settings",
            f"hf stack: tiled_mlp ({ran.tiled_mlp_impl if ran.tiled_mlp else 'off'}; ALST's TiledMLP, ceil(S/dim) "
            "shards)" + ("" if want["tiled_mlp_impl"] == "deepspeed" else ": DeepSpeed not installed, ours instead"),
            "hf stack: sdpa_backend (flash_attention_2: FA2 backward scratch model)",
            "hf stack: sharding (ZeRO-3 with the optimizer on the host, as the suite's FSDP2 with CPU offload; "
            "ZeRO-3's buckets not modelled)",
            "hf stack: allocator (expandable segments, ALST's PYTORCH_CUDA_ALLOC_CONF)",
        ]
    else:
        notes += [
            "hf stack: checkpoints kept on the device (Accelerate fsdp_activation_checkpointing, no offload)",
            f"hf stack: chunked_loss (TRL's chunked_nll, {TRL_LOSS_CHUNK} tokens per chunk)",
            "hf stack: sdpa_backend (cuDNN attention first on H100; cuDNN's scratch not modelled, none assumed)",
            "hf stack: gqa (enable_gqa: K/V at their KV heads; rotate allgather, head-tail load balancer)",
            "hf stack: sharding (Accelerate's FSDP2)",
            "hf stack: allocator (PyTorch's default: no expandable segments)",
        ]
    notes.append("hf stack: rope (cos/sin of the local positions, no TorchTitan table)")
    return ran, notes


def _consistent(values: dict[str, Any], step: StepConfig) -> dict[str, Any]:
    """The levers of ``values`` that a lever switched off makes no-ops, back to the trial's own values."""
    out: dict[str, Any] = {}
    governed = {"ac": ("ac_offload", "offload_pin", "offload_keep"), "ac_offload": ("offload_pin", "offload_keep"),
                "fsdp": ("fsdp_offload",), "tiled_mlp": ("tiled_mlp_impl",),
                "chunked_loss": ("loss_chunk", "chunked_loss_impl")}
    for switch, levers_off in governed.items():
        if not values[switch]:
            out.update({name: getattr(step, name) for name in levers_off})
    return out
