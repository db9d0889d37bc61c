"""A step's modelled time from what the simulation observed (``bench.stackmodel.counts.StepCounts``).

Version ``STEPTIME_VERSION``. Every simulated row carries the counts and this model's terms in
``figures.step_time_model`` and its total in ``step_time_s`` (mode ``simulated``: a model, not
a measurement). The terms, each a named mechanism:

* **compute** = Σ_class FLOPs_class / (eff_class × peak), with ``peak`` the device preset's
  dense bf16 tensor-core peak (H100 SXM: 989 TFLOP/s, NVIDIA H100 datasheet, "BF16 Tensor Core
  1,979 TFLOPS with sparsity", i.e. 989.5 dense) and FLOPs those the simulated step executed
  (``stepcount``: recompute included, causal attention counted as the masked pairs it
  skips). Classes: ``matmul`` (GEMMs) at ``eff_matmul``, ``attention`` (flash kernels) at
  ``eff_attention`` for FlashAttention 3 (the paper's kernel for the reported throughputs,
  docs/paper.md "Kernels and versions") and ``eff_attention_fa2`` for torch's SDPA flash
  kernel, which is FlashAttention 2's code (what Native PyTorch = ``torch-cp`` ran; the same
  split as the paper stack's ``kernel_scratch`` term, ``bench.stackmodel.stack.scratch_model``;
  the FA3 paper, Shah et al. 2024, reports FA3 1.5-2x FA2 on H100); ``other`` (none counted
  today) at ``eff_matmul``. Under documents the attention's FLOPs are joined by
  ``flops.attention_varlen_excess``: the dense-rate FLOPs the flash op's varlen calls cost beyond
  their own, short documents and few heads per call running below the dense rate (the fall-off
  measured on an H200, ``bench.stackmodel.varlenrate``; 0 without documents).
* **memory-bound kernels** = ``bytes.memory_bound / hbm_Bps``: every other kernel on the device
  (norms, RoPE, SwiGLU, residual adds, casts, the loss's vocabulary-sized softmax, softmax merges,
  the optimizer's updates) moves at least its inputs and outputs through HBM
  (``bench.stackmodel.stepcount.MemoryTraffic``), at the preset's memory bandwidth (H100 SXM:
  3.35 TB/s, NVIDIA H100 datasheet). On the compute stream, between the matmuls: serial with
  compute. A lower bound (real elementwise kernels reach 80-90% of the datasheet rate; a norm
  reads its input twice); no constant fitted. Counts from before ``STEPTIME_VERSION`` 3 lack
  these bytes (the term is 0 there) and, where the step ran tiled MLPs or norms or the chunked
  loss, count only the tiles the simulation ran (``methods.core.tiling.run_tiles``).
* **communication**: every collective the step issued (``CommCounter``: op, bytes per rank,
  group and its members) through the link model of the preset (``bench.stackmodel.hardware``):
  NCCL's ring algorithm, as the paper set (``NCCL_ALGO=RING``, docs/paper.md "Allocator and
  NCCL"): all-gather / reduce-scatter move ``B·(n-1)/n`` per rank (all-reduce twice that),
  over NVLink when the whole group is in rank 0's node and over the InfiniBand NIC when it
  spans nodes (a ring through two nodes runs at its slowest hop); an all-to-all's share to
  peers in the node goes over NVLink and to the others over IB, concurrently, so the slower
  decides (``max``); a P2P send of a ring attention goes at its link. Each call also costs
  the per-collective latency ``latency_s`` (NCCL's launch and the peers' synchronisation: a
  fitted constant, below), which is what makes many small collectives cost more than few
  large ones.
  Overlap, as the code runs them: all-to-alls (Ulysses, UPipe, USP, FPDT's exchanges, torch's
  CP rotations) and any other collective the attention itself issues (torch's CP all-gathers
  K/V before its ring: ``Collective(..., attention=True)``, ``comm_attn.*`` in a row's counts,
  ``CommCounter.issuers``) are waited on before
  the attention kernel or the next projection can run, so they are **on the critical path**;
  FSDP2's all-gathers (prefetched one block ahead) and reduce-scatters (issued on their own
  stream), and ring attention's P2P sends (posted before the block's kernel runs) **overlap
  compute**: only what exceeds the compute is exposed, ``max(0, overlapped − compute)``.
* **The paper's ring-step barriers** (paper stack term 9, ``methods.core.ringsync``): the ring
  code the paper ran ends every ring step with ``dist.barrier(group)``; the counts have them
  (``Collective("barrier", ...)``, bytes 0), on the critical path (``CRITICAL_OPS``: the host waits for it),
  each at ``barrier_s`` (fitted) instead of ``latency_s``: ``4R - 3`` per layer and ring pass
  (forward R-1, its recomputation R-1, backward 2R-1) for a ring of R, per UPipe stage for
  UPipe 8 x 2. A barrier costs more than an asynchronous collective's launch: NCCL's
  ``barrier`` waits on the host for the one-element all-reduce, so the device drains its queue
  and idles while the host launches the next ring step. One figure for every group is a
  simplification: the fit takes it from Ring's eight-rank ring in one node (Llama3-8B 128K);
  validated on Ring's sixteen ranks over two nodes (Qwen3-32B 128K: +3.9%, was +36.7% with no
  barrier counted) and over-charged on UPipe 8 x 2's two-rank rings (Qwen3-32B 128K: -10.5%).
* **host traffic** through the host link (``HOST_LINK_Bps``: PCIe 5.0 x16, 32 GT/s per lane x 16
  lanes with 128b/130b coding = 63.0 GB/s per direction, PCI-SIG PCIe 5.0 base specification;
  each H100 SXM has its own x16 link to the host in a DGX/HGX H100). Checkpoint offload
  (``ac_offload``: ``bench.training.step.HostOffload``) copies with ``non_blocking`` on the
  compute stream, so it is serialised with compute: ``(d2h + h2d) / HOST_LINK_Bps`` added.
  A method's own store (FPDT's chunks, ``methods.core.chunkstore``) copies on a side stream
  with one-ahead prefetch, overlapping the attention kernels: exposed ``max(0, t_host −
  t_attention)``.
* **UPipe's per-stage cost** is not a separate formula: UPipe's stages issue ``stages × 4``
  smaller all-to-alls per layer and pass where Ulysses issues 4; the counted calls pay
  ``latency_s`` each. So the stage count × layers × passes enters through the observed calls.
* **DeepSpeed FPDT's per-chunk synchronisation** (``ds_fpdt_sync``: only where the step stands
  for DeepSpeed's FPDT, the paper's, not for our ``fpdt``) = ``pipeline.chunk_passes ×
  ds_fpdt_chunk_s``. DeepSpeed 0.17.4's ``deepspeed/sequence/fpdt_layer.py`` (the version the
  paper's FPDT ran, docs/paper.md) makes the host wait for the device at every chunk it
  processes (``dist.barrier()`` after each chunk's exchanges, ``get_accelerator().synchronize()``,
  ``compute_stream.synchronize()`` after each chunk pair and each chunk's host copies) and stages
  each chunk's Q/K/V/O/LSE through freshly allocated pinned host buffers (``SequenceChunk``), so
  its chunk pipeline does not run ahead of the host as ours does (events on a side stream,
  ``methods.core.chunkstore``). Counted: one ``pipeline.chunk_passes`` per chunk per forward
  (recompute included) and backward (``methods.core.events``, noted by ``methods.fpdt``).
  The cost of one is fitted (``ds_fpdt_chunk_s``); which of those synchronisations takes the time
  is not separated. Evidence that it is a per-chunk cost: fitted on two Llama3-8B cells, it gives
  every other FPDT cell of Table 3, both models, within a few per cent (``python -m bench
  steptime``), where the version-3 model, which charged FPDT only its counted calls and copies,
  was 24-30% fast at 256K-512K.

Measured constant: ``eff_matmul`` = ``EFF_MATMUL_MEASURED``, the FLOP-weighted rate of the model's
four bf16 GEMMs (QKV, O, gate/up, down of Llama3-8B at 4096 tokens) on the lent H100
(``results/gpu/h100-ws1/kernels.ndjson``: 775 TFLOP/s of 989), not fitted since version 4.

Fitted constants (``FITTED``): ``eff_attention``, ``eff_attention_fa2``, ``latency_s``,
``ds_fpdt_chunk_s`` and ``barrier_s``, by
``python -m bench steptime`` on the declared cells ``FIT_CELLS`` of the paper's Table 3 (the
counts are committed in ``results/fidelity/steptime.jsonl``); ``tests/bench/stackmodel/test_steptime.py``
checks that refitting reproduces them. Through version 3 ``eff_matmul`` was fitted as well and
the one ``latency_s`` (then 0.9 ms per call) had to absorb FPDT's per-chunk cost too, which made
every other method's calls 0.9 ms each (UPipe/Ulysses 0.79 on Qwen3-32B at 128K, the paper 0.886).

Checked on a real H100 (``results/gpu/h100-ws1/compare.md``; world size 1, 4 blocks of
Llama3-8B, torch's SDPA flash; never used to fit): with the version-3 counts and constants the
modelled step was within -10% to +2% of the real one (compare.md, made then); with the version-5
constants on the same counts it is within -12% to 0% (Ulysses 64K-256K -1.0 / -0.2 / -1.1%,
torch-cp -0.8%, fpdt -5.5%, UPipe -12.0 / -6.4 / -4.2%, offload -10.4%; no ring there, so no
barrier), and ``eff_attention_fa2`` (0.32) sits at the kernel's measured rate (0.31-0.36).
Before version 3 the model was 13-43% fast there with ``eff_matmul`` at 0.43: the counts left out
the tiles a simulation skips (most of the tiled MLP's and the loss's matmuls at long sequences) and
the memory-bound kernels, and the fit had absorbed them. UPipe's measured stage cost at world size
1 (1.18x / 1.10x / 1.05x Ulysses at 64K / 128K / 256K; modelled 1.05x / 1.03x / 1.02x) is still
partly missing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from methods.core.events import CHUNK_PASSES

from .counts import COUNTS_VERSION, Collective, StepCounts, Traffic, flat_name
from .hardware import CommCounter, DevicePreset, LinkModel
from .stack import scratch_model

# 2: collectives the attention issues (comm_attn.*) are on the critical path; 3: counts weigh the
# simulated tiles by the skipped ones they stand for, addmm_ FLOPs, the memory-bound kernels' term;
# 4: DeepSpeed FPDT's per-chunk synchronisation (pipeline.chunk_passes), eff_matmul measured, not fitted;
# 5: the paper's ring-step barriers (comm.barrier.*) at their own fitted barrier_s
STEPTIME_VERSION = 5
# the counts' own version (bench.stackmodel.counts.COUNTS_VERSION: what bench.stackmodel.stepcount counts): 3 since
# the memory-bound bytes, 4 since the indexing kernels' bytes are the rows they index. Version 4 of the model added
# pipeline.chunk_passes, which only the DeepSpeed-FPDT term reads (the Table 3 model, on counts it collects itself),
# so counts of version 3 are complete for everything else and need no re-simulation
HOST_LINK_Bps = 32e9 * 16 / 8 * 128 / 130  # PCIe 5.0 x16 per direction (see the module docstring)
CRITICAL_OPS = ("all_to_all", "barrier")  # waited on before the next kernel
OVERLAP_OPS = ("all_gather", "reduce_scatter", "all_reduce", "send", "broadcast")  # FSDP2 prefetch, ring P2P
BLOCKING_IF_ATTENTION = ("all_gather", "reduce_scatter", "all_reduce")  # issued by the attention: waited on


@dataclass(frozen=True)
class StepTimeConstants:
    """The model's free constants (fitted, ``FITTED``)."""

    eff_matmul: float  # fraction of the bf16 peak GEMMs reach
    eff_attention: float  # fraction of the bf16 peak FlashAttention 3 reaches (on the FLOPs it computes)
    eff_attention_fa2: float  # the same for torch's SDPA flash kernel (FlashAttention 2's code)
    latency_s: float  # per collective call: NCCL launch + peer synchronisation
    ds_fpdt_chunk_s: float = 0.0  # per chunk pass of DeepSpeed's FPDT: its host synchronisations (docstring)
    barrier_s: float = 0.0  # per ring-step barrier of the paper's ring code: all-reduce, host wait, relaunch

    def __post_init__(self) -> None:
        effs = (self.eff_matmul, self.eff_attention, self.eff_attention_fa2)
        if not all(0 < e <= 1 for e in effs):
            raise ValueError(f"efficiencies must be in (0, 1], got {effs}")
        if self.latency_s < 0 or self.ds_fpdt_chunk_s < 0 or self.barrier_s < 0:
            raise ValueError(f"latency_s, ds_fpdt_chunk_s and barrier_s must be >= 0, got {self.latency_s}, "
                             f"{self.ds_fpdt_chunk_s}, {self.barrier_s}")


