"""A fake tensor made as ``FakeTensor(fake_mode, elem, device)`` makes it, for a device a fake tensor already has.

The simulator's own routes (``fakeview``'s views, ``fakememo``'s replayed answers) make most of a simulated
step's fake tensors, each from a meta tensor and the device of a fake tensor that exists. ``FakeTensor.__new__``
spends most of its time on what such a call does not need: its keyword-argument checks, normalising the device
(``torch.device(value)``, an index for an indexed device, a GPU context made if an accelerator is present), and
five memo descriptors set through ``SymNumberMemoDescriptor.__set__``, three attributes each (what it cost:
results/speed/README.md). ``new_fake`` does what remains, in torch's order: the
subclass made with the device's dispatch keys, its mutable data pointer guarded as the mode says, and the
attributes ``__new__`` sets, set directly to the same values.

It takes only what that holds for: a device already normalised (a fake tensor's ``fake_device``), no accelerator
present (``init_gpu_context`` would make a tensor on it), and torch's fake-tensor debugging off (which records a
traceback per tensor); otherwise it calls ``FakeTensor`` itself. ``FakeTensor.__init__``, which Python would run
after ``__new__``, does nothing outside ``torch.export`` (it registers the tensor with export's leak detector),
which a simulation never runs. Tests compare its tensors with ``FakeTensor``'s, attribute by attribute.
"""
from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode, SymNumberMemoDescriptor

# the attributes FakeTensor.__new__ sets after the device and the mode, each to None: its arguments' defaults,
# then every memo's value, version counter and epoch (SymNumberMemoDescriptor.__set__ with None)
_MEMOS = [name for name, value in vars(FakeTensor).items() if isinstance(value, SymNumberMemoDescriptor)]
_NONE_STATE = dict.fromkeys(["constant", "pytype", "dispatch_keys", "real_tensor"]
                            + [f"_{m}{part}" for m in _MEMOS for part in ("", "_vc", "_epoch")])


@functools.cache
def _no_accelerator() -> bool:
    return torch.accelerator.current_accelerator(True) is None


def new_fake(fake_mode: FakeTensorMode, elem: torch.Tensor, device: torch.device) -> FakeTensor:
    """``FakeTensor(fake_mode, elem, device)`` for a meta ``elem`` and a ``device`` some fake tensor has."""
    if FakeTensorConfig.debug or not _no_accelerator():
        return FakeTensor(fake_mode, elem, device)
    out = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                      device_for_backend_keys=device)
    if not fake_mode._allow_unsafe_data_ptr_access:
        torch._C._set_throw_on_mutable_data_ptr(out)
    else:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
    state = out.__dict__
    state["_fake_device"] = device
    state["fake_mode"] = fake_mode
    state.update(_NONE_STATE)
    return out
