"""Where an operator under simulation goes: FakeTensorMode's known answers made without its dispatch.

``call`` is what a dispatch mode right above the active ``FakeTensorMode`` runs for an operator: a lifted host
tensor or a constant's value (``fakelift``), a composite view decomposed (below), a simulated flash-attention
kernel's fake implementation run (below), a view of ``fakeview.VIEWS`` made directly (``fakeview``), a
point-to-point send or receive, an all-to-all or a barrier answered with its work handle (``_WORK_ONLY``), an
operator ``FakeTensorMode`` answers only by its last routes (below), else an answer ``FakeTensorMode`` gave from
its cache replayed from a cheaper key (``fakememo``), else the operator itself. Each returns exactly what
``FakeTensorMode`` would.

Composite views. Code running below autograd (torch's ring attention, which DTensor's handler for
scaled-dot-product attention runs on the local tensors) sends CompositeImplicitAutograd views to the dispatch
modes: ``chunk``, ``reshape``, ``flatten``, ``to``, ``contiguous`` (tens of thousands per simulated rank of
``torch-cp``). ``FakeTensorMode`` builds a whole cache key for each, refuses to cache it (a composite view may
or may not alias its input) and runs the composite kernel with itself entered, so each of its pieces pays a
cache lookup too. ``call`` runs the same kernel (``func.decompose``) with ``FastFake`` entered, so that the
pieces go through ``call``: where ``FakeTensorMode`` would take exactly that path (``_decompose``) and nothing
else. The modes above see the composite operator alone, as before.

Simulated kernels. The flash-attention kernels simulation stands in for (``cpab_sim::fa2_*``/``fa3_*``,
``bench.stackmodel.fake_flash_attn``; two per attention call and ring step) are custom operators, which
``FakeTensorMode`` never caches: it builds their key, refuses it ("non-builtin") and runs their registered fake
implementation with itself entered. ``call`` runs that implementation with ``FastFake`` entered (its
``torch.empty`` calls through ``call``), under the same fake-implementation context, where the arguments are
plain (``_own_kernel``). A barrier (yunchang's ring code issues one after every step) has a fake kernel that
makes only a work handle, as a send has.

A ring's sends and receives (``dist.batch_isend_irecv``: two per ring step, layer and pass, on every rank
simulated) are ``c10d.send``/``c10d.recv_``, and a head-parallel method's all-to-alls (``dist.all_to_all_single``:
two per attention call, stage and pass) are ``c10d.alltoall_base_``, whose fake kernels
(``torch.distributed._meta_registrations``) only make a ``FakeWork`` handle: no tensor is made or changed (the
all-to-all's output was allocated by its caller), so ``FakeTensorMode`` has nothing to cache and goes through its
whole uncached dispatch each time, the process group's script object checked on the way (what that cost:
results/speed/README.md). Where every tensor is a fake tensor of the active mode, ``call`` makes the handle as
that kernel does.

In-place foreach operators (the optimizer's ``_foreach_lerp_``, ``_foreach_addcdiv_``, ...: seven per step over
every parameter) return nothing, and ``FakeTensorMode`` changes nothing of their tensors: it builds a cache key
from every tensor of the lists and runs the operator's meta kernel on each index, which only checks that the
index's tensors broadcast to the written one and that the result's dtype can be written to it. Where every
list holds, at each index, tensors of the written one's shape, dtype and device (or numbers), and that one is
floating point, those checks cannot fail, and ``call`` answers None itself (``_answer_nothing``). An out-of-place
foreach operator (Adam's ``_foreach_sqrt``), which ``FakeTensorMode`` never caches, is asked of it once per
distinct element of the lists (``foreachnew``).

Last routes. FSDP2's custom operators (``fsdp::all_gather_copy_in``, ``split_with_sizes_copy``, ``chunk_cat``:
one each per parameter group, all-gather and reduce-scatter) and the profiler's ``_record_function_enter_new``
(FSDP2 and the optimizer mark their steps with ``record_function``) are answered by what ``FakeTensorMode``
tries last: it builds their key, refuses it ("non-builtin"), tries each of its other routes in turn and at
last runs its own fake-tensor implementation of the operator (the profiler's: the real operator run) or the
operator's Meta kernel in its kernel invocation, the tensors returned wrapped by its device logic. ``call``
does those last steps itself (``_run_last_routes``), where no earlier route could apply (``_last_routes``) and
the call is plain.

Host data: a plain host tensor lifted into the simulation (``torch.tensor(values)``, UPipe's and FPDT's index
tensors) is made as ``FakeTensorMode``'s converter makes it, and a constant's value read back (``.item()``,
Adam's step counts) is read from the constant as its constant propagation does (``fakelift``).

A fake tensor's device (``tensor.device``) is answered before ``call`` (``simmode.fake_device``), by both
modes below.

Two dispatch modes use it. The memory tracker (``simulate.PeakTracker``) calls it for every operator of
the tracked step. ``FastFake`` does nothing else: it is entered for the untracked work a simulation does
before the step (building the model and FSDP2's sharding of it, the optimizer's priming step,
``bench.measure.run.measure_simulated``), which goes through the same operators as the step and, without
it, through ``FakeTensorMode``'s whole dispatch each time (what that cost: results/speed/README.md).

The priming step also runs DTensor's sharding propagation once per foreach operator, which on a model of
many layers is mostly ``_propagate_use_strided_shard_flag`` scanning every argument of the operator once
per tensor of its lists (quadratic in the parameters). ``FastFake`` skips those scans where they can
change nothing (``_strided_flag_once``), and propagates each distinct element of the lists once
(``foreachprop``: the parameters of one layer stand for every layer's).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._decomp import decomposition_table, meta_table
from torch._library import fake_impl, simple_registry
from torch._subclasses.fake_impls import has_meta, op_implementations_checks
from torch._subclasses.fake_tensor import (
    _DISPATCH_HANDLE_DIRECTLY,
    _DISPATCH_META_HANDLERS,
    FakeTensor,
    FakeTensorMode,
    in_kernel_invocation_manager,
)
from torch.distributed._meta_registrations import create_fakework
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..stackmodel.simmode import DEVICE_QUERY, any_dtensor, fake_device
from . import fakelift, fakememo, fakeview, foreachnew, foreachprop
from .skipmath import SIM_NAMESPACE


def active_fake_mode() -> FakeTensorMode | None:
    """``torch._guards.active_fake_mode()`` without building the whole mode stack in Python on every operator:
    ``FakeTensorMode`` is an infra mode, held in the dispatcher's FAKE slot, which this reads."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd
