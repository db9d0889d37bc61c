"""Step-time statistics and host load for real and emulated trials.

Why: one mean over two steps hides how much a step varies, and on a shared host a step can be
slowed by work that is not the trial's. A row therefore keeps every timed step, reports the
median as its step time (robust to one slow step) with the minimum and maximum beside it, and
records the host's load before and after the timed steps, so that a reader can see when the host
was shared instead of taking a slow figure for the method's.

``MIN_TIMED_STEPS`` is the fewest timed steps that give a median and a range worth reporting;
fewer are refused unless the trial is marked ``smoke`` (a wiring check whose row says so).
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from records.schema import MIN_TIMED_STEPS

__all__ = ["MIN_TIMED_STEPS", "HostLoad", "StepStats", "host_shared", "slowest_rank_steps"]


@dataclass(frozen=True)
class StepStats:
    """The timed steps of one trial (seconds), and their median, minimum and maximum."""

    times: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.times:
            raise ValueError("no timed steps: a trial times at least one step (iters >= 1)")

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    def plus(self, seconds: float) -> StepStats:
        """Every step lengthened by ``seconds`` (emulated: modelled communication per step)."""
        return StepStats(tuple(t + seconds for t in self.times))


def slowest_rank_steps(per_rank: list[list[float]]) -> list[float]:
    """Step ``i`` of a real job lasts as long as its slowest rank's step ``i`` (the ranks meet in
    collectives every step), so the job's step times are the element-wise maximum over ranks."""
    lengths = {len(t) for t in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks timed different numbers of steps: {sorted(lengths)}")
    return [max(steps) for steps in zip(*per_rank, strict=False)]


@dataclass(frozen=True)
class HostLoad:
    """The 1-minute load average (runnable threads, as ``uptime`` shows) and logical CPUs."""

    load_1m: float
    cpus: int

    @classmethod
    def now(cls) -> HostLoad:
        return cls(os.getloadavg()[0], os.cpu_count() or 1)


def host_shared(before: float, after: float, own_threads: int) -> bool:
    """True when the host ran more than the trial itself: the 1-minute load average before or
    after the timed steps exceeds the threads the trial's processes keep busy on this host.

    The load average lags (it is a one-minute exponential average), so the trial's own threads
    contribute at most ``own_threads`` to it; anything above that was someone else's work."""
    return max(before, after) > own_threads
