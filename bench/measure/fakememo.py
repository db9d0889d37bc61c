"""FakeTensorMode's cache hits, replayed from a cheaper key.

Why: most of a ``FakeTensorMode`` cache hit is building the cache key, every argument's whole metadata
flattened through a chain of type checks (the measurements: results/speed/README.md). A simulated step repeats the same
few hundred (operator, shapes) pairs thousands of times, so the answer is the same each time.

What it does: after ``FakeTensorMode`` has answered an operator *from its cache* (its hit counter rose by
one, its miss and bypass counters did not move: the operator is one torch's own rules allow to cache,
and nothing was dispatched beneath it), what torch's cache entry gave is kept under a key of the same facts
torch's key holds (the operator; the default dtype and device and inference mode; every tensor argument's
sizes, strides, offset, storage size, dtype, fake device, layout, ``requires_grad``, conjugate, negative and
inference bits; every other argument's type and value), for three kinds of answer (``_answer``):

* a single new fake tensor (not an input, not on an input's storage, no constant): its metadata. The next
  call with that key builds the output as torch's cache hit builds it (an empty strided meta tensor, its
  conjugate and negative bits, wrapped as a ``FakeTensor`` on the kept fake device);
* one of the positional arguments, as an in-place operator returns it: its position. Torch's entry holds the
  first position whose argument is the output and its hit returns that argument; only an output that is
  exactly one argument is kept, so the position is torch's;
* an integer or None (``record_stream``'s answer): the value, which torch's entry holds as it is;
* a tuple of new fake tensors, each on a storage of its own, and such values (attention's outputs with their
  sequence lengths): each one's metadata or value, each tensor rebuilt as above, as torch's hit builds each
  output of a tuple from its entry.

Each without building torch's key. Only where that is the whole of what ``FakeTensorMode`` would do: the
caller's next dispatch mode is the active ``FakeTensorMode``, with no shape environment, and every tensor
argument is a plain strided ``FakeTensor`` of that mode without a constant; anything else (symbolic sizes,
other arguments, views, tuples holding a view or a number, operators torch does not cache) goes to
``FakeTensorMode`` as before. Torch's counters are read around
one call, so one thread dispatches at a time, as in a simulation (the autograd engine's thread runs the
backward while the caller waits). Kept outputs, like torch's cache, last as long as the process.

``tests/bench/measure/test_fakememo.py`` checks replayed outputs against ``FakeTensorMode``'s and what is
never kept; the simulation equality test (``tests/bench/stackmodel/test_sim_equality.py``) checks that no
figure moves.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .fakenew import new_fake

# argument types kept by value (with their type: 1 and 1.0 and True give different dtypes)
_SCALARS = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout,
                      torch.memory_format})
_SEQUENCES = frozenset({list, tuple, torch.Size})
_NO_KEY = object()

# key -> (kind, facts): _NEW with the output's (sizes, strides, dtype, layout, requires_grad, is_conj, is_neg,
# fake device); _INPUT with the position of the argument returned; _VALUE with the value; _TUPLE with each
# output's facts or value (``_answer``)
_NEW, _INPUT, _VALUE, _TUPLE = "new", "input", "value", "tuple"
_VALUES = (int, type(None))  # what torch's entry holds as a constant value: returned as it is (bool is an int)
_outputs: dict[tuple, tuple] = {}
# operators not worth a key: those FakeTensorMode answers before its cache (prim.device, size, ...), and
# those it answered with something this module does not keep (a view, a list) or without its cache
_UNKEYED = frozenset({*fake_tensor._DISPATCH_META_HANDLERS, *fake_tensor._DISPATCH_HANDLE_DIRECTLY})
_skipped: set = set()


def clear() -> None:
    """Forget every kept output and skipped operator."""
    _outputs.clear()
    _skipped.clear()


def _arg_key(arg: Any, fake_mode: FakeTensorMode, out: list) -> bool:
    """Append ``arg``'s facts to ``out``; False where it is not one this module keys."""
    kind = type(arg)
    if kind in _SCALARS:
        out.append(kind)
        out.append(arg)
        return True
    if kind is FakeTensor:
        if arg.fake_mode is not fake_mode or arg.constant is not None or arg.layout is not torch.strided:
            return False
        # the shape as the torch.Size it is (a tuple: equal to, and hashed as, the tuple of its sizes); the
        # fake device as the attribute the fake_device property returns
        out.append((arg.shape, arg.stride(), arg.storage_offset(), arg.untyped_storage().nbytes(),
                    arg.dtype, arg._fake_device, arg.requires_grad, arg.is_conj(), arg.is_neg(),
                    arg.is_inference()))
        return True
    if isinstance(arg, torch.Stream):  # record_stream's: torch's key holds it by value (its id and device)
        out.append(kind)
        out.append(arg)
        return True
    if kind in _SEQUENCES:
        out.append(kind)
        out.append(len(arg))
        return all(_arg_key(item, fake_mode, out) for item in arg)
    return False


