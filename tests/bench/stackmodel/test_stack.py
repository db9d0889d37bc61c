"""The accounting stacks of simulated mode (``bench.stackmodel.stack``): what ``paper`` applies and
how a row records and judges it. Behaviour only; the paper's numbers are the fidelity command's."""
from __future__ import annotations

import pytest

import methods
from bench.measure.config import StepConfig
from bench.measure.run import run_trial
from bench.measure.trial import Trial
from bench.stackmodel import stack
from bench.stackmodel.counts import Collective, StepCounts, Traffic
from bench.stackmodel.hardware import get_device


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
    outside_torchtitan = [info.name for info in methods.all_infos() if not info.facts.torchtitan]
    assert {"fpdt", "ds-fpdt", "ds-ulysses-hf"} <= set(outside_torchtitan)  # Megatron-DeepSpeed, Hugging Face
    for outside in outside_torchtitan:
        assert stack.apply(StepConfig(stack="paper"), outside)[0].rope_table == "auto"
    assert stack.apply(StepConfig(stack="paper", scope="attention"), "upipe")[0].rope_table == "auto"
    assert stack.apply(StepConfig(stack="paper", rope_table="none"), "upipe")[0].rope_table == "none"
    with pytest.raises(ValueError, match="rope_table must be one of"):
        StepConfig(rope_table="yes")


def test_paper_terms_follow_each_methods_facts():
    """The kernel-scratch model, the RoPE table and the ring-step barrier come from each method's
    registration (``MethodFacts``), for every registered method."""
    for info in methods.all_infos():
        facts = info.facts
        step, notes = stack.apply(StepConfig(stack="paper"), info.name)
        scratch = "none" if facts.library_kernels else facts.kernel
        assert stack.scratch_model(info.name) == scratch and step.kernel_workspace == scratch, info.name
        assert step.ring_barrier == facts.ring_barrier, info.name
        assert (step.rope_table == "checkpointed") == facts.torchtitan, info.name
        assert any("ring_step_barrier" in n for n in notes) == facts.ring_barrier, info.name
    assert {i.name for i in methods.all_infos() if i.facts.ring_barrier} >= {"yc-ring", "yc-usp", "usp-upipe"}
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        stack.apply(StepConfig(stack="paper"), "nope")


def test_paper_budget_is_capacity_less_the_context():
    h100 = get_device("h100-80g")
    assert stack.usable_bytes(h100, "lean") == h100.usable() == stack.usable_bytes(h100, "lean", nccl=10**9)
    assert stack.usable_bytes(h100, "paper") == h100.capacity() - stack.CUDA_CONTEXT_BYTES - stack.FITTED
    assert stack.usable_bytes(h100, "paper", nccl=10**9) == stack.usable_bytes(h100, "paper") - 10**9
    assert stack.FITTED == 0
    names = [t.name for t in stack.PAPER_TERMS]
    assert len(names) == len(set(names)) and all(t.source for t in stack.PAPER_TERMS)


def _calls(**kinds: int) -> StepCounts:
    """Counts with ``op_size_in_node=calls`` collectives (``all_to_all_8_8=256``), no bytes."""
    def kind(name: str) -> Collective:
        op, size, in_node = name.rsplit("_", 2)
        return Collective(op, int(size), int(in_node))

    return StepCounts(collectives={kind(name): Traffic(calls) for name, calls in kinds.items()})


