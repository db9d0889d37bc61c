"""Device presets (memory capacity) and link models (communication time), both named.

A result row names its device preset and, where communication time is modelled
(``emulated`` mode, and the modelled figure in ``simulated`` rows), the link model with its
parameters, so every figure says what it assumed.

**Device presets.** ``capacity_bytes`` is the device memory as ``nvidia-smi`` reports it;
``usable_fraction`` is the share a run may fill. ``host_bytes`` is the host memory each GPU's
rank may use for offloaded tensors (a node's memory over its GPUs); a simulated trial whose
offloads exceed its usable share does not fit either. The simulation counts live tensors only:
the CUDA context, NCCL buffers, kernel workspaces and the caching allocator's fragmentation
are not modelled, so a simulated trial "fits" when its peak is at most
``usable_fraction * capacity``. 0.90 leaves about 8 GiB on an H100 for all of that (the
paper ran with ``expandable_segments:True``, which keeps fragmentation low). The fraction is a
stated constant, not fitted to the paper's results (docs/stacks.md, section "Lean").

**Link models.** Time of one collective on C ranks, for ``B`` bytes per rank (the input of
an all-to-all or reduce-scatter, the output of an all-gather, the buffer of an all-reduce):

    all-to-all:      max(B*(c_in-1)/C / bw_intra, B*(C-c_in)/C / bw_inter) + latency
    all-gather,
    reduce-scatter:  B*(C-1)/C / bw + latency       (ring; bw = bw_intra if C <= ranks_per_node else bw_inter)
    all-reduce:      2 * B*(C-1)/C / bw + latency
    send/recv:       B / bw + latency

with ``c_in = min(C, ranks_per_node)`` ranks in a node. Bandwidths are per rank per
direction. The step's modelled communication time is the sum over its collectives, with
**no overlap** with compute assumed (an upper bound for methods that overlap, e.g. Ring).
"""
from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from records import GiB, MiB

from .simmode import Counter, any_dtensor


@dataclass(frozen=True)
class DevicePreset:
    name: str
    kind: str  # "cuda" or "cpu": what a real/emulated run needs, and the host of offloads
    capacity_bytes: int  # 0: the host's memory, read at run time (cpu)
    usable_fraction: float
    link: str  # default link model
    description: str
    host_bytes: int = 0  # host (CPU) memory per device for offloads; 0: none apart (cpu)
    peak_bf16_flops: float = 0.0  # dense bf16 tensor-core peak, FLOP/s (vendor datasheet; planner's step time)
    hbm_Bps: float = 0.0  # device memory bandwidth, bytes/s (vendor datasheet; the step time's memory-bound kernels)

    def host_usable(self) -> int | None:
        """Host bytes one rank's offloads may fill under simulation (``None``: not modelled)."""
        return int(self.host_bytes * self.usable_fraction) if self.host_bytes else None

    def capacity(self, world_size: int = 1) -> int:
        """Bytes of one rank's device. ``cpu``: the host's memory shared by ``world_size`` ranks."""
        if self.capacity_bytes:
            return self.capacity_bytes
        return host_memory_bytes() // max(1, world_size)

    def usable(self, world_size: int = 1) -> int:
        return int(self.capacity(world_size) * self.usable_fraction)


