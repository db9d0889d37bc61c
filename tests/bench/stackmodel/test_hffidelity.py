"""The HF stack's fidelity section (``bench.stackmodel.hffidelity``): its cited anchors, and one anchor
run at small scale through the same code path (the published lengths take minutes each)."""
from __future__ import annotations

import dataclasses

import pytest

from bench.measure.run import run_trial
from bench.stackmodel import hffidelity


def test_the_anchors_are_alsts_published_lengths_with_their_sources():
    anchors = {a.name: a for a in hffidelity.load_anchors()}
    assert [(a.gpus, a.seq_len) for a in anchors.values()] == [(1, 500_000), (8, 3_700_000), (32, 15_000_000)]
    for a in anchors.values():
        assert "2506.13996" in a.source and "ArcticTraining" in a.recipe and a.expect == "fits"
        trial = a.trial()
        assert trial.step.stack == "hf" and trial.method == "ds-ulysses-hf" and trial.config().name
        trial.validate(here=False)


def test_a_missing_column_is_refused_in_one_line(tmp_path):
    (tmp_path / "alst_anchors.csv").write_text("name,model,method,gpus,seq_len,expect,source,recipe\n"
                                               "x,tiny-llama,ds-ulysses-hf,2,4096,fits,,r\n")
    with pytest.raises(ValueError, match=r"alst_anchors.csv:2: missing \['source'\]"):
        hffidelity.load_anchors(tmp_path)


def test_one_anchor_at_small_scale_fits_and_reports_its_headroom(tmp_path):
    small = dataclasses.replace(hffidelity.load_anchors()[0], name="small", model="tiny-llama", gpus=2,
                                seq_len=8192)
    [result] = hffidelity.run_anchors([small], runner=run_trial)
    assert result.status() == "ok" and result.passes()
    assert result.headroom_gib() > 0
    md = hffidelity.markdown([result])
    assert "**1/1 anchors pass.**" in md and "| small | fits at 8K x2 | ok |" in md
    paths = hffidelity.write_outputs([result], tmp_path, tmp_path)
    assert [p.name for p in paths] == ["hf_fidelity.jsonl", "hf_fidelity.md"]


def test_alsts_all_to_alls_are_counted():
    """ALST exchanges Q, K, V and the output through DeepSpeed's registered operator
    (``deepspeed::dim_zero_all_to_all``), whose fake kernel hides the c10d call under simulation: the
    counter counts the operator, so the step's all-to-alls reach the step time and NCCL's buffers."""
    from bench.stackmodel import stack

    pytest.importorskip("deepspeed", reason="ds-ulysses-hf wraps DeepSpeed's ALST")
    small = dataclasses.replace(hffidelity.load_anchors()[0], name="small", model="tiny-llama", gpus=2,
                                seq_len=8192)
    row = run_trial(small.trial())
    assert row.status == "ok", row.message
    counts = row.figures.step_time_model["counts"]
    layers = small.trial().config().n_layers
    # per layer Q, K, V and the output forward, again in the recomputation, and their gradients
    assert counts["comm.all_to_all.2.2.calls"] == 12 * layers
    assert row.figures.comm_bytes_by_op["all_to_all"] == counts["comm.all_to_all.2.2.bytes"] > 0
    one_peer = stack.NVLINK_CHANNELS_PER_PEER * stack.NCCL_CONNECTION_BYTES  # the all-to-all's one peer
    capacity = small.trial().preset().capacity_bytes - stack.CUDA_CONTEXT_BYTES
    assert capacity - row.figures.usable_bytes >= one_peer
