"""``methods.core.ringsync``: a barrier after every ring step, as the paper's ring code does.

On gloo ranks: with the barriers the ring methods (ours, yunchang's, UPipe over a ring) still
match the reference, forward and every gradient, and issue exactly one barrier per ring step;
without them none. Simulated: the step counts the barriers the paper stack turns on (term 9 of
``bench.stackmodel.stack``) for the methods that stand for the paper's ring code only. And
yunchang's own ``RingComm.wait`` is back once the scope ends.
"""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from bench.measure.config import StepConfig
from bench.measure.run import guarded, measure_simulated
from bench.measure.trial import Trial
from bench.model.config import get_config
from bench.stackmodel import stack
from methods.core import ringsync
from tests.methods.cases import SPECS, TOLERANCE, check_against_reference

HAS_YUNCHANG = importlib.util.find_spec("yunchang") is not None


@pytest.fixture
def fresh_yunchang():
    """yunchang imported in this process only while a test runs: it records at import whether
    flash-attn is present, and later tests (tests/bench/stackmodel/test_fake_flash_attn.py) check what a process
    that never imported it sees (as tests/methods/test_yc_fa3.py does)."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "yunchang" or name.startswith("yunchang."):
            del sys.modules[name]


def ring_steps_of_one_pass(ring_degree: int) -> int:
    """Ring waits of one attention forward and backward: R-1 forward; R-1 for K/V and R for dK/dV
    (the last brings each block's gradients home) backward."""
    return (ring_degree - 1) + (ring_degree - 1) + ring_degree


def _with_barriers(group, method: str, options: dict, on: bool) -> tuple[dict, int]:
    calls = []
    own = ringsync.barrier

    def counting(g):
        calls.append(g)
        own(g)

    ringsync.barrier = counting
    try:
        if on:
            with ringsync.ring_step_barriers():
                errors = check_against_reference(group, method, SPECS["gqa"], options, "float32")
        else:
            errors = check_against_reference(group, method, SPECS["gqa"], options, "float32")
    finally:
        ringsync.barrier = own
    return errors, len(calls)


CASES = [
    pytest.param("ring", {}, 4, 4, id="ring-ws4"),
    pytest.param("ring", {}, 2, 2, id="ring-ws2"),
    pytest.param("usp-upipe", {"ulysses_degree": 2}, 4, 2, id="usp-upipe-2x2"),
    pytest.param("yc-ring", {}, 4, 4, id="yc-ring-ws4",
                 marks=pytest.mark.skipif(not HAS_YUNCHANG, reason="yunchang is not installed (pip install yunchang)")),
]


@pytest.mark.parametrize("method,options,world_size,ring_degree", CASES)
def test_ring_steps_end_with_a_barrier_and_the_numerics_stay(pool, method, options, world_size, ring_degree):
    for on in (False, True):
        results = pool.run(_with_barriers, method, options, on, world_size=world_size)
        for errors, barriers in results:
            worst = max(errors.values())
            assert worst <= TOLERANCE["float32"], (method, on, errors)
            if not on:
                assert barriers == 0
            elif method == "usp-upipe":  # one ring pass per UPipe stage
                stages = SPECS["gqa"]["n_heads"] // options["ulysses_degree"]
                assert barriers == stages * ring_steps_of_one_pass(ring_degree), barriers
            else:
                assert barriers == ring_steps_of_one_pass(ring_degree), barriers


def _barrier_calls(model: str, method: str, options: dict, **step) -> float:
    trial = Trial.make(method, model, 8192, 4, options, mode="simulated", device="h100-80g",
                       step=StepConfig(**step))
    r = guarded(measure_simulated, trial)
    assert r.status == "ok", r.message
    return sum(t.calls for kind, t in r.step_counts.collectives.items() if kind.op == "barrier" and not kind.attention)


def test_the_paper_stack_synchronises_the_papers_ring_code_only(fresh_yunchang, tmp_path):
    layers = 2  # tiny-llama with two blocks (fewer to simulate)
    model = tmp_path / "tiny-llama-2l.json"
    model.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": layers}))
    model = str(model)
    per_layer = ring_steps_of_one_pass(4) + 3  # the checkpointed block's forward runs again: R-1 more
    assert _barrier_calls(model, "ring", {}, stack="paper") == 0  # ours: no barrier unless asked
    assert _barrier_calls(model, "ring", {}, ring_barrier=True) == layers * per_layer
    if HAS_YUNCHANG:
        yc = {"ulysses_degree": 1, "attn_type": "fa3"}
        assert _barrier_calls(model, "yc-usp", yc, stack="lean") == 0
        assert _barrier_calls(model, "yc-usp", yc, stack="paper") == layers * per_layer
    step, notes = stack.apply(StepConfig(stack="paper"), "usp-upipe")
    assert step.ring_barrier and any("ring_step_barrier" in n for n in notes)
    assert not stack.apply(StepConfig(stack="paper"), "upipe")[0].ring_barrier
    assert not stack.apply(StepConfig(stack="lean"), "yc-usp")[0].ring_barrier


@pytest.mark.skipif(not HAS_YUNCHANG, reason="yunchang is not installed (pip install yunchang)")
def test_yunchangs_wait_is_its_own_again_after_the_scope(fresh_yunchang):
    from yunchang.ring import utils

    own = utils.RingComm.wait
    with ringsync.ring_step_barriers():
        with ringsync.ring_step_barriers():  # scopes nest
            assert utils.RingComm.wait is not own and ringsync.enabled()
        assert utils.RingComm.wait is not own
    assert utils.RingComm.wait is own and not ringsync.enabled()
