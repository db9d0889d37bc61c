"""A persistent pool of gloo ranks shared by many checks (spawning costs ~1 s per rank).

``RankPool(4)`` spawns 4 CPU ranks once, each with the world group and subgroups of the
first 1, 2 and 4 ranks. ``pool.run(fn, *args, world_size=2)`` runs ``fn(group, *args)``
on ranks 0..1 with the 2-rank group (the others idle) and returns each rank's result.
``fn`` must be a module-level function (it is pickled by reference). An exception on a
rank is re-raised here with the remote traceback; a hang (one rank raised while its
peers wait in a collective) ends at the gloo timeout and the pool is restarted.
"""
from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

GLOO_TIMEOUT_S = 30
# A task's first call on a rank imports its module (unpickling ``fn``): on a loaded machine (two
# pytest-xdist workers on two cores) one rank may take far longer than GLOO_TIMEOUT_S to get there,
# so the ranks meet at a barrier with this timeout before ``fn``'s own collectives start.
IMPORT_TIMEOUT_S = 600
NO_POOLS = "CPAB_NO_POOLS"  # set by make test-fast: spawning a pool is then an error


def _worker(rank: int, size: int, port: int, tasks, results, setup: Callable | None) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if setup is not None:
        setup()
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=IMPORT_TIMEOUT_S))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    )
    groups = {n: dist.new_group(list(range(n))) for n in (1, 2, 4, 8) if n < size}
    groups[size] = dist.group.WORLD
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs, n = task
        if rank >= n:
            continue
        try:
            if n > 1:  # every rank has imported what the task needs
                dist.monitored_barrier(groups[n], timeout=datetime.timedelta(seconds=IMPORT_TIMEOUT_S))
            results.put((rank, True, fn(groups[n], *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RemoteError(AssertionError):
    """A check raised on a rank; the message holds that rank's traceback."""


def _call(group, fn: Callable, args: tuple) -> None:
    fn(*args)


class RankPool:
    def __init__(self, size: int = 4, setup: Callable | None = None, task_timeout: float = 300) -> None:
        self.size, self.setup, self.task_timeout = size, setup, task_timeout
        self.installed: list[tuple[Callable, tuple]] = []  # run on every rank now and after each restart
        self._start()

    def _start(self) -> None:
        if os.environ.get(NO_POOLS):  # make test-fast: a test that gets here lacks its `slow` marker
            raise RuntimeError(f"{NO_POOLS} is set (make test-fast), yet a test spawns a rank pool: mark it slow "
                               "(use the `pool` fixture, tests/conftest.py SLOW_FIXTURES, or list its module in "
                               "SLOW_MODULES)")
        ctx = mp.get_context("spawn")
        from bench.measure.launch import host_store  # the parent serves the rendezvous (no port race)

        self._store = host_store(IMPORT_TIMEOUT_S)
        port = self._store.port
        self.tasks = [ctx.Queue() for _ in range(self.size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.size, port, self.tasks[r], self.results, self.setup),
                daemon=True,
            )
            for r in range(self.size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args: Any, world_size: int | None = None, **kwargs: Any) -> list:
        """Run ``fn(group, *args, **kwargs)`` on the first ``world_size`` ranks; results by rank."""
        n = self.size if world_size is None else world_size
        if n not in (1, 2, 4, 8) and n != self.size or n > self.size:
            raise ValueError(f"world_size {n} not available in a pool of {self.size}")
        for q in self.tasks:
            q.put((fn, args, kwargs, n))
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + self.task_timeout
        while len(got) < n:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                late = time.monotonic() > deadline
                if dead or late:
                    self.restart()
                    why = f"rank {dead[0]} died" if dead else f"timed out after {self.task_timeout}s"
                    raise RemoteError(f"{fn.__name__}: {why}; ranks done: {sorted(got)}") from None
                continue
            got[rank] = (ok, value)
        failures = [(r, v) for r, (ok, v) in sorted(got.items()) if not ok]
        if failures:
            # a failed rank may have left its peers' gloo state broken: start clean for the next check
            self.restart()
            raise RemoteError(f"rank {failures[0][0]} raised:\n{failures[0][1]}")
        return [got[r][1] for r in range(n)]

    def install(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` on every rank now and again on the new ranks after any restart, until
        ``uninstall(fn, *args)``: a module's own start-up on a pool that outlives the module."""
        self.run(_call, fn, args)
        self.installed.append((fn, args))

    def uninstall(self, fn: Callable, *args: Any, undo: Callable | None = None, undo_args: tuple = ()) -> None:
        """Stop re-running an ``install``; ``undo(*undo_args)`` runs on every rank to take it back."""
        self.installed.remove((fn, args))
        if undo is not None:
            self.run(_call, undo, undo_args)

    def restart(self) -> None:
        self.close()
        self._start()
        for fn, args in self.installed:
            self.run(_call, fn, args)

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
