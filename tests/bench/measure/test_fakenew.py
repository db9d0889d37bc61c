"""bench.measure.fakenew: ``new_fake`` makes the fake tensor ``FakeTensor(fake_mode, elem, device)`` makes, for a
device a fake tensor has: the same class, attributes (in the same order), dispatch keys, metadata and guard on
its data pointer; and it leaves the cases it does not take to ``FakeTensor``."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import bench  # noqa: F401  (the simulated CUDA device)
from bench.measure import fakenew


def _facts(t: FakeTensor) -> tuple:
    return (type(t), list(t.__dict__.items()), torch._C._dispatch_keys(t), t.device, t.shape, t.stride(), t.dtype,
            t.requires_grad, t.is_leaf, t.storage_offset())


CASES = [("cuda:0", False, torch.float32), ("cuda:0", True, torch.bfloat16), ("cpu", False, torch.int64),
         ("cpu", True, torch.float32)]


@pytest.mark.parametrize("device,requires_grad,dtype", CASES, ids=[f"{d}-{g}-{t}" for d, g, t in CASES])
@pytest.mark.parametrize("unsafe_data_ptr", [False, True], ids=["guarded", "unsafe-data-ptr"])
def test_new_fake_is_fake_tensors_own(device, requires_grad, dtype, unsafe_data_ptr):
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    mode._allow_unsafe_data_ptr_access = unsafe_data_ptr
    with mode:
        existing = torch.empty(2, device=device)

    def elem() -> torch.Tensor:  # one each: the data pointer's guard is set on the storage
        return torch.empty_strided((4, 3), (1, 4), dtype=dtype, device="meta", requires_grad=requires_grad)

    ours = fakenew.new_fake(mode, elem(), existing.fake_device)
    theirs = FakeTensor(mode, elem(), existing.fake_device)
    assert _facts(ours) == _facts(theirs)
    assert ours._nonzero_memo is None and ours.item_memo is None  # the descriptors read what was set
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _data_ptr_refused(ours) == _data_ptr_refused(theirs) == (not unsafe_data_ptr)


def _data_ptr_refused(t: FakeTensor) -> bool:
    """Whether its storage's data pointer is refused (the mode's guard); where the mode allows it, torch warns
    once per process, which is not observable twice, so only the refusal is compared."""
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return True
    return False


def test_it_leaves_debugging_and_an_accelerator_to_fake_tensor(monkeypatch):
    mode = FakeTensorMode()
    elem = torch.empty(3, device="meta")
    made = []
    original = fake_tensor.FakeTensor.__new__
    monkeypatch.setattr(fake_tensor.FakeTensor, "__new__",
                        staticmethod(lambda *a, **k: made.append(1) or original(*a, **k)))
    fakenew.new_fake(mode, elem, torch.device("cpu"))
    assert not made
    monkeypatch.setattr(fake_tensor.FakeTensorConfig, "debug", True)
    fakenew.new_fake(mode, elem, torch.device("cpu"))
    assert len(made) == 1
    monkeypatch.setattr(fake_tensor.FakeTensorConfig, "debug", False)
    monkeypatch.setattr(fakenew, "_no_accelerator", lambda: False)
    fakenew.new_fake(mode, elem, torch.device("cpu"))
    assert len(made) == 2
