"""bench.measure.foreachnew: an out-of-place foreach operator's answer, asked of FakeTensorMode once per distinct
element, is FakeTensorMode's whole answer: at every index a new tensor of the same sizes, strides, dtype,
device and storage size; and the calls it does not take are asked whole."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import bench  # noqa: F401  (the simulated CUDA device)
from bench.measure import fakeroute, foreachnew
from tests.bench.measure.fakemodes import PassOn, Through, facts

aten = torch.ops.aten

# a layer's parameter shapes repeated over three layers, one transposed, and one in another dtype
SHAPES = [[8, 4], [4], [4, 8]] * 3


def _tensors(dtype=torch.float32) -> list:
    out = [torch.empty(s, dtype=dtype, device="cuda") for s in SHAPES]
    out[2] = torch.empty([8, 4], dtype=dtype, device="cuda").t()  # a non-contiguous element
    out[-1] = torch.empty(SHAPES[-1], dtype=torch.bfloat16, device="cuda")
    return out


CALLS = {
    "sqrt (Adam's)": lambda xs, ys: (aten._foreach_sqrt.default, (xs,), {}),
    "add Scalar": lambda xs, ys: (aten._foreach_add.Scalar, (xs, 2), {}),
    "add List with alpha": lambda xs, ys: (aten._foreach_add.List, (xs, ys), {"alpha": 0.5}),
    "div ScalarList": lambda xs, ys: (aten._foreach_div.ScalarList, (xs, [1.0, 2.0, 3.0] * 3), {}),
    "mul ScalarList of ints": lambda xs, ys: (aten._foreach_mul.ScalarList, (xs, [2] * 9), {}),
    "norm": lambda xs, ys: (aten._foreach_norm.Scalar, (xs, 2), {}),
    "lerp": lambda xs, ys: (aten._foreach_lerp.Scalar, (xs, ys, 0.1), {}),
    "addcdiv": lambda xs, ys: (aten._foreach_addcdiv.Scalar, (xs, ys, ys, 0.1), {}),
}


@pytest.mark.parametrize("make", CALLS.values(), ids=CALLS.keys())
def test_an_out_of_place_foreach_answer_is_fake_tensor_modes_whole_answer(make):
    with FakeTensorMode() as mode:
        xs, ys = _tensors(), _tensors()
        func, args, kwargs = make(xs, ys)
        assert foreachnew._returns_new_list(func)
        with PassOn():
            want = func(*args, **kwargs)
        with Through(fakeroute.call):
            got = func(*args, **kwargs)
        made = foreachnew.answer(func, args, kwargs)
    assert made is not None  # not a vacuous comparison: the reduced route answers these
    for answer in (got, made):
        assert type(answer) is list and len(answer) == len(want)
        assert [facts(t) for t in answer] == [facts(t) for t in want]
        assert all(t.fake_mode is mode for t in answer)
        inputs = {t.untyped_storage()._cdata for t in (*xs, *ys)}
        storages = [t.untyped_storage()._cdata for t in answer]
        assert len(set(storages)) == len(answer) and not set(storages) & inputs  # each new, on its own


def test_other_calls_are_asked_whole():
    assert not foreachnew._returns_new_list(aten._foreach_add_.Scalar)  # in place
    assert not foreachnew._returns_new_list(aten.add.Tensor)
    with FakeTensorMode():
        distinct = [torch.empty([n], device="cuda") for n in range(1, 5)]
        assert foreachnew.answer(aten._foreach_sqrt.default, (distinct,), {}) is None  # nothing to share
        xs = _tensors()
        assert foreachnew.answer(aten._foreach_add.List, (xs, xs[:-1]), {}) is None  # lists of unequal length
        tensor_scalar = torch.empty([], device="cuda")
        made = foreachnew.answer(aten._foreach_mul.Tensor, (xs, tensor_scalar), {})  # a tensor shared by all
        with PassOn():
            want = aten._foreach_mul.Tensor(xs, tensor_scalar)
        assert [facts(t) for t in made] == [facts(t) for t in want]


def test_a_call_fake_tensor_mode_refuses_is_refused():
    """An element that does not broadcast is its own distinct element, asked of FakeTensorMode, which refuses it."""
    with FakeTensorMode():
        xs, ys = _tensors(), _tensors()
        ys[4] = torch.empty([5], device="cuda")  # against a [4]
        for above in (PassOn(), Through(fakeroute.call)):
            with above, pytest.raises(RuntimeError):
                aten._foreach_add.List(xs, ys)
