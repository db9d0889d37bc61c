"""What a simulated step executes, counted: FLOPs by kernel class and host<->device copies.

The step-time model (``bench.stackmodel.steptime``) turns these counts (``StepCounter.counts``:
``bench.stackmodel.counts.StepCounts``), with the collectives ``bench.stackmodel.hardware.CommCounter``
records, into seconds. Counting happens under the same
FakeTensorMode as the memory simulation, so the counts are exactly what the code issues,
activation-checkpoint recompute included (the recomputed forward runs its kernels again). Where
a simulation runs a few tiles of a tiled loop for all of them (tiled MLP and norms, the chunked
loss, a method's tiled norm; ``methods.core.tiling``), each count made inside a tile is
multiplied by the tiles it stands for (``counted_as``), so the counts are the full step's.
Collectives are not weighed (no tiled loop issues one).

FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` (its dispatch mode passing DTensor ops on to
DTensor, so each rank's local kernels are counted: ``LocalFlopCounter``) with its own formulas for the matmul ops
(``aten.mm``/``addmm``/``bmm``/``baddbmm``: 2·m·n·k) and, through ``custom_mapping``, formulas
for the attention kernels the suite calls that count **causal masking**:

* torch's fused SDPA ops (``aten._scaled_dot_product_flash_attention[_for_cpu]`` and their
  backward, what ``methods.core.kernels`` calls; also ``_efficient``/``_cudnn``) and the
  simulated flash-attn kernels (``cpab_sim::fa2_*``/``fa3_*``, ``bench.stackmodel.fake_flash_attn``;
  what yunchang and DeepSpeed's FPDT call). torch's own formulas count every (query, key)
  pair ("NB: We aren't accounting for causal attention here", torch/utils/flop_counter.py);
  causal flash kernels skip the tiles above the diagonal, so here the dense count
  (``sdpa_flop_count``/``sdpa_backward_flop_count``: 4·sq·sk·d forward, 10·sq·sk·d backward per
  head) is multiplied by the unmasked share of the (sq, sk) pairs. Alignment: torch's
  ``is_causal`` is top-left (row i sees keys 0..i, torch SDPA docs); flash-attn >= 2.1 is
  bottom-right (row i sees keys up to sk - sq + i, flash-attn README "2.1: change behavior of
  causal flag"). Tiles straddling the diagonal are computed whole by the kernels; at a tile
  of 128 that adds ~128/S of the causal work (< 0.2% at 64K per kernel call), not counted.
* the flash op's variable-length form (``aten._flash_attention_forward/backward`` with cumulative
  lengths: a call with documents, ``bench.stackmodel.varlencount``): each sequence at its own
  length and mask. Its short sequences run below the dense rate (``bench.stackmodel.varlenrate``):
  the dense-rate FLOPs a call costs beyond its counted ones are summed beside the FLOPs
  (``LocalFlopCounter.varlen_excess``; a formula returns plain FLOPs) into
  ``StepCounts.flops_attention_varlen_excess``.

Host copies: every ``aten._to_copy``/``aten.copy_`` between the simulated accelerator and the
host device (``cpu`` on the GPU code path, ``meta`` on the CPU code path) with its bytes and
direction, split by **who issues it** (the calling code, from the Python frames): the attention
methods' code under ``methods/`` (FPDT's K/V/Q/O chunks, ``methods.core.chunkstore``) or the
training step (the checkpoint offload of ``bench.training.step.HostOffload``, ``ac_offload``).
The split matters because the two overlap differently with compute (``bench.stackmodel.steptime``).

Memory traffic of the other kernels (``MemoryTraffic``): every local op on the accelerator that is
not a matmul, an attention kernel, a collective or a host copy (norms, RoPE, SwiGLU, residual
adds, casts, softmax merges, the loss's vocabulary-sized softmax, the optimizer's ``_foreach``
updates, device-to-device copies) is memory-bound on a GPU: it must read its tensor inputs and
write its outputs from HBM at least once. Counted as those bytes (``bytes.memory_bound``), each
tensor as the distinct elements it spans (a broadcast dimension, stride 0, counted once); views
and allocations move nothing and are skipped; ``copy_``/``fill_``/``zero_`` and the random fills
only write their destination, and ``new_zeros``/``new_ones``/``new_full`` and
``zeros_like``/``ones_like``/``full_like`` their output (their tensor argument gives only the shape,
dtype and device). The indexing kernels move the rows they index, not the whole tensors they index
into (``_indexed_bytes``; counts of version 4): a gather (``index_select``, ``index``, ``gather``,
``embedding``) reads as many elements of its source as it writes to its output, plus the index; an
in-place scatter (``index_copy_``, ``index_add_``, ``index_put_``, ``scatter_``, ``scatter_add_``,
``scatter_reduce_``) reads its source and the index and writes the rows of its destination that the
index names, reading them first where it accumulates (CUDA's ``index_select``/``gather`` and
``index_add_``/``scatter_add_`` kernels loop over the index, ATen's ``native/cuda/Indexing.cu`` and
``ScatterGatherKernel.cu``). Before version 4 they counted the whole source or destination: the
ring's packed ``doc-zigzag`` calls, which gather and scatter their rows on every ring step, and the
loss's ``gather``/``scatter_add_`` over the vocabulary-wide logits, were overcounted. A lower bound:
a kernel that re-reads an input (a norm's two passes) moves more, and fused kernels (a fused AdamW)
less.

Events (``methods.core.events``): what a method notes as it runs, for costs that go by a count
of pieces of its schedule rather than by FLOPs or bytes: ``pipeline.chunk_passes``, one per
chunk FPDT processes in a forward (recompute included) or backward.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import methods
from methods.core import events
from methods.core.tiling import counted_as

from . import varlencount
from .counts import COUNTS_VERSION, KERNEL_CLASSES, HostCopy, StepCounts, Traffic
from .simmode import Counter, SimulationMode, any_dtensor, tensor_leaves

aten = torch.ops.aten

MATMUL_OPS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "_scaled_mm")


def causal_pairs(sq: int, sk: int, bottom_right: bool) -> int:
    """(query, key) pairs a causal mask keeps for ``sq`` queries and ``sk`` keys."""
    if bottom_right:  # row i sees keys j <= sk - sq + i
        if sq <= sk:
            return sq * (sk - sq) + sq * (sq + 1) // 2
        return sk * (sk + 1) // 2
    if sq <= sk:  # top-left: row i sees keys j <= i
        return sq * (sq + 1) // 2
    return sk * (sk + 1) // 2 + (sq - sk) * sk


def _share(sq: int, sk: int, causal: bool, bottom_right: bool) -> float:
    return causal_pairs(sq, sk, bottom_right) / (sq * sk) if causal and sq and sk else 1.0


def _bhsd(t) -> tuple[int, int, int, int]:
    return tuple(t.shape)


def _bshd(t) -> tuple[int, int, int, int]:
    b, s, h, d = t.shape
    return (b, h, s, d)


# torch's SDPA formulas, kept per shape: the same few shapes come back in every layer, pass and ring step, and
# each call builds its matmuls' counts through FlopCounterMode's shape wrapper (a pytree map per matmul)
_sdpa_flops = functools.lru_cache(maxsize=4096)(sdpa_flop_count)
_sdpa_backward_flops = functools.lru_cache(maxsize=4096)(sdpa_backward_flop_count)


def _fwd(q, k, v, causal: bool, bottom_right: bool, layout=_bhsd) -> int:
    qs, ks, vs = layout(q), layout(k), layout(v)
    return int(_sdpa_flops(qs, ks, vs) * _share(qs[2], ks[2], causal, bottom_right))


def _bwd(dout, q, k, v, causal: bool, bottom_right: bool, layout=_bhsd) -> int:
    qs, ks, vs, ds = layout(q), layout(k), layout(v), layout(dout)
    ds = (ds[0], ds[1], ds[2], vs[3])  # flash-attn pads dout's head dim to 8: count the real one
    return int(_sdpa_backward_flops(ds, qs, ks, vs) * _share(qs[2], ks[2], causal, bottom_right))


def _raw(fn):
    fn._get_raw = True
    return fn


def _arg(args, kwargs, index: int, name: str, default=False):
    return kwargs.get(name, args[index] if len(args) > index else default)


@_raw
def _sdpa_fwd(q, k, v, *args, out_val=None, **kwargs) -> int:  # flash/cudnn/efficient/_for_cpu
    return _fwd(q, k, v, bool(_arg(args, kwargs, 1, "is_causal")), False)


@_raw
def _sdpa_efficient_fwd(q, k, v, attn_bias=None, compute_log_sumexp=False, dropout_p=0.0, is_causal=False,
                        *args, out_val=None, **kwargs) -> int:
    return _fwd(q, k, v, bool(is_causal), False)


@_raw
def _sdpa_flash_bwd(dout, q, k, v, out, lse, *args, out_val=None, **kwargs) -> int:
    # cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, ...
    return _bwd(dout, q, k, v, bool(_arg(args, kwargs, 5, "is_causal")), False)


@_raw
def _sdpa_cpu_bwd(dout, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *args, out_val=None, **kwargs) -> int:
    return _bwd(dout, q, k, v, bool(is_causal), False)


@_raw
def _fa2_fwd(q, k, v, dropout_p, softmax_scale, causal, *args, out_val=None, **kwargs) -> int:
    return _fwd(q, k, v, bool(causal), True, _bshd)


@_raw
def _fa2_bwd(dout, q, k, v, out, lse, dq, dk, dv, dq_accum, dk_e, dv_e, dropout_p, softmax_scale, causal,
             *args, out_val=None, **kwargs) -> int:
    return _bwd(dout, q, k, v, bool(causal), True, _bshd)


@_raw
def _fa3_fwd(q, k, v, softmax_scale, causal, *args, out_val=None, **kwargs) -> int:
    return _fwd(q, k, v, bool(causal), True, _bshd)


@_raw
def _fa3_bwd(dout, q, k, v, out, lse, dq, dk, dv, scratch, softmax_scale, causal, *args, out_val=None,
             **kwargs) -> int:
    return _bwd(dout, q, k, v, bool(causal), True, _bshd)


@_raw
def _addmm_inplace(self, mat1, mat2, *args, out_val=None, **kwargs) -> int:
    """``aten.addmm_`` (a weight gradient accumulated in place: the chunked loss's ``dw``, the fused
    norm's projections' weight gradients), which torch's formulas leave out: 2·m·n·k like ``addmm``."""
    m, k = mat1.shape
    return 2 * m * k * mat2.shape[1]


