"""docs/adding-a-method.md, run: the example method, its correctness tests, a sweep, the comparison.

The method file and the sweep spec are taken verbatim from the page, and the commands of its
sections 3 and 4 (the bash blocks marked ``<!-- run: NAME -->``) run as written, by bash, in a
working folder of their own holding what a user's checkout has at those paths, with ``$CPAB_RUNS``
(where every command writes its runs) outside it, so nothing is written into the repository. Subprocesses (the test
matrix's gloo ranks, the sweep's bench jobs) cannot see a method registered in this process,
and copying the file into methods/ would leak it into other runs in the same checkout (and
leave it behind if the test is killed). So the module goes into a temporary folder with a
``sitecustomize.py`` (``SITECUSTOMIZE``), first on ``PYTHONPATH``: every Python process started
with that environment imports the module as soon as it has imported ``methods``, and the method
registers there too. In this process it is imported directly and unregistered at the end.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import methods
from analysis import tables
from analysis.load import load_rows

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "adding-a-method.md"
NAME = "ulysses-headgroups"
MODULE = "ulysses_headgroups"


# The plugin's sitecustomize.py. ``bench`` at start-up, before anything imports torch (the simulated
# CUDA device must load first; importing bench does not import torch). The method's module once
# ``methods`` is imported: a process can only look a method up through ``methods``, so the method
# is registered wherever it can be asked for, and a process that never imports ``methods`` (a
# sweep job's process, which only starts ``python -m bench``; jupytext; papermill) does not
# import torch for it.
SITECUSTOMIZE = f"""\
import importlib.abc
import importlib.machinery
import sys

import bench  # noqa: F401


class _RegisterAfterMethods(importlib.abc.MetaPathFinder):
    \"\"\"Finds ``methods`` on sys.path as usual, and imports {MODULE} (registering {NAME}) once
    ``methods`` has run. It stays in place until then: a spec found but not loaded (runpy's look-up of
    ``python -m methods``) must not use it up.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name != "methods":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            import {MODULE}  # noqa: F401

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _RegisterAfterMethods())
"""


def doc_file(path: str) -> str:
    """The fenced block that follows ``<!-- file: PATH -->`` in the page."""
    text = DOC.read_text()
    m = re.search(r"<!-- file: " + re.escape(path) + r" -->\s*```\w*\n(.*?)```", text, re.S)
    assert m, f"{DOC} has no block for {path}"
    return m.group(1)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The example method as a module in a temporary folder, importable by every subprocess."""
    folder = tmp_path_factory.mktemp("plugin")
    (folder / f"{MODULE}.py").write_text(doc_file(f"methods/{MODULE}.py"))
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    spec = importlib.util.spec_from_file_location(MODULE, folder / f"{MODULE}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)  # registers NAME in this process
    env = dict(os.environ, MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join(filter(None, [str(folder), str(REPO), os.environ.get("PYTHONPATH")])))
    try:
        yield folder, env
    finally:
        methods.unregister(NAME)
        sys.modules.pop(MODULE, None)


def test_example_registers_validates_and_matches_the_reference(plugin):
    assert NAME in methods.available()
    llama = methods.AttnSpec(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128)
    methods.validate(NAME, llama, 8)
    methods.validate(NAME, llama, 4, head_groups=2)
    with pytest.raises(ValueError, match=r"head_groups=3 must be a positive divisor of the 1 KV head.*\[1\]"):
        methods.validate(NAME, llama, 8, head_groups=3)
    with pytest.raises(ValueError, match=r"unknown option.*head_groups"):
        methods.validate(NAME, llama, 8, chunk_heads=8)
    from methods.core.reference import AttentionBlock

    torch.manual_seed(0)
    spec = methods.AttnSpec(dim=64, n_heads=8, n_kv_heads=4, head_dim=16)
    block = methods.build(NAME, spec, head_groups=2)
    ref = AttentionBlock(spec, kernel="math")
    ref.load_state_dict(block.state_dict())
    x = torch.randn(2, 32, 64)
    torch.testing.assert_close(block(x), ref(x), rtol=1e-5, atol=1e-5)


def test_correctness_matrix_picks_the_example_up(plugin):
    """The page's command, with ``-x``: a failed case restarts the module's rank pool (tests/distpool.py),
    so a method failing every case would otherwise spend a pool start per case before this test fails."""
    _, env = plugin
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/methods",
                           "-k", NAME], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-2000:]
    assert proc.returncode == 0, tail + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", tail)
    assert passed and int(passed.group(1)) >= 24, tail
    assert "failed" not in tail and "error" not in tail.lower(), tail


