"""Every registered method vs the single-device reference: output, dx and every weight grad.

Matrix: world sizes 1, 2, 4 (gloo) x MHA / GQA / GQA with fewer KV heads than ranks / QK-norm
x causal and not x fp32 and bf16 x each method's option variants (UPipe at U = C, 2C, H).
"""
from __future__ import annotations

import pytest

import methods
from tests.methods.cases import TOLERANCE, cases, check_against_reference

METHODS = methods.available()


@pytest.mark.parametrize("method,ws,spec,options,dtype", list(cases(METHODS)))
def test_matches_reference(pool, method, ws, spec, options, dtype):
    try:
        methods.validate(method, methods.AttnSpec(**spec), ws, **options)
    except ValueError as err:  # an unsupported combination is skipped with the method's own reason
        pytest.skip(f"{method} refuses this case: {err}")
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
