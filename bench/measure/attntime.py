"""Each rank's time in attention kernel calls over the timed steps of a real trial.

Why. With packed documents the ranks of a sequence-sharded method attend for different amounts of
work (``bench.stackmodel.docwork`` counts them, per rank, from the layout); a row's step time is the
slowest rank's and says nothing about which rank was slow or by how much. Timing each rank's own
attention kernel calls measures the imbalance the model predicts.

How. ``AttentionTimer.step()`` is a context manager a measurement puts around one timed step
(``bench.measure.run.measure_on_device``, warm-up steps left out): it installs itself as the
``methods.core.kernels`` call timer for that step, which sums the time on its clock and counts the
calls of every kernel ``forward`` (recomputations under activation checkpointing included) and
``backward``, and restores the previous timer on exit. The methods are not told: every call through
the kernel interface is timed, whoever makes it. The time is the host's, exact for CPU kernels
(synchronous); on CUDA the host only launches them, so a measurement times CPU ranks alone
(``timed_device``) and a CUDA row records none.

Which clock (``attention_clock``, recorded in the row as ``figures.attention_clock``):

* ``thread``: the calling thread's CPU time (``time.thread_time``), where torch runs a rank's kernels
  on that thread alone (one intra-op thread: ``at::parallel_for`` and the BLAS calls run inline). It
  is the kernel's own work, whether or not the rank was descheduled during the call, so it stays the
  rank's attention cost when the ranks are time-sliced on fewer cores than ranks (4 ranks on 2 cores)
  or share the host with other jobs, where wall time also counts the waits for a core.
* ``wall``: ``time.perf_counter``, where a rank has several intra-op threads, whose work is not on the
  calling thread's clock. Rows made before the clock was recorded used this one.

A method whose library calls its own kernels (``rfa-zigzag``, ``yc-*``, ``ds-fpdt``, ``torch-cp``)
makes no call through the interface: ``seconds`` is then None (not measured), never 0.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from methods.core import kernels
from records.schema import ATTENTION_CLOCKS

# a row's note when a real trial's ranks timed no attention (bench.measure.run.build_row)
NONE_SEEN = ("rank_attention_s not measured: no attention call went through methods.core.kernels in the timed "
             "steps (the method's library calls its own kernels)")
MIXED_CLOCKS = ("rank_attention_s not reported: the ranks timed their attention on different clocks (their torch "
                "intra-op threads differ: give every rank the same --threads)")
NOT_ON_CUDA = ("rank_attention_s not measured on CUDA: the kernels run asynchronously, and timing them would "
               "need a synchronisation around each call that changes the step")


def timed_device(device: torch.device) -> bool:
    """Whether the host's clock around a kernel call is the call's time on ``device`` (CPU only)."""
    return device.type == "cpu"


WALL, THREAD = ATTENTION_CLOCKS  # the names a row records (records.schema validates them)
CLOCKS: dict[str, Callable[[], float]] = {WALL: time.perf_counter, THREAD: time.thread_time}
# what a row's note calls each clock's time
CLOCK_SAID = {WALL: "wall time (time.perf_counter)",
              THREAD: "CPU time of the calling thread, its one intra-op thread (time.thread_time)"}


def attention_clock(intra_op_threads: int) -> str:
    """The clock a rank with ``intra_op_threads`` torch threads times its kernel calls on (module docstring)."""
    return THREAD if intra_op_threads == 1 else WALL


@dataclass
class StepAttention:
    """One step's attention kernel calls: their count and summed time on ``clock_name``, by direction."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_calls: int = 0
    backward_calls: int = 0
    clock_name: str = WALL

    def clock(self) -> float:
        """A ``methods.core.kernels.CallTimer``'s clock: ``CLOCKS[clock_name]``."""
        return CLOCKS[self.clock_name]()

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def calls(self) -> int:
        return self.forward_calls + self.backward_calls

    def record(self, direction: str, seconds: float) -> None:
        """A ``methods.core.kernels.CallTimer``: one call's time on ``clock``."""
        if direction == "forward":
            self.forward_s += seconds
            self.forward_calls += 1
        elif direction == "backward":
            self.backward_s += seconds
            self.backward_calls += 1
        else:
            raise ValueError(f"a kernel call's direction is 'forward' or 'backward', got {direction!r}")


@dataclass
class AttentionTimer:
    """The timed steps' attention, one ``StepAttention`` per ``step()``, on ``clock`` (``CLOCKS``; None:
    ``attention_clock`` of torch's intra-op threads now)."""

    clock: str | None = None
    steps: list[StepAttention] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.clock is None:
            self.clock = attention_clock(torch.get_num_threads())
        if self.clock not in CLOCKS:
            raise ValueError(f"an attention clock is one of {sorted(CLOCKS)}, got {self.clock!r}")

    @contextlib.contextmanager
    def step(self) -> Iterator[StepAttention]:
        """Time the kernel calls of one step (the block inside)."""
        current = StepAttention(clock_name=self.clock)
        previous = kernels.set_call_timer(current)
        try:
            yield current
        finally:
            kernels.set_call_timer(previous)
        self.steps.append(current)

    def seconds(self) -> list[float] | None:
        """Each timed step's attention seconds (forward + backward), in order; None when no step made a call."""
        if not self.steps or not any(s.calls for s in self.steps):
            return None
        return [s.seconds for s in self.steps]

    def calls(self) -> dict[str, int] | None:
        """Calls per step by direction (the first step's; every step of a trial makes the same); None: none."""
        if self.seconds() is None:
            return None
        first = self.steps[0]
        return {"forward": first.forward_calls, "backward": first.backward_calls}


def median_seconds(per_step: list[float]) -> float:
    """A rank's attention time: the median over its timed steps (robust to one slow step, as the step time)."""
    return statistics.median(per_step)


def imbalance(per_rank: list[float]) -> float:
    """The slowest rank's attention time over the mean rank's (1: balanced), as ``docwork``'s for pairs."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0
