"""One dispatch mode for the simulator's per-operator counters.

A simulated trial counts what every operator does several ways at once: the kernels' scratch
(``bench.stackmodel.workspace.KernelWorkspace``), the memory-bound kernels' traffic, the host copies
and the FLOPs (``bench.stackmodel.stepcount``), the integer tensors a varlen call's lengths come from
(``bench.stackmodel.varlencount``) and the collectives (``bench.stackmodel.hardware.CommCounter``).
Each is a ``Counter``: a ``TorchDispatchMode`` that can be entered on its own, as any mode, and
whose bookkeeping is split into a ``before`` hook (run before the operator) and an ``after`` hook
(run on its output). Stacked as modes, every operator would go through the Python dispatcher once
per counter (each mode's handler calls the operator again, which dispatches to the next mode); a
``SimulationMode`` does the same bookkeeping in one handler and calls the operator once.

Counters entered while a ``SimulationMode`` is the innermost mode (the top of the dispatch-mode
stack) **join** it instead of pushing a mode: each becomes its outermost hook, exactly where it would
have been pushed, and leaves it on exit. The mode's own work comes innermost (``_call``): the operator
itself, or, for the memory tracker (``bench.measure.simulate.PeakTracker``, a ``SimulationMode``, which
a simulated step's counters are entered in), the operator and the tracking of its outputs, as a
tracker pushed below every counter did. Every counter therefore sees what it saw stacked:

* ``before`` hooks run outermost first, then ``_call``, then the ``after`` hooks innermost first, as
  the stacked handlers' code before and after their own call of the operator ran;
* what a ``before`` hook returns is held until every ``after`` hook has run, and dropped then (a
  kernel's scratch buffers live while the kernel runs, and die before the operator returns);
* the operators a hook makes (the scratch buffers) go, within ``Counter.dispatching_below``, through
  the counters inside the one that made them and ``_call`` (the mode is pushed again with those only),
  as a stacked counter's handler made them reach the modes below it: the tracker sees the scratch;
* an operator on DTensors is handed back to DTensor (``NotImplemented``) when the outermost counter
  declines DTensors (``declines_dtensor``), and then no counter sees it, as no mode below a declining
  one did; DTensor runs the local operators, which come through again.

A fake tensor's device (``tensor.device`` on a ``FakeTensor``, the operator ``prim.device``, which autograd asks
of every input and output of every operator) is answered at once with what ``FakeTensorMode`` answers
(``fake_device``): no counter counts it, and nothing is made or changed.

Two things a stack allowed are refused instead of merged: an operator on DTensors when the outermost
counter takes them and one inside declines (stacked, the outer ones would see the operator and the
inner ones its local operators only), and higher-order operators (a ``SimulationMode`` does not take
them; the outermost counters of the simulator's stack did not either).
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode

DEVICE_QUERY = torch.ops.prim.device.default  # `tensor.device` asked from C++: a hot path, checked before the call


def fake_device(func, args: tuple, kwargs: dict | None) -> torch.device | None:
    """The answer to ``tensor.device`` on a fake tensor, as ``FakeTensorMode`` gives it (its ``_device_handler``:
    ``meta`` inside a kernel's invocation, else the tensor's fake device); None for any other operator."""
    if func is not DEVICE_QUERY or kwargs or len(args) != 1 or type(args[0]) is not FakeTensor:
        return None
    return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device


def any_dtensor(types) -> bool:
    """Whether a dispatched op has DTensor arguments. ``torch.distributed.tensor`` is looked up, not
    imported: it is a quarter of this package's import time, and until something has imported it
    (FSDP2 does) no tensor can be a DTensor, so processes that never shard (a sweep's runner, its
    job wrappers, a method's numerics) need not load it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and any(issubclass(t, module.DTensor) for t in types)


def tensor_leaves(tree, out: list) -> list:
    """The tensors among ``tree``'s leaves, appended to ``out`` in pytree's order: an operator's arguments and
    outputs hold them in tuples, lists and dicts, which are walked here directly (pytree's ``tree_leaves`` costs
    more per operator than the hooks that read them); any other container is given to pytree."""
    kind = type(tree)
    if kind is tuple or kind is list:
        for item in tree:
            tensor_leaves(item, out)
    elif kind is dict:
        for item in tree.values():
            tensor_leaves(item, out)
    elif isinstance(tree, torch.Tensor):
        out.append(tree)
    elif kind not in _LEAVES:
        out.extend(t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))
    return out


_LEAVES = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout,
                     torch.memory_format, torch.Size})


