"""A store of named tensors that can live in host memory between uses (FPDT's chunk store).

Why it exists. A chunked method such as ``fpdt`` produces a tensor per sequence chunk (K, V,
Q, output, LSE, gradients) long before it uses most of them again. Keeping them on the
device would give back the memory the chunking saved, so they wait in host memory and
come back shortly before they are needed. Doing that well takes the same few steps every
time (pinned buffers, a side stream for the copies, ordering against the compute stream,
prefetch of the next chunk while the current one is used), so they live here once, apart
from the method's algorithm.

Where it runs:

* CUDA with ``offload``: ``put`` copies to pinned host memory on a side stream, after the
  compute stream's work that produced the tensor; ``prefetch`` allocates the device copy on the
  compute stream (so the caching allocator serves it from that stream's pool) and fills it on the
  side stream; ``get`` makes the compute stream wait for it. ``record_stream`` keeps the
  allocator from reusing a tensor's memory while the other stream still reads it.
* CPU: the tensor already is in host memory, so it is kept as it is and there is no side
  stream; the code path and the bookkeeping (which tests read) are the same.
* Simulation (``hostmem.simulated_host``, used by bench's simulated mode): the accelerator
  is a fake CPU device, so pinned memory and streams cannot be modelled with real ones.
  Host memory is the ``meta`` device instead: ``put`` moves the tensor there (the memory
  tracker counts it off the device) and ``get`` returns a fresh device tensor of the same
  shape, which is all a peak-memory simulation needs. Streams play no part: a simulation
  measures memory, not overlap.
* Without ``offload`` every tensor stays on its device: the store is then just a dict.

Lifetime between forward and backward (``hand_over``/``take_back``). A method's autograd
function must not keep the store alive through an attribute of its ``ctx``: under activation
checkpointing (``torch.utils.checkpoint``, non-reentrant, as the training step runs it) the
first forward of a block keeps its autograd graph but drops the tensors saved for backward, to
recompute them. Tensors reachable only from a ``ctx`` attribute escape that, so every
checkpointed layer's chunks would stay in host memory until its backward
(results/plan/README.md, section "Chunk stores"). ``hand_over`` gives the tensors to the
caller for ``ctx.save_for_backward`` and keeps weak references only, so the checkpoint
frees them; ``take_back`` restores them in the backward from ``ctx.saved_tensors``.

One side stream per device serves every store (``copy_stream``), not one per store. The CUDA
caching allocator keeps a pool per stream, and a store is made per forward call: with a stream
each, the prefetched chunks would be cached on up to 32 streams (PyTorch hands its pooled streams
out in turn), each keeping its own segment, as measured on an H100
(results/gpu/README.md, section "Chunk-store streams").
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Hashable

import torch

from . import hostmem

# (device, the stream constructor in effect) -> the stream. The constructor is part of the key because a
# simulation (bench.stackmodel.simcuda.runtime) puts its own in place for its duration: a stream made under one
# simulation is unknown to the next, which would key its copies as the default stream's. On real CUDA the
# constructor is torch.cuda.Stream itself, so there is one stream per device for the process.
_COPY_STREAMS: dict[tuple, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of ``device`` that every store copies on (see the module docstring)."""
    key = (device, torch.cuda.Stream)
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.cuda.Stream(device)
    return _COPY_STREAMS[key]


class ChunkStore:
    """Named tensors kept on the device, or in host memory with prefetch back (see the module docstring)."""

    def __init__(self, device: torch.device | str, offload: bool) -> None:
        self.device = torch.device(device)
        self.offload = offload
        cuda = offload and self.device.type == "cuda"
        self.stream = copy_stream(self.device) if cuda else None
        self._items: dict[Hashable, torch.Tensor] = {}
        self._ready: dict[Hashable, tuple[torch.Tensor, torch.cuda.Event]] = {}
        self._handed: dict[Hashable, weakref.ref] | None = None  # after hand_over: weak references only

    def hand_over(self) -> list[torch.Tensor]:
        """The held tensors, in ``keys()`` order, for the caller to save for backward
        (``ctx.save_for_backward``); the store keeps weak references only (module docstring)."""
        tensors = list(self._items.values())
        self._handed = {k: weakref.ref(t) for k, t in self._items.items()}
        self._items, self._ready = {}, {}
        return tensors

    def take_back(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        """Hold again the tensors ``hand_over`` gave out (as ``ctx.saved_tensors`` returns them)."""
        if self._handed is None or len(tensors) != len(self._handed):
            raise RuntimeError(f"take_back: expected the {len(self._handed or ())} tensors hand_over gave, got "
                               f"{len(tensors)}")
        self._items = dict(zip(self._handed, tensors, strict=False))
        self._handed = None

    def _held(self) -> dict[Hashable, torch.Tensor]:
        """The tensors held now: after ``hand_over``, those still alive elsewhere."""
        if self._handed is None:
            return self._items
        alive = ((k, r()) for k, r in self._handed.items())
        return {k: t for k, t in alive if t is not None}

    def _side(self) -> contextlib.AbstractContextManager:
        """The side stream's context on CUDA; a no-op elsewhere."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def put(self, key: Hashable, t: torch.Tensor) -> None:
        """Keep ``t`` under ``key`` (in host memory when offloading)."""
        self._ready.pop(key, None)
        if self.offload and hostmem.simulated() is not None:
            self._items[key] = hostmem.to_simulated_host(t)  # simulation: host memory is meta
            return
        if self.stream is None:
            self._items[key] = t
            return
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._side():
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # t's memory is not reused before the copy has read it
        self._items[key] = host

    def prefetch(self, key: Hashable) -> None:
        """Start bringing ``key`` back to the device on the side stream (CUDA only)."""
        if self.stream is None or key in self._ready or key not in self._items:
            return
        # the device copy is allocated on the compute stream and filled on the side stream: the caching
        # allocator keeps a pool per stream, and copies allocated on the side stream would be cached in
        # its own pool, which the compute stream never reuses (results/plan/README.md, section "Chunk stores").
        # The side stream first waits for the compute stream's work so far, which may still use the
        # memory the allocator just handed out.
        host = self._items[key]
        dev = torch.empty_like(host, device=self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._side():
            dev.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._ready[key] = (dev, done)

    def get(self, key: Hashable) -> torch.Tensor:
        """``key``'s tensor on the device, ready for the compute stream."""
        if self._items[key].device.type == "meta" and self.device.type != "meta":
            return hostmem.back_to(self._items[key], self.device)
        if self.stream is None:
            return self._items[key]
        self.prefetch(key)
        dev, done = self._ready.pop(key)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        dev.record_stream(current)
        return dev

    def pop(self, key: Hashable) -> None:
        """Forget ``key`` (its host copy and any prefetched device copy)."""
        self._items.pop(key, None)
        self._ready.pop(key, None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    # -- bookkeeping read by tests and reports (after hand_over: the tensors still alive)
    def in_host_memory(self, key: Hashable) -> bool:
        """Whether ``key`` is held as an offloaded copy in host memory."""
        return self.offload and self._held()[key].device.type in ("cpu", "meta")

    def location(self, key: Hashable) -> torch.device:
        return self._held()[key].device

    def is_pinned(self, key: Hashable) -> bool:
        return self._held()[key].is_pinned()

    def keys(self) -> list[Hashable]:
        return list(self._held())

    def host_bytes(self) -> int:
        """Bytes held in host memory (offloaded copies only)."""
        return sum(t.numel() * t.element_size() for k, t in self._held().items() if self.in_host_memory(k))
