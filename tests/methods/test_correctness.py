"""Every registered method vs the single-device reference: output, dx and every weight grad.

Matrix: world sizes 1, 2, 4 (gloo) x MHA / GQA / GQA with fewer KV heads than ranks / QK-norm
x causal and not x fp32 and bf16 x each method's option variants (UPipe at U = C, 2C, H).
A case a method refuses is skipped with its reason; after the matrix, a method none of whose
cases ran fails (``test_every_method_ran_a_case``), except the methods with CUDA kernels only
(``cases.CUDA_ONLY``), which are checked elsewhere and must refuse a CPU input with a one-line
reason (``test_cuda_only_methods_refuse_cpu``).
"""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest

import methods
from methods.core.base import AttentionMethod
from tests.methods.cases import (
    CUDA_ONLY,
    SPECS,
    TOLERANCE,
    cases,
    check_against_reference,
    cpu_refusal,
    ran_none,
    refusal,
)

METHODS = methods.available()
CASES = list(cases(METHODS))
CASES_PER_METHOD = Counter(case.values[0] for case in CASES)
# method -> one entry per case the matrix went through in this session: its refusal, or None (it ran)
REFUSALS: dict[str, list[str | None]] = defaultdict(list)


@pytest.mark.parametrize("method,ws,spec,options,dtype", CASES)
def test_matches_reference(pool, method, ws, spec, options, dtype):
    reason = refusal(method, ws, spec, options)
    REFUSALS[method].append(reason)
    if reason is not None:  # an unsupported combination is skipped with the method's own reason
        pytest.skip(f"{method} refuses this case: {reason}")
    per_rank = pool.run(check_against_reference, method, spec, options, dtype, world_size=ws)
    tol = TOLERANCE[dtype]
    for rank, errors in enumerate(per_rank):
        bad = {k: v for k, v in errors.items() if not v <= tol}
        assert not bad, f"rank {rank}: relative errors above {tol}: {bad} (all: {errors})"


def test_matrix_covers_every_method_and_upipe_chunk_sizes():
    ids = [p.id for p in cases(METHODS)]
    for m in METHODS:
        assert any(i.startswith(m + "-ws4-") for i in ids), m
    for u in ("chunk_heads=4", "chunk_heads=8", "default"):
        assert any(i.startswith("upipe-ws2-") and i.endswith(u) for i in ids), u


@pytest.mark.parametrize("method", METHODS)
def test_every_method_ran_a_case(method):
    """Runs after the matrix (pytest keeps a module's order). Judged only when every case of the
    method went through the matrix in this session: with ``-k`` or a single test id selected,
    too few cases were seen to say that the method refuses them all."""
    if method in CUDA_ONLY:
        pytest.skip(f"{method} has CUDA kernels only and cannot run on the CPU ranks (tests.methods.cases.CUDA_ONLY); "
                    f"test_cuda_only_methods_refuse_cpu checks it refuses CPU, and {CUDA_ONLY[method]} checks it")
    seen = len(REFUSALS[method])
    if seen < CASES_PER_METHOD[method]:
        pytest.skip(f"only {seen} of the {CASES_PER_METHOD[method]} correctness cases of {method} went "
                    "through the matrix in this session: too few for a verdict")
    failure = ran_none(method, REFUSALS[method])
    assert failure is None, failure


@pytest.mark.parametrize("method", sorted(CUDA_ONLY))
def test_cuda_only_methods_refuse_cpu(pool, method):
    """The exemption above holds only while it is true: on a CPU input the method refuses, with one
    line naming CUDA, on every rank (here at 2 ranks, GQA, causal)."""
    if method not in METHODS:
        pytest.skip(f"{method} is not usable here: {methods.get_info(method).status}")
    for rank, message in enumerate(pool.run(cpu_refusal, method, dict(SPECS["gqa"], causal=True), world_size=2)):
        assert message is not None, (f"{method} ran on CPU on rank {rank}: drop it from CUDA_ONLY and let the "
                                     "matrix run it")
        assert "\n" not in message and "CUDA" in message, message


def test_ran_none_fails_a_method_that_refuses_every_case():
    """The check above, on a throw-away method that refuses everything, without running the matrix."""

    @methods.register("refuses-everything", "test method: refuses every case")
    class RefusesEverything(AttentionMethod):
        @classmethod
        def validate(cls, spec: methods.AttnSpec, world_size: int, options) -> None:
            raise ValueError("refuses-everything: no case is supported (test method)")

    try:
        refusals = [refusal(*case.values[:4]) for case in cases(["refuses-everything"])]
        assert refusals and None not in refusals
        failure = ran_none("refuses-everything", refusals)
        assert failure is not None and failure.startswith(
            f"method 'refuses-everything' ran none of its {len(refusals)} correctness cases"), failure
        assert "no case is supported" in failure
        assert ran_none("refuses-everything", refusals + [None]) is None  # one case ran: enough
        assert ran_none("refuses-everything", []) is None  # nothing went through the matrix: no verdict
    finally:
        methods.unregister("refuses-everything")
    ulysses = [refusal(*case.values[:4]) for case in cases(["ulysses"])]
    assert None in ulysses and ran_none("ulysses", ulysses) is None