_DECOMPOSED: dict = {}  # operator -> _decomposed_each_time(operator)
_VOID_FOREACH: dict = {}  # operator -> _writes_lists_only(operator)
_LAST: dict = {}  # operator -> _last_routes(operator)
# values FakeTensorMode passes through untouched: numbers, strings, torch's enums, and TorchScript objects (a c10d
# operator's process group and reduce operation)
_PLAIN = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout, torch.memory_format,
                    torch.ScriptObject})

# c10d's operators whose fake kernel makes a work handle and nothing else (module docstring), each with the
# arguments that hold its tensors: a send's or receive's list, an all-to-all's output and input, a barrier's
_WORK_ONLY = {torch.ops.c10d.send.default: lambda args: args[0], torch.ops.c10d.recv_.default: lambda args: args[0],
              torch.ops.c10d.alltoall_base_.default: lambda args: args[:2],
              torch.ops.c10d.barrier.default: lambda args: args[:1]}


def _decomposed_each_time(func) -> bool:
    """Whether ``FakeTensorMode`` runs ``func``'s CompositeImplicitAutograd kernel on every call, with nothing
    before it that a plain fake argument could change: a view its cache refuses ("CompositeImplicitAutograd":
    whether the output aliases the input is not known before it runs), with no meta function, no Python
    decomposition, no C++ meta kernel it prefers, not a lift and not an operator it answers before its cache."""
    known = _DECOMPOSED.get(func)
    if known is None:
        known = _DECOMPOSED[func] = (
            isinstance(func, torch._ops.OpOverload) and func.is_view
            and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE)
            and _nothing_before_decomposing(func))
    return known


def _nothing_before_decomposing(func: torch._ops.OpOverload) -> bool:
    """What ``FakeTensorMode`` could do for ``func`` before it decomposes it or goes past its decomposition (both
    routes below depend on it doing neither): answer it before its cache, lift it, run a meta function or a Python
    decomposition, or prefer a C++ meta kernel. None of these applies."""
    return (func not in _DISPATCH_META_HANDLERS and func not in _DISPATCH_HANDLE_DIRECTLY
            and func not in FakeTensorMode.lift_fns and func not in meta_table and func not in decomposition_table
            and torch.Tag.view_copy not in func.tags and func not in FakeTensorMode._cpp_meta_supports_symint)


def _plain(arg: Any, fake_mode: FakeTensorMode) -> bool:
    """A fake tensor of ``fake_mode`` with no constant and no symbolic size, or a plain value (``_PLAIN``), or a
    list of them."""
    kind = type(arg)
    if kind is FakeTensor:
        return arg.fake_mode is fake_mode and arg.constant is None and not arg._has_symbolic_sizes_strides
    if kind in (list, tuple):
        return all(_plain(a, fake_mode) for a in arg)
    return kind in _PLAIN


