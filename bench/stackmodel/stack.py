"""The accounting stack of a simulation: what a simulated peak includes and what it must fit in.

Three stacks: ``lean`` and ``paper`` below, and ``hf``, the Hugging Face stack (Accelerate's
``sp_size`` and ``cp_size`` paths; its terms in ``bench.stackmodel.hfstack``, judged as the paper
stack is, terms 6-8 included: :func:`reserved`). All three are ``StepConfig.stack`` (``--stack``
on the CLI, ``step: {stack: ...}`` in sweep specs, recorded in every simulated row's levers; rows
without it are ``lean``):

* ``lean`` (the suite's accounting before the paper stack existed): the live tensors of the
  step as the code allocates them (``bench.measure.simulate``), against the device preset's
  ``usable_fraction`` (90%) of its capacity. Simple, and a lower bound on what a run holds.
* ``paper``: what the paper's runs held, each term a named mechanism with its source (below);
  the peak compared is the modelled allocator's **reserved** peak (the paper reports
  ``max_memory_reserved``), and it must fit in the device's capacity less the memory that
  lives outside the caching allocator (the CUDA context, NCCL's buffers). No factor is tuned to the paper's
  numbers; :data:`FITTED` is the one fitted constant the model allows, and it is unused
  (zero) until a 128K anchor needs it.

The terms of the paper stack (:data:`PAPER_TERMS`), each applied by :func:`apply` to the trial's
step before it runs, in the budget by :func:`usable_bytes`, or (term 8) by the simulation itself
(``bench.measure.run.measure_simulated``):

1. ``allocator``: the step's device allocations and frees replayed through a model of
   PyTorch's CUDA caching allocator with ``expandable_segments:True``
   (``bench.stackmodel.allocator``). Source: the authors' scripts set
   ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (docs/paper.md, "Training stack");
   the allocator's rules from ``c10/cuda/CUDACachingAllocator.cpp``. Its pools
   (``StepConfig.allocator_pools``): ``per-stream`` wherever the paper stack is the default
   (``bench run``/``max-context`` in simulated mode, sweep specs, ``bench fidelity``, ``bench
   plan``), a pool per
   CUDA stream as the real allocator keeps them, so FSDP2's all-gather buffers (made on its
   copy-in stream) and reduce-scatter outputs never serve the compute stream; ``shared``, one
   pool for every stream, is the dataclass default and what every row made before records
   implicitly. Checked on a real H100 (``results/gpu/h100-ws1``, world size 1): per-stream
   within -0.2% to +2.3% of ``max_memory_reserved`` for Ulysses, UPipe and offload, shared
   3-12% under. The committed 16-GPU plans and max-context rows were simulated with ``shared``
   and say so (results/plan/README.md).
2. ``kernel_scratch``: the attention backward's scratch buffers. Methods that call flash-attn
   through a library (yunchang, ring-flash-attn, DeepSpeed; ``MethodFacts.library_kernels``) get
   them from ``bench.stackmodel.fake_flash_attn`` (flash-attn's ``mha_bwd``); the others get the
   model of ``bench.stackmodel.workspace`` for their ``MethodFacts.kernel``: FA3 for our own
   kernels (the paper's runs used FlashAttention 3, "Kernels and versions"), FA2 for
   ``torch-cp`` (torch's SDPA flash kernel is FA2's code).
3. ``offload_first_only``: with checkpoint offload, only the first block's checkpoint stays
   on the device. Source: the authors' ``parallelize_llama.py`` full-checkpointing path
   passes no "last layer" flag to their checkpoint wrapper (docs/paper.md, "Checkpoint
   offload").
4. ``tiled_mlp_deepspeed``: the tiled MLP runs through DeepSpeed's ALST ``TiledMLP``, which
   the authors vendored (``torchtitan/patch_torch_files/ulysses_sp.py``), when DeepSpeed is
   installed (otherwise ours, and the row says so).
5. ``rope_table``: TorchTitan's precomputed RoPE table, ``freqs_cis``, ``complex64
   [training.seq_len, head_dim / 2]`` (8 bytes x head_dim / 2 per token of the *global*
   sequence: 1.5 GiB at 3M tokens, 4 GiB at 8M for head_dim 128), a buffer every rank
   holds whole for the entire step (FSDP2 shards parameters, not buffers). Source: the
   authors' ``torchtitan/torchtitan/models/llama3/model.py`` (``_precompute_freqs_cis``
   over ``model_args.max_seq_len``, which ``update_from_config`` sets to
   ``training.seq_len``; the buffer is registered with ``persistent=False`` and built on
   the device); UPipe's ``fully_fused_attn.py`` and the USP path read it from there. Applies
   to the methods the paper ran in its TorchTitan fork (every method but FPDT, which ran in
   Megatron-DeepSpeed, and the Hugging Face stack's Ulysses: ``MethodFacts.torchtitan``), unless the trial sets
   ``rope_table`` itself (``none``: our decoder's own RoPE, angles of the local positions only).
6. ``cuda_context``: device memory outside the caching allocator, taken off the capacity:
   the CUDA context with lazy module loading, about 400 MB per process on CUDA >= 11.7
   (PyTorch maintainers in pytorch/pytorch#109888 and #107667); counted as 0.5 GiB.

7. ``nccl_buffers``: NCCL's connection buffers, which NCCL allocates itself (cuMem), outside the
   caching allocator: taken off the capacity like the context, for the collectives the step
   issued (:func:`nccl_buffer_bytes`, from the step's collective counts). NCCL connects a rank to
   a peer once per channel, on first use, and keeps the buffers for the communicator's life.
   Measured on 8 x H100 (NVIDIA/nccl#1685, an intra-node ``all_to_all_single``): NCCL's device
   memory grew by 3.28 GB at the first all-to-all, 32 channels per pair of GPUs, allocations of
   10 MiB and 2 MiB: 14 MiB per peer and channel (7 peers x 32 channels x 14 MiB = 3.06 GiB).
   Channels per peer: ``ncclTopoGetNchannels`` (``src/graph/paths.cc``) gives two per NVLink
   between the pair (H100 SXM: 18, through the NVSwitches) capped at the communicator's 32 p2p
   channels, and ``NCCL_NCHANNELS_PER_NET_PEER`` (2) to a peer in another node. An all-to-all
   connects every peer of its group; a ring's send/recv its two neighbours; a ring collective
   (all-gather, reduce-scatter, all-reduce, broadcast; the paper set ``NCCL_ALGO=RING``) one
   send and one receive connection per channel, 32 channels (at least the 32 p2p channels, which
   a communicator cannot have more of than its collective channels). Groups of the same size
   and span count once (the counts do not tell communicators of the same ranks apart; TorchTitan
   makes one per mesh dimension, so this is a lower bound).

8. ``cublas_workspace``: the cuBLAS and cuBLASLt workspaces, which PyTorch allocates through
   the caching allocator (``getNewWorkspace`` and ``getNewCUDABlasLtWorkspace`` in
   ``aten/src/ATen/cuda/CublasHandlePool.cpp``) once per cuBLAS handle and stream, on the first
   GEMM, and keeps for the process's life: ``CUBLAS_WORKSPACE_CONFIG``'s default, 32 MiB on
   sm90 (H100, H200: ``4096 * 8 * 1024``) and 8 MiB + 128 KiB elsewhere, plus cuBLASLt's
   1 MiB (``CUBLASLT_WORKSPACE_SIZE``'s default, capped at the cuBLAS size). Handles are per
   thread (a thread-local pool window): the forward runs on the Python thread, the backward
   (and the checkpoints' recomputation) on autograd's thread for the device, both on the
   compute stream, so two of each (:func:`cublas_workspace_sizes`). They enter the simulated
   step as live device storage before it starts, in allocated and reserved alike, as
   ``max_memory_allocated`` counts them on a GPU (simulated GPU code path only).
9. ``ring_step_barrier``: a barrier over the ring's group after every ring step
   (``StepConfig.ring_barrier``, ``methods.core.ringsync``), for the methods that stand for the
   paper's ring code (``MethodFacts.ring_barrier``: yunchang's Ring and USP, and UPipe 8 x 2).
   Source: the authors' vendored yunchang (``long-context-attention/yunchang/ring/utils.py``) and
   UPipe's ring (``untied_ulysses/flash_attn_utils.py``) both end ``RingComm.wait`` with
   ``dist.barrier(group=self._process_group)``; pip yunchang does not. It changes what runs
   (one ``c10d::barrier`` per ring step: step time, ``bench.stackmodel.steptime``) and, through
   term 7, the NCCL buffers of the ring group's all-reduce where nothing else ran a ring
   collective on it (USP and UPipe 8 x 2's two-rank ring across the nodes). Term 7 counts that
   ring with the 32 channels of a ring inside an NVSwitch node; NCCL probably gives a ring of one
   rank per node fewer (its network channels), so there it may over-count by up to 0.4 GiB.

Not modelled (named so that a residual can be attributed): NVLink SHARP (NVLS) buffers (no
NVLS algorithm under ``NCCL_ALGO=RING``); Liger's fused
linear cross-entropy, the paper's loss, which our chunked loss stands in for (CUDA/Triton
only); memory a real run holds a little longer because of stream ordering
(``bench.stackmodel.simcuda``); FSDP2's all-gather buffers beyond what its CPU-stream code path
holds. The Native PyTorch runs also had no tiled MLP or norms: that is the trial's levers
(the Table 3 specs), not the stack.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import methods
from records import GiB, MiB

from ..measure.config import StepConfig
from . import hfstack
from .counts import StepCounts
from .hardware import DevicePreset

CUDA_CONTEXT_BYTES = GiB // 2  # ~400 MB measured by PyTorch's maintainers; rounded up (see the docstring)
# term 7: NCCL's buffers per peer and channel (10 MiB + 2 x 2 MiB, NVIDIA/nccl#1685) and its channel counts
NCCL_CONNECTION_BYTES = 14 * MiB
NVLINK_CHANNELS_PER_PEER = 32  # 2 per NVLink (18 on an H100 SXM) capped at 32 p2p channels (paths.cc)
NET_CHANNELS_PER_PEER = 2  # NCCL_NCHANNELS_PER_NET_PEER's default
RING_CHANNELS = 32  # a ring collective's channels on an 8 x H100 NVSwitch node
RING_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier")  # NCCL's barrier: an all-reduce
FITTED = 0  # the one fitted constant the paper stack allows (bytes of reserved memory); unused
PAPER_POOLS = "per-stream"  # term 1: the allocator pools the paper stack replays unless a trial asks otherwise


RESERVED_STACKS = ("paper", "hf")  # judged on the modelled allocator's reserved peak, terms 6-8 included


def reserved(stack: str) -> bool:
    """Whether ``stack`` judges a simulation as the paper stack does: the modelled allocator's reserved
    peak against the capacity less the CUDA context and NCCL's buffers, with the cuBLAS workspaces
    held (terms 6-8: PyTorch's and NCCL's, so the ``hf`` stack's too)."""
    return stack in RESERVED_STACKS


def allocator_pools(stack: str, paper: str = PAPER_POOLS) -> str:
    """The allocator pools of a trial under ``stack`` (``StepConfig.allocator_pools``): ``paper``
    under the paper and hf stacks; under the lean stack ``shared``, the field's default, since it runs
    no allocator model unless asked (and a trial's key then stays what it was)."""
    return paper if reserved(stack) else "shared"


@dataclass(frozen=True)
class Term:
    """One named term of the paper stack: what it models, how, and where that comes from."""

    name: str
    mechanism: str
    source: str


PAPER_TERMS: tuple[Term, ...] = (
    Term("allocator", "reserved peak of a replayed caching-allocator model, expandable segments",
         "authors' scripts (PYTORCH_CUDA_ALLOC_CONF); c10/cuda/CUDACachingAllocator.cpp"),
    Term("kernel_scratch", "attention backward scratch (flash-attn mha_bwd; FA3 for our methods, FA2 for torch-cp)",
         "flash-attn csrc/flash_attn/flash_api.cpp, hopper/flash_api.cpp; paper: FA3 for reported runs"),
    Term("offload_first_only", "checkpoints of every block but the first offloaded",
         "authors' parallelize_llama.py full-checkpointing path (no last-layer flag)"),
    Term("tiled_mlp_deepspeed", "the MLP tiles through DeepSpeed's TiledMLP",
         "authors' torchtitan/patch_torch_files/ulysses_sp.py (vendored ALST)"),
    Term("rope_table", "TorchTitan's freqs_cis: complex64 [global seq_len, head_dim/2] on every rank",
         "authors' torchtitan/torchtitan/models/llama3/model.py "
         "(_precompute_freqs_cis, max_seq_len = training.seq_len)"),
    Term("cuda_context", f"{CUDA_CONTEXT_BYTES / GiB:.1f} GiB outside the allocator taken off the capacity",
         "pytorch/pytorch#109888, #107667 (about 400 MB with lazy module loading)"),
    Term("nccl_buffers", f"NCCL's connection buffers ({NCCL_CONNECTION_BYTES // MiB} MiB per peer and channel) "
         "for the collectives the step issued, taken off the capacity",
         "NVIDIA/nccl#1685 (8 x H100 all-to-all: +3.28 GB, 32 channels per pair); nccl src/graph/paths.cc"),
    Term("ring_step_barrier", "a barrier over the ring's group after every ring step (yunchang's Ring and USP, "
         "UPipe 8 x 2)",
         "authors' long-context-attention/yunchang/ring/utils.py and untied_ulysses/flash_attn_utils.py "
         "(RingComm.wait: dist.barrier(group))"),
    Term("cublas_workspace", "cuBLAS (32 MiB on sm90) and cuBLASLt (1 MiB) workspaces per handle and stream, "
         "two handles (forward thread, autograd's thread) on the compute stream, through the caching allocator",
         "pytorch aten/src/ATen/cuda/CublasHandlePool.cpp (parseChosenWorkspaceSize, getNewWorkspace)"),
)

def scratch_model(method: str) -> str:
    """The ``kernel_workspace`` model the paper stack gives ``method`` (see term 2): none where its
    library calls flash-attn itself (``MethodFacts.library_kernels``: ``bench.stackmodel.fake_flash_attn``
    allocates the real kernels' scratch), else its kernel's (``MethodFacts.kernel``: fa3 for our
    kernels, fa2 for torch's SDPA flash kernel)."""
    facts = methods.get_info(method).facts
    return "none" if facts.library_kernels else facts.kernel


def apply(step: StepConfig, method: str) -> tuple[StepConfig, list[str]]:
    """The step as the stack runs it, and a note per term applied (``lean``: unchanged).

    A lever the user set away from its default is kept (an explicit ``kernel_workspace`` or
    ``allocator_model`` wins), so the stack only fills in what the trial left open. The ``hf`` stack's
    terms are ``bench.stackmodel.hfstack``'s (a method it cannot run is refused there)."""
    if step.stack == "lean":
        return step, []
    if step.stack == "hf":
        return hfstack.apply(step, method)
    changes: dict[str, object] = {}
    notes = []
    if step.allocator_model == "none":
        changes["allocator_model"] = "expandable"
        notes.append("paper stack: allocator (expandable segments, reserved peak)")
    if step.kernel_workspace == "none" and scratch_model(method) != "none":
        changes["kernel_workspace"] = scratch_model(method)
        notes.append(f"paper stack: kernel_scratch ({scratch_model(method)} backward scratch model)")
    if step.ac_offload and step.offload_keep == "first_last":
        changes["offload_keep"] = "first"
        notes.append("paper stack: offload_first_only (checkpoints of all blocks but the first offloaded)")
    if step.tiled_mlp and step.tiled_mlp_impl == "ours":
        if importlib.util.find_spec("deepspeed") is not None:
            changes["tiled_mlp_impl"] = "deepspeed"
            notes.append("paper stack: tiled_mlp_deepspeed (DeepSpeed's TiledMLP)")
        else:
            notes.append("paper stack: DeepSpeed not installed, so the tiled MLP is ours, not its TiledMLP")
    facts = methods.get_info(method).facts
    if step.rope_table == "auto" and facts.torchtitan and step.scope == "model":
        changes["rope_table"] = "checkpointed"
        notes.append("paper stack: rope_table (TorchTitan's freqs_cis over the whole sequence on every rank)")
    if not step.ring_barrier and facts.ring_barrier:
        changes["ring_barrier"] = True
        notes.append("paper stack: ring_step_barrier (a barrier after every ring step, as the paper's ring code)")
    return dataclasses.replace(step, **changes), notes


SM90_PRESETS = ("h100-80g", "h200-141g")  # compute capability 9.0: the 32 MiB cuBLAS workspace default
CUBLAS_THREADS = 2  # term 8: handles are per thread: the forward's and autograd's device thread
CUBLASLT_WORKSPACE = MiB  # CUBLASLT_WORKSPACE_SIZE's default (1024 KiB)


def cublas_workspace_sizes(preset: DevicePreset) -> tuple[int, ...]:
    """Term 8: the device storages cuBLAS's and cuBLASLt's workspaces hold on one rank of
    ``preset`` (none on a CPU)."""
    if preset.kind != "cuda":
        return ()
    cublas = 4096 * 8 * 1024 if preset.name in SM90_PRESETS else 4096 * 1024 * 2 + 16 * 1024 * 8
    return (cublas, min(CUBLASLT_WORKSPACE, cublas)) * CUBLAS_THREADS


def cublas_note(preset: DevicePreset) -> str:
    sizes = cublas_workspace_sizes(preset)
    return (f"paper stack: cublas_workspace ({len(sizes)} workspaces, {sum(sizes) / MiB:.2f} MiB in all, "
            "held through the caching allocator)")


def nccl_buffer_bytes(counts: StepCounts | None) -> int:
    """Term 7: NCCL's connection buffers on one rank for the collectives in ``counts`` (their kinds,
    ``StepCounts.collectives``: op, group size, members in the rank's node; kinds with no call do
    not connect; 0 without counts)."""
    peers: dict[tuple[int, int], tuple[int, int]] = {}  # group shape -> (NVLink peers, network peers)
    rings: set[tuple[int, int]] = set()
    for kind, traffic in (counts.collectives if counts is not None else {}).items():
        if kind.attention or not traffic.calls:  # the attention's own calls: counted in their kind already
            continue
        op, shape = kind.op, (kind.size, kind.in_node)
        if shape[0] <= 1:
            continue
        if op in RING_OPS:
            rings.add(shape)
            continue
        if op == "all_to_all":
            linked = (shape[1] - 1, shape[0] - shape[1])
        elif op == "send":  # a ring's two neighbours (one in a group of two), local ones first
            both = min(2, shape[0] - 1)
            local = min(both, shape[1] - 1)
            linked = (local, both - local)
        else:
            continue
        have = peers.get(shape, (0, 0))
        peers[shape] = (max(have[0], linked[0]), max(have[1], linked[1]))
    connections = sum(nvl * NVLINK_CHANNELS_PER_PEER + net * NET_CHANNELS_PER_PEER for nvl, net in peers.values())
    return (connections + len(rings) * RING_CHANNELS) * NCCL_CONNECTION_BYTES


def usable_bytes(preset: DevicePreset, stack: str, world_size: int = 1, nccl: int = 0) -> int:
    """The bytes a simulated peak may reach on one device of ``preset`` under ``stack`` (``nccl``:
    the paper stack's NCCL buffers of the trial, :func:`nccl_buffer_bytes`)."""
    if not reserved(stack) or preset.kind == "cpu":
        return preset.usable(world_size)
    return preset.capacity(world_size) - CUDA_CONTEXT_BYTES - nccl - FITTED
