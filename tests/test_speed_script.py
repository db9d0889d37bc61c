"""scripts/speed/run.py: whole commands timed with their children's CPU and their answers; bad names refused.

The benchmark itself runs for many minutes (results/speed/README.md); here only its parts that do not
depend on the simulator: a command's timing and answer, and the argument checks."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def speed():
    spec = importlib.util.spec_from_file_location("speed_run", ROOT / "scripts" / "speed" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_a_command_is_timed_with_its_childrens_cpu_and_gives_its_answer(speed, tmp_path):
    # the command spends CPU in a child it waits for: that CPU is the command's
    burn = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'x = 0\\nfor i in range(3_000_000): x += i']); "
            "open(sys.argv[1] + '/answer.txt', 'w').write('42'); print('[done] 1 probe', file=sys.stderr)")
    command = speed.Command("burn", ("-c", burn, "{out}"), lambda out, stdout, stderr: (out / "answer.txt").read_text())
    r = speed.run_command(tmp_path, command, timeout=120)
    assert r["answer"] == "42" and r["exit"] == 0 and r["progress_lines"] == 1
    assert 0 < r["cpu_s"] and 0 < r["wall_s"]
    assert r["cpu_s"] >= 0.05  # the child's loop, not only the parent's start


def test_a_failing_command_is_one_error_naming_it(speed, tmp_path):
    command = speed.Command("broken", ("-c", "import sys; sys.exit('no such model')"), lambda *a: None)
    with pytest.raises(RuntimeError, match=r"broken in .* failed \(exit 1\): no such model"):
        speed.run_command(tmp_path, command, timeout=60)


@pytest.mark.parametrize("argv,problem", [
    (["--commands", "nosuch"], "unknown or no cases/stacks/commands ['nosuch']"),
    (["--cases", "none"], "unknown or no cases/stacks/commands []"),
    (["--cases", "huge"], "unknown or no cases/stacks/commands ['huge']"),
])
def test_bad_names_are_refused_before_anything_runs(speed, argv, problem, capsys):
    with pytest.raises(SystemExit):
        speed.parse_args(argv)
    assert problem in capsys.readouterr().err


def test_every_command_names_a_real_entry_point(speed):
    assert set(speed.COMMANDS) == {"search", "plan", "fidelity", "demo"}
    for command in speed.COMMANDS.values():
        module = command.argv[command.argv.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, module
