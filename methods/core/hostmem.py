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


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory, wherever that is: the stand-in device under simulation, ``t`` itself when it
    is already on the CPU, else a pinned copy started on the current stream (non-blocking). A method
    offloads through this without knowing whether it is simulated."""
    if _SIMULATED is not None:
        return to_simulated_host(t)
    if t.device.type == "cpu":
        return t
    host = torch.empty_like(t, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor that :func:`to_host` moved, back on ``device``."""
    if t.device == device:
        return t
    if t.device.type == "meta":
        return back_to(t, device)
    return t.to(device, non_blocking=True)


def back_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A simulated host copy brought back to ``device`` (values do not matter in simulation)."""
    return torch.empty_like(t, device=device)
