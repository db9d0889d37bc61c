"""Session-wide test set-up: the flash-attn stand-in, installed before any test is collected.

Without flash-attn (no CPU build exists) the ``rfa-zigzag`` and ``ds-fpdt`` wrappers would be
unusable and drop out of ``methods.available()``, so the correctness matrix would never run
them. Installing the plain-torch stand-in at import time of this conftest (before collection
imports the test modules) makes them usable here; the rank pools install it on each rank
(tests/methods/conftest.py). It does nothing where a real flash-attn is importable.

``bench`` is imported first, before anything imports torch, so that simulated trials in this
process run on the GPU code path (``bench.stackmodel.simcuda`` must be loaded before torch).
"""
import os
from pathlib import Path

# One torch thread per test process and per subprocess it starts (before torch is imported): two
# pytest-xdist workers already fill the two cores, and a second intra-op thread per process only
# waits for a core, which slows every small op (spin-waits under oversubscription). Trials' ranks
# set their own thread counts (bench.measure.launch), so what a test checks of threads is unchanged.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

import bench  # noqa: F401, I001, E402 - first of all: it loads the simulated CUDA device before torch
from tests.flash_attn_standin import install_if_missing  # noqa: E402
from tests.xdist_modules import MODULE_SCHEDULED, SAME_WORKER, module_scheduler  # noqa: E402

install_if_missing()

pytest_plugins = ["tests.suite_profile"]  # seconds per module and per worker, at the end of a run


# ------------------------------------------------------------------------ the `slow` marker
# `make test-fast` (`pytest -m "not slow"`) is the inner loop; `make test` and CI run everything.
# A test is slow when it uses a fixture that spawns rank pools or brings up Slurm (SLOW_FIXTURES,
# wherever the test lives), or sits in a module that spawns subprocesses, sweeps or notebooks
# itself (SLOW_MODULES).
SLOW_FIXTURES = {"pool", "slurm_cluster"}
SLOW_MODULES = {
    "tests/methods/test_correctness.py", "tests/methods/test_ring_usp.py", "tests/methods/test_offload_fpdt.py",
    "tests/methods/test_wrappers.py",
    "tests/bench/measure/test_modes.py", "tests/bench/training/test_step.py", "tests/bench/search/test_autochunk.py",
    "tests/bench/search/test_maxctx.py", "tests/bench/search/test_plan.py", "tests/bench/test_cli.py",
    "tests/bench/measure/test_launch.py",
    "tests/bench/stackmodel/test_simulated_flash_attn.py",
    "tests/sweeps/test_local_sweep.py", "tests/sweeps/test_slurm_cluster.py", "tests/sweeps/test_slurm_sweep.py",
    "tests/analysis/test_notebooks.py", "tests/analysis/test_adding_a_method.py", "tests/analysis/test_figs_cli.py",
    "tests/test_user_runs.py",
}


# The suite simulates rank 0 alone (bench.measure.run.SIM_RANKS_ENV), as every test did before
# simulations took the worst rank: an asymmetric method at C ranks would cost C simulations in every
# test that simulates one. tests/bench/measure/test_worst_rank.py sets it back to "deciding" and checks
# the worst-rank path itself. Subprocesses inherit it.
os.environ.setdefault("CPAB_SIM_RANKS", "0")


def pytest_configure(config):
    root = Path(__file__).resolve().parents[1]
    missing = sorted(m for m in SLOW_MODULES if not (root / m).is_file())
    missing += sorted(m for m in SAME_WORKER if not (root / m).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOW_MODULES or tests/xdist_modules.py SAME_WORKER names missing "
                                f"files: {missing}")


def pytest_collection_modifyitems(config, items):
    """Marks ``slow`` tests (by fixture or module)."""
    root = Path(__file__).resolve().parents[1]
    for item in items:
        module = str(Path(item.fspath).relative_to(root))
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SLOW_FIXTURES or module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


# ------------------------------------------------------------------------ one worker per module
# `make test` runs two pytest-xdist workers with `--dist loadscope`, scheduled by module
# (tests/xdist_modules.py): a module runs whole, in order, on one worker, so its module-scoped
# fixtures run once and the matrix's verdicts after its cases see them all. `--dist loadgroup` (what
# `make test` ran before) gets the same scheduler: xdist's own grouping is lost under pytest 9.2.
@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    return module_scheduler(config, log) if config.getvalue("dist") in MODULE_SCHEDULED else None
