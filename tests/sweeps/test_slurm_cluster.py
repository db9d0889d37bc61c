"""submitit against the real single-node Slurm cluster of scripts/slurm-up.sh.

A 2-task job initialises torch.distributed (gloo) from ``submitit.JobEnvironment()`` and
all-reduces; a job that raises comes back as ``FailedJobError``; accounting (slurmdbd) makes
``job.state`` read COMPLETED / FAILED.
"""

from __future__ import annotations

import time
import uuid

import pytest

from . import _slurm_jobs

submitit = pytest.importorskip("submitit")

pytestmark = pytest.mark.slurm

JOB_TIMEOUT_S = 60  # per job, queueing included; both tests take a few seconds when all is well
STATE_TIMEOUT_S = 30  # for sacct to report the final state once the result is in


def _wait_done(job, cluster, timeout: float = JOB_TIMEOUT_S) -> None:
    """Wait for a job to finish; cancel it and fail with squeue's view if it takes too long."""
    deadline = time.monotonic() + timeout
    while not job.done():
        if time.monotonic() > deadline:
            state = job.get_info(mode="force").get("State", "UNKNOWN")
            queue = cluster.queue()
            job.cancel(check=False)
            pytest.fail(
                f"job {job.job_id} not done after {timeout} s (state {state}); the queue then:\n{queue}\n"
                f"job stdout:\n{job.stdout()}\njob stderr:\n{job.stderr()}",
                pytrace=False,
            )
        time.sleep(0.5)


def _wait_state(job, expected: str, timeout: float = STATE_TIMEOUT_S) -> str:
    """Poll sacct (through submitit) until ``job.state`` is ``expected`` or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        job.get_info(mode="force")  # refresh submitit's cached sacct view
        state = job.state
        if state == expected or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def test_two_task_gloo_all_reduce(slurm_cluster, tmp_path):
    executor = slurm_cluster.executor(
        tmp_path,
        nodes=1,
        tasks_per_node=2,
        cpus_per_task=1,
        mem_gb=1,
        timeout_min=5,
    )
    port = _slurm_jobs.free_port()
    job = executor.submit(_slurm_jobs.gloo_all_reduce, port)
    assert isinstance(job, submitit.SlurmJob)
    _wait_done(job, slurm_cluster)

    results = job.results()  # one per task
    assert len(results) == 2, results
    assert sorted(r["global_rank"] for r in results) == [0, 1]
    assert sorted(r["local_rank"] for r in results) == [0, 1]
    for r in results:
        assert r["num_tasks"] == 2
        assert r["job_id"] == job.job_id
        assert r["all_reduce_sum"] == 3.0  # (0 + 1) + (1 + 1)

    state = _wait_state(job, "COMPLETED")
    assert state == "COMPLETED", f"sacct says {state!r} for job {job.job_id}"


def test_failing_job_reports_exception_and_failed_state(slurm_cluster, tmp_path):
    executor = slurm_cluster.executor(
        tmp_path,
        nodes=1,
        tasks_per_node=1,
        cpus_per_task=1,
        mem_gb=1,
        timeout_min=5,
    )
    message = f"deliberate failure {uuid.uuid4().hex}"
    job = executor.submit(_slurm_jobs.raise_runtime_error, message)
    _wait_done(job, slurm_cluster)

    with pytest.raises(submitit.core.utils.FailedJobError) as excinfo:
        job.result()
    assert message in str(excinfo.value)
    assert "RuntimeError" in str(excinfo.value)

    state = _wait_state(job, "FAILED")
    assert state == "FAILED", f"sacct says {state!r} for job {job.job_id}"
