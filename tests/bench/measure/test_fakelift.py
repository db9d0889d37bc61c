"""bench.measure.fakelift: a plain host tensor lifted into the simulation (``torch.tensor(values)``) is the fake
tensor ``FakeTensorMode`` makes of it, recorded in the same memos, and a constant's value read back is the same
number; every case it does not take is left to ``FakeTensorMode``."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import bench  # noqa: F401  (the simulated CUDA device)
from bench.measure import fakelift, fakeroute
from tests.bench.measure.fakemodes import PassOn, Through, facts


def _facts_but_the_mode(t: FakeTensor) -> tuple:
    return (*facts(t)[2:], torch._C._dispatch_keys(t), t.is_leaf, t.is_inference(), t._is_view())


def _lift_both(make):
    """``make()`` under the fake mode, once through ``fakeroute.call`` and once through ``FakeTensorMode`` alone,
    each in a mode of its own (the answers then name their modes, which are compared by position)."""
    answers = []
    for above in (Through(fakeroute.call), PassOn()):
        mode = FakeTensorMode()
        with mode, above:
            answers.append((mode, make()))
    return answers


PLAIN = {
    "int64 indices": lambda: torch.tensor([3, 1, 2, 0, 7, 5, 4, 6]),
    "a constant (one element)": lambda: torch.tensor([5]),
    "a float scalar constant (Adam's step)": lambda: torch.tensor(0.0, dtype=torch.float32),
    "an int scalar constant": lambda: torch.tensor(3),
    "int32 offsets": lambda: torch.tensor([0, 128, 512], dtype=torch.int32),
    "float matrix": lambda: torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
    "bfloat16": lambda: torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16),
}


@pytest.mark.parametrize("make", PLAIN.values(), ids=PLAIN.keys())
def test_a_plain_host_tensor_is_lifted_as_fake_tensor_mode_lifts_it(make):
    (ours_mode, ours), (theirs_mode, theirs) = _lift_both(make)
    assert type(ours) is type(theirs) is FakeTensor
    assert ours.fake_mode is ours_mode and theirs.fake_mode is theirs_mode
    replaced = [(k, v if v is not ours_mode else "mode") for k, v in ours.__dict__.items()]
    assert replaced == [(k, v if v is not theirs_mode else "mode") for k, v in theirs.__dict__.items()]
    assert _facts_but_the_mode(ours) == _facts_but_the_mode(theirs)
    if theirs.constant is not None:  # a copy of the data, its own, and registered as the mode registers it
        assert ours.constant is not None and torch.equal(ours.constant, theirs.constant)
        for mode, fake in ((ours_mode, ours), (theirs_mode, theirs)):
            mapping = mode.fake_tensor_converter.constant_storage_mapping
            assert [[ref() for ref in refs] for refs in mapping.values()] == [[fake]]


def test_a_constant_is_lifted_here_and_invalidated_by_a_write_as_fake_tensor_modes_is():
    """A one-element tensor is made here too, with its constant; written to by an operator whose result cannot
    be known (a random fill), the constant is dropped, as the mode drops its own; added to, it is propagated."""
    mode = FakeTensorMode()
    real = torch.tensor([2.0])
    with mode:
        made = fakelift.lifted((real,), {}, mode)
    assert made is not None and made.constant is not None and made.constant is not real
    with mode, Through(fakeroute.call):
        step = torch.tensor(1.0)
        step.add_(1)
        assert step.item() == 2.0
        step.uniform_()
        assert step.constant is None


def test_the_lift_is_made_here_and_recorded_in_the_converters_memos():
    """Not a vacuous equality: ``lifted`` answers the plain case itself, and the same real tensor lifted again
    (a lift called by hand) is the same fake tensor, as the converter's memo makes it."""
    mode = FakeTensorMode()
    real = torch.arange(6)
    with mode:
        made = fakelift.lifted((real,), {}, mode)
    assert made is not None
    converter = mode.fake_tensor_converter
    assert converter._get_memo(real) is made
    with mode, Through(fakeroute.call):
        assert torch.ops.aten.lift_fresh.default(real) is made
    storage_id = converter.meta_converter.describer.lookup_storage.get(real.untyped_storage())
    assert storage_id is not None


LEFT = {
    "requires grad": lambda: torch.tensor([1.0, 2.0], requires_grad=True),
    "a view": lambda: torch.arange(8)[2:],
    "conjugate": lambda: torch.tensor([1 + 2j, 3 - 1j]).conj(),
}


@pytest.mark.parametrize("make", LEFT.values(), ids=LEFT.keys())
def test_other_tensors_are_left_to_fake_tensor_mode(make):
    real = make()
    mode = FakeTensorMode()
    with mode:
        assert fakelift.lifted((real,), {}, mode) is None


def test_a_tensor_whose_storage_a_fake_tensor_already_shares_is_left_to_fake_tensor_mode():
    mode = FakeTensorMode()
    base = torch.arange(10)
    whole = mode.fake_tensor_converter.from_real_tensor(mode, base)
    twin = torch.empty(0, dtype=base.dtype).set_(base.untyped_storage(), 0, (10,), (1,))  # not a view
    with mode:
        assert fakelift.lifted((twin,), {}, mode) is None
    theirs = mode.fake_tensor_converter.from_real_tensor(mode, twin)
    assert theirs.untyped_storage()._cdata == whole.untyped_storage()._cdata


def test_other_modes_or_a_shape_environment_leave_the_lift_to_fake_tensor_mode():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    real = torch.arange(4)
    with FakeTensorMode(shape_env=ShapeEnv()) as symbolic:
        assert fakelift.lifted((real,), {}, symbolic) is None
    mode = FakeTensorMode()
    with mode, PassOn():  # a second mode below the caller
        assert fakelift.lifted((real,), {}, mode) is None
    with mode, torch.inference_mode():
        assert fakelift.lifted((real,), {}, mode) is None


ITEMS = {
    "a float step": lambda: torch.tensor(3.0).item(),
    "an int": lambda: torch.tensor(7).item(),
    "after an in-place add (constant propagated)": lambda: torch.tensor(1.0).add_(2).item(),
    "a bool": lambda: torch.tensor(True).item(),
}


@pytest.mark.parametrize("make", ITEMS.values(), ids=ITEMS.keys())
def test_a_constants_value_is_read_as_fake_tensor_mode_reads_it(make):
    (_, ours), (_, theirs) = _lift_both(make)
    assert type(ours) is type(theirs) and ours == theirs


def test_a_constants_value_is_read_here_and_a_tensor_without_one_is_left():
    mode = FakeTensorMode()
    with mode:
        step = torch.tensor(4.0)
        plain = torch.empty(1)
        assert fakelift.constant_item((step,), {}, mode) == 4.0
        assert fakelift.constant_item((plain,), {}, mode) is fakelift.NOT_HERE
        assert fakelift.constant_item((step,), {}, FakeTensorMode()) is fakelift.NOT_HERE  # another mode's
        with PassOn():  # a second mode below the caller
            assert fakelift.constant_item((step,), {}, mode) is fakelift.NOT_HERE
