"""pytest-xdist scheduling by test module: every module runs whole, in order, on one worker.

Module-scoped fixtures (rank pools, shared simulations, plan caches) then run once per module, and
the matrix's verdicts that follow its cases (``test_every_method_ran_a_case``) see every case. The
modules of ``SAME_WORKER`` share one worker too (the Slurm tests share one cluster).

Why not xdist's own ``--dist loadgroup``: it groups by suffixing each item's ``_nodeid`` with its group
on the workers, and pytest 9.2 keeps a node's id elsewhere (``Node._id``), so the suffix is lost and the
groups silently degrade to ``--dist load``: one module's tests spread over both workers, and each worker
builds the module's fixtures again. Here the controller groups by the module part of each node id, which
depends on no pytest internals (tests/conftest.py installs ``module_scheduler`` for ``loadscope`` and
``loadgroup``); ``WorkersPerModule`` lets tests/suite_profile.py fail a run where a module still ran on
two workers.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import PurePath

# the --dist modes scheduled by module here (tests/conftest.py, pytest_xdist_make_scheduler)
MODULE_SCHEDULED = ("loadscope", "loadgroup")

# Modules that must share one pytest-xdist worker: the Slurm tests share one cluster, which the
# session that started it stops at its end (tests/sweeps/conftest.py).
SAME_WORKER = {
    "tests/sweeps/test_slurm_cluster.py": "slurm", "tests/sweeps/test_slurm_sweep.py": "slurm",
}


def module_of(nodeid: str) -> str:
    """``tests/x/test_y.py`` of ``tests/x/test_y.py::test_z[param]``."""
    return PurePath(nodeid.split("::", 1)[0]).as_posix()


def scope_of(nodeid: str) -> str:
    """The unit of work a node id belongs to: its module, or its ``SAME_WORKER`` group."""
    module = module_of(nodeid)
    return SAME_WORKER.get(module, module)


def module_scheduler(config, log):
    """xdist's ``--dist loadscope`` scheduler with modules (and ``SAME_WORKER`` groups) as the scopes, test
    classes included in their module's scope. xdist is imported here, so that this module (which
    tests/conftest.py imports) loads where xdist is not installed."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ModuleScheduling(config, log)


class WorkersPerModule:
    """On the controller: which workers ran each module's tests (from their reports)."""

    def __init__(self) -> None:
        self.workers: dict[str, set[str]] = defaultdict(set)

    def add(self, nodeid: str, worker: str | None) -> None:
        if worker is not None:
            self.workers[scope_of(nodeid)].add(worker)

    def split(self) -> dict[str, list[str]]:
        """Scopes whose tests ran on more than one worker."""
        return {scope: sorted(w) for scope, w in self.workers.items() if len(w) > 1}