class Counter(TorchDispatchMode):
    """A per-operator counter: a dispatch mode of its own, or a hook of the ``SimulationMode`` it
    joins when entered inside one (module docstring).

    Subclasses override ``before`` and/or ``after`` (the ones left as they are cost nothing per operator)
    and set ``declines_dtensor``."""

    declines_dtensor = True  # ops on DTensors go back to DTensor, whose local ops come through again

    def before(self, func, args: tuple, kwargs: dict) -> Any:
        """Before ``func`` runs; what it returns is held until the operator and every ``after`` hook ran."""
        return None

    def after(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        """After ``func`` ran and returned ``out``."""

    def __enter__(self):
        top = _get_current_dispatch_mode()
        joined = isinstance(top, SimulationMode) and top.joinable()
        self.__dict__.setdefault("_joined", []).append(top if joined else None)
        if joined:
            top.join(self)
            return self
        return super().__enter__()

    def __exit__(self, exc_type, exc_val, exc_tb):
        mode = self._joined.pop()
        if mode is not None:
            mode.leave(self)
            return None
        return super().__exit__(exc_type, exc_val, exc_tb)

    def dispatching_below(self) -> contextlib.AbstractContextManager:
        """A context in which the operators this counter's hooks make reach the counters inside it and the
        modes below (``SimulationMode.inside``), as a stacked counter's handler made them reach the modes
        below it; on its own, a counter's handler already does."""
        joined = self.__dict__.get("_joined")
        mode = joined[-1] if joined else None
        return mode.inside(self) if mode is not None else contextlib.nullcontext()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.declines_dtensor and any_dtensor(types):
            return NotImplemented
        kwargs = kwargs or {}
        held = self.before(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
            self.after(func, args, kwargs, out)
        finally:
            del held
        return out


def _overrides(counter: Counter, name: str) -> bool:
    return getattr(type(counter), name) is not getattr(Counter, name)


class SimulationMode(TorchDispatchMode):
    """The counters that joined it (``Counter.__enter__``), run in one handler per operator around the
    mode's own ``_call`` (module docstring). ``with SimulationMode(): with counter_a, counter_b: ...``
    counts as ``with counter_a, counter_b: ...`` does, with one dispatch per operator instead of two."""

    declines_dtensor = False  # whether the mode's own innermost call (``_call``) declines DTensor ops

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: ``__torch_dispatch__`` is not wrapped in ``torch._disable_dynamo``, which ``TorchDispatchMode``
        puts around a subclass's handler (``__init_subclass__``) unless it says so here. That wrapper keeps
        TorchDynamo from compiling the handler's frames and costs a few calls per operator; a simulation never
        compiles (nothing here calls ``torch.compile``)."""
        return False

    def __init__(self) -> None:
        super().__init__()
        self._init_counters()

    def _init_counters(self) -> None:
        self._counters: list[Counter] = []  # outermost first
        self._plan(self._counters)

    def joinable(self) -> bool:
        """Whether a counter entered now may join this mode (a subclass that is pushed more than once may
        not: the counters would run once per push)."""
        return True

    @property
    def counters(self) -> tuple[Counter, ...]:
        """The joined counters, outermost first."""
        return tuple(self._counters)

    def join(self, counter: Counter) -> None:
        """``counter`` becomes the outermost hook (where entering it as a mode would have pushed it)."""
        self._counters.insert(0, counter)
        self._plan(self._counters)

    def leave(self, counter: Counter) -> None:
        """``counter`` leaves; counters leave in the reverse order of joining, as modes are popped."""
        if not self._counters or self._counters[0] is not counter:
            raise RuntimeError(f"{type(counter).__name__} leaves a SimulationMode it is not the outermost counter "
                               "of: exit counters in the reverse order of entering them")
        del self._counters[0]
        self._plan(self._counters)

    def _plan(self, counters: Sequence[Counter]) -> None:
        """The hooks one operator runs through: ``counters`` (outermost first), then ``_call``."""
        self._befores = tuple(c.before for c in counters if _overrides(c, "before"))  # outermost first
        self._afters = tuple(c.after for c in reversed(counters) if _overrides(c, "after"))  # innermost first
        self._declines = counters[0].declines_dtensor if counters else self.declines_dtensor
        self._mixed = not self._declines and (self.declines_dtensor or any(c.declines_dtensor for c in counters))

    @contextlib.contextmanager
    def inside(self, counter: Counter) -> Iterator[None]:
        """Within the block (entered by one of ``counter``'s hooks, while this mode handles an operator),
        operators dispatch to the counters inside ``counter`` and this mode's ``_call``: the mode is pushed
        again, with those counters only, for the block."""
        index = next(i for i, c in enumerate(self._counters) if c is counter)
        saved = self._befores, self._afters, self._declines, self._mixed
        self._plan(self._counters[index + 1:])
        _push_mode(self)
        try:
            yield
        finally:
            _pop_mode()
            self._befores, self._afters, self._declines, self._mixed = saved

    def _call(self, func, args: tuple, kwargs: dict) -> Any:
        """The operator itself, inside every counter (a subclass may do its own work around it)."""
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY and (device := fake_device(func, args, kwargs)) is not None:
            return device
        if (self._declines or self._mixed) and any_dtensor(types):
            if self._declines:
                return NotImplemented  # DTensor runs the local ops, which come back here
            raise RuntimeError("a counter that declines DTensor ops is inside one that takes them: they cannot "
                               "share a SimulationMode; enter them outside one, as separate modes")
        kwargs = kwargs or {}
        if not self._befores:
            out = self._call(func, args, kwargs)
            for after in self._afters:
                after(func, args, kwargs, out)
            return out
        held = [before(func, args, kwargs) for before in self._befores]
        try:
            out = self._call(func, args, kwargs)
            for after in self._afters:
                after(func, args, kwargs, out)
        finally:
            del held  # what the before hooks made (a kernel's scratch) dies before the operator returns
        return out
