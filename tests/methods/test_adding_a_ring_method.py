"""docs/adding-a-method.md, section 7, run: the third example (``striped-ring``, a ring method on the ring loop).

The method file is taken verbatim from the page (the block after ``<!-- file: methods/striped_ring.py -->``),
written to a temporary folder and imported from there (in this process and on every rank of the
shared gloo pool while this module runs), as ``test_adding_a_second_method.py`` does with the second example. It is
checked with the correctness matrix's own machinery: every spec, causal or not, fp32 and bf16, world
sizes 1, 2, 4, output, dx and every weight gradient against the reference; and it refuses documents
in one line.
"""
from __future__ import annotations

import pytest
import torch

import methods
from tests.methods.cases import DOC_LAYOUTS, SPECS, TOLERANCE, cases, check_against_reference, refusal
from tests.methods.guide_example import REPO, doc_block, fixtures

pytestmark = pytest.mark.slow  # spawns a rank pool (tests/conftest.py's meaning of slow)

NAME = "striped-ring"
MODULE = "striped_ring"
CASES = list(cases([NAME]))  # the matrix's cases for this one method (no registration needed to list them)


example, pool = fixtures(NAME, MODULE)


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