def test_nccl_buffers_follow_the_collectives_a_step_issued():
    """Connections per peer and channel: 32 channels to a peer in the node, 2 to one in another, all
    peers of an all-to-all, a ring's two neighbours, one ring of 32 channels per group of ring
    collectives; groups of the same shape count once."""
    conn, mib = stack.NCCL_CONNECTION_BYTES, 2**20
    assert stack.nccl_buffer_bytes(StepCounts()) == stack.nccl_buffer_bytes(None) == 0
    # Ulysses on 8 GPUs of one node, FSDP over the same 8: 7 x 32 + 32 connections of 14 MiB = 3.5 GiB
    one_node = StepCounts(collectives={Collective("all_to_all", 8, 8): Traffic(256, 1e9),
                                       Collective("all_gather", 8, 8): Traffic(66),
                                       Collective("reduce_scatter", 8, 8): Traffic(33)})
    assert stack.nccl_buffer_bytes(one_node) == (7 * 32 + 32) * conn == 3584 * mib
    # an all-to-all over two nodes: 7 NVLink peers and 8 network peers; a ring over two nodes
    assert stack.nccl_buffer_bytes(_calls(all_to_all_16_8=1)) == (7 * 32 + 8 * 2) * conn
    assert stack.nccl_buffer_bytes(_calls(send_8_8=1)) == 2 * 32 * conn
    assert stack.nccl_buffer_bytes(_calls(send_2_1=1)) == 1 * 2 * conn
    assert stack.nccl_buffer_bytes(_calls(send_16_8=1)) == 2 * 32 * conn
    assert stack.nccl_buffer_bytes(_calls(all_to_all_8_8=0, all_gather_1_1=5)) == 0
    # the attention's own blocking calls are counted in their kind already: they connect nothing more
    attention = StepCounts(collectives={Collective("all_gather", 8, 8): Traffic(4),
                                        Collective("all_gather", 8, 8, attention=True): Traffic(2)})
    assert stack.nccl_buffer_bytes(attention) == stack.nccl_buffer_bytes(_calls(all_gather_8_8=4)) == 32 * conn
    # the measurement it rests on: +3.28 GB at the first all-to-all of 8 H100s (NVIDIA/nccl#1685)
    assert stack.nccl_buffer_bytes(_calls(all_to_all_8_8=1)) == pytest.approx(3.28e9, rel=0.01)


def test_a_paper_row_records_its_stack_and_is_judged_on_reserved_memory():
    trial = Trial.make("upipe", "tiny-llama", 8192, 2, mode="simulated", device="h100-80g",
                       step=StepConfig(stack="paper"))
    row = run_trial(trial)
    assert row.status == "ok", row.message
    assert row.levers["stack"] == "paper"
    assert row.figures.peak_reserved_bytes >= row.figures.peak_bytes
    # NCCL's buffers (term 7) for what the step issued: UPipe's all-to-alls to its one peer, FSDP's ring
    nccl = stack.nccl_buffer_bytes(StepCounts.from_flat(row.figures.step_time_model["counts"]))
    assert nccl == (stack.NVLINK_CHANNELS_PER_PEER + stack.RING_CHANNELS) * stack.NCCL_CONNECTION_BYTES
    assert row.figures.usable_bytes == get_device("h100-80g").capacity() - stack.CUDA_CONTEXT_BYTES - nccl
    assert any("GiB of NCCL buffers" in n for n in row.notes)
    assert any("paper stack: allocator" in n for n in row.notes)
    lean = run_trial(Trial.make("upipe", "tiny-llama", 8192, 2, mode="simulated", device="h100-80g"))
    assert lean.levers["stack"] == "lean" and lean.figures.peak_reserved_bytes is None
    # term 8: the cuBLAS workspaces are live device storage throughout the step (category "other")
    workspaces = sum(stack.cublas_workspace_sizes(get_device("h100-80g")))
    assert any("paper stack: cublas_workspace (4 workspaces" in n for n in row.notes)
    assert row.figures.peak_by_category["other"] - lean.figures.peak_by_category.get("other", 0) == workspaces


def test_cublas_workspaces_follow_the_device():
    """32 MiB per handle on sm90 (H100, H200), 8 MiB + 128 KiB on others, each with cuBLASLt's 1 MiB;
    two handles (the forward's thread and autograd's); none on a CPU."""
    mib = 2**20
    assert stack.cublas_workspace_sizes(get_device("h100-80g")) == (32 * mib, mib, 32 * mib, mib)
    assert stack.cublas_workspace_sizes(get_device("h200-141g")) == (32 * mib, mib, 32 * mib, mib)
    a100 = 8 * mib + 128 * 1024
    assert stack.cublas_workspace_sizes(get_device("a100-80g")) == (a100, mib, a100, mib)
    assert stack.cublas_workspace_sizes(get_device("cpu")) == ()


def test_stack_is_refused_outside_simulation():
    trial = Trial.make("upipe", "tiny-llama", 1024, 2, mode="real", device="cpu", step=StepConfig(stack="paper"))
    with pytest.raises(ValueError, match="stack='paper' is an accounting of simulated memory"):
        trial.validate()
    with pytest.raises(ValueError, match="stack must be one of"):
        StepConfig(stack="fast")
