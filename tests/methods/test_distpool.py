"""tests.distpool.RankPool, the shared gloo ranks: a rank that dies ends the check at once (not at the task
timeout) and the pool starts new ranks; a module's start-up (``install``) runs on those new ranks too, and
``uninstall`` takes it back. One test, since each restart costs a pool's start (seconds of imports per rank)."""
from __future__ import annotations

import os
import time

import pytest

from tests.distpool import RemoteError

MARK = "CPAB_TEST_DISTPOOL_MARK"


def _set_mark(value: str) -> None:
    os.environ[MARK] = value


def _drop_mark() -> None:
    os.environ.pop(MARK, None)


def _mark(group) -> str | None:
    return os.environ.get(MARK)


def _pid(group) -> int:
    return os.getpid()


def test_a_dead_rank_fails_at_once_and_installs_reach_the_new_ranks(pool):
    pool.install(_set_mark, "on")
    try:
        assert pool.run(_mark) == ["on"] * pool.size, "install did not run on every rank"
        before = pool.run(_pid)
        pool.procs[1].kill()
        pool.procs[1].join()
        start = time.monotonic()
        with pytest.raises(RemoteError, match=r"rank 1 died"):
            pool.run(_pid, world_size=2)
        assert time.monotonic() - start < 60, "a dead rank was noticed only at the task timeout"
        after = pool.run(_pid)
        assert len(set(after)) == pool.size and set(after).isdisjoint(before), "the pool did not start new ranks"
        assert pool.run(_mark) == ["on"] * pool.size, "the install did not reach the new ranks"
    finally:
        pool.uninstall(_set_mark, "on", undo=_drop_mark)
    assert pool.run(_mark) == [None] * pool.size and not pool.installed, "uninstall left the mark behind"
