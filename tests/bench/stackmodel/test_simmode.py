"""One dispatch mode for the simulator's counters (``bench.stackmodel.simmode``).

The counters of a simulated trial (kernel scratch, memory traffic, host copies, FLOPs, varlen lengths,
collectives) join the memory tracker's dispatch mode instead of each pushing its own: the figures must
be those of the counters stacked as separate modes, to the byte, on a method with DTensors (torch-cp:
the counters hand its ops back to DTensor) and one without, both with the paper stack's kernel scratch
(which the tracker must see) and the allocator trace.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from bench.measure.config import StepConfig
from bench.measure.run import measure_simulated
from bench.measure.simulate import PeakTracker
from bench.measure.trial import Trial
from bench.stackmodel.hardware import CommCounter
from bench.stackmodel.simmode import Counter, SimulationMode
from bench.stackmodel.stepcount import MemoryTraffic, StepCounter


def _figures(trial: Trial) -> dict:
    out = measure_simulated(trial).to_dict()
    out.get("allocator", {}).pop("replay_s", None)
    return out


@pytest.mark.parametrize("method", ["torch-cp", "upipe"])
def test_joined_counters_give_the_stacked_modes_figures(method, monkeypatch):
    trial = Trial.make(method, "tiny-llama", 8192, 4, mode="simulated", device="h100-80g",
                       step=StepConfig(stack="paper"))
    joined = _figures(trial)
    assert joined["status"] == "ok", joined.get("message")
    monkeypatch.setattr(SimulationMode, "joinable", lambda self: False)  # every counter a mode of its own
    stacked = _figures(trial)
    assert joined == stacked


class _Stack(TorchDispatchMode):
    """Notes the user modes on the dispatch stack below it at the first operator."""

    def __init__(self) -> None:
        super().__init__()
        self.below: list[str] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.below is None:
            self.below = [type(m).__name__ for m in _get_current_dispatch_mode_stack()]
        return func(*args, **(kwargs or {}))


def test_counters_join_the_tracker_in_the_order_they_nest():
    with FakeTensorMode():
        x = torch.empty(8, 8)
        tracker, comm, steps, spy = PeakTracker(), CommCounter(), StepCounter("cpu", "meta"), _Stack()
        with tracker, comm, steps.counting():
            names = [type(c).__name__ for c in tracker.counters]
            with spy:
                (x @ x).sum()
        assert not tracker.counters  # each left on exit
    # outermost first: as modes, the last entered would be on top
    assert names == ["MemoryTraffic", "HostCopies", "_LocalOpsMode", "CuSeqlensValues", "CommCounter"]
    assert spy.below == ["FakeTensorMode", "PeakTracker"]  # one mode for the tracker and every counter
    assert steps.counts().flops_matmul == 2 * 8 * 8 * 8
    assert steps.traffic.calls > 0


def test_a_counter_alone_is_a_mode_of_its_own():
    traffic = MemoryTraffic("cpu")
    with FakeTensorMode():
        x = torch.empty(8, 8)
        with traffic:
            assert _get_current_dispatch_mode_stack()[-1] is traffic
            x + x
    assert traffic.calls == 1 and traffic.bytes == 3 * 8 * 8 * 4


def test_counters_leave_in_the_reverse_order():
    mode, a, b = SimulationMode(), Counter(), Counter()
    mode.join(a)
    mode.join(b)
    with pytest.raises(RuntimeError, match="reverse order"):
        mode.leave(a)
    mode.leave(b)
    mode.leave(a)
    assert mode.counters == ()


class _Seen(Counter):
    """A counter that records every operator its hooks see."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def before(self, func, args, kwargs):
        self.ops.append(func)


def test_a_fake_tensors_device_is_answered_as_fake_tensor_mode_answers_it_and_no_counter_sees_it():
    """``tensor.device`` asked from C++ on a fake tensor (``prim.device``: autograd asks it of every input and
    output) under a ``SimulationMode``: the fake device outside a kernel's invocation and ``meta`` inside one, as
    ``FakeTensorMode`` answers; no counter's hook runs for it, while the operators around it reach them."""
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    device = torch.ops.prim.device.default
    seen = _Seen()
    with FakeTensorMode() as fake:
        t = torch.empty(3, device="cuda", requires_grad=True)
        with SimulationMode() as mode, seen:
            (t * 2).sum().backward()
            assert mode.__torch_dispatch__(device, (type(t),), (t,)) == t.fake_device == torch.device("cuda", 0)
            with in_kernel_invocation_manager(fake):
                assert mode.__torch_dispatch__(device, (type(t),), (t,)) == torch.device("meta")
        assert t.grad.device == t.device
    assert device not in seen.ops
    assert {torch.ops.aten.mul.Tensor, torch.ops.aten.sum.default} <= set(seen.ops)


def test_the_simulations_dispatch_handlers_are_not_wrapped_by_dynamos_guard():
    """``TorchDispatchMode`` wraps a subclass's handler in ``torch._disable_dynamo`` unless the subclass says not
    to; the simulation's modes (the tracker, the fast fake route) say so, and their handlers are their own."""
    from bench.measure.fakeroute import FastFake

    for mode in (SimulationMode, PeakTracker, FastFake):
        handler = mode.__torch_dispatch__
        assert not hasattr(handler, "__wrapped__"), mode
        assert handler.__qualname__.endswith(".__torch_dispatch__"), mode

    class Plain(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert hasattr(Plain.__torch_dispatch__, "__wrapped__")  # what the check above would see, wrapped
