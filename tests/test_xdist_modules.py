"""The scheduling by module (tests/xdist_modules.py): scopes, and the check that fails a split module."""
from tests.xdist_modules import SAME_WORKER, WorkersPerModule, scope_of


def test_a_module_is_one_scope_whatever_its_classes_and_parameters():
    assert scope_of("tests/bench/test_plan.py::test_x[ring]") == "tests/bench/test_plan.py"
    assert scope_of("tests/bench/test_plan.py::TestA::test_y") == "tests/bench/test_plan.py"
    assert scope_of("tests/bench/test_plan.py::test_z[a::b]") == "tests/bench/test_plan.py"


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
