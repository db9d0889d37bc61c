"""Where the suite's time goes: at the end of a run, the seconds each test module took (setup, call
and teardown summed, the slowest modules first) and each pytest-xdist worker's busy seconds.

``--durations`` names single tests; the suite's time is spread over modules of many short tests
(the correctness matrix) and uneven work per worker, which only these sums show. CI prints the tail
of its log, so the summary is short: ``CPAB_PROFILE_MODULES`` modules (default 20).

Under ``--dist loadscope`` (``make test``) or ``loadgroup``, both scheduled by module
(tests/xdist_modules.py), it also fails the run where a module's tests ran on more than one worker:
its module-scoped fixtures would have run twice, and the matrix's verdicts after its cases would have
seen only some of them.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.xdist_modules import MODULE_SCHEDULED, WorkersPerModule, module_of

_modules: Counter[str] = Counter()
_workers: Counter[str] = Counter()
_started = time.monotonic()
_per_module = WorkersPerModule()


def pytest_runtest_logreport(report) -> None:
    _modules[module_of(report.nodeid)] += report.duration
    node = getattr(report, "node", None)  # pytest-xdist's worker, on the controller
    gateway = getattr(getattr(node, "gateway", None), "id", None)
    _workers[gateway or "main"] += report.duration
    _per_module.add(report.nodeid, gateway)


def pytest_sessionfinish(session) -> None:
    out = os.environ.get("CPAB_MODULE_SECONDS_OUT")  # the scheduler's table (tests/xdist_modules.py)
    if out and _modules and "PYTEST_XDIST_WORKER" not in os.environ:  # the controller's sums, all workers
        table = {module: round(seconds, 1) for module, seconds in sorted(_modules.items())}
        Path(out).write_text(json.dumps(table, indent=0) + "\n")
    split = _per_module.split() if session.config.getvalue("dist") in MODULE_SCHEDULED else {}
    if split:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        session.config._cpab_split_modules = split


@pytest.hookimpl(trylast=True)  # after --durations, so both stay in the tail CI shows
def pytest_terminal_summary(terminalreporter, config) -> None:
    if _modules:
        _profile(terminalreporter)
    # last, so that CI's tail shows it
    for scope, workers in sorted(getattr(config, "_cpab_split_modules", {}).items()):
        terminalreporter.write_line(f"ERROR: {scope} ran on workers {', '.join(workers)}: every module must run on one "
                                    "worker (tests/xdist_modules.py schedules by module)", red=True)


def _profile(terminalreporter) -> None:
    shown = int(os.environ.get("CPAB_PROFILE_MODULES", "20"))
    write = terminalreporter.write_line
    terminalreporter.section("seconds per test module (setup + call + teardown)")
    for module, seconds in _modules.most_common(shown):
        write(f"{seconds:8.1f}  {module}")
    rest = sum(_modules.values()) - sum(s for _, s in _modules.most_common(shown))
    write(f"{rest:8.1f}  the other {max(len(_modules) - shown, 0)} modules")
    busy = "  ".join(f"{w} {s:.0f} s" for w, s in sorted(_workers.items()))
    write(f"busy per worker: {busy}; wall {time.monotonic() - _started:.0f} s")