# the FLOP-weighted rate of Llama3-8B's four GEMMs at 4096 tokens on the lent H100 (775 TFLOP/s of the preset's 989;
# results/gpu/h100-ws1/kernels.ndjson, bench.stackmodel.steptime_fit.measured_eff_matmul): measured, not fitted
# (version 4)
EFF_MATMUL_MEASURED = 0.783165
# fitted by `python -m bench steptime` on FIT_CELLS (10 cells) from results/fidelity/steptime.jsonl (counts of
# COUNTS_VERSION 4), eff_matmul held at EFF_MATMUL_MEASURED. eff_attention_fa2 sits at the kernel's measured H100
# rate (0.31-0.36, kernels.ndjson). latency_s is still above NCCL's own (~10-50 us per call): a fitted, not a
# measured, figure. Before version 4 of the model a single latency (0.9 ms) also absorbed DeepSpeed FPDT's per-chunk
# cost. barrier_s, per barrier of the paper's ring code (paper stack term 9), is fitted by Ring's 928 barriers in the
# Llama3-8B 128K fit cell; charged at latency_s instead, the fit doubled the latency of every call (696 us). Refitted
# on the version-4 counts (what moved against FITTED_V3: docs/steptime.md, "Counts versions").
FITTED = StepTimeConstants(eff_matmul=EFF_MATMUL_MEASURED, eff_attention=0.630977, eff_attention_fa2=0.318545,
                           latency_s=495.294e-6, ds_fpdt_chunk_s=36.4032e-3, barrier_s=1233.51e-6)
