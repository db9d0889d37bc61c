"""The scheduling by module (tests/xdist_modules.py): scopes, their order, and the check that fails a split module."""
from tests.xdist_modules import (
    MODULE_SECONDS,
    SAME_WORKER,
    SECONDS_PER_NEW_TEST,
    WorkersPerModule,
    load_module_seconds,
    longest_first,
    module_of,
    scope_of,
)


def test_a_module_is_one_scope_whatever_its_classes_and_parameters():
    assert scope_of("tests/bench/search/test_plan.py::test_x[ring]") == "tests/bench/search/test_plan.py"
    assert scope_of("tests/bench/search/test_plan.py::TestA::test_y") == "tests/bench/search/test_plan.py"
    assert scope_of("tests/bench/search/test_plan.py::test_z[a::b]") == "tests/bench/search/test_plan.py"


def test_same_worker_modules_share_one_scope():
    modules = [m for m, group in SAME_WORKER.items() if group == "slurm"]
    assert len(modules) == 2 and {scope_of(f"{m}::test_a") for m in modules} == {"slurm"}


def test_a_module_on_two_workers_is_reported():
    seen = WorkersPerModule()
    seen.add("tests/a.py::test_1", "gw0")
    seen.add("tests/a.py::test_2", "gw0")
    seen.add("tests/b.py::test_1", "gw1")
    seen.add("tests/b.py::test_2[x]", "gw0")
    seen.add("tests/c.py::test_1", None)  # no xdist: nothing to check
    assert seen.split() == {"tests/b.py": ["gw0", "gw1"]}


def test_scopes_are_handed_out_the_longest_first():
    work = {"tests/short.py": {"tests/short.py::t1": False, "tests/short.py::t2": False},
            "tests/new.py": {f"tests/new.py::t{i}": False for i in range(5)},
            "slurm": {"tests/s1.py::t": False, "tests/s2.py::t": False},
            "tests/long.py": {"tests/long.py::t": False}}
    seconds = {"tests/short.py": 1.0, "tests/long.py": 100.0, "tests/s1.py": 20.0, "tests/s2.py": 30.0}
    # slurm's two modules sum to 50 s; the new module counts SECONDS_PER_NEW_TEST per test
    assert 1.0 < 5 * SECONDS_PER_NEW_TEST < 50.0
    assert longest_first(work, seconds) == ["tests/long.py", "slurm", "tests/new.py", "tests/short.py"]
    assert longest_first(work, {}) == ["tests/new.py", "tests/short.py", "slurm", "tests/long.py"]


def test_the_committed_module_seconds_name_modules_that_exist():
    """The table the scheduler orders by (refreshed from a full run with ``CPAB_MODULE_SECONDS_OUT``):
    every entry a test module of this tree with a positive time, and most of the tree's modules in it."""
    table = load_module_seconds()
    root = MODULE_SECONDS.parents[1]
    modules = {module_of(p.relative_to(root).as_posix()) for p in (root / "tests").rglob("test_*.py")}
    assert table and all(seconds >= 0 for seconds in table.values())
    assert set(table) <= modules, sorted(set(table) - modules)
    assert len(table) >= 0.8 * len(modules)
