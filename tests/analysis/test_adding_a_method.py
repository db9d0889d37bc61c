"""docs/adding-a-method.md, run: the example method, its correctness tests, a sweep, the comparison.

The method file and the sweep spec are taken verbatim from the page. Subprocesses (the test
matrix's gloo ranks, the sweep's bench jobs) cannot see a method registered in this process,
and copying the file into methods/ would leak it into other runs in the same checkout (and
leave it behind if the test is killed). So the module goes into a temporary folder with a
``sitecustomize.py`` that imports it, first on ``PYTHONPATH``: every Python process started
with that environment imports it at start-up and the method registers there too. In this
process it is imported directly and unregistered at the end.
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
    # bench first: the simulated CUDA device must load before the module imports torch
    (folder / "sitecustomize.py").write_text(
        f"import bench  # noqa: F401\nimport {MODULE}  # noqa: F401  (registers {NAME})\n")
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


def run_sweep(spec_path: Path, out: Path, env: dict) -> None:
    """The page's command: ``python -m sweeps run SPEC --executor local`` (rows into ``out``)."""
    proc = subprocess.run([sys.executable, "-m", "sweeps", "run", str(spec_path), "--executor", "local",
                           "--set", f"out={out}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_sweep_rows_reach_the_comparison_table_and_notebook(plugin, tmp_path):
    folder, env = plugin
    spec_path = tmp_path / "my-method.yaml"
    spec_path.write_text(doc_file("sweeps/configs/my-method.yaml"))
    results = tmp_path / "results"
    run_sweep(spec_path, results / "my-method.jsonl", env)

    rows = load_rows(results)
    assert len(rows) == 4 and not rows.attrs["bad_lines"]
    assert set(rows["label"]) == {"ulysses", "upipe", NAME, f"{NAME}[head_groups=1]"}
    assert (rows["status"] == "ok").all(), rows[["label", "seq", "status", "message"]]

    table = tables.compare_methods(rows, metric="mem_gib", scope="attention", highlight=NAME)
    df = table.df
    mine = df[df["Method"] == NAME]
    assert len(mine) == 1 and mine.iloc[0][""] == "◀" and df.iloc[0]["Method"] == NAME
    assert mine.iloc[0]["Mode, device"] == "simulated, h100-80g, paper stack"  # simulated specs default to it
    assert float(mine.iloc[0]["1M"]) > 0  # a measured peak, GiB per rank
    assert NAME in table.to_markdown()

    # the notebook of the page, on the same rows
    nb_dir = tmp_path / "nb"
    nb_dir.mkdir()
    shutil.copy(REPO / "analysis" / "notebooks" / "compare_my_method.py", nb_dir)
    bin_dir = Path(sys.executable).parent
    conv = subprocess.run([str(bin_dir / "jupytext"), "--set-kernel", "python3", "--to", "ipynb",
                           str(nb_dir / "compare_my_method.py")], capture_output=True, text=True, env=env, timeout=120)
    assert conv.returncode == 0, conv.stderr
    run = subprocess.run([str(bin_dir / "papermill"), str(nb_dir / "compare_my_method.ipynb"),
                          str(nb_dir / "out.ipynb"),
                          "-p", "METHOD", NAME, "-p", "RESULTS", str(results), "-p", "SCOPE", "attention",
                          "--no-progress-bar"], capture_output=True, text=True, env=env, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads((nb_dir / "out.ipynb").read_text())
    text = json.dumps(out, ensure_ascii=False)
    assert f"2 of '{NAME}'" in text and f"◀ marks '{NAME}'" in text
