"""A method file taken verbatim from docs/adding-a-method.md, imported from a temporary folder.

Shared by the tests that run the guide's examples (``test_adding_a_second_method``,
``test_adding_a_ring_method``): the block after ``<!-- file: methods/NAME.py -->`` is written to a
temporary folder and imported from there, in the test process by a module fixture and on every rank
of the shared gloo pool while the module runs (``RankPool.install``). It never goes into ``methods/``: other test runs
in the same checkout would pick it up, and a killed test would leave it behind.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import methods

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "adding-a-method.md"


def doc_block(path: str) -> str:
    """The fenced block that follows ``<!-- file: PATH -->`` in the page, verbatim."""
    m = re.search(r"<!-- file: " + re.escape(path) + r" -->\s*```\w*\n(.*?)```", DOC.read_text(), re.S)
    assert m, f"{DOC} has no block for {path}"
    return m.group(1)


def load_example(module: str, folder: str) -> None:
    """Import the example ``module`` from ``folder``, which registers the method in this process.

    Module-level so that the rank pool can pickle it (with ``functools.partial``) as each rank's
    start-up; a no-op where it is imported already."""
    if module in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(module, Path(folder) / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded
    spec.loader.exec_module(loaded)


def unload_example(name: str, module: str) -> None:
    """Take back ``load_example``: unregister the method and forget its module."""
    methods.unregister(name)
    sys.modules.pop(module, None)


def fixtures(name: str, module: str) -> tuple:
    """The ``example`` and ``pool`` module fixtures of a test module running the guide's ``name``."""

    @pytest.fixture(scope="module")
    def example(tmp_path_factory):
        """The page's method file in a temporary folder, registered in this process until the module ends."""
        folder = tmp_path_factory.mktemp(f"{module}-example")
        (folder / f"{module}.py").write_text(doc_block(f"methods/{module}.py"))
        load_example(module, str(folder))
        try:
            yield folder
        finally:
            unload_example(name, module)

    @pytest.fixture(scope="module")
    def pool(pool, example):
        """tests/methods/conftest.py's ranks, on each of which the example is imported (and registered) while
        this module runs: after a restart too (``RankPool.install``), and taken back at its end."""
        pool.install(load_example, module, str(example))
        yield pool
        pool.uninstall(load_example, module, str(example), undo=unload_example, undo_args=(name, module))

    return example, pool