def host_memory_bytes() -> int:
    """Total host memory (``/proc/meminfo`` MemTotal, else sysconf)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


DEVICES: dict[str, DevicePreset] = {
    d.name: d
    for d in (
        DevicePreset("h100-80g", "cuda", 81559 * MiB, 0.90, "nvlink-h100",
                     "NVIDIA H100 SXM 80 GB HBM3 (81559 MiB as nvidia-smi reports it); 90% usable; "
                     "host memory 256 GiB per GPU (a DGX H100's 2 TiB over 8 GPUs), 90% usable",
                     host_bytes=256 * GiB, peak_bf16_flops=989e12, hbm_Bps=3.35e12),
        DevicePreset("h200-141g", "cuda", 143771 * MiB, 0.90, "nvlink-h200",
                     "NVIDIA H200 141 GB HBM3e (143771 MiB as nvidia-smi reports it); 90% usable; "
                     "host memory 256 GiB per GPU (a DGX H200's 2 TiB over 8 GPUs), 90% usable",
                     host_bytes=256 * GiB, peak_bf16_flops=989e12, hbm_Bps=4.8e12),
        DevicePreset("a100-80g", "cuda", 81920 * MiB, 0.90, "nvlink-a100",
                     "NVIDIA A100 SXM 80 GB HBM2e (81920 MiB); 90% usable; host memory 256 GiB per GPU "
                     "(a DGX A100 640GB's 2 TiB over 8 GPUs), 90% usable", host_bytes=256 * GiB,
                     peak_bf16_flops=312e12, hbm_Bps=2.039e12),
        DevicePreset("cpu", "cpu", 0, 0.80, "cpu-shm",
                     "this host's CPU; capacity = host memory / ranks on it (read at run time); 80% usable",
                     peak_bf16_flops=1e12),
    )
}


@dataclass(frozen=True)
class LinkModel:
    name: str
    intra_Bps: float  # bytes/s per rank per direction inside a node
    inter_Bps: float  # bytes/s per rank per direction between nodes
    latency_s: float  # per collective
    ranks_per_node: int
    description: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def time(self, op: str, nbytes: int, size: int) -> float:
        """Modelled seconds for one collective (see the module docstring)."""
        if size <= 1:
            return 0.0
        in_node = min(size, self.ranks_per_node)
        ring_bw = self.intra_Bps if size <= self.ranks_per_node else self.inter_Bps
        if op == "all_to_all":
            intra = nbytes * (in_node - 1) / size / self.intra_Bps
            inter = nbytes * (size - in_node) / size / self.inter_Bps
            return max(intra, inter) + self.latency_s
        if op in ("all_gather", "reduce_scatter"):
            return nbytes * (size - 1) / size / ring_bw + self.latency_s
        if op == "all_reduce":
            return 2 * nbytes * (size - 1) / size / ring_bw + self.latency_s
        if op in ("send", "recv", "broadcast"):
            return nbytes / ring_bw + self.latency_s
        return self.latency_s


LINKS: dict[str, LinkModel] = {
    m.name: m
    for m in (
        LinkModel("nvlink-h100", 450e9, 50e9, 10e-6, 8,
                  "H100 SXM node: NVLink 4 (900 GB/s bidirectional = 450 GB/s per direction per GPU) "
                  "inside 8-GPU nodes, one 400 Gb/s (50 GB/s) InfiniBand NDR NIC per GPU between nodes"),
        LinkModel("nvlink-h200", 450e9, 50e9, 10e-6, 8,
                  "H200 SXM node: same NVLink 4 and 400 Gb/s NIC per GPU as nvlink-h100"),
        LinkModel("nvlink-a100", 300e9, 25e9, 10e-6, 8,
                  "A100 SXM node: NVLink 3 (600 GB/s bidirectional), 200 Gb/s HDR NIC per GPU"),
        LinkModel("cpu-shm", 5e9, 5e9, 50e-6, 1 << 30,
                  "processes on one host through gloo over loopback TCP: a rough 5 GB/s, 50 us"),
    )
}


def get_device(name: str) -> DevicePreset:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device preset {name!r}; choose one of {sorted(DEVICES)}") from None


def get_link(name: str) -> LinkModel:
    try:
        return LINKS[name]
    except KeyError:
        raise ValueError(f"unknown link model {name!r}; choose one of {sorted(LINKS)}") from None


# --------------------------------------------------------------------------- counting collectives

# c10d op -> (our collective name, index of the tensor whose bytes count)
_C10D_OPS = {
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "barrier": ("barrier", None),
}

# functional collectives (``torch.distributed._functional_collectives``, what DTensor and torch's
# context parallel issue: ``_c10d_functional::*`` ops, the group named by a string). Counted like
# the c10d ops above: an all-gather by its gathered output (input bytes x group size), the others
# by their input.
_FUNCTIONAL_OPS = {
    "all_gather_into_tensor": "all_gather",
    "all_to_all_single": "all_to_all",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
}




def _deepspeed_all_to_all_group(args):
    """The process group of DeepSpeed's ``dim_zero_all_to_all`` operator: its second argument names a group
    that ``deepspeed.sequence.layer.register_all_to_all_group`` registered (None: DeepSpeed not loaded)."""
    layer = sys.modules.get("deepspeed.sequence.layer")
    return getattr(layer, "_all_to_all_groups", {}).get(args[1]) if layer is not None else None


# collectives a library registers as its own operator (torch.library): under FakeTensorMode its fake
# kernel runs and the c10d call inside is never dispatched, and in a real run that call runs inside
# this mode's handler, where the mode does not see it; so the operator itself is counted.
# name -> (op, index of the tensor sent, the process group from the arguments). DeepSpeed's ALST
# (UlyssesSPAttentionHF, deepspeed/runtime/sequence_parallel/ulysses_sp.py) exchanges Q, K, V and the
# output through deepspeed::dim_zero_all_to_all (deepspeed/sequence/layer.py)
_LIBRARY_OPS = {
    "deepspeed::dim_zero_all_to_all": ("all_to_all", 0, _deepspeed_all_to_all_group),
}


_METHODS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "methods")
# code that issues a method's own collectives: the suite's methods, torch's context parallel, the
# attention libraries the methods wrap (yunchang, ring-flash-attn, DeepSpeed's sequence parallel)
_ATTENTION_CODE = ("/torch/distributed/tensor/experimental/", "/yunchang/", "/ring_flash_attn/",
                   "/deepspeed/sequence/")


def issuer() -> str:
    """``attention`` when the attention's code is on the Python stack, else ``step``."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_METHODS_DIR) or any(part in name for part in _ATTENTION_CODE):
            return "attention"
        frame = frame.f_back
    return "step"


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _group_size(args) -> int:
    return _group(args)[0]


