"""Fixtures for the sweep tests.

``slurm_cluster`` (session scope) brings up the single-node Slurm cluster of
``scripts/slurm-up.sh`` once per session (a no-op when it is already up). A cluster this
session started is stopped at its end (``scripts/slurm-down.sh``: slurmd, slurmctld, slurmdbd,
MariaDB, munged), unless ``CPAB_KEEP_SLURM=1`` keeps it for faster later sessions; a cluster
that was already up is left as it was. It skips the tests that use it only
when the script says it cannot work here (exit 3: not root; exit 4: no apt-get, or apt cannot
offer the packages); any other failure of the script errors those tests with its output.

Jobs must not outlive the session: tests submit with ``cluster.job_name`` (see
``SlurmCluster.executor``), the fixture cancels every job of that name at the end of the session,
and at its start it cancels jobs left by earlier sessions that died without cleaning up (their
name carries the pid of a pytest process that no longer exists on this host).
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SLURM_UP = REPO_ROOT / "scripts" / "slurm-up.sh"
SLURM_DOWN = REPO_ROOT / "scripts" / "slurm-down.sh"
SLURM_UP_TIMEOUT_S = 1200  # a first run installs packages with apt
# Exit codes of slurm-up.sh that mean "Slurm cannot be brought up on this machine": skip.
SKIP_EXIT_CODES = {3: "not root", 4: "apt-get missing or cannot offer the packages"}
JOB_NAME_PREFIX = "cpab-pytest"


def _tail(text: str, n: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


@dataclasses.dataclass
class SlurmCluster:
    """Handle on the running cluster, for tests."""

    partition: str
    job_name: str  # every job of this session carries it, so teardown can cancel them
    user: str
    up_output: str  # what slurm-up.sh printed
    up_seconds: float

    def executor(self, folder: Path | str, **parameters):
        """A submitit executor for this cluster with this session's job name and partition."""
        import submitit

        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        executor.update_parameters(name=self.job_name, slurm_partition=self.partition, **parameters)
        return executor

    def queue(self) -> str:
        """squeue's view of every job on the cluster (for failure messages)."""
        proc = _run(["squeue", "-o", "%.8i %.30j %.8u %.10T %.10M %R"])
        return proc.stdout if proc.returncode == 0 else proc.stderr

    def cancel_all(self) -> None:
        _run(["scancel", "-u", self.user, "-n", self.job_name])


def _session_job_name() -> str:
    return f"{JOB_NAME_PREFIX}-{socket.gethostname()}-{os.getpid()}"


def _cancel_orphaned_jobs(user: str) -> None:
    """Cancel this user's test jobs whose submitting pytest process (on this host) is gone."""
    proc = _run(["squeue", "-h", "-u", user, "-o", "%i %j"])
    if proc.returncode != 0:
        return
    prefix = f"{JOB_NAME_PREFIX}-{socket.gethostname()}-"
    for line in proc.stdout.splitlines():
        job_id, _, name = line.strip().partition(" ")
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _run(["scancel", job_id])


def _cluster_is_up() -> bool:
    """True when a Slurm controller answers and a node is up (slurm-up.sh's own test)."""
    if shutil.which("sinfo") is None:
        return False
    try:
        proc = _run(["sinfo", "-h", "-o", "%T"], timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0 and any(s.strip() in ("idle", "mixed", "allocated") for s in proc.stdout.split())


@pytest.fixture(scope="session")
def slurm_cluster():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("Slurm cluster unavailable: bash not found, cannot run scripts/slurm-up.sh")
    was_up = _cluster_is_up()
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [bash, str(SLURM_UP)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=SLURM_UP_TIMEOUT_S,
            cwd=REPO_ROOT,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(
            f"scripts/slurm-up.sh did not finish in {SLURM_UP_TIMEOUT_S} s; its output:\n{out}",
            pytrace=False,
        )
    seconds = time.monotonic() - start
    output = proc.stdout or ""
    if proc.returncode in SKIP_EXIT_CODES:
        pytest.skip(
            f"Slurm cluster unavailable ({SKIP_EXIT_CODES[proc.returncode]}): scripts/slurm-up.sh "
            f"exited {proc.returncode}:\n{_tail(output)}"
        )
    if proc.returncode != 0:
        pytest.fail(
            f"scripts/slurm-up.sh failed (exit {proc.returncode}) after {seconds:.1f} s; its output:\n{output}",
            pytrace=False,
        )
    missing = [b for b in ("sbatch", "srun", "squeue", "scancel", "sacct") if shutil.which(b) is None]
    if missing:
        pytest.fail(f"scripts/slurm-up.sh succeeded but {missing} are not on PATH:\n{output}", pytrace=False)

    user = getpass.getuser()
    _cancel_orphaned_jobs(user)
    cluster = SlurmCluster(
        partition="debug",
        job_name=_session_job_name(),
        user=user,
        up_output=output,
        up_seconds=seconds,
    )
    try:
        yield cluster
    finally:
        cluster.cancel_all()  # the session's jobs never outlive it
        if not was_up and os.environ.get("CPAB_KEEP_SLURM") != "1":
            down = _run([bash, str(SLURM_DOWN)], timeout=120)
            if down.returncode != 0:
                print(f"scripts/slurm-down.sh failed (exit {down.returncode}):\n{_tail(down.stdout + down.stderr)}")


@pytest.fixture
def no_flash_attn(monkeypatch):
    """flash-attn not importable here, as on a login node without CUDA: the session's stand-in
    (tests/flash_attn_standin.py) hidden from the registry's import check."""
    from methods.core import registry

    absent = ("flash_attn", "flash_attn_interface")
    importable = registry._importable
    monkeypatch.setattr(registry, "_importable", lambda module: module not in absent and importable(module))
    assert not registry.get_info("yc-usp").usable