# what FITTED was on the version-3 counts (the indexing kernels' whole tensors counted): for counts of version 3
# (committed rows simulated before version 4, the planner's cache), which these constants were fitted with
FITTED_V3 = StepTimeConstants(eff_matmul=EFF_MATMUL_MEASURED, eff_attention=0.630307, eff_attention_fa2=0.318587,
                              latency_s=459.679e-6, ds_fpdt_chunk_s=36.4536e-3, barrier_s=1218.39e-6)
# what FITTED was before version 3, fitted on the version-2 counts (the tiles a simulation skips left out, no
# memory-bound bytes): for counts made before version 3 (the planner's cache), which these constants absorbed
FITTED_V2 = StepTimeConstants(eff_matmul=0.426829, eff_attention=0.614063, eff_attention_fa2=0.315194,
                              latency_s=929.395e-6)
FIT_CELLS = (("llama3-8b", 131072), ("llama3-8b", 1048576))  # (model, length): every Table 3 method there
# the FLOP-weighted forward + backward rate of torch's SDPA flash kernel (FlashAttention 2's code) on the lent
# H100, bf16 causal, Llama3-8B's heads at 32K-512K tokens (results/gpu/h100-ws1/kernels.ndjson, 319 TFLOP/s of the
# preset's 989; bench.stackmodel.steptime_fit.measured_eff_sdpa_flash): measured, not fitted. The hf stack's
# attention rate (stack_constants): flash_attention_2 on the sp path, and the stand-in for cuDNN's on the cp path
# (no cuDNN rate measured)
EFF_SDPA_FLASH_MEASURED = 0.322490
HF_CONSTANTS = StepTimeConstants(eff_matmul=EFF_MATMUL_MEASURED, eff_attention=EFF_SDPA_FLASH_MEASURED,
                                 eff_attention_fa2=EFF_SDPA_FLASH_MEASURED, latency_s=FITTED.latency_s)


