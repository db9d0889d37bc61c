"""bench.measure.fakeview: every view it makes directly is FakeTensorMode's own result, and anything else is
left to FakeTensorMode.

Each op of ``fakeview.VIEWS`` runs twice below a dispatch mode, as in a simulation: once through
``fakeview.call``, once passed on to ``FakeTensorMode``. The outputs must agree in everything a simulation
reads: type, fake mode, fake device, sizes, strides, storage offset, storage (the input's), dtype,
``requires_grad``; on contiguous and transposed inputs, on the CPU and meta devices. The figures of whole
simulations are checked by tests/bench/stackmodel/test_sim_equality.py.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from bench.measure import fakeview
from tests.bench.measure.fakemodes import PassOn, Through, facts

aten = torch.ops.aten

# (op, arguments after the viewed tensor); the tensor is [4, 6, 8] (or its transpose [8, 6, 4])
CASES = [
    (aten.view.default, ([4, 48],)),
    (aten.t.default, None),  # 2-D only: see _input
    (aten.transpose.int, (0, 2)),
    (aten.permute.default, ([2, 0, 1],)),
    (aten.slice.Tensor, (1, 1, 5, 2)),
    (aten.select.int, (1, 3)),
    (aten.detach.default, ()),
    (aten.alias.default, ()),
    (aten.as_strided.default, ([2, 3], [1, 2], 5)),
    (aten.expand.default, ([3, 4, 6, 8],)),
    (aten.unsqueeze.default, (1,)),
    (aten.squeeze.dim, (0,)),
    (aten.squeeze.dims, ([0, 1],)),
    (aten.split.Tensor, (2, 1)),
    (aten.split_with_sizes.default, ([1, 2, 3], 1)),
    (aten.unbind.int, (1,)),
    (aten.narrow.default, (2, 1, 3)),
    (aten.diagonal.default, (0, 0, 1)),
    (aten._unsafe_view.default, ([24, 8],)),
]


def _input(func, transposed: bool, device: str, requires_grad: bool) -> torch.Tensor:
    shape = [6, 8] if func is aten.t.default else [4, 6, 8]
    if transposed and func not in (aten.view.default, aten._unsafe_view.default):  # they need a contiguous input
        x = torch.empty(shape[::-1], device=device).transpose(0, -1)
    else:
        x = torch.empty(shape, device=device)
    if func in (aten.squeeze.dim, aten.squeeze.dims):
        x = x.unsqueeze(0).unsqueeze(0)[0]  # a size-1 dimension 0 (and one of size 1 at dimension 1 for dims)
        x = x.unsqueeze(1) if func is aten.squeeze.dims else x
    return x.requires_grad_(requires_grad)


@pytest.mark.parametrize("func,rest", CASES, ids=[str(f) for f, _ in CASES])
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
def test_a_direct_view_is_fake_tensor_modes_result(func, rest, device, transposed, requires_grad):
    assert func in fakeview.VIEWS
    with FakeTensorMode() as mode:
        x = _input(func, transposed, device, requires_grad)
        args = (x, *(rest or ()))
        with PassOn():
            want = func(*args)
        with Through(fakeview.call):
            got = func(*args)
    wants = [want] if isinstance(want, torch.Tensor) else list(want)
    gots = [got] if isinstance(got, torch.Tensor) else list(got)
    assert type(got) is type(want) and len(gots) == len(wants)
    for g, w in zip(gots, wants, strict=True):
        assert isinstance(g, FakeTensor) and g.fake_mode is mode
        assert facts(g) == facts(w)
        assert g.untyped_storage()._cdata == x.untyped_storage()._cdata  # a view: the input's storage


def test_every_listed_view_is_checked():
    assert {func for func, _ in CASES} == set(fakeview.VIEWS)
    for func in fakeview.VIEWS - {aten._unsafe_view.default}:  # _unsafe_view: a view autograd does not track
        assert func.is_view and torch.Tag.inplace_view not in func.tags, func


@pytest.mark.parametrize("why", ["not a view", "keyword arguments", "another fake mode", "a constant",
                                 "a mode in between", "no fake mode"])
def test_what_is_not_exactly_a_fake_view_goes_to_fake_tensor_mode(why):
    calls = []

    def op(*args, **kwargs):
        calls.append(why)
        return "passed on"

    class Op:  # an operator stand-in: fakeview.call looks it up in VIEWS, then calls it
        def __init__(self, func):
            self.func = func

        def __hash__(self):
            return hash(self.func)

        def __eq__(self, other):
            return self.func == other

        def __call__(self, *args, **kwargs):
            return op(*args, **kwargs)

    real = torch.zeros(4, 6)
    with FakeTensorMode() as mode:
        x = torch.empty(4, 6)
        func, args, kwargs, fake_mode = Op(aten.view.default), (x, [24]), {}, mode
        if why == "not a view":
            func, args = Op(aten.mul.Tensor), (x, x)
        elif why == "keyword arguments":
            func, args, kwargs = Op(aten.expand.default), (x, [2, 4, 6]), {"implicit": False}
        elif why == "another fake mode":
            fake_mode = FakeTensorMode()
        elif why == "a constant":
            x = mode.from_tensor(real, static_shapes=True)
            x.constant = real
            args = (x, [24])
        elif why == "no fake mode":
            fake_mode = None
        if why == "a mode in between":
            with PassOn():
                assert fakeview.call(func, args, kwargs, fake_mode) == "passed on"
        else:
            assert fakeview.call(func, args, kwargs, fake_mode) == "passed on"
    assert calls == [why]
