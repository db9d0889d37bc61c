"""Reserved memory of a simulated step: its allocation trace replayed through a model of
PyTorch's CUDA caching allocator.

Simulation (``bench.measure.simulate``) measures live tensor bytes, what
``torch.cuda.max_memory_allocated`` reports. The paper reports ``max_memory_reserved``: the
bytes the caching allocator holds from the driver, which add rounding, segment granularity,
split blocks that cannot be returned and cached free blocks. Rather than a flat factor, this
module records every allocation and free of device storage during the simulated step
(``TraceRecorder``) and replays them, in order, through a data-structure model of the
allocator (``CachingAllocatorModel``). ``allocator_peaks`` does both for a step.

Source of the model: ``c10/cuda/CUDACachingAllocator.cpp`` in pytorch/pytorch (read at
commit 001074d25084fdb87a799823e395a50f5ec044d3; the rules below hold from torch 2.1, the
release that added expandable segments). Mechanisms modelled, each with where it lives there:

* Size rounding: ``DeviceCachingAllocator::round_size``: below ``kMinBlockSize`` (512) a
  request takes 512 bytes, otherwise it is rounded up to a multiple of 512
  (the ``roundup_power2_divisions`` option is off by default and not modelled).
* Two pools: ``get_pool``: rounded sizes ``<= kSmallSize`` (1 MiB) go to the small pool,
  larger ones to the large pool. Free blocks of a pool are kept per stream ordered by
  (size, address) (``BlockComparatorSize``), as ``BlockPool::blocks`` is.
* Best fit: ``get_free_block``: the smallest free block of the pool and stream with
  ``size >= request`` (``blocks.lower_bound``), lowest address on ties. With expandable
  segments the search then steps to a larger block while that one's "expandable size"
  (its size plus the unmapped space right after it) is smaller, so the growable tail of a
  segment is taken last (the ``expandable_size`` lambda there).
* New segments, classic mode: ``alloc_block`` ``cudaMalloc``s ``get_allocation_size(size)``:
  ``kSmallBuffer`` (2 MiB) for small requests, ``kLargeBuffer`` (20 MiB) for requests below
  ``kMinLargeAlloc`` (10 MiB), else the size rounded up to ``kRoundLarge`` (2 MiB).
* Splitting: ``should_split`` then ``alloc_found_block``: the block is cut to the request
  and the rest returns to the pool when ``remaining >= kMinBlockSize`` (small pool, and every
  pool with expandable segments) or ``remaining > kSmallSize`` (large pool, classic mode).
  An unsplit block is handed out whole, and ``allocated_bytes`` counts its whole size.
* Coalescing: ``free_block`` merges a freed block with free neighbours of its segment
  (``try_merge_blocks``, which refuses neighbours that are allocated or differ in being
  mapped). Freed memory stays reserved: the allocator caches it.
* Running out: ``malloc`` tries ``get_free_block``, then ``alloc_block``, then
  ``release_available_cached_blocks`` (only with ``max_split_size``: not modelled, so a
  no-op), then ``release_cached_blocks`` (``release_blocks`` on the large then small pool:
  every free unsplit segment is ``cudaFree``d in classic mode, ``release_block``; with
  expandable segments every whole free page is unmapped, ``unmap_block``, and a segment left
  wholly unmapped is dropped, ``release_expandable_segment``) and one more ``alloc_block``;
  if that fails too, the CUDA out-of-memory error. Here ``capacity`` stands for the device
  memory ``cudaMalloc``/``cuMemCreate`` may take: a segment or page that would take
  ``reserved`` past it fails.
* Expandable segments (``expandable_segments:True``, Note [Expandable Segments] and
  ``struct ExpandableSegment``): one segment per pool and stream, a virtual range of 1 1/8
  of the device's total memory (``find_expandable_block``: ``prop.totalGlobalMem``, not what
  the allocator may map; ``device_bytes``), backed by physical pages of
  ``kSmallBuffer`` (2 MiB, small pool) or ``kLargeBuffer`` (20 MiB, large pool) mapped on
  demand. ``try_allocate_expandable_block`` takes the lowest-address unmapped range (with
  the free block just before it) that has room, and maps the pages the request needs
  (``map_block``, ``ExpandableSegment::map``: whole pages, so reserved grows in page
  steps; the mapped range merges with the free block before it). Frees never unmap: pages
  stay mapped (reserved) until ``release_cached_blocks`` runs on a failed allocation
  (``unmap_block``, ``ExpandableSegment::unmap``: only pages wholly inside a free block).
* Statistics: ``allocated_bytes`` grows by the block size in ``alloc_found_block`` and
  shrinks in ``free``; ``reserved_bytes`` grows in ``alloc_block``/``map_block`` and shrinks
  in ``release_block``/``unmap_block``; their peaks are what ``max_memory_allocated`` and
  ``max_memory_reserved`` return.

Streams: each allocation is recorded with the stream current when it was made
(``bench.stackmodel.simcuda.stream_id``: the simulated runtime tracks ``torch.cuda.stream(...)``
contexts; FSDP2 makes its all-gather inputs and outputs on its copy-in stream and its
reduce-scatter outputs on its reduce-scatter stream, a method's store its chunks on its copy
stream), and the replay keeps a pool per stream, so a block cached by one stream is not
reused by another (``BlockPool`` lookups compare ``stream``; ``Block::stream``). A replay with
``per_stream=False`` (``StepConfig.allocator_pools="shared"``) puts every allocation in one
stream's pools instead: one shared pool, which ignores the streams.

Not modelled: cross-stream use (``recordStream``, ``stream_uses`` and the CUDA events that
defer a free until other streams are done, ``insert_events``/``process_events``): every
free here completes at once, on the stream it was allocated on. Nor the ``max_split_size_mb``,
``roundup_power2_divisions`` and ``garbage_collection_threshold`` options, the memory
fraction (``set_fraction``), the free-memory callbacks, CUDA graph private pools, IPC,
memory the allocator does not manage (CUDA context, NCCL's buffers; cuBLAS's workspaces it does
manage: the paper stack adds them, ``bench.stackmodel.stack``), and
allocations that kernels make and free internally (a fake kernel allocates its outputs
only). Tensors that exist before the step (parameters, optimizer state) enter the trace as
initial allocations in the order the tracker meets them, not in the order and with the
frees that created them; ``Trace.step_start`` marks where the step begins.
"""
from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.distributed._tools.mem_tracker import _UpdateType