def attention_formulas() -> dict:
    """Op -> FLOP formula for what torch's table misses or counts wrong (``FlopCounterMode(custom_mapping=...)``):
    the attention kernels, causal-aware, and ``addmm_``."""
    table = {
        aten.addmm_: _addmm_inplace,
        aten._scaled_dot_product_flash_attention: _sdpa_fwd,
        aten._scaled_dot_product_cudnn_attention: _sdpa_fwd,
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_fwd,
        aten._scaled_dot_product_efficient_attention: _sdpa_efficient_fwd,
        aten._scaled_dot_product_flash_attention_backward: _sdpa_flash_bwd,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_bwd,
    }
    table.update(varlencount.varlen_formulas())  # the flash op's variable-length form, per sequence
    sim = getattr(torch.ops, "cpab_sim", None)
    for name, fn in (("fa2_fwd", _fa2_fwd), ("fa2_bwd", _fa2_bwd), ("fa3_fwd", _fa3_fwd), ("fa3_bwd", _fa3_bwd)):
        op = getattr(sim, name, None) if sim is not None else None
        if op is not None:
            table[op] = fn
    return table


ATTENTION_NAMES = ("_scaled_dot_product", "fa2_", "fa3_", "_flash_attention", "_efficient_attention")


def kernel_class(op) -> str:
    """``matmul``, ``attention`` or ``other`` for an op FlopCounterMode counted."""
    parts = str(op).replace("::", ".").split(".")  # aten.mm / aten.mm.default / cpab_sim.fa2_fwd
    name = parts[1] if len(parts) > 1 else parts[0]
    if any(a in str(op) for a in ATTENTION_NAMES):
        return "attention"
    if name in MATMUL_OPS:
        return "matmul"
    return "other"