def _plain_call(args: tuple, kwargs: dict, fake_mode: FakeTensorMode) -> bool:
    """Nothing ``FakeTensorMode`` checks before its decomposition or fake implementation could apply: no shape
    environment, no real tensors propagated, that mode the only one below, and every argument plain."""
    return (fake_mode.shape_env is None and not fake_mode.propagate_real_tensors
            and torch._C._len_torch_dispatch_stack() == 1
            and all(_plain(a, fake_mode) for a in args) and all(_plain(a, fake_mode) for a in kwargs.values()))


def _writes_lists_only(func) -> bool:
    """Whether ``func`` is an in-place foreach operator of aten returning nothing (``_foreach_add_``,
    ``_foreach_addcdiv_``, ...): its first argument a list of tensors it writes."""
    known = _VOID_FOREACH.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        first = schema.arguments[0] if schema is not None and schema.arguments else None
        known = _VOID_FOREACH[func] = (
            isinstance(func, torch._ops.OpOverload) and func.name().startswith("aten::_foreach_")
            and not schema.returns and first is not None and str(first.type) == "List[Tensor]"
            and first.alias_info is not None and first.alias_info.is_write)
    return known


def _alike_lists(args: tuple, kwargs: dict) -> bool:
    """A foreach call its meta kernel can only accept: the written list of floating-point tensors, every other
    list as long, of tensors with each index's shape, dtype and device or of numbers, and the rest numbers."""
    written = args[0]
    if type(written) not in (list, tuple) or not all(type(t) is FakeTensor and t.dtype.is_floating_point
                                                     for t in written):
        return False
    for arg in (*args[1:], *kwargs.values()):
        if type(arg) in (list, tuple):
            if len(arg) != len(written):
                return False
            if any(type(a) is FakeTensor for a in arg):
                if not all(type(a) is FakeTensor and a.shape == t.shape and a.dtype == t.dtype
                           and a.fake_device == t.fake_device for a, t in zip(arg, written, strict=True)):
                    return False
            elif not all(type(a) in (int, float) for a in arg):
                return False
        elif type(arg) not in (int, float, bool):
            return False
    return True


def _answer_nothing(func, args: tuple, kwargs: dict, fake_mode: FakeTensorMode | None) -> bool:
    """Whether ``call`` answers an in-place foreach operator itself (module docstring)."""
    return (fake_mode is not None and _writes_lists_only(func) and _alike_lists(args, kwargs)
            and _plain_call(args, kwargs, fake_mode))


def _last_routes(func) -> tuple | None:
    """FakeTensorMode's fake-tensor implementations that apply to ``func``, in its order, where on a plain call
    (``_plain_call``) with no operator profiles it reaches them and its Meta kernel with nothing before that
    which could apply; else None. Nothing before: an operator outside torch's own namespaces (its cache refuses
    it, "non-builtin"), not answered before its cache, not a lift, no meta function, Python decomposition,
    CompositeImplicitAutograd kernel, C++ meta support or fake implementation of its own; and a Meta kernel, so
    that nothing after them could apply either (FSDP2's ``fsdp::all_gather_copy_in``, ``split_with_sizes_copy``
    and ``chunk_cat``, the profiler's ``_record_function_enter_new``)."""
    if func in _LAST:
        return _LAST[func]
    last = None
    if (isinstance(func, torch._ops.OpOverload) and not torch._library.utils.is_builtin(func)
            and _nothing_before_decomposing(func)
            and torch._C.DispatchKey.CompositeImplicitAutograd not in func.py_kernels
            and not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _COMPOSITE)
            and "prims::" not in func._schema.name
            and simple_registry.singleton.find(func.name()).fake_impl.kernel is None
            and has_meta(func)):
        last = tuple(impl for check, impl in op_implementations_checks if check(func))
    _LAST[func] = last
    return last


def _run_last_routes(func, impls: tuple, args: tuple, kwargs: dict, fake_mode: FakeTensorMode) -> Any:
    """What ``FakeTensorMode`` does last for such an operator, with the mode out of its slot as within its own
    dispatch: each fake-tensor implementation in turn until one answers, else its Meta kernel run on the fake
    tensors as the meta tensors they wrap, every tensor returned wrapped by the mode's own device logic."""
    mode = torch._C._unset_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    try:
        for impl in impls:
            out = impl(fake_mode, func, *args, **kwargs)
            if out is not NotImplemented:
                return out
        with in_kernel_invocation_manager(fake_mode):
            out = func(*args, **kwargs)
    finally:
        torch._C._set_dispatch_mode(mode)
    flat_args = pytree.tree_leaves((args, kwargs))
    return fake_mode.wrap_meta_outputs_with_default_device_logic(out, func, flat_args, device=kwargs.get("device"))