from ..measure.simulate import MemoryPeak, PeakTracker, peaks_by_device
from .simcuda import stream_id

# constants of c10/cuda/CUDACachingAllocator.cpp
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 << 20  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 << 20  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
K_LARGE_BUFFER = 20 << 20  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
K_ROUND_LARGE = 2 << 20  # kRoundLarge: round up large allocations to 2 MiB

ALLOC, FREE = "alloc", "free"


def round_size(size: int) -> int:
    """``round_size``: at least 512 bytes, else up to a multiple of 512."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the ``cudaMalloc`` size of a new classic segment for a
    rounded request of ``size`` bytes."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


# --------------------------------------------------------------------------- the trace


class Event(NamedTuple):
    """One allocation or free of device storage. ``id`` pairs a free with its allocation;
    a free repeats the allocation's ``nbytes``, ``device`` and ``stream``."""

    action: str  # ALLOC | FREE
    id: int
    nbytes: int  # bytes of the untyped storage
    device: str  # "cuda:0", "cpu", "meta"...
    stream: int = 0
    op: str | None = None  # the operator running when it happened (None: outside any op)


@dataclass
class Trace:
    """Events in program order; those before ``step_start`` existed before the step."""

    events: list[Event]
    step_start: int = 0

    def devices(self) -> list[str]:
        return sorted({e.device for e in self.events})

    def for_device(self, device: str) -> list[Event]:
        return [e for e in self.events if e.device == device]

    def peak_live(self, device: str, rounded: bool = False) -> int:
        """Peak of live bytes on ``device`` over the trace (``rounded``: each storage
        rounded as ``round_size`` rounds it, which is ``allocated_bytes`` when every block
        is split to its request)."""
        size = round_size if rounded else (lambda n: n)
        live = peak = 0
        for e in self.events:
            if e.device != device:
                continue
            if e.action == ALLOC:
                live += size(e.nbytes)
                peak = max(peak, live)
            else:
                live -= size(e.nbytes)
        return peak