def _key(func, args: tuple, kwargs: dict, fake_mode: FakeTensorMode) -> Any:
    out = [func, torch.get_default_dtype(), torch._C._get_default_device(), torch.is_inference_mode_enabled()]
    if not all(_arg_key(a, fake_mode, out) for a in args):
        return _NO_KEY
    for name, value in kwargs.items():
        out.append(name)
        if not _arg_key(value, fake_mode, out):
            return _NO_KEY
    return tuple(out)


def _fresh(out: Any, args: tuple, kwargs: dict, fake_mode: FakeTensorMode) -> bool:
    """A single new fake tensor of ``fake_mode`` on a storage of its own, without a constant."""
    if type(out) is not FakeTensor or out.fake_mode is not fake_mode or out.constant is not None:
        return False
    if out.layout is not torch.strided or out.storage_offset() != 0:
        return False
    storage = out.untyped_storage()._cdata
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return all(a is not out and a.untyped_storage()._cdata != storage for a in inputs)


def call(func, args: tuple, kwargs: dict, fake_mode: FakeTensorMode | None) -> Any:
    """``func(*args, **kwargs)`` below a dispatch mode whose next mode is ``fake_mode`` (the active
    ``FakeTensorMode``, or None): a kept output rebuilt, as the module says, else the operator."""
    if (fake_mode is None or func in _UNKEYED or func in _skipped or fake_mode.shape_env is not None
            or not fake_mode.cache_enabled or torch._C._len_torch_dispatch_stack() != 1):
        return func(*args, **kwargs)
    key = _key(func, args, kwargs, fake_mode)
    if key is _NO_KEY:
        return func(*args, **kwargs)
    kept = _outputs.get(key)
    if kept is not None:
        kind, facts = kept
        if kind is _NEW:
            return rebuild(facts, fake_mode)
        if kind is _INPUT:
            return args[facts]
        if kind is _VALUE:
            return facts
        return tuple(f if isinstance(f, _VALUES) else rebuild(f, fake_mode) for f in facts)
    hits, misses = FakeTensorMode.cache_hits, FakeTensorMode.cache_misses
    bypasses = sum(FakeTensorMode.cache_bypasses.values())
    out = func(*args, **kwargs)
    bypassed = sum(FakeTensorMode.cache_bypasses.values()) != bypasses
    from_cache = FakeTensorMode.cache_hits == hits + 1 and FakeTensorMode.cache_misses == misses and not bypassed
    answer = _answer(out, args, kwargs, fake_mode) if from_cache else None
    if answer is not None:
        _outputs[key] = answer
    elif from_cache or (bypassed and FakeTensorMode.cache_misses == misses):
        # an answer not kept, or one torch does not cache: bypassed, with no miss (an operator torch misses, such
        # as log_sigmoid_forward, may run a decomposition whose own operators bypass; it is kept from its hit)
        _skipped.add(func)
    return out


def metadata(out: FakeTensor) -> tuple:
    """What ``rebuild`` needs of a fake tensor: sizes, strides, dtype, layout, ``requires_grad``, conjugate and
    negative bits, fake device."""
    return (tuple(out.shape), out.stride(), out.dtype, out.layout, out.requires_grad, out.is_conj(), out.is_neg(),
            out.fake_device)


def rebuild(facts: tuple, fake_mode: FakeTensorMode) -> FakeTensor:
    """A new fake tensor as torch's cache hit builds one from its entry's metadata (``metadata``'s tuple)."""
    shape, stride, dtype, layout, requires_grad, conj, neg, device = facts
    with torch._C._DisableTorchDispatch():  # a meta tensor made below the modes (torch: in its kernel invocation)
        empty = torch.empty_strided(shape, stride, dtype=dtype, layout=layout, device="meta",
                                    requires_grad=requires_grad)
    if conj:
        torch._C._set_conj(empty, True)
    if neg:
        torch._C._set_neg(empty, True)
    return new_fake(fake_mode, empty, device)


def _answer(out: Any, args: tuple, kwargs: dict, fake_mode: FakeTensorMode) -> tuple | None:
    """What to keep of an answer torch gave from its cache, or None: a new tensor's metadata (``_NEW``); the
    position of the one positional argument an in-place operator returned, as torch's entry records it
    (``_INPUT``: torch returns ``args[entry.inplace_idx]``, the first argument that is the output, so only an
    output that is exactly one argument, and no keyword argument, is kept); an integer or None (``_VALUE``: the
    constant value torch's entry returns); or a tuple of new tensors, each on a storage of its own, and values
    (``_TUPLE``: torch builds each tensor from its entry's metadata and returns each value)."""
    if _fresh(out, args, kwargs, fake_mode):
        return _NEW, metadata(out)
    if type(out) is FakeTensor:
        at = [i for i, a in enumerate(args) if a is out]
        if len(at) == 1 and not any(v is out for v in kwargs.values()):
            return _INPUT, at[0]
        return None
    if isinstance(out, _VALUES):
        return _VALUE, out
    if type(out) is tuple and out:
        new = [t for t in out if not isinstance(t, _VALUES)]
        if all(_fresh(t, args, kwargs, fake_mode) for t in new) \
                and len({t.untyped_storage()._cdata for t in new}) == len(new):
            return _TUPLE, tuple(t if isinstance(t, _VALUES) else metadata(t) for t in out)
    return None
