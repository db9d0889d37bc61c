"""Where and with what a row was produced: commit, libraries, host, time, command line.

Torch-free: the torch version comes from the installed distribution's metadata, and the CUDA
version from torch only when the process has already imported it (a sweep runner writing an
error row for a failed job has not, and records ``cuda: null``).
"""
from __future__ import annotations

import datetime
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from .schema import Environment

_GIT_CACHE: dict[str, tuple[str, bool]] = {}
LIBRARIES = ("numpy", "deepspeed", "flash-attn", "ring-flash-attn", "yunchang", "transformers", "submitit")
PACKAGES = ("records", "methods", "bench", "sweeps", "analysis")  # the project's code: what a row's run imports


def git_dirty(root: Path) -> bool:
    """Whether the code at ``root`` differs from its commit: a tracked file changed anywhere, or an
    untracked file inside one of ``PACKAGES`` (a method file not committed yet registers and runs,
    on a commit that lacks it). Untracked files elsewhere (scratch files, rows under ``runs/``)
    are not code a row ran, and ignored files (caches) are not seen."""
    out = subprocess.run(["git", "status", "--porcelain", "-z", "--untracked-files=normal"], cwd=root,
                         capture_output=True, text=True, timeout=10).stdout
    for entry in filter(None, out.split("\0")):
        status, path = entry[:2], entry[3:]
        if status != "??" or path.split("/", 1)[0] in PACKAGES:
            return True
    return False


def _git_info() -> tuple[str, bool]:
    if "info" not in _GIT_CACHE:
        root = Path(__file__).resolve().parents[1]
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or "unknown"
            dirty = git_dirty(root)
        except (OSError, subprocess.SubprocessError):
            commit, dirty = "unknown", False
        _GIT_CACHE["info"] = (commit, dirty)
    return _GIT_CACHE["info"]


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(kernel: str, device_name: str) -> Environment:
    """Where and with what a row was produced."""
    commit, dirty = _git_info()
    torch = sys.modules.get("torch")
    return Environment(
        git_commit=commit,
        git_dirty=dirty,
        torch=torch.__version__ if torch is not None else (_version("torch") or "not installed"),
        cuda=torch.version.cuda if torch is not None else None,
        python=platform.python_version(),
        libraries={name: _version(name) for name in LIBRARIES},
        device_name=device_name,
        kernel=kernel,
        host=socket.gethostname(),
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        argv=list(sys.argv),
    )
