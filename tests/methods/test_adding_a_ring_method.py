"""docs/adding-a-method.md, section 7, run: the third example (``striped-ring``, a ring method on the ring loop).

The method file is taken verbatim from the page (the block after ``<!-- file: methods/striped_ring.py -->``),
written to a temporary folder and imported from there (in this process and on every rank of this
module's own gloo pool), as ``test_adding_a_second_method.py`` does with the second example. It is
checked with the correctness matrix's own machinery: every spec, causal or not, fp32 and bf16, world
sizes 1, 2, 4, output, dx and every weight gradient against the reference; and it refuses documents
in one line.
"""
from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

import methods
from tests.distpool import RankPool
from tests.methods.cases import DOC_LAYOUTS, SPECS, TOLERANCE, cases, check_against_reference, refusal

pytestmark = pytest.mark.slow  # spawns a rank pool (tests/conftest.py's meaning of slow)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "adding-a-method.md"
NAME = "striped-ring"
MODULE = "striped_ring"
CASES = list(cases([NAME]))  # the matrix's cases for this one method (no registration needed to list them)


def doc_block(path: str) -> str:
    """The fenced block that follows ``<!-- file: PATH -->`` in the page, verbatim."""
    m = re.search(r"<!-- file: " + re.escape(path) + r" -->\s*```\w*\n(.*?)```", DOC.read_text(), re.S)
    assert m, f"{DOC} has no block for {path}"
    return m.group(1)


def load_example(folder: str) -> None:
    """Import the example module from ``folder``, which registers the method in this process.

    Module-level so that the rank pool can pickle it (with ``functools.partial``) as each rank's
    start-up; a no-op where it is imported already."""
    if MODULE in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(MODULE, Path(folder) / f"{MODULE}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The page's method file in a temporary folder, registered in this process until the module ends."""
    folder = tmp_path_factory.mktemp("ring-example")
    (folder / f"{MODULE}.py").write_text(doc_block(f"methods/{MODULE}.py"))
    load_example(str(folder))
    try:
        yield folder
    finally:
        methods.unregister(NAME)
        sys.modules.pop(MODULE, None)


@pytest.fixture(scope="module")
def pool(example):
    """This module's 4 gloo ranks (instead of tests/methods/conftest.py's): each imports the example first."""
    p = RankPool(4, setup=functools.partial(load_example, str(example)))
    yield p
    p.close()


def test_the_example_registers_from_the_page_and_uses_the_strided_layout(example):
    assert NAME in methods.available()
    assert not (REPO / "methods" / f"{MODULE}.py").exists()  # it lives in the guide only
    block = methods.build(NAME, methods.AttnSpec(**SPECS["gqa"]))
    assert block.shard(torch.arange(8), 0).tolist() == list(range(8))  # one rank: every token in order
    docs = methods.Documents.from_lengths(DOC_LAYOUTS["many-short"])
    with pytest.raises(ValueError, match=r"method 'striped-ring' refuses packed documents \(docs=\)"):
        methods.validate(NAME, methods.AttnSpec(**SPECS["gqa"]), 2, docs=docs)


def test_page_lines_of_the_example():
    """The page's example is small: the ring loop is reused, not copied (fewer than 60 lines)."""
    assert len(doc_block(f"methods/{MODULE}.py").splitlines()) < 60


@pytest.mark.parametrize("method,ws,spec,options,dtype", CASES)
def test_matches_reference(pool, method, ws, spec, options, dtype):
    assert refusal(method, ws, spec, options) is None  # no head constraint: it runs every case
    per_rank = pool.run(check_against_reference, method, spec, options, dtype, world_size=ws)
    tol = TOLERANCE[dtype]
    for rank, errors in enumerate(per_rank):
        bad = {k: v for k, v in errors.items() if not v <= tol}
        assert not bad, f"rank {rank}: relative errors above {tol}: {bad} (all: {errors})"
