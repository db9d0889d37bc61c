"""docs/adding-a-method.md, section 5, run: the second example (``allgather-kv-mini``, not head-parallel).

The method file is taken verbatim from the page (the block after ``<!-- file: methods/allgather_kv_mini.py -->``),
written to a temporary folder and imported from there: in this process by a fixture, and on every
rank of the shared gloo pool while this module runs (the ranks are other processes, where a method
registered here does not exist). It never goes into ``methods/``: other test runs in the same
checkout would pick it up, and a killed test would leave it behind. It is checked with the
correctness matrix's own machinery (``tests/methods/cases.py``: every spec, causal or not, fp32 and
bf16, world sizes 1, 2, 4, output, dx and every weight gradient against the reference), and run
once through the benchmark's simulated mode, whose communication count must see its all-gathers
and their backward reduce-scatters.
"""
from __future__ import annotations

import pytest

import methods
from bench.measure.config import StepConfig
from bench.measure.run import run_trial
from bench.measure.trial import Trial
from tests.methods.cases import TOLERANCE, cases, check_against_reference, refusal
from tests.methods.guide_example import REPO, fixtures

pytestmark = pytest.mark.slow  # spawns a rank pool (tests/conftest.py's meaning of slow)

NAME = "allgather-kv-mini"
MODULE = "allgather_kv_mini"
CASES = list(cases([NAME]))  # the matrix's cases for this one method (no registration needed to list them)


example, pool = fixtures(NAME, MODULE)


def test_the_example_registers_from_the_page_and_has_no_head_constraint(example):
    assert NAME in methods.available()
    assert not (REPO / "methods" / f"{MODULE}.py").exists()  # it lives in the guide only
    # head counts that head-parallel methods refuse: 6 heads on 4 ranks; 3 KV heads on 4 ranks
    for heads, kv, ws in ((6, 6, 4), (12, 3, 4)):
        spec = methods.AttnSpec(dim=heads * 16, n_heads=heads, n_kv_heads=kv, head_dim=16)
        with pytest.raises(ValueError):
            methods.validate("ulysses", spec, ws)
        methods.validate(NAME, spec, ws)


@pytest.mark.parametrize("method,ws,spec,options,dtype", CASES)
def test_matches_reference(pool, method, ws, spec, options, dtype):
    assert refusal(method, ws, spec, options) is None  # no head constraint: it runs every case
    per_rank = pool.run(check_against_reference, method, spec, options, dtype, world_size=ws)
    tol = TOLERANCE[dtype]
    for rank, errors in enumerate(per_rank):
        bad = {k: v for k, v in errors.items() if not v <= tol}
        assert not bad, f"rank {rank}: relative errors above {tol}: {bad} (all: {errors})"


@pytest.mark.parametrize("heads,kv", [(6, 6), (12, 3)])
def test_runs_where_head_parallel_methods_cannot(pool, heads, kv):
    """The head counts above, at 4 ranks, against the reference (causal, fp32)."""
    spec = dict(dim=heads * 8, n_heads=heads, n_kv_heads=kv, head_dim=8)
    for rank, errors in enumerate(pool.run(check_against_reference, NAME, spec, {}, "float32", world_size=4)):
        assert max(errors.values()) <= TOLERANCE["float32"], (rank, errors)


def test_simulated_run_counts_the_gathers_and_their_reduce_scatters(example):
    """One attention block of Llama3-8B (8 KV heads of 128) at 64K tokens on 8 ranks, simulated:
    K and V are each all-gathered forward and reduce-scattered backward, every collective over
    the full sequence's K (or V) of one rank in bf16."""
    seq = 1 << 16
    row = run_trial(Trial.make(NAME, "llama3-8b", seq, 8, step=StepConfig(scope="attention")))
    assert row.status == "ok", row.message
    full_kv = seq * 8 * 128 * 2  # one of K or V, all tokens, bf16
    assert row.figures.comm_bytes_by_op == {"all_gather": 2 * full_kv, "reduce_scatter": 2 * full_kv}
    assert row.figures.peak_bytes > 2 * full_kv  # the gathered K and V are held for the backward
