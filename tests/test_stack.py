"""The accounting stacks of simulated mode (``bench.measure.stack``): what ``paper`` applies and
how a row records and judges it. Behaviour only; the paper's numbers are the fidelity command's."""
from __future__ import annotations

import pytest

from bench.measure import stack
from bench.measure.hardware import get_device
from bench.measure.run import run_trial
from bench.measure.trial import Trial
from bench.training.config import StepConfig


def test_lean_leaves_the_step_alone():
    step = StepConfig()
    assert stack.apply(step, "upipe") == (step, [])


def test_paper_fills_in_its_terms_and_keeps_explicit_levers():
    step, notes = stack.apply(StepConfig(stack="paper"), "upipe")
    assert step.allocator_model == "expandable" and step.kernel_workspace == "fa3"
    assert step.offload_keep == "first"
    assert len(notes) >= 3 and all(n.startswith("paper stack:") for n in notes)
    explicit, _ = stack.apply(StepConfig(stack="paper", kernel_workspace="fa2", allocator_model="classic"), "ulysses")
    assert explicit.kernel_workspace == "fa2" and explicit.allocator_model == "classic"
    library, _ = stack.apply(StepConfig(stack="paper"), "yc-usp")
    assert library.kernel_workspace == "none"  # its fake flash-attn allocates the real scratch itself
    assert stack.apply(StepConfig(stack="paper"), "torch-cp")[0].kernel_workspace == "fa2"
    # TorchTitan's RoPE table: every method the paper ran in TorchTitan, not FPDT or the HF stack
    assert step.rope_table == library.rope_table == "checkpointed"
    for outside in stack.OUTSIDE_TORCHTITAN:
        assert stack.apply(StepConfig(stack="paper"), outside)[0].rope_table == "auto"
    assert stack.apply(StepConfig(stack="paper", scope="attention"), "upipe")[0].rope_table == "auto"
    assert stack.apply(StepConfig(stack="paper", rope_table="none"), "upipe")[0].rope_table == "none"
    with pytest.raises(ValueError, match="rope_table must be one of"):
        StepConfig(rope_table="yes")


def test_paper_budget_is_capacity_less_the_context():
    h100 = get_device("h100-80g")
    assert stack.usable_bytes(h100, "lean") == h100.usable()
    assert stack.usable_bytes(h100, "paper") == h100.capacity() - stack.CUDA_CONTEXT_BYTES - stack.FITTED
    assert stack.FITTED == 0
    names = [t.name for t in stack.PAPER_TERMS]
    assert len(names) == len(set(names)) and all(t.source for t in stack.PAPER_TERMS)


def test_a_paper_row_records_its_stack_and_is_judged_on_reserved_memory():
    trial = Trial.make("upipe", "tiny-llama", 8192, 2, mode="simulated", device="h100-80g",
                       step=StepConfig(stack="paper"))
    row = run_trial(trial)
    assert row.status == "ok", row.message
    assert row.levers["stack"] == "paper"
    assert row.figures.peak_reserved_bytes >= row.figures.peak_bytes
    assert row.figures.usable_bytes == get_device("h100-80g").capacity() - stack.CUDA_CONTEXT_BYTES
    assert any("paper stack: allocator" in n for n in row.notes)
    lean = run_trial(Trial.make("upipe", "tiny-llama", 8192, 2, mode="simulated", device="h100-80g"))
    assert "stack" not in lean.levers and lean.figures.peak_reserved_bytes is None


def test_stack_is_refused_outside_simulation():
    trial = Trial.make("upipe", "tiny-llama", 1024, 2, mode="real", device="cpu", step=StepConfig(stack="paper"))
    with pytest.raises(ValueError, match="stack='paper' is an accounting of simulated memory"):
        trial.validate()
    with pytest.raises(ValueError, match="stack must be one of"):
        StepConfig(stack="fast")
