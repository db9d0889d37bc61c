"""Views of fake tensors made directly: FakeTensorMode's own result for them, without its cache.

Why: a ``FakeTensorMode`` cache hit costs as much for a view as for any operator (the cache key from
every argument's metadata, then a new fake tensor built from the entry), and views are a large share
of the operators a simulated step sends to it (the measurements: results/speed/README.md). A view
needs neither: its output is its input's storage seen with other sizes and strides, which the op's
meta kernel computes in a few microseconds. ``call`` does for the views in ``VIEWS`` what
``FakeTensorMode`` does when its cache misses on one: the meta kernel inside
``in_kernel_invocation_manager`` (the fake input taken as the meta tensor it wraps), each output
wrapped as a ``FakeTensor`` of that mode on the input's fake device (``fakenew.new_fake``). It skips
the cache key and the entry, not a step of the result.

It applies only where that is exactly what ``FakeTensorMode`` would return: an op of ``VIEWS``
(out-of-place views whose only tensor argument is the viewed one: no ``inplace_view`` op, no
constant propagation), no keyword arguments, an input that is a ``FakeTensor`` of the active fake
mode with no constant, and that fake mode the only dispatch mode below the caller. Everything else
goes to ``func(*args, **kwargs)``. ``tests/bench/measure/test_fakeview.py`` compares every op of
``VIEWS`` with ``FakeTensorMode``'s result (sizes, strides, offset, storage, dtype, device,
``requires_grad``); the simulation equality test (``tests/bench/stackmodel/test_sim_equality.py``)
checks that the figures do not move.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

from .fakenew import new_fake

aten = torch.ops.aten

# out-of-place views with one tensor argument (the viewed one); the ops a simulated step makes most
VIEWS = frozenset({
    aten.view.default, aten.t.default, aten.transpose.int, aten.permute.default, aten.slice.Tensor,
    aten.select.int, aten.detach.default, aten.alias.default, aten.as_strided.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.narrow.default, aten.diagonal.default,
    # a view autograd does not track as one (reshape's): its output aliases its input all the same, and
    # FakeTensorMode runs its whole dispatch for it every time (its cache bypasses "unsafe view")
    aten._unsafe_view.default,
})


def call(func, args: tuple, kwargs: dict, fake_mode: FakeTensorMode | None) -> Any:
    """``func(*args, **kwargs)`` below a dispatch mode whose next mode is ``fake_mode`` (the active
    ``FakeTensorMode``, or None): a view of ``VIEWS`` made directly, as the module says; else the op."""
    if func in VIEWS and not kwargs and fake_mode is not None:
        x = args[0]
        if (type(x) is FakeTensor and x.fake_mode is fake_mode and x.constant is None
                and torch._C._len_torch_dispatch_stack() == 1
                and not any(isinstance(a, torch.Tensor) for a in args[1:])):
            with in_kernel_invocation_manager(fake_mode):
                out = func(*args)
            device = x.fake_device
            if isinstance(out, torch.Tensor):
                return new_fake(fake_mode, out, device)
            return type(out)(new_fake(fake_mode, t, device) for t in out)
    return func(*args, **kwargs)
