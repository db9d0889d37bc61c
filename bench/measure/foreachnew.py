"""An out-of-place foreach operator's new tensors, asked of ``FakeTensorMode`` once per distinct element.

Adam's multi-tensor step sends ``_foreach_sqrt`` over every parameter's second moment (what it cost:
results/speed/README.md). ``FakeTensorMode`` never caches an operator that returns a list ("non-FakeTensor output"):
each call builds a cache key over every tensor of the lists, runs the operator's meta kernel on each index and makes
each output a fake tensor on the device of that index's tensors (``foreach_run_and_map_input_device``). What it
makes at an index depends only on the lists' elements at that index: their sizes, strides, dtypes and devices, and
the numbers of a list of scalars. A model's parameters have a few distinct shapes, repeated per layer.

``answer`` asks ``FakeTensorMode`` for the operator on the first index of each distinct element (every list
reduced alike, so any check across the lists sees the same distinct elements) and makes every index's tensor
as torch makes a cached output from its metadata (``fakememo.rebuild``), from its representative's answer.
It takes an aten foreach operator that returns a new list and writes nothing, on a plain call whose arguments
are lists of one length (fake tensors or numbers) and numbers; it checks that each answer is a tensor of its own
over a storage of exactly its span, which a rebuilt tensor has; otherwise, or where every element is distinct,
the operator is asked whole. Tests compare its answers with ``FakeTensorMode``'s for Adam's and other foreach
operators over mixed shapes, strides and dtypes.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._prims_common import compute_required_storage_length
from torch._subclasses.fake_tensor import FakeTensor

from .fakememo import metadata, rebuild
from .foreachprop import representatives

_NEW_LIST: dict = {}  # operator -> _returns_new_list(operator)


def _returns_new_list(func) -> bool:
    """Whether ``func`` is an aten foreach operator that returns one new list of tensors and writes nothing."""
    known = _NEW_LIST.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = _NEW_LIST[func] = (
            isinstance(func, torch._ops.OpOverload) and func.name().startswith("aten::_foreach_")
            and len(schema.returns) == 1 and str(schema.returns[0].type) == "List[Tensor]"
            and schema.returns[0].alias_info is None
            and not any(a.alias_info is not None for a in schema.arguments))
    return known


def _element(value: Any) -> tuple | None:
    """What the operator's answer at an index can depend on of one list's element there; None if not plain."""
    if type(value) is FakeTensor:
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.fake_device,
                value.requires_grad, value.is_conj(), value.is_neg())
    if type(value) in (int, float, bool):
        return type(value), value
    return None


def answer(func, args: tuple, kwargs: dict) -> list | None:
    """The operator's list of new tensors, asked of ``FakeTensorMode`` once per distinct element (module
    docstring), or None where it is to be asked whole. The caller has checked the call is plain."""
    if not _returns_new_list(func):
        return None
    lists = [a for a in (*args, *kwargs.values()) if type(a) in (list, tuple)]
    if not lists or any(len(a) != len(lists[0]) for a in lists):
        return None
    keys = [tuple(_element(e) for e in elements) for elements in zip(*lists, strict=True)]
    if any(None in key for key in keys):
        return None
    firsts, index = representatives(keys)
    if len(firsts) == len(keys):
        return None

    def reduced(a: Any) -> Any:
        return [a[i] for i in firsts] if type(a) in (list, tuple) else a

    asked = func(*[reduced(a) for a in args], **{k: reduced(a) for k, a in kwargs.items()})
    if type(asked) is not list or len(asked) != len(firsts) or not all(_own_span(t) for t in asked):
        return None
    made = [metadata(t) for t in asked]
    return [rebuild(made[place], asked[0].fake_mode) for place in index]


def _own_span(t: Any) -> bool:
    """A fake tensor at offset 0 of a storage of exactly its span, as a tensor rebuilt from its metadata has."""
    if type(t) is not FakeTensor or t.storage_offset() != 0:
        return False
    span = compute_required_storage_length(t.shape, t.stride(), 0)
    return t.untyped_storage().nbytes() == span * t.element_size()

