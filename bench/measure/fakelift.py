"""Host data under simulation, answered as ``FakeTensorMode`` answers it: a tensor made from Python data, and a
constant's value read back.

A tensor made from Python data (``torch.tensor(values)``) is made real on the host below the dispatch modes and then
lifted (``aten.lift_fresh``) into them. UPipe's and FPDT's index tensors (``methods.core.base.index_tensor``: one
per stage, layer and pass) are made this way (how many, and what they cost: results/speed/README.md).
``FakeTensorMode`` refuses to cache a lift and converts the real tensor with
``FakeTensorConverter.from_real_tensor``, whose ``MetaConverter`` first describes every property of the tensor
(``describe_tensor``) and then walks the cases of its conversion. For a plain host tensor (strided, dense, not a
view, no gradient, not conjugate or negative, no functorch or functionalization around it) the answer is a fake
tensor of the real one's sizes, strides and dtype on its device, over a meta storage of its own, recorded in the
converter's memos of tensors and storages. ``lifted`` makes exactly that: the converter's own memo is looked up
first, and where the real tensor's storage is already known (another fake shares it) the conversion is left to
``FakeTensorMode``. A tensor of at most ``CONSTANT_NUMEL_LIMIT`` elements (Adam's step counts,
``torch.tensor(0.0)``, one per parameter) the mode lifts as a constant: it copies the real tensor, converts the copy
the same way and keeps it as the fake tensor's ``constant`` (``.item()`` is answered from it, an operator that
writes to it unknowably drops it), registered in the converter's map of constant storages; ``lifted`` does the same.

A constant's value read back (``.item()``: ``aten._local_scalar_dense``; Adam reads every parameter's step
count each step) goes through ``FakeTensorMode``'s whole dispatch, its cache refused ("data dependent output"),
to its constant propagation, which runs the operator on the constant with dispatch disabled. ``constant_item``
does that directly, where the mode would reach that branch: a fake tensor of the mode with a constant and no
symbolic size.

``bench.measure.fakeroute.call`` sends both here; tests compare every answer with ``FakeTensorMode``'s.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import CONSTANT_NUMEL_LIMIT, FakeTensor, FakeTensorMode

from .fakememo import rebuild

LIFT = torch.ops.aten.lift_fresh.default
ITEM = torch.ops.aten._local_scalar_dense.default


def _plain_mode(fake_mode: FakeTensorMode) -> bool:
    """Nothing that changes a conversion: no shape environment, no real data copied, no functorch transform or
    functionalization active, not in inference mode, and that mode the only one below."""
    return (fake_mode.shape_env is None and not fake_mode.propagate_real_tensors
            and torch._C._len_torch_dispatch_stack() == 1
            and torch._C._functorch.peek_interpreter_stack() is None
            and not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.Functionalize)
            and not torch.is_inference_mode_enabled())


def _plain_host(t: Any) -> bool:
    """A plain dense host tensor, which ``MetaConverter`` converts by its dense, non-view case."""
    return (type(t) is torch.Tensor and t.device.type == "cpu" and t.layout is torch.strided
            and not t.requires_grad and t.grad is None
            and not t.is_quantized and not t.is_nested and not t.is_mkldnn and not t._is_view()
            and t.storage_offset() == 0 and not t.is_conj() and not t.is_neg() and not t.is_inference()
            and not torch._C._functorch.is_functorch_wrapped_tensor(t)
            and not torch._C._functorch.is_legacy_batchedtensor(t)
            and not getattr(t, "_is_buffer", False))


def lifted(args: tuple, kwargs: dict, fake_mode: FakeTensorMode | None) -> FakeTensor | None:
    """``FakeTensorMode``'s answer to ``lift_fresh(t)`` for a plain host tensor ``t`` (module docstring), or
    None where it is not made here."""
    if fake_mode is None or kwargs or len(args) != 1 or not _plain_host(args[0]) or not _plain_mode(fake_mode):
        return None
    t = args[0]
    if t.numel() <= CONSTANT_NUMEL_LIMIT:  # the mode lifts a copy of it, kept as the fake tensor's constant
        with torch._C._DisableTorchDispatch():  # the lift run on the real tensor, then copied (torch: no_dispatch)
            constant = LIFT(t).clone()
        return _fake_of(constant, fake_mode, constant=constant)
    known = fake_mode.fake_tensor_converter._get_memo(t)
    return known if known is not None else _fake_of(t, fake_mode)


def _fake_of(t: torch.Tensor, fake_mode: FakeTensorMode, constant: torch.Tensor | None = None) -> FakeTensor | None:
    """``from_real_tensor(fake_mode, t, make_constant=constant is not None)`` for a plain host tensor not yet
    converted: a fake tensor of its sizes, strides and dtype on its device over a meta storage of its own,
    recorded in the converter's memos of storages and tensors (and its constants, for one); None where another
    fake tensor shares its storage."""
    converter = fake_mode.fake_tensor_converter
    metas = converter.meta_converter
    storage_id = metas.describer.get_storage_id(t.untyped_storage())
    if storage_id in metas.storage_memo:  # another fake tensor shares its storage: torch's conversion
        return None
    # not conjugate or negative, no gradient (_plain_host)
    out = rebuild((t.shape, t.stride(), t.dtype, torch.strided, False, False, False, t.device), fake_mode)
    metas.storage_memo[storage_id] = out.untyped_storage()
    converter.set_tensor_memo(t, out)
    if constant is not None:
        out.constant = constant  # FakeTensor(..., constant=constant) sets it in the same place
        converter.add_constant_storage_mapping(out)
    return out


NOT_HERE = object()  # constant_item's answer where the value is not read here


def constant_item(args: tuple, kwargs: dict, fake_mode: FakeTensorMode | None) -> Any:
    """``FakeTensorMode``'s answer to ``_local_scalar_dense(t)`` for a fake tensor with a constant (module
    docstring), or ``NOT_HERE``."""
    if fake_mode is None or kwargs or len(args) != 1:
        return NOT_HERE
    t = args[0]
    if (type(t) is not FakeTensor or t.fake_mode is not fake_mode or t.constant is None
            or t._has_symbolic_sizes_strides or fake_mode.shape_env is not None
            or torch._C._len_torch_dispatch_stack() != 1):  # another mode below would see the operator
        return NOT_HERE
    with torch._C._DisableTorchDispatch():
        return ITEM(t.constant)