class HostCopies(Counter):
    """Bytes copied between the simulated accelerator and the host device, by direction and issuer."""

    declines_dtensor = False

    def __init__(self, accelerator: str, host: str) -> None:
        super().__init__()
        self.accelerator, self.host = accelerator, host
        self.counts: dict[HostCopy, Traffic] = {}

    def _add(self, src: torch.device, dst: torch.device, nbytes: int) -> None:
        if src.type == self.accelerator and dst.type == self.host:
            way = "d2h"
        elif src.type == self.host and dst.type == self.accelerator:
            way = "h2d"
        else:
            return
        kind = HostCopy("method" if _issued_by_a_method() else "offload", way)
        weight = counted_as()
        self.counts[kind] = self.counts.get(kind, Traffic()) + Traffic(weight, weight * nbytes)

    def after(self, func, args: tuple, kwargs: dict, out) -> None:
        if func is aten._to_copy.default and isinstance(out, torch.Tensor):
            self._add(args[0].device, out.device, out.numel() * out.element_size())
        elif func is aten.copy_.default:
            dst, src = args[0], args[1]
            self._add(src.device, dst.device, dst.numel() * dst.element_size())


_METHODS_DIR = str(Path(methods.__file__).resolve().parent)


def _issued_by_a_method() -> bool:
    """Whether the copy being dispatched was called from the attention methods' code (``methods/``:
    FPDT's chunk store, a method's index tensors) rather than from the training step (the
    checkpoint offload's saved-tensor hooks, ``bench.training.step``): the Python frames say."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_METHODS_DIR):
            return True
        frame = frame.f_back
    return False


class _LocalOpsMode(Counter, _FlopCounterMode):
    """torch's FlopCounterMode dispatch mode, counting the **local** kernels a rank runs:

    * ops on DTensors are handed back to DTensor (as ``CommCounter`` and torch's ``MemTracker``
      do), so the local ops it runs come back through here;
    * ops DTensor's sharding propagation runs only to infer output shapes
      (``ShardingPropagator._propagate_tensor_meta_non_cached`` runs the op on fake tensors of the
      **global** shape, under the active fake mode, which in simulation is ours) are not counted.

    Without both, an SDPA on sequence-sharded DTensors (``torch-cp``: torch's context parallel)
    counts as every rank attending the whole sequence."""

    propagating = 0  # > 0 while DTensor's shape propagation runs (``StepCounter.counting``)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # a higher-order operator reaches a counter only as a mode of its own (not a SimulationMode's)
        if isinstance(func, torch._ops.HigherOrderOperator) and not _LocalOpsMode.propagating \
                and not any_dtensor(types):
            return _FlopCounterMode.__torch_dispatch__(self, func, types, args, kwargs or {})
        return super().__torch_dispatch__(func, types, args, kwargs)

    def after(self, func, args: tuple, kwargs: dict, out) -> None:
        """Count ``func``'s FLOPs. Every op runs as it would without the counter: torch's mode first tries
        to *decompose* an op it has no formula for (``func.decompose``), which runs other kernels with other
        temporaries and moved the simulated peak (+1.6% on a tiny ring step); the matmuls and attention
        kernels the model counts reach here whole (linear/matmul are decomposed by autograd before any
        dispatch mode sees them), so nothing counted is lost."""
        if _LocalOpsMode.propagating:
            return
        packet = func._overloadpacket
        weight = counted_as()  # a simulated tile standing for skipped ones (methods.core.tiling)
        if weight != 1 and packet in self.counter.flop_registry:
            extra = self.counter.flop_registry[packet](*args, **kwargs, out_val=out)
            self.counter.flop_counts["Global"][packet] += (weight - 1) * extra
        if packet in self.counter.flop_registry:  # a varlen call's cost beyond its FLOPs (varlencount)
            self.counter.varlen_excess += weight * varlencount.excess_flops(packet, args, kwargs)
        self.counter._count_flops(packet, out, args, kwargs)


def in_shape_propagation() -> bool:
    """Whether DTensor's shape propagation is running (inside ``StepCounter.counting``): the ops
    it runs on global-shape fake tensors are not a rank's kernels."""
    return _LocalOpsMode.propagating > 0


@contextlib.contextmanager
def _marking_shape_propagation() -> Iterator[None]:
    """Mark the span of DTensor's shape propagation (``_LocalOpsMode.propagating``)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def marked(self, *args, **kwargs):
        _LocalOpsMode.propagating += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _LocalOpsMode.propagating -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = marked
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


class _GlobalOnly:
    """Stands in for FlopCounterMode's ``ModTracker``: every count goes to ``Global``. torch's
    ModTracker registers module hooks (backward ones through multi-grad hooks) that keep some
    tensors alive longer: under it the simulated peak of ``torch-cp`` grew (27 -> 38 MB on a tiny
    case), and the counters must not change any memory figure (a test checks)."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        return None


class LocalFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` counting the local ops under DTensor (``_LocalOpsMode``), per step only
    (no per-module breakdown: ``_GlobalOnly``), and the varlen calls' excess (``varlen_excess``:
    ``varlencount.excess_flops``, weighed by the tiles a call stands for as its FLOPs are)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.mod_tracker = _GlobalOnly()
        self.varlen_excess = 0.0  # dense-rate attention FLOPs the varlen calls cost beyond their own

    def __enter__(self):
        self.flop_counts.clear()
        self.varlen_excess = 0.0
        self.mod_tracker.__enter__()
        self.mode = _LocalOpsMode(self)
        self.mode.__enter__()
        return self


_NO_DATA_OPS = frozenset({"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                          "lift_fresh", "_local_scalar_dense", "set_", "resize_", "record_stream", "_to_copy",
                          "copy_"})
# write their output (or destination) without reading the first argument: in-place fills and copies, and
# the ``new_*`` constructors, whose first argument only gives the dtype and device (``q.new_zeros(...)``)
_WRITE_ONLY_OPS = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_",
                             "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"})
# gathers: read from their source only the elements they write to their output (module docstring);
# the argument positions of the index tensors
_GATHER_INDEX_ARGS = {"index_select": (2,), "gather": (2,), "index": (1,), "embedding": (1,)}
# in-place scatters: (position of the index argument(s), position of the source or None, whether the destination's
# indexed elements are also read: an accumulating kernel)
_SCATTER_OPS = {"index_copy_": (2, 3, False), "index_add_": (2, 3, True), "scatter_": (2, 3, False),
                "scatter_add_": (2, 3, True), "scatter_reduce_": (2, 3, True), "index_put_": (1, 2, None)}
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor")


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor spans (a stride-0, broadcast, dimension once). A contiguous tensor
    with elements spans them all (its only strides that can be 0 are those of dimensions of size 1)."""
    if t.is_contiguous() and t.numel():
        return t.numel() * t.element_size()
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=False):
        if stride != 0:
            n *= size
    return n * t.element_size()


_NO_KERNEL = object()  # an operator MemoryTraffic leaves to others: a view, a collective, a matmul, an attention


def _traffic_of(func) -> object:
    """What ``MemoryTraffic`` needs of an operator, worked out once per operator: ``_NO_KERNEL``, or
    (its name, the (index, name) of the arguments it writes in place, None when it writes none)."""
    name = func._schema.name.split("::")[-1]
    if (func.is_view or func.namespace in _COMM_NAMESPACES or name in MATMUL_OPS
            or kernel_class(func) == "attention"):
        return _NO_KERNEL
    written = None
    if func._schema.is_mutable:
        names = {a.name for a in func._schema.arguments if a.alias_info and a.alias_info.is_write}
        written = tuple((i, a.name) for i, a in enumerate(func._schema.arguments) if a.name in names)
    return name, written


_TRAFFIC: dict = {}  # operator -> _traffic_of(operator)


class MemoryTraffic(Counter):
    """Bytes the memory-bound kernels of a step read and write on the accelerator (module docstring)."""

    def __init__(self, accelerator: str) -> None:
        super().__init__()
        self.accelerator = accelerator
        self.bytes = 0
        self.calls = 0

    def _on_device(self, tree) -> list[torch.Tensor]:
        """The tensors on the accelerator among ``tree``'s leaves (``tensor_leaves``)."""
        return [t for t in tensor_leaves(tree, []) if t.device.type == self.accelerator]

    def _indexed_bytes(self, name: str, args: tuple, kwargs: dict, out) -> int | None:
        """The bytes an indexing kernel moves (module docstring): the elements it gathers or scatters, the
        index, and (accumulating) the destination's indexed elements read; None where the indexed elements
        are not known from the shapes (a boolean mask's), or the destination is not on the accelerator."""
        def index_bytes(positions: tuple[int, ...]) -> int:
            found = [args[i] for i in positions if i < len(args)]
            return sum(_span_bytes(t) for t in self._on_device(found))

        if name in _GATHER_INDEX_ARGS:
            if not isinstance(out, torch.Tensor) or out.device.type != self.accelerator:
                return None
            return 2 * _span_bytes(out) + index_bytes(_GATHER_INDEX_ARGS[name])
        at, source_at, accumulates = _SCATTER_OPS[name]
        dest = args[0]
        if not isinstance(dest, torch.Tensor) or dest.device.type != self.accelerator:
            return None
        source = args[source_at] if source_at < len(args) else None
        if name == "index_put_":  # x[indices] = values: the indexed shape is the integer indices' broadcast
            indices = args[at]
            given = [i for i in indices if i is not None]
            if not given or any(i.dtype in (torch.bool, torch.uint8) for i in given):
                return None  # a mask: how many elements it names is in its data
            rest = [dest.shape[d] for d, i in enumerate(indices) if i is None] + list(dest.shape[len(indices):])
            elements = torch.Size(torch.broadcast_shapes(*(i.shape for i in given))).numel() * torch.Size(rest).numel()
            accumulates = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
        elif name.startswith("scatter"):
            elements = args[at].numel()  # one element of the destination per element of the index
        else:  # index_copy_, index_add_: the source's rows
            elements = source.numel() if isinstance(source, torch.Tensor) else 0
        region = elements * dest.element_size()
        idx = index_bytes((at,))  # the index tensor, or index_put_'s list of them
        read_source = 0
        if isinstance(source, torch.Tensor) and source.device.type == self.accelerator:
            read_source = min(_span_bytes(source), elements * source.element_size())
        return read_source + idx + region * (2 if accumulates else 1)

    def after(self, func, args: tuple, kwargs: dict, out) -> None:
        if _LocalOpsMode.propagating or not isinstance(func, torch._ops.OpOverload):
            return
        how = _TRAFFIC.get(func)
        if how is None:
            how = _TRAFFIC[func] = _traffic_of(func)
        if how is _NO_KERNEL:
            return
        name, written = how
        if name == "copy_" and args[0].device == args[1].device and args[0].device.type == self.accelerator:
            moved = 2 * _span_bytes(args[0])  # a device-to-device copy: read the source, write the destination
        elif name == "_to_copy" and isinstance(out, torch.Tensor) and args[0].device == out.device \
                and out.device.type == self.accelerator:
            moved = _span_bytes(args[0]) + _span_bytes(out)  # a cast on the device (bf16 logits to fp32)
        elif name in _NO_DATA_OPS:  # a copy to or from the host is a host copy (HostCopies)
            return
        elif (name in _GATHER_INDEX_ARGS or name in _SCATTER_OPS) \
                and (indexed := self._indexed_bytes(name, args, kwargs, out)) is not None:
            moved = indexed
        else:
            writes = self._on_device(out)
            if written is not None:  # in-place (the _foreach_ ones return nothing): the written arguments
                ids = {id(t) for t in writes}
                writes += [t for t in self._on_device([kwargs.get(n, args[i] if i < len(args) else None)
                                                       for i, n in written]) if id(t) not in ids]
            if not writes:
                return  # metadata (prim.device, sizes): no kernel
            reads = self._on_device((args[1:], kwargs) if name in _WRITE_ONLY_OPS else (args, kwargs))
            moved = sum(_span_bytes(t) for t in reads) + sum(_span_bytes(t) for t in writes)
        weight = counted_as()
        self.bytes += weight * moved
        self.calls += weight


class StepCounter:
    """FLOPs by kernel class and host copies of a step (a context manager, see the module docstring)."""

    def __init__(self, accelerator: str = "cuda", host: str = "cpu") -> None:
        self.flops = LocalFlopCounter(display=False, custom_mapping=attention_formulas())
        self.copies = HostCopies(accelerator, host)
        self.traffic = MemoryTraffic(accelerator)
        self.events: dict[str, float] = {}

    @contextlib.contextmanager
    def counting(self) -> Iterator[StepCounter]:
        """Count within the block. The counters join the ``SimulationMode`` the block is entered in, else one
        of their own: one dispatch per operator for all of them (``bench.stackmodel.simmode``)."""
        joined = isinstance(_get_current_dispatch_mode(), SimulationMode)
        with contextlib.nullcontext() if joined else SimulationMode(), _marking_shape_propagation(), \
                varlencount.tracking(), self.flops, self.copies, self.traffic, events.counting() as noted:
            self.events = noted
            yield self

    def counts(self) -> StepCounts:
        """The FLOPs by kernel class (and the varlen calls' excess attention FLOPs), the host copies, the
        memory-bound kernels' traffic and the methods' noted events (``methods.core.events``:
        ``pipeline.chunk_passes``); no collectives (``bench.stackmodel.steptime.comm_counts`` counts those)."""
        flops = dict.fromkeys(KERNEL_CLASSES, 0)
        for op, n in self.flops.get_flop_counts().get("Global", {}).items():
            flops[kernel_class(op)] += n
        return StepCounts(flops_matmul=flops["matmul"], flops_attention=flops["attention"],
                          flops_other=flops["other"], flops_attention_varlen_excess=self.flops.varlen_excess,
                          host_copies=dict(self.copies.counts),
                          memory_bound=Traffic(self.traffic.calls, self.traffic.bytes), events=dict(self.events),
                          version=COUNTS_VERSION)
