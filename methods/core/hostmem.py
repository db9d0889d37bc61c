"""Where "host memory" is, for the methods that offload to it (``offload``, ``fpdt``).

Normally the CPU. Under simulation the accelerator itself is a fake CPU device, so host
memory is modelled by the ``meta`` device instead: bench's simulated mode enters
``simulated_host()``, offloaded tensors then leave the tracked device (MemTracker counts
them under ``meta``) and come back as fresh device tensors of the same shape, which is
all a simulation needs. Outside simulation nothing here changes a method's behaviour.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SIMULATED: torch.device | None = None


def simulated() -> torch.device | None:
    """The device standing in for host memory in a simulation, or ``None`` (real run)."""
    return _SIMULATED


@contextlib.contextmanager
def simulated_host(device: str = "meta") -> Iterator[None]:
    global _SIMULATED
    previous, _SIMULATED = _SIMULATED, torch.device(device)
    try:
        yield
    finally:
        _SIMULATED = previous


def to_simulated_host(t: torch.Tensor) -> torch.Tensor:
    return t.to(_SIMULATED)


def back_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A simulated host copy brought back to ``device`` (values do not matter in simulation)."""
    return torch.empty_like(t, device=device)
