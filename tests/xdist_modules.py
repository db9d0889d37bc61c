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

import json
from collections import defaultdict
from pathlib import Path, PurePath

# the --dist modes scheduled by module here (tests/conftest.py, pytest_xdist_make_scheduler)
MODULE_SCHEDULED = ("loadscope", "loadgroup")

# Modules that must share one pytest-xdist worker: the Slurm tests share one cluster, which the
# session that started it stops at its end (tests/sweeps/conftest.py).
SAME_WORKER = {
    "tests/sweeps/test_slurm_cluster.py": "slurm", "tests/sweeps/test_slurm_sweep.py": "slurm",
}


# Seconds each module took in a full run (tests/suite_profile.py writes them where
# $CPAB_MODULE_SECONDS_OUT names a file): the scheduler hands out the longest modules first, so the
# run does not end with one worker busy on a long module the other could have shared the time of.
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
# a module missing from MODULE_SECONDS (a new one) is expected to take this much per test
SECONDS_PER_NEW_TEST = 0.5


def load_module_seconds(path: Path = MODULE_SECONDS) -> dict[str, float]:
    """``MODULE_SECONDS``'s table (module -> seconds); empty where the file is missing."""
    return json.loads(path.read_text()) if path.is_file() else {}


def longest_first(work: dict[str, dict], seconds: dict[str, float]) -> list[str]:
    """The scopes of ``work`` (scope -> its node ids) by expected seconds, the longest first: a scope's
    modules' seconds from ``seconds``, ``SECONDS_PER_NEW_TEST`` per test for a module not in it; ties
    keep their order in ``work``."""
    def expected(scope: str) -> float:
        per_module: dict[str, int] = defaultdict(int)
        for nodeid in work[scope]:
            per_module[module_of(nodeid)] += 1
        return sum(seconds.get(module, SECONDS_PER_NEW_TEST * n) for module, n in per_module.items())

    return sorted(work, key=expected, reverse=True)


def module_of(nodeid: str) -> str:
    """``tests/x/test_y.py`` of ``tests/x/test_y.py::test_z[param]``."""
    return PurePath(nodeid.split("::", 1)[0]).as_posix()


def scope_of(nodeid: str) -> str:
    """The unit of work a node id belongs to: its module, or its ``SAME_WORKER`` group."""
    module = module_of(nodeid)
    return SAME_WORKER.get(module, module)


def module_scheduler(config, log):
    """xdist's ``--dist loadscope`` scheduler with modules (and ``SAME_WORKER`` groups) as the scopes, test
    classes included in their module's scope, handed out the longest first (``longest_first``). xdist is
    imported here, so that this module (which tests/conftest.py imports) loads where xdist is not
    installed."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the queue is complete at the first assignment: order it once
                seconds = load_module_seconds()
                for scope in longest_first(dict(self.workqueue), seconds):
                    self.workqueue.move_to_end(scope)
                self.ordered = True
            super()._assign_work_unit(node)

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