class TraceRecorder(PeakTracker):
    """A ``MemTracker`` (with the per-device peak only, ``simulate.PeakTracker``) that also
    logs, in order, every storage it starts or stops counting.

    MemTracker follows each tensor's untyped storage through a ``WeakIdKeyDictionary`` and a
    ``weakref`` whose callback fires when the storage dies; all its bookkeeping goes through
    ``_update_snap``, which this class extends: an ``ADD`` is an allocation, a ``DEL`` a free,
    a ``SIZE`` change (``UntypedStorage.resize_``, which FSDP uses) a new allocation followed
    by the free of the old one. Views share their base's storage, so they are counted once.
    Tensors given to ``track_external`` (before entering) are the trace's initial
    allocations. Works on fake and real tensors alike.

    ``stream``: the simulated runtime's current stream for device storage
    (``simcuda.stream_id``; 0 outside a simulation and for host storage).
    """

    def __init__(self) -> None:
        super().__init__()
        self.trace = Trace([])
        self._ids = itertools.count()
        self._op: str | None = None
        self._recording = True
        self._device_names: dict[torch.device, str] = {}

    def _device_name(self, device: torch.device) -> str:
        name = self._device_names.get(device)
        if name is None:
            name = self._device_names[device] = str(device)
        return name

    def _log_alloc(self, winfo, nbytes: int) -> None:
        eid = next(self._ids)
        stream = stream_id() if winfo.device.type == "cuda" else 0
        winfo._trace_event = (eid, nbytes, stream)
        self.trace.events.append(Event(ALLOC, eid, nbytes, self._device_name(winfo.device), stream, self._op))

    def _log_free(self, winfo, live: tuple[int, int, int] | None) -> None:
        if live is not None:
            eid, nbytes, stream = live
            self.trace.events.append(Event(FREE, eid, nbytes, self._device_name(winfo.device), stream, self._op))

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if not self._recording:
            return
        if u_type == _UpdateType.ADD:
            self._log_alloc(winfo, winfo.size * winfo.element_size)
        elif u_type == _UpdateType.DEL:
            self._log_free(winfo, getattr(winfo, "_trace_event", None))
            winfo._trace_event = None
        elif u_type == _UpdateType.SIZE:
            old = getattr(winfo, "_trace_event", None)
            winfo._trace_event = None
            nbytes = winfo.size * winfo.element_size
            if nbytes:
                self._log_alloc(winfo, nbytes)  # resize_ allocates the new storage, copies, frees the old
            self._log_free(winfo, old)

    def __enter__(self) -> TraceRecorder:
        if self._depth == 0:
            self.trace.step_start = len(self.trace.events)
        super().__enter__()
        return self

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        if self._depth == 0:
            self._recording = False  # what dies after the step is not part of it

    def _call(self, func, args: tuple, kwargs: dict):
        # the operator's own allocations are its events; the counters' (a kernel's scratch) those of
        # the operators that made them, and the scratch's frees, after the operator, the outer one's
        outer, self._op = self._op, getattr(func, "__name__", None)
        try:
            return super()._call(func, args, kwargs)
        finally:
            self._op = outer


# --------------------------------------------------------------------------- the allocator


class AllocatorOOM(MemoryError):
    """The modelled allocator could not find room even after releasing its cache."""