def _members(pg) -> tuple[int, ...]:
    """Global ranks of ``pg`` (empty when the group is not registered, e.g. a backend's own)."""
    try:
        return tuple(torch.distributed.get_process_group_ranks(pg))
    except (ValueError, RuntimeError, KeyError):
        return ()


def _group(args) -> tuple[int, tuple[int, ...]]:
    """(size, global ranks) of the process group among a c10d op's arguments."""
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            pg = torch.distributed.ProcessGroup.unbox(a)
            return pg.size(), _members(pg)
    return 1, ()


_any_dtensor = any_dtensor  # the name this module gave it first (tests read it here)


class CommCounter(Counter):
    """Records every c10d collective issued while active: ``(op, bytes per rank, group size)``.

    Works on real, fake-backend and fake-tensor runs alike (collectives pass through the
    dispatcher as ``c10d::*`` or functional ``_c10d_functional::*`` ops). Ops on DTensors are
    handed back to DTensor (``NotImplemented``, as torch's ``MemTracker`` does), so the local ops
    it runs, collectives included, come through here. ``time(link)`` sums the link model over them.
    Receives are not counted separately from sends (a ring step is one send + one recv).
    ``members[i]`` holds the global ranks of call ``i``'s group (empty when unknown): which
    nodes a group spans; ``issuers[i]`` whether the attention issued it (``"attention"``: called
    from the methods' code, torch's context parallel or the attention libraries, by the Python
    frames) or the rest of the step (``"step"``: FSDP's hooks); ``bench.stackmodel.steptime``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []
        self.members: list[tuple[int, ...]] = []
        self.issuers: list[str] = []

    def before(self, func, args: tuple, kwargs: dict) -> None:
        """Record ``func`` if it is a collective (as it is issued: the Python frames say who issues it)."""
        if func.namespace == "_c10d_functional":
            op = _FUNCTIONAL_OPS.get(func._schema.name.split("::", 1)[-1])
            if op is not None:
                pg = _resolve_process_group(args[-1])
                size = pg.size()
                nbytes = _nbytes(args[0]) * (size if op == "all_gather" else 1)
                self.calls.append((op, nbytes, size))
                self.members.append(_members(pg))
                self.issuers.append(issuer())
        library = _LIBRARY_OPS.get(func._schema.name)
        if library is not None:
            op, idx, group_of = library
            pg = group_of(args)
            self.calls.append((op, _nbytes(args[idx]), pg.size() if pg is not None else 1))
            self.members.append(_members(pg) if pg is not None else ())
            self.issuers.append(issuer())
        if func.namespace == "c10d":
            name = func._schema.name.split("::", 1)[-1]
            kind = _C10D_OPS.get(name)
            if kind is not None and kind[0] != "recv":
                op, idx = kind
                nbytes = 0 if idx is None else _nbytes(args[idx])
                size, members = _group(args)
                self.calls.append((op, nbytes, size))
                self.members.append(members)
                self.issuers.append(issuer())

    @property
    def bytes(self) -> int:
        return sum(b for _, b, size in self.calls if size > 1)

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for op, b, size in self.calls:
            if size > 1:
                out[op] = out.get(op, 0) + b
        return out

    def time(self, link: LinkModel) -> float:
        return sum(link.time(op, b, size) for op, b, size in self.calls)
