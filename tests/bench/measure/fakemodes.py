"""Dispatch modes for the tests of bench.measure.fakeview and fakememo: each sits where the simulation's peak
tracker sits (just above ``FakeTensorMode``), one sending every operator through a given ``call`` as the
tracker does, the other passing it on to ``FakeTensorMode``, so the two answers can be compared."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode


class Through(TorchDispatchMode):
    """Every operator through ``call(func, args, kwargs, fake_mode)``, as ``bench.measure.simulate.PeakTracker``
    sends it (``fakeview.call``, ``fakememo.call``)."""

    def __init__(self, call: Callable) -> None:
        super().__init__()
        self.call = call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.call(func, args, kwargs or {}, active_fake_mode())


class PassOn(TorchDispatchMode):
    """The same place in the dispatch, every operator passed on to FakeTensorMode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def facts(t: torch.Tensor) -> tuple:
    """What a simulation reads of a fake tensor: type, fake mode and device, sizes, strides, offset, storage size,
    dtype, ``requires_grad``, conjugate and negative bits."""
    return (type(t), t.fake_mode, t.fake_device, tuple(t.shape), t.stride(), t.storage_offset(),
            t.untyped_storage().nbytes(), t.dtype, t.requires_grad, t.is_conj(), t.is_neg())
