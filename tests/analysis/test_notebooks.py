"""Every notebook in analysis/notebooks/ executes headless (a failing cell fails the test).

jupytext converts the percent-format ``.py`` files to ``.ipynb`` in a temporary folder with
``--set-kernel python3`` (without it papermill finds no kernel), and papermill runs each with
the results folder as a parameter.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "analysis" / "notebooks").glob("*.py"))
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable} (pip install -e '.[notebooks]')")
    return str(path)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("notebooks")
    for nb in NOTEBOOKS:
        shutil.copy(nb, folder / nb.name)
    proc = subprocess.run([_tool("jupytext"), "--set-kernel", "python3", "--to", "ipynb",
                           *[str(folder / nb.name) for nb in NOTEBOOKS]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return folder


def execute(ipynb: Path, out: Path, **params) -> dict:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    argv = [_tool("papermill"), str(ipynb), str(out), "--cwd", str(REPO), "--no-progress-bar"]
    for k, v in params.items():
        argv += ["-p", k, str(v)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, f"{ipynb.name} failed:\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


def outputs_text(nb: dict) -> str:
    parts = []
    for cell in nb["cells"]:
        for o in cell.get("outputs", []):
            parts.append("".join(o.get("text", "")))
            for kind in ("text/markdown", "text/plain"):
                parts.append("".join(o.get("data", {}).get(kind, "")))
    return "\n".join(parts)


def test_there_is_a_notebook_per_figure_group():
    names = {nb.stem for nb in NOTEBOOKS}
    assert names >= {"table3_throughput", "max_context", "memory_breakdown", "fig5_multinode", "attention_memory",
                     "compare_my_method"}


def test_every_notebook_executes(converted, results_dir, tmp_path):
    start = time.perf_counter()
    for nb in NOTEBOOKS:
        done = execute(converted / f"{nb.stem}.ipynb", tmp_path / f"{nb.stem}.out.ipynb", RESULTS=results_dir)
        text = outputs_text(done)
        assert "rows" in text, nb.name
        if nb.stem == "table3_throughput":
            assert "98.25" in text and "2100.00" in text
        if nb.stem == "compare_my_method":
            assert "◀" in text and "upipe" in text
    elapsed = time.perf_counter() - start
    assert elapsed < 120, f"notebooks took {elapsed:.0f} s"


def test_compare_notebook_takes_a_method_parameter(converted, results_dir, tmp_path):
    done = execute(converted / "compare_my_method.ipynb", tmp_path / "cmp.ipynb", RESULTS=results_dir, METHOD="mystery")
    text = outputs_text(done)
    assert "of 'mystery'" in text and "◀ marks 'mystery'" in text