def stack_constants(stack: str, version: int = COUNTS_VERSION) -> tuple[StepTimeConstants, str | None]:
    """(constants, attention kernel) of a simulated row under ``stack`` with counts of ``version``: the
    constants fitted on such counts (``constants_of``) and the method's own kernel (None:
    ``attention_kernel``) for the paper and lean stacks; under ``hf`` the kernel that runs there,
    FlashAttention 2's code (flash_attention_2 or torch's SDPA; cuDNN stood in for by it), at
    ``EFF_SDPA_FLASH_MEASURED``, with the model's other constants (the per-call latency still fitted, that
    of ``version``), no ring barrier and no FPDT term (the hf stack runs neither)."""
    fitted = constants_of(version)
    if stack != "hf":
        return fitted, None
    return replace(HF_CONSTANTS, latency_s=fitted.latency_s), "fa2"


def counts_version(counts: StepCounts) -> int:
    """The counts' version (``StepCounts.known_version``; ``COUNTS_VERSION`` for empty counts): 4 for counts
    that write it, else 3 for counts with the memory-bound bytes (``bench.stackmodel.stepcount`` since
    ``STEPTIME_VERSION`` 3, skipped tiles weighed), else 2."""
    known = counts.known_version()
    return COUNTS_VERSION if known is None else known