class _Block:
    """``struct Block``: a range of a segment, allocated, free (cached) or unmapped."""

    __slots__ = ("addr", "size", "allocated", "mapped", "prev", "next", "pool", "segment")

    def __init__(self, addr: int, size: int, pool: _Pool, segment: _Segment | None = None,
                 mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.pool = pool
        self.segment = segment  # the expandable segment, None for a cudaMalloc'd one

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class _Segment:
    """``struct ExpandableSegment``: a virtual range mapped in pages of ``page`` bytes."""

    __slots__ = ("base", "size", "page")

    def __init__(self, base: int, size: int, page: int) -> None:
        self.base, self.size, self.page = base, size, page


class _Pool:
    """``struct BlockPool`` restricted to one stream: free mapped blocks ordered by
    (size, address), unmapped blocks ordered by address."""

    __slots__ = ("small", "stream", "keys", "free", "unmapped", "unmapped_blocks")

    def __init__(self, small: bool, stream: int) -> None:
        self.small, self.stream = small, stream
        self.keys: list[tuple[int, int]] = []
        self.free: dict[int, _Block] = {}
        self.unmapped: list[int] = []
        self.unmapped_blocks: dict[int, _Block] = {}

    def insert(self, b: _Block) -> None:
        bisect.insort(self.keys, (b.size, b.addr))
        self.free[b.addr] = b

    def erase(self, b: _Block) -> None:
        key = (b.size, b.addr)
        i = bisect.bisect_left(self.keys, key)
        assert self.keys[i] == key, "free block missing from its pool"
        del self.keys[i]
        del self.free[b.addr]

    def insert_unmapped(self, b: _Block) -> None:
        bisect.insort(self.unmapped, b.addr)
        self.unmapped_blocks[b.addr] = b

    def erase_unmapped(self, b: _Block) -> None:
        i = bisect.bisect_left(self.unmapped, b.addr)
        assert self.unmapped[i] == b.addr, "unmapped block missing from its pool"
        del self.unmapped[i]
        del self.unmapped_blocks[b.addr]


@dataclass
class ReplayResult:
    """What a replay ends with. ``peak_allocated``/``peak_reserved`` are the allocator's
    ``max_memory_allocated``/``max_memory_reserved``; ``peak_live_rounded`` is the peak of
    the live storages each rounded by ``round_size`` (equal to ``peak_allocated`` unless a
    large block was handed out unsplit, classic mode only). ``oom``: the error message if
    an allocation failed (the replay stops there)."""

    peak_allocated: int
    peak_reserved: int
    peak_live_rounded: int
    reserved_at_end: int
    segments_allocated: int  # cudaMalloc calls (classic) or page mappings (expandable)
    cache_releases: int  # release_cached_blocks calls forced by the capacity
    events: int
    oom: str | None = None


class CachingAllocatorModel:
    """One device's ``DeviceCachingAllocator`` as data structures (see the module docstring
    for each rule's source). ``capacity``: bytes the allocator may reserve in all (None:
    unlimited). ``malloc`` returns an opaque block handle for ``free``."""

    _ALIGN = 1 << 30  # distance between the (fictitious) base addresses of segments

    def __init__(self, expandable_segments: bool = False, capacity: int | None = None,
                 device_bytes: int | None = None) -> None:
        self.expandable = expandable_segments
        self.capacity = capacity
        self.device_bytes = device_bytes if device_bytes is not None else capacity
        self._pools: dict[tuple[bool, int], _Pool] = {}
        self._next_addr = self._ALIGN
        self.allocated = self.reserved = self.live_rounded = 0
        self.peak_allocated = self.peak_reserved = self.peak_live_rounded = 0
        self.segments_allocated = 0
        self.cache_releases = 0

    # ---------------------------------------------------------------- public
    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        """``DeviceCachingAllocator::malloc``."""
        size = round_size(nbytes)
        pool = self._pool(size <= K_SMALL_SIZE, stream)
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, size)
            if block is None:
                self.cache_releases += 1
                self.release_cached_blocks()
                block = self._alloc_block(pool, size)
            if block is None:
                raise AllocatorOOM(
                    f"modelled CUDA out of memory: tried to allocate {size} bytes with {self.allocated} "
                    f"allocated and {self.reserved} reserved of a capacity of {self.capacity}")
        if self._should_split(block, size):
            block = self._split(block, size)
        block.allocated = True
        self.allocated += block.size
        self.live_rounded += size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        if self.live_rounded > self.peak_live_rounded:
            self.peak_live_rounded = self.live_rounded
        return block

    def free(self, block: _Block, nbytes: int) -> None:
        """``free`` then ``free_block`` (no stream uses: it completes at once)."""
        assert block.allocated, "double free"
        block.allocated = False
        self.allocated -= block.size
        self.live_rounded -= round_size(nbytes)
        pool = block.pool
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.insert(block)

    def release_cached_blocks(self) -> None:
        """``release_cached_blocks`` (``emptyCache``): large pools, then small ones."""
        for small in (False, True):
            for (is_small, _), pool in list(self._pools.items()):
                if is_small == small:
                    self._release_blocks(pool)

    def replay(self, events: Iterable[Event], device: str | None = None, per_stream: bool = True) -> ReplayResult:
        """Replay ``events`` (those of ``device`` if given) and return the peaks. An
        allocation that fails ends the replay with ``oom`` set. ``per_stream=False`` puts every
        allocation in the default stream's pools (one shared pool, as if on one stream)."""
        live: dict[int, _Block] = {}
        count = 0
        oom = None
        for e in events:
            if device is not None and e.device != device:
                continue
            count += 1
            if e.action == ALLOC:
                try:
                    live[e.id] = self.malloc(e.nbytes, e.stream if per_stream else 0)
                except AllocatorOOM as err:
                    oom = str(err)
                    break
            else:
                block = live.pop(e.id, None)
                if block is not None:
                    self.free(block, e.nbytes)
        return ReplayResult(self.peak_allocated, self.peak_reserved, self.peak_live_rounded, self.reserved,
                            self.segments_allocated, self.cache_releases, count, oom)

    # ---------------------------------------------------------------- internals
    def _pool(self, small: bool, stream: int) -> _Pool:
        pool = self._pools.get((small, stream))
        if pool is None:
            pool = self._pools[(small, stream)] = _Pool(small, stream)
        return pool

    def _grow_reserved(self, nbytes: int) -> bool:
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return False  # cudaMalloc / cuMemCreate: out of memory
        self.reserved += nbytes
        self.segments_allocated += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return True

    def _should_split(self, block: _Block, size: int) -> bool:
        """``should_split`` (max_split_size unlimited)."""
        remaining = block.size - size
        if block.pool.small or self.expandable:
            return remaining >= K_MIN_BLOCK_SIZE
        return remaining > K_SMALL_SIZE

    def _split(self, block: _Block, size: int) -> _Block:
        """``alloc_found_block`` with ``split_remainder``: the front ``size`` bytes are handed
        out, the rest (the old block, shrunk) goes back to the pool."""
        front = _Block(block.addr, size, block.pool, block.segment)
        front.prev, front.next = block.prev, block
        if block.prev is not None:
            block.prev.next = front
        block.prev = front
        block.addr += size
        block.size -= size
        block.pool.insert(block)
        return front

    def _expandable_size(self, b: _Block) -> int:
        n = b.next
        return b.size + (n.size if n is not None and not n.mapped else 0)

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        """``get_free_block``: best fit in the pool's stream."""
        keys = pool.keys
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        if self.expandable:
            here = self._expandable_size(pool.free[keys[i][1]])
            while i + 1 < len(keys):
                there = self._expandable_size(pool.free[keys[i + 1][1]])
                if there >= here:
                    break
                i, here = i + 1, there
        block = pool.free[keys[i][1]]
        pool.erase(block)
        return block

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        """``alloc_block``: a new segment (classic) or newly mapped pages (expandable)."""
        if self.expandable:
            return self._try_allocate_expandable_block(pool, size)
        alloc = allocation_size(size)
        if not self._grow_reserved(alloc):
            return None
        block = _Block(self._next_addr, alloc, pool)
        self._next_addr += -(-alloc // self._ALIGN) * self._ALIGN
        return block

    def _try_merge(self, dst: _Block, src: _Block | None) -> int:
        """``try_merge_blocks``: ``src`` (free, same mapping) is absorbed into ``dst``."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            src.pool.erase(src)
        else:
            src.pool.erase_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # ---- expandable segments
    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        """``find_expandable_block``: the lowest-address unmapped range (with the free block
        before it) that has room for ``size``; else a new segment."""

        def has_room(b: _Block | None) -> bool:
            total = 0
            while total < size and b is not None and not b.allocated:
                total += b.size
                b = b.next
            return total >= size

        for addr in pool.unmapped:
            c = pool.unmapped_blocks[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            if has_room(c):
                return c
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        # address space for 1 1/8 of the device's total memory (prop.totalGlobalMem, whatever part of it
        # the allocator may map; unknown: 1 PiB)
        space = (self.device_bytes + self.device_bytes // 8) if self.device_bytes is not None else 1 << 50
        space = -(-space // page) * page
        segment = _Segment(self._next_addr, space, page)
        self._next_addr += -(-space // self._ALIGN) * self._ALIGN
        block = _Block(segment.base, space, pool, segment, mapped=False)
        pool.insert_unmapped(block)
        return block

    def _map_block(self, to_map: _Block, size: int) -> bool:
        """``map_block``: back the first ``size`` bytes of an unmapped block with whole pages."""
        seg = to_map.segment
        offset = to_map.addr - seg.base
        end = -(-(offset + size) // seg.page) * seg.page
        mapped = end - offset
        if not self._grow_reserved(mapped):
            return False
        pool = to_map.pool
        pool.erase_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, pool, seg, mapped=False)
            rest.splice(to_map, to_map.next)
            pool.insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        pool.insert(to_map)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        """``try_allocate_expandable_block``."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        pool.erase(candidate)
        return candidate

    def _unmap_block(self, block: _Block) -> None:
        """``unmap_block``: unmap the whole pages inside a free block."""
        seg = block.segment
        offset = block.addr - seg.base
        begin = -(-offset // seg.page) * seg.page
        end = (offset + block.size) // seg.page * seg.page
        if begin >= end:
            return
        pool = block.pool
        pool.erase(block)
        before = begin - offset
        if before > 0:
            head = _Block(block.addr, before, pool, seg)
            head.splice(block.prev, block)
            pool.insert(head)
        after = block.size - before - (end - begin)
        if after > 0:
            tail = _Block(seg.base + end, after, pool, seg)
            tail.splice(block, block.next)
            pool.insert(tail)
        block.addr = seg.base + begin
        block.size = end - begin
        block.mapped = False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.insert_unmapped(block)
        self.reserved -= end - begin

    def _release_blocks(self, pool: _Pool) -> None:
        """``release_blocks``: free unsplit cached segments (``release_block``); unmap the
        free pages of expandable ones, dropping a segment left wholly unmapped
        (``release_expandable_segment``)."""
        to_unmap = []
        for _, addr in list(pool.keys):
            block = pool.free[addr]
            if block.segment is not None:
                to_unmap.append(block)
            elif not block.is_split():
                pool.erase(block)
                self.reserved -= block.size
        for block in to_unmap:
            self._unmap_block(block)
            if not block.is_split() and not block.mapped:
                pool.erase_unmapped(block)


# --------------------------------------------------------------------------- a simulated step


def record_step(step: Callable[[], None], *external) -> tuple[dict[str, MemoryPeak], Trace]:
    """Run ``step`` under a ``TraceRecorder``: ``simulate.track_peaks``'s per-device peaks
    and the allocation trace, from one run. ``external`` as ``track_peaks`` takes them."""
    recorder = TraceRecorder()
    if external:
        recorder.track_external(*external)
    with recorder:
        step()
    return peaks_by_device(recorder), recorder.trace


def replay(trace: Trace, device: str, expandable_segments: bool = True,
           capacity: int | None = None, per_stream: bool = True, device_bytes: int | None = None) -> ReplayResult:
    """``trace``'s events on ``device`` through a fresh ``CachingAllocatorModel`` (``device_bytes``:
    the device's total memory, which sizes an expandable segment's address space; default
    ``capacity``)."""
    return CachingAllocatorModel(expandable_segments, capacity, device_bytes).replay(trace.events, device, per_stream)


def allocator_peaks(step: Callable[[], None], *external, device: str, expandable_segments: bool = True,
                    capacity: int | None = None) -> tuple[int, int]:
    """(peak allocated, peak reserved) of ``device`` over ``step``, as the CUDA caching
    allocator would report them (``max_memory_allocated``, ``max_memory_reserved``).
    Raises ``AllocatorOOM`` if the modelled allocator runs out of ``capacity``."""
    _, trace = record_step(step, *external)
    result = replay(trace, device, expandable_segments, capacity)
    if result.oom:
        raise AllocatorOOM(result.oom)
    return result.peak_allocated, result.peak_reserved
