"""Ulysses with the attention block's saved activations offloaded to host memory.

The forward of ``Ulysses`` runs unchanged inside ``torch.autograd.graph.saved_tensors_hooks``:
each tensor autograd saves for backward passes through ``_pack``, which moves the chosen ones
to host memory (pinned buffers, ``non_blocking`` copies on the current stream on CUDA, so the
copy is ordered before any reuse of the device memory), and ``_unpack`` brings them back to
their device when backward needs them. Which tensors are moved (option ``what``):

* ``"all"``: every saved tensor of at least ``min_bytes`` bytes (block input, projections,
  Q/K/V and output in head layout, the kernel's LSE, ...). Parameters and views of them are
  never moved: they stay on the device for the optimizer anyway.
* ``"attention"``: only what the attention kernel saves, i.e. q, k, v, out and lse in head
  layout (the largest activations of the block), whatever their size. They are recognised
  by identity: the block's kernel is wrapped so that each forward records the tensors it
  received and returned, and ``_pack`` moves exactly those.

On CPU the tensors already are in host memory: nothing is copied, but the same hooks run and
``stats`` (tensors and bytes passed to host storage in the latest forward) is kept the same
way, which is what the tests observe.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .core import hostmem
from .core.base import MethodOptions
from .core.documents import Documents
from .core.registry import register
from .core.spec import AttnSpec
from .ulysses import Ulysses

WHAT = ("all", "attention")


@dataclass(frozen=True)
class OffloadOptions(MethodOptions):
    what: str = "all"  # "all": every saved tensor >= min_bytes; "attention": the kernel's q, k, v, out, lse
    min_bytes: int = 4096  # with what="all", smaller saved tensors stay on the device


@dataclass
class OffloadStats:
    """What the latest forward sent to host memory and what it kept on the device."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    kept_tensors: int = 0
    host_devices: tuple = ()  # devices of the host copies (always ("cpu",) when anything moved)


class _RecordingKernel:
    """Wraps a kernel and records the tensors each forward call uses (they are what its
    autograd function saves), so that only those are offloaded with ``what="attention"``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.recorded: list[torch.Tensor] = []

    def forward(self, q, k, v, causal, scale, **mask):
        out, lse = self.inner.forward(q, k, v, causal, scale, **mask)
        self.recorded.extend((q, k, v, out, lse))
        return out, lse

    def backward(self, *args, **mask):
        return self.inner.backward(*args, **mask)


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


@register("offload", "Ulysses with the block's saved activations offloaded to host memory (saved-tensor hooks)")
class OffloadUlysses(Ulysses):
    rank_symmetric_reason = ("Ulysses' all-to-all gives every rank the whole sequence on H/C heads, and every rank "
                             "offloads the same saved tensors")
    Options = OffloadOptions

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: OffloadOptions) -> None:
        super().validate(spec, world_size, options)
        if options.what not in WHAT:
            raise ValueError(
                f"offload: what={options.what!r} is not one of {WHAT}: 'all' offloads every saved "
                f"tensor of at least min_bytes, 'attention' only the attention kernel's q, k, v, out, lse"
            )
        mb = options.min_bytes
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
            raise ValueError(f"offload: min_bytes={mb!r} must be an int >= 0 (bytes)")

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        if self.options.what == "attention":
            self.kernel = _RecordingKernel(self.kernel)
        self.stats = OffloadStats()

    def _wanted(self, t: torch.Tensor) -> bool:
        if self.options.what == "attention":
            return any(t is r for r in self.kernel.recorded)
        return not _is_parameter(t) and t.numel() * t.element_size() >= self.options.min_bytes

    def _pack(self, t: torch.Tensor):
        if not self._wanted(t):
            self.stats.kept_tensors += 1
            return None, t
        host = hostmem.to_host(t)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += t.numel() * t.element_size()
        if host.device.type not in self.stats.host_devices:
            self.stats.host_devices += (host.device.type,)
        return t.device, host

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        device, t = packed
        return t if device is None else hostmem.to_device(t, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        self.stats = OffloadStats()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return super().forward(x, positions, docs)
        finally:
            if isinstance(self.kernel, _RecordingKernel):
                self.kernel.recorded.clear()