def constants_of(version: int) -> StepTimeConstants:
    """The constants fitted on counts of ``version``: ``FITTED``; ``FITTED_V3`` for counts of version 3
    (the indexing kernels' whole tensors counted, which those constants were fitted with); ``FITTED_V2``
    for older counts (which leave out work that version-2 constants absorbed; with ``FITTED`` they would
    come out too fast)."""
    return FITTED if version >= 4 else FITTED_V3 if version == 3 else FITTED_V2


def constants_for(counts: StepCounts) -> StepTimeConstants:
    """``constants_of`` the counts' version."""
    return constants_of(counts_version(counts))


def memory_bound_seconds(counts: StepCounts, device: DevicePreset) -> float:
    """The memory-bound kernels' term: their bytes at the device's HBM bandwidth (0 without one)."""
    moved = counts.memory_bound.bytes if counts.memory_bound is not None else 0
    return moved / device.hbm_Bps if device.hbm_Bps else 0.0


# --------------------------------------------------------------------------- collective counts


def comm_counts(counter: CommCounter, ranks_per_node: int, rank: int = 0) -> dict[Collective, Traffic]:
    """A step's collectives by kind (op, group size, members in ``rank``'s node), in the order first
    issued (``StepCounts.collectives``): every call, and the attention's blocking ones again as
    ``Collective(..., attention=True)``."""
    node = rank // ranks_per_node
    out: dict[Collective, Traffic] = {}
    for i, (op, nbytes, size) in enumerate(counter.calls):
        if size <= 1:
            continue
        members = counter.members[i] if i < len(counter.members) else ()
        in_node = sum(1 for r in members if r // ranks_per_node == node) if members else min(size, ranks_per_node)
        kinds = [Collective(op, size, in_node)]
        by_attention = i < len(counter.issuers) and counter.issuers[i] == "attention"
        if by_attention and op in BLOCKING_IF_ATTENTION:
            kinds.append(Collective(op, size, in_node, attention=True))  # the same call, also on the critical path
        for kind in kinds:
            out[kind] = out.get(kind, Traffic()) + Traffic(1, nbytes)
    return out


def collective_seconds(op: str, nbytes: float, size: int, in_node: int, link: LinkModel) -> float:
    """Bandwidth time of ``nbytes`` (per rank) of ``op`` in a group of ``size`` with ``in_node``
    members in the rank's node (no latency: ``latency_s`` is added per call)."""
    if size <= 1:
        return 0.0
    if op == "all_to_all":
        intra = nbytes * (in_node - 1) / size / link.intra_Bps
        inter = nbytes * (size - in_node) / size / link.inter_Bps
        return max(intra, inter)
    bw = link.intra_Bps if in_node >= size else link.inter_Bps  # a ring is as fast as its slowest hop
    if op in ("all_gather", "reduce_scatter"):
        return nbytes * (size - 1) / size / bw
    if op == "all_reduce":
        return 2 * nbytes * (size - 1) / size / bw
    if op in ("send", "broadcast"):
        return nbytes / bw
    return 0.0


def _comm_terms(counts: StepCounts, link: LinkModel, latency_s: float, barrier_s: float) -> dict[str, float]:
    """Critical and overlapped communication: bandwidth time plus ``latency_s`` per call, ``barrier_s``
    per barrier (``barrier_calls``, also among ``critical_calls``); summed in the order of the collectives'
    flat keys (``StepCounts.to_flat``), so that counts read back from a row give its figures to the bit
    whatever order the step issued them in."""
    out = {"critical_s": 0.0, "overlapped_s": 0.0, "critical_calls": 0.0, "overlapped_calls": 0.0,
           "barrier_calls": 0.0}
    for kind, traffic in sorted(counts.collectives.items(), key=lambda item: f"{flat_name(item[0])}.bytes"):
        op, calls = kind.op, traffic.calls
        t = collective_seconds(op, traffic.bytes, kind.size, kind.in_node, link) + calls * (
            barrier_s if op == "barrier" else latency_s)
        if op == "barrier":
            out["barrier_calls"] += calls
        if kind.attention:  # counted without the flag as overlapped: move it to the critical path
            out["overlapped_s"] -= t
            out["overlapped_calls"] -= calls
            out["critical_s"] += t
            out["critical_calls"] += calls
            continue
        where = "critical" if op in CRITICAL_OPS else "overlapped"
        out[f"{where}_s"] += t
        out[f"{where}_calls"] += calls
    return out


# --------------------------------------------------------------------------- the model


def attention_kernel(method: str) -> str:
    """``fa2`` for the methods whose attention is torch's SDPA flash kernel in the paper's runs
    (``torch-cp``), else ``fa3`` (see the module docstring)."""
    return "fa2" if scratch_model(method) == "fa2" else "fa3"


def ds_fpdt_sync_seconds(counts: StepCounts, constants: StepTimeConstants) -> float:
    """DeepSpeed FPDT's per-chunk synchronisation: the chunk passes at ``ds_fpdt_chunk_s`` each."""
    return counts.events.get(CHUNK_PASSES, 0) * constants.ds_fpdt_chunk_s


def step_time(counts: StepCounts, device: DevicePreset, link: LinkModel,
              constants: StepTimeConstants = FITTED, kernel: str = "fa3", ds_fpdt_sync: bool = False) -> dict[str, Any]:
    """The modelled step: ``{"step_time_s", "compute_time_s", "terms", "constants", "version"}``
    (``kernel``: the attention kernel family, ``attention_kernel(method)``; ``ds_fpdt_sync``: the
    counts stand for DeepSpeed's FPDT, which adds its per-chunk synchronisation)."""
    if not device.peak_bf16_flops:
        raise ValueError(f"device preset {device.name!r} has no peak_bf16_flops: add it to bench.stackmodel.hardware")
    if kernel not in ("fa3", "fa2"):
        raise ValueError(f"kernel must be 'fa3' or 'fa2', got {kernel!r}")
    peak = device.peak_bf16_flops
    mm = (counts.flops_matmul + counts.flops_other) / (constants.eff_matmul * peak)
    eff_attn = constants.eff_attention if kernel == "fa3" else constants.eff_attention_fa2
    attn = (counts.flops_attention + counts.flops_attention_varlen_excess) / (eff_attn * peak)
    memory = memory_bound_seconds(counts, device)
    compute = mm + attn + memory
    comm = _comm_terms(counts, link, constants.latency_s, constants.barrier_s)
    exposed_overlap = max(0.0, comm["overlapped_s"] - compute)
    offload_b = counts.host_bytes("offload")
    method_b = counts.host_bytes("method")
    host_offload = offload_b / HOST_LINK_Bps
    host_method = method_b / HOST_LINK_Bps
    exposed_method = max(0.0, host_method - attn)
    sync = ds_fpdt_sync_seconds(counts, constants) if ds_fpdt_sync else 0.0
    total = compute + comm["critical_s"] + exposed_overlap + host_offload + exposed_method + sync
    terms = {
        "compute_matmul_s": mm, "compute_attention_s": attn, "compute_memory_bound_s": memory,
        "comm_critical_s": comm["critical_s"], "comm_critical_calls": comm["critical_calls"],
        "comm_barrier_calls": comm["barrier_calls"],
        "comm_overlapped_s": comm["overlapped_s"], "comm_overlapped_exposed_s": exposed_overlap,
        "host_offload_s": host_offload, "host_method_s": host_method, "host_method_exposed_s": exposed_method,
        "ds_fpdt_sync_s": sync,
    }
    return {"version": STEPTIME_VERSION, "step_time_s": total, "compute_time_s": compute, "terms": terms,
            "constants": {**asdict(constants), "peak_bf16_flops": peak, "host_link_Bps": HOST_LINK_Bps,
                          "hbm_Bps": device.hbm_Bps, "link": link.name, "attention_kernel": kernel}}


def slowest_rank_counts(counts: StepCounts, simulated_pairs: int, slowest_pairs: int) -> StepCounts:
    """``counts`` of the simulated rank with its attention FLOPs carried to the slowest rank's: under packed
    documents the ranks' attention differs (``bench.stackmodel.docwork``), and the step waits for the
    slowest; the simulated rank's counted FLOPs (each document's own causal area) and their varlen excess
    (``flops_attention_varlen_excess``) are scaled by the ratio of the two ranks' counted (query, key)
    pairs. Everything else is the simulated rank's."""
    if simulated_pairs <= 0 or slowest_pairs == simulated_pairs:
        return counts
    ratio = slowest_pairs / simulated_pairs
    return replace(counts, flops_attention=counts.flops_attention * ratio,
                   flops_attention_varlen_excess=counts.flops_attention_varlen_excess * ratio)


def attention_rate(device: DevicePreset, constants: StepTimeConstants = FITTED, kernel: str = "fa3") -> float | None:
    """The attention kernel's modelled dense rate (FLOP/s) on ``device``: its efficiency times the bf16 peak.
    A step with documents is timed at this rate on its attention FLOPs plus the dense-rate FLOPs its
    varlen calls cost beyond them (``StepCounts.flops_attention_varlen_excess``: short documents and few
    heads per call run below the dense rate, ``bench.stackmodel.varlenrate``), so each varlen call runs
    at its measured relative rate; blockwise calls (a ring step's document blocks) stay at this rate. A
    rank's idle time under imbalanced documents (``bench.stackmodel.docwork``) is priced at it."""
    if not device.peak_bf16_flops:
        return None
    eff = constants.eff_attention if kernel == "fa3" else constants.eff_attention_fa2
    return eff * device.peak_bf16_flops


def scale_counts(counts: StepCounts, from_len: int, to_len: int) -> StepCounts:
    """Counts at ``from_len`` carried to ``to_len`` by their leading power in the length: attention
    FLOPs ∝ S², the other FLOPs, collective, host and memory-bound bytes and the events ∝ S, call
    counts constant. Exact up to the lower-order terms (attention's S·d diagonal, per-call fixed sizes)
    for one sequence. The varlen excess (``flops_attention_varlen_excess``) scales with the attention
    FLOPs, S², which keeps its share of them, as for documents whose lengths grow with S. Not exact for
    documents of fixed lengths (a draw from a distribution of document lengths): there the attention
    FLOPs and the excess grow ∝ S (more documents, each as long) and the excess's share stays."""
    r = to_len / from_len

    def bytes_scaled(entries: dict) -> dict:
        return {k: Traffic(t.calls, t.bytes * r) for k, t in entries.items()}

    bound = counts.memory_bound
    return StepCounts(flops_matmul=counts.flops_matmul * r, flops_attention=counts.flops_attention * r * r,
                      flops_attention_varlen_excess=counts.flops_attention_varlen_excess * r * r,
                      flops_other=counts.flops_other * r, host_copies=bytes_scaled(counts.host_copies),
                      memory_bound=None if bound is None else Traffic(bound.calls, bound.bytes * r),
                      events={k: v * r for k, v in counts.events.items()},
                      collectives=bytes_scaled(counts.collectives), version=counts.version)


def figures_from_counts(counts: StepCounts | None, device: DevicePreset, link: LinkModel,
                        tokens_per_device: int, method: str, constants: StepTimeConstants = FITTED,
                        kernel: str | None = None) -> dict[str, Any]:
    """``step_time_s``, ``compute_time_s``, ``tokens_per_s_per_device`` and ``step_time_model``
    (the counts included, in the flat form rows store: ``StepCounts.to_flat``) for a simulated row;
    ``{}`` without counts or a device peak. ``kernel``: the attention kernel (None: the method's,
    ``attention_kernel``; ``stack_constants`` gives both for a stack)."""
    if counts is None or not device.peak_bf16_flops:
        return {}
    model = step_time(counts, device, link, constants, kernel or attention_kernel(method))
    total = model.pop("step_time_s")
    return {"step_time_s": total, "compute_time_s": model.pop("compute_time_s"),
            "tokens_per_s_per_device": tokens_per_device / total if total > 0 else None,
            "step_time_model": {**model, "counts": counts.to_flat()}}