def doc_commands(name: str) -> str:
    """The fenced bash block that follows ``<!-- run: NAME -->`` in the page: commands as a user types them."""
    m = re.search(r"<!-- run: " + re.escape(name) + r" -->\s*```bash\n(.*?)```", DOC.read_text(), re.S)
    assert m, f"{DOC} has no commands marked {name!r}"
    return m.group(1)


def start_commands(name: str, cwd: Path, env: dict) -> tuple[str, subprocess.Popen]:
    """The page's block ``name``, started in bash as written (``-e``: it stops at the first failing command),
    in ``cwd``, with this interpreter's environment first on ``PATH`` (its ``python``, ``jupytext``, ``papermill``)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return name, subprocess.Popen(["bash", "-e", "-c", doc_commands(name)], cwd=cwd, env=dict(env, PATH=path),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(started: tuple[str, subprocess.Popen], timeout: float = 900) -> subprocess.CompletedProcess:
    """Wait for a block started by ``start_commands`` (killed past ``timeout``): its name, exit status and output."""
    name, proc = started
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(name, proc.returncode, out, err)


def succeeded(done: subprocess.CompletedProcess) -> str:
    """The stdout of a finished block, which must have succeeded."""
    assert done.returncode == 0, f"{done.args}: " + done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_sweep_rows_reach_the_comparison_table_and_notebook(plugin, tmp_path):
    """Sections 3 and 4 of the page, their commands as written, in a working folder of their own that holds
    what a user has there (the spec saved where the page says, the notebook the page converts) and with
    ``$CPAB_RUNS`` (the runs folder every command honours) outside it: the rows land there, every
    comparison finds them, and nothing is written into the repository."""
    _, env = plugin
    work, runs = tmp_path / "work", tmp_path / "runs"
    (work / "sweeps" / "configs").mkdir(parents=True)
    (work / "sweeps" / "configs" / "my-method.yaml").write_text(doc_file("sweeps/configs/my-method.yaml"))
    (work / "analysis" / "notebooks").mkdir(parents=True)
    shutil.copy(REPO / "analysis" / "notebooks" / "compare_my_method.py", work / "analysis" / "notebooks")
    env = dict(env, CPAB_RUNS=str(runs))
    repo_status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout

    succeeded(finish(start_commands("sweep", work, env)))
    assert [p.relative_to(runs) for p in runs.rglob("*.jsonl")] == [Path("sweeps/my-method.jsonl")]
    rows = load_rows(runs)
    assert len(rows) == 4 and not rows.attrs["bad_lines"]
    assert set(rows["label"]) == {"ulysses", "upipe", NAME, f"{NAME}[head_groups=1]"}
    assert (rows["status"] == "ok").all(), rows[["label", "seq", "status", "message"]]

    table = tables.compare_methods(rows, metric="mem_gib", scope="attention", highlight=NAME)
    df = table.df
    mine = df[df["Method"] == NAME]
    assert len(mine) == 1 and mine.iloc[0][""] == "◀" and df.iloc[0]["Method"] == NAME
    assert mine.iloc[0]["Mode, device"] == "simulated, h100-80g, paper stack"  # simulated specs default to it
    assert float(mine.iloc[0]["1M"]) > 0  # a measured peak, GiB per rank

    # the notebook, headless, and the table without one, side by side (both only read): each reads the committed
    # rows and the user's (from $CPAB_RUNS) by default
    started = [start_commands("notebook", work, env), start_commands("table", work, env)]
    _, table_out = [succeeded(done) for done in [finish(s) for s in started]]
    text = json.dumps(json.loads((work / "runs" / "compare-out.ipynb").read_text()), ensure_ascii=False)
    assert f"2 of '{NAME}'" in text and f"◀ marks '{NAME}'" in text

    # the table: the method marked and first
    lines = [line for line in table_out.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    first = dict(zip(header, (c.strip() for c in lines[2].strip("|").split("|")), strict=True))
    assert first["Method"] == NAME and first[""] == "◀" and float(first["1M"]) > 0, lines[:3]
    assert first["Mode, device"].startswith("simulated, h100-80g, paper stack"), first

    assert not list(work.rglob("*.jsonl")), "rows were written outside $CPAB_RUNS"
    assert subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                          text=True).stdout == repo_status, "the page's commands changed the repository"
