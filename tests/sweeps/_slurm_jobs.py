"""Functions that the Slurm tests run inside jobs.

submitit pickles a submitted function by reference (module name + attribute), and the job's
Python has to import that module again. Under pytest this module's name depends on the import
mode (``sweeps._slurm_jobs`` with pytest's default rootdir-relative ``prepend`` mode, which in
the job would resolve to the real ``sweeps`` package instead), so the module registers itself
with cloudpickle to be pickled *by value*: the job needs torch and submitit, not this file.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

import cloudpickle


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (chosen by the submitting side)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def gloo_all_reduce(master_port: int, master_addr: str = "127.0.0.1") -> dict:
    """Run in every task of a Slurm job: all_reduce(rank + 1) over gloo, return what each saw."""
    import submitit
    import torch
    import torch.distributed as dist

    env = submitit.JobEnvironment()
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=env.global_rank,
        world_size=env.num_tasks,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        value = torch.tensor([float(env.global_rank + 1)])
        dist.all_reduce(value)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "job_id": env.job_id,
        "global_rank": env.global_rank,
        "local_rank": env.local_rank,
        "num_tasks": env.num_tasks,
        "hostname": env.hostname,
        "all_reduce_sum": value.item(),
    }


def raise_runtime_error(message: str) -> None:
    """Run in a Slurm job: fail with ``message``."""
    raise RuntimeError(message)


cloudpickle.register_pickle_by_value(sys.modules[__name__])