def _decompose(func, args: tuple, kwargs: dict, fake_mode: FakeTensorMode | None) -> bool:
    """Whether ``call`` decomposes ``func`` itself (module docstring): ``FakeTensorMode`` would, on a plain call
    (``_plain_call``) with at least one fake tensor."""
    return (fake_mode is not None and _decomposed_each_time(func) and any(type(a) is FakeTensor for a in args)
            and _plain_call(args, kwargs, fake_mode))


def _own_kernel(args: tuple, kwargs: dict, fake_mode: FakeTensorMode | None) -> bool:
    """Whether ``call`` runs a simulated flash-attention kernel's fake implementation itself (module docstring):
    ``FakeTensorMode`` would, on a plain call (``_plain_call``) with no operator profiles."""
    return (fake_mode is not None and torch._dynamo.config._custom_ops_profile is None
            and _plain_call(args, kwargs, fake_mode))


def call(func, args: tuple, kwargs: dict, fake_mode: FakeTensorMode | None) -> Any:
    """``func(*args, **kwargs)`` below a dispatch mode whose next mode is ``fake_mode`` (module docstring)."""
    if func is fakelift.LIFT:
        if (made := fakelift.lifted(args, kwargs, fake_mode)) is not None:
            return made
    elif func is fakelift.ITEM:
        if (value := fakelift.constant_item(args, kwargs, fake_mode)) is not fakelift.NOT_HERE:
            return value
    if _decompose(func, args, kwargs, fake_mode):
        with FastFake():
            return func.decompose(*args, **kwargs)
    if getattr(func, "namespace", None) == SIM_NAMESPACE and _own_kernel(args, kwargs, fake_mode):
        kernel = simple_registry.singleton.find(func.name()).fake_impl.kernel
        if kernel is not None:
            ctx = fake_impl.FakeImplCtx(fake_mode, func)
            with fake_impl.set_ctx_getter(lambda: ctx), FastFake():
                return kernel(*args, **kwargs)
    if func in _WORK_ONLY and fake_mode is not None and not kwargs \
            and all(isinstance(t, FakeTensor) and t.fake_mode is fake_mode for t in _WORK_ONLY[func](args)):
        return create_fakework(args, return_first_arg=False)
    if _answer_nothing(func, args, kwargs, fake_mode):
        return None
    if fake_mode is not None and foreachnew._returns_new_list(func) and _plain_call(args, kwargs, fake_mode) \
            and (made := foreachnew.answer(func, args, kwargs)) is not None:
        return made
    if (impls := _last_routes(func)) is not None and _own_kernel(args, kwargs, fake_mode):
        return _run_last_routes(func, impls, args, kwargs, fake_mode)
    route = fakeview.call if func in fakeview.VIEWS else fakememo.call
    return route(func, args, kwargs, fake_mode)


class FastFake(TorchDispatchMode):
    """Every operator through ``call`` (module docstring). An operator on DTensors goes back to DTensor
    (``NotImplemented``), whose local operators come through again, as under the memory tracker."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False, as ``SimulationMode`` says (its docstring): no ``torch._disable_dynamo`` around the handler."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY and (device := fake_device(func, args, kwargs)) is not None:
            return device
        if any_dtensor(types):
            return NotImplemented
        return call(func, args, kwargs or {}, active_fake_mode())


@contextlib.contextmanager
def fast_fake() -> Iterator[None]:
    """``FastFake`` entered, with DTensor's strided-shard flag scanned once per operator and a foreach operator's
    sharding propagated once per distinct element (module docstring)."""
    with _strided_flag_once(), foreachprop.once_per_element(), FastFake():
        yield


@contextlib.contextmanager
def _strided_flag_once() -> Iterator[None]:
    """DTensor's ``_propagate_use_strided_shard_flag(strategy, schema)`` first looks for a ``_StridedShard`` among
    every argument's placements and returns, changing nothing, where there is none; a foreach operator's
    propagation calls it once per tensor of its lists with the same schema. Within this context the answer
    of that look is kept for the last schema seen (held, so its identity cannot be reused), and the original
    runs only where a ``_StridedShard`` is there. What it does to the strategies is therefore unchanged."""
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor.placement_types import _StridedShard

    original = _sharding_prop._propagate_use_strided_shard_flag
    last: list = [None, False]  # the schema last looked at, and whether it holds a _StridedShard

    def once(op_strategy, op_schema) -> None:
        if last[0] is not op_schema:
            last[0] = op_schema
            last[1] = any(isinstance(p, _StridedShard) for spec in op_schema.args_spec for p in spec.placements)
        if last[1]:
            original(op_strategy, op_schema)

    _sharding_prop._propagate_use_strided_shard_flag = once
    try:
        yield
    finally:
        _sharding_prop._propagate_use_strided_shard_flag = original
