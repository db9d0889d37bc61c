"""Real ranks: spawn them locally, or join the ones torchrun / submitit already started.

``run_ranks(world_size, fn, *args)`` runs ``fn(group, *args)`` on every rank and returns the
list of every rank's result (rank order):

* launched: this process is one rank of a job started by ``torchrun`` (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK`` in the environment) or by
  submitit with several tasks (``submitit.JobEnvironment``), or ``torch.distributed`` is
  already initialised. A one-task job counts as not launched: it spawns its ranks.
  The default process group is initialised from that environment (NCCL when CUDA is
  available, gloo otherwise), ``fn`` runs here, and the results are all-gathered.
* otherwise: ``world_size`` processes are spawned on this host (``torch.multiprocessing``,
  spawn start method), each with a gloo group (NCCL when asked and CUDA is there) and
  ``cpu_count // world_size`` threads (at least one), and their results come back
  through a queue. If a rank raises, the others are terminated and ``RankError`` carries
  the failing rank's traceback; a rank that dies without a result (killed by the
  out-of-memory killer, say) is reported with its exit code.
"""
from __future__ import annotations

import datetime
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600


class RankError(RuntimeError):
    """A spawned rank failed; ``exitcode`` is set when it died without reporting."""

    def __init__(self, message: str, rank: int, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode


def host_store(timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The rendezvous store of locally spawned ranks, served by this (the parent) process.

    The OS picks its port as it binds, so no other process can take the port between choosing and
    binding (the race a free-port probe that rank 0 binds later loses under parallel launches, as
    torchrun's agent-hosted store avoids).
    """
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def launched_env() -> dict[str, Any] | None:
    """This process's rank info when started as one rank of a job, else ``None``."""
    if dist.is_available() and dist.is_initialized():
        return {"source": "initialized", "rank": dist.get_rank(), "world_size": dist.get_world_size(),
                "local_rank": int(os.environ.get("LOCAL_RANK", 0))}
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return {"source": "torchrun", "rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", 0)), "master_addr": env["MASTER_ADDR"],
                "master_port": int(env["MASTER_PORT"])}
    if "SUBMITIT_EXECUTOR" in env or "SUBMITIT_FOLDER" in env:
        try:
            import submitit

            job = submitit.JobEnvironment()
        except Exception:  # noqa: BLE001 - not inside a submitit job after all
            return None
        if job.num_tasks <= 1:  # a one-task job spawns its own ranks
            return None
        hosts = list(getattr(job, "hostnames", None) or ["127.0.0.1"])
        port = 20000 + (abs(hash(str(job.job_id))) % 20000)
        return {"source": "submitit", "rank": job.global_rank, "world_size": job.num_tasks,
                "local_rank": job.local_rank, "master_addr": hosts[0],
                "master_port": int(env.get("MASTER_PORT", port))}
    return None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(info: dict[str, Any], backend: str | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialise the default process group of a launched rank (no-op if already done)."""
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(info["local_rank"])
    dist.init_process_group(
        backend, init_method=f"tcp://{info['master_addr']}:{info['master_port']}",
        rank=info["rank"], world_size=info["world_size"], timeout=datetime.timedelta(seconds=timeout_s),
    )


def local_device(kind: str) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` for CUDA runs, else the CPU."""
    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _worker(rank: int, size: int, port: int, backend: str, threads: int, fn, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
        except RuntimeError as err:
            if GLOO_CONNECT_FAILED in str(err):  # the parent may spawn the ranks again (spawn)
                results.put((rank, False, f"{GLOO_CONNECT_FAILED}: {traceback.format_exc()}"))
                return
            raise
        value = fn(dist.group.WORLD, *args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


# gloo's message when its full mesh of pairs between the ranks could not be connected (a peer's socket
# closed during the handshake). Seen on a loaded host with other jobs' gloo groups forming at the same
# time; it happens before any of the task's work, so the ranks can be spawned again.
GLOO_CONNECT_FAILED = "Gloo connectFullMesh failed"
SPAWN_ATTEMPTS = 2


def spawn(world_size: int, fn: Callable, *args, backend: str = "gloo",
          timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None) -> list:
    """Run ``fn(group, *args)`` on ``world_size`` freshly spawned local ranks; results by rank.

    ``fn`` must be importable by name (module level) since ranks are spawned, not forked. Where gloo
    could not connect the ranks to each other (``GLOO_CONNECT_FAILED``, before ``fn`` ran anywhere),
    the ranks are spawned again, up to ``SPAWN_ATTEMPTS`` times in all, saying so on stderr.
    """
    for attempt in range(2, SPAWN_ATTEMPTS + 1):  # the attempts before the last, which raises what it raises
        try:
            return _spawn_once(world_size, fn, *args, backend=backend, timeout_s=timeout_s, threads=threads)
        except RankError as err:
            if GLOO_CONNECT_FAILED not in str(err):
                raise
            print(f"launch: gloo could not connect the {world_size} ranks (rank {err.rank}: "
                  f"{GLOO_CONNECT_FAILED}); spawning them again ({attempt}/{SPAWN_ATTEMPTS})",
                  file=sys.stderr, flush=True)
    return _spawn_once(world_size, fn, *args, backend=backend, timeout_s=timeout_s, threads=threads)


def _spawn_once(world_size: int, fn: Callable, *args, backend: str, timeout_s: float,
                threads: int | None) -> list:
    """One attempt of ``spawn``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = host_store()  # kept alive until the ranks are done
    port = store.port
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, threads, fn, args, results),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    r, code = dead[0]
                    raise RankError(f"rank {r} died without a result (exit code {code})", r, code) from None
                if time.monotonic() > deadline:
                    raise RankError(f"ranks {sorted(set(range(world_size)) - set(got))} timed out "
                                    f"after {timeout_s:.0f}s", -1) from None
                continue
            if not ok:
                raise RankError(f"rank {rank} raised:\n{value}", rank)
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [got[r] for r in range(world_size)]


def run_ranks(world_size: int, fn: Callable, *args, backend: str | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list:
    """``fn(group, *args)`` on every rank; every rank's result in rank order (see module doc)."""
    info = launched_env()
    if info is not None and info["world_size"] == 1 and world_size > 1 and not dist.is_initialized():
        info = None  # a single launched process (torchrun --nproc-per-node 1): spawn the ranks here
    if info is not None:
        if info["world_size"] != world_size:
            raise ValueError(
                f"this process was launched as one of {info['world_size']} ranks ({info['source']}), "
                f"but world size {world_size} was asked for: make them equal"
            )
        init_from_env(info, backend, timeout_s)
        value = fn(dist.group.WORLD, *args)
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, value)
        return gathered
    return spawn(world_size, fn, *args, backend=backend or "gloo", timeout_s=timeout_s)


def is_rank_zero() -> bool:
    """True unless this is a launched rank other than 0 (who prints and writes rows)."""
    info = launched_env()
    return info is None or info["rank"] == 0
