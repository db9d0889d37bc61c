"""The levers past 10M tokens (issue 18): each one's numerics on gloo ranks against the plain
single-device step (loss and every gradient), and its memory effect under simulation.

* ``offload_keep="none"``: every block's checkpoint on the host, the first and last included;
* ``fsdp_offload``: FSDP2's ``CPUOffloadPolicy`` (sharded fp32 masters, gradients and AdamW
  state on the host, optimizer step on the host);
* ``fused_attn_norm``: the attention's RMSNorm run inside the method, tile by tile, so that its
  output (a full-length tensor the attention would save) never exists.
"""
from __future__ import annotations

import pytest

from bench.measure.run import measure_simulated
from bench.measure.trial import Trial
from bench.training.config import StepConfig
from tests.bench.test_step import ALL_ON, cp_step, reference_step

TOL = 1e-4  # fp32: gradient error relative to the gradient's largest entry (as test_step's)


def _close(got: dict, ref: dict) -> None:
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in got["grads"].items():
        want = ref["grads"][name]
        err = ((g.to(want.device) - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        assert err < TOL, (name, err)


_REF: dict[str, dict] = {}


def _ref(method: str) -> dict:
    if method not in _REF:
        _REF[method] = reference_step(method)
    return _REF[method]


@pytest.mark.parametrize("lever", [dict(offload_keep="none"), dict(fsdp_offload=True)],
                         ids=["offload_keep-none", "fsdp_offload"])
def test_lever_step_equals_plain_single_device_step(pool, lever):
    got = pool.run(cp_step, "upipe", {**ALL_ON, **lever}, world_size=2)[0]
    _close(got, _ref("upipe"))


def sim(seq_len: int = 8192, **levers) -> dict:
    trial = Trial.make("upipe", "tiny-llama", seq_len, 2, mode="simulated", device="h100-80g",
                       step=StepConfig(**levers))
    return measure_simulated(trial)


def test_offload_keep_none_moves_the_first_and_last_checkpoints_to_the_host():
    from bench.model.config import get_config

    cfg = get_config("tiny-llama")
    hidden = 8192 // 2 * cfg.dim * 2  # one block input [1, S/C, dim] bf16
    first = sim(offload_keep="first_last")
    none = sim(offload_keep="none")
    # two more block inputs (first and last) on the host, each with its positions (int64)
    assert none["host_peak_bytes"] - first["host_peak_bytes"] == pytest.approx(2 * (hidden + 8192 // 2 * 8),
                                                                                 rel=0.01)
    assert none["peak_bytes"] < first["peak_bytes"]


def test_fsdp_offload_moves_masters_and_adam_state_to_the_host():
    from bench.model.config import get_config

    n = get_config("tiny-llama").n_params
    plain, off = sim(), sim(fsdp_offload=True)
    assert plain["peak_by_category"]["optstate"] > 0
    assert off["peak_by_category"]["optstate"] == 0
    # fp32 master shard + AdamW's two fp32 states of this rank's half now on the host (at least)
    assert off["host_peak_bytes"] - plain["host_peak_bytes"] >= 0.95 * 12 * n / 2
    assert off["peak_bytes"] < plain["peak_bytes"]


def test_fsdp_offload_needs_fsdp_and_the_gpu_code_path():
    with pytest.raises(ValueError, match="needs fsdp=True"):
        StepConfig(fsdp=False, fsdp_offload=True)
    with pytest.raises(ValueError, match="sim_device='cpu'"):
        StepConfig(fsdp_offload=True, sim_device="cpu")


def test_new_levers_at_their_defaults_keep_old_rows_identity():
    assert not {"fsdp_offload", "fused_attn_norm"} & set(StepConfig().levers())
    assert StepConfig(fsdp_offload=True).levers()["fsdp_offload"] is True


def test_fused_attn_norm_step_equals_plain_single_device_step(pool):
    got = pool.run(cp_step, "upipe", {**ALL_ON, "fused_attn_norm": True}, world_size=2)[0]
    _close(got, _ref("upipe"))


def test_norm_tiles_equal_autograd_through_the_plain_norm():
    """methods.core.normtile over 3 uneven tiles (300 tokens, dim 128: the step above has one)."""
    import torch
    import torch.nn.functional as F

    from methods.core.normtile import norm_backward_, norm_linear, norm_weight_grad

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 128, generator=gen, dtype=torch.float64)
    nw = 1 + 0.1 * torch.randn(128, generator=gen, dtype=torch.float64)
    w = torch.randn(48, 128, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, 300, 48, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, nw, w)]
    ref = F.linear(F.rms_norm(leaves[0], (128,), leaves[1], 1e-5), leaves[2])
    ref.backward(dy)
    torch.testing.assert_close(norm_linear(x, nw, 1e-5, w), ref.detach())
    dt = dy.reshape(-1, 48)
    torch.testing.assert_close(norm_weight_grad(x, nw, 1e-5, dt), leaves[2].grad)
    da = (dy @ w).clone()
    dnw = norm_backward_(x, nw, 1e-5, da)
    torch.testing.assert_close(da, leaves[0].grad)
    torch.testing.assert_close(dnw, leaves[1].grad)


def test_fused_attn_norm_removes_the_saved_normed_input():
    from bench.model.config import get_config

    # long enough that the peak is in a block's attention backward (at 8K the loss decides it)
    seq = 262144
    hidden = seq // 2 * get_config("tiny-llama").dim * 2
    plain, fused = sim(seq), sim(seq, fused_attn_norm=True)
    # the normed input [1, S/C, dim] bf16 the attention saved is gone from the peak
    assert plain["peak_bytes"] - fused["peak_bytes"] == pytest.approx(hidden, rel=0.01)


def test_fused_attn_norm_is_refused_for_methods_that_cannot_run_it():
    trial = Trial.make("ulysses", "tiny-llama", 8192, 2, mode="simulated", device="h100-80g",
                       step=StepConfig(fused_attn_norm=True))
    with pytest.raises(ValueError, match="only upipe"):
        trial.validate()


def test_cli_and_sweep_specs_set_the_levers():
    from bench.cli import _trial, build_parser
    from sweeps.spec import STEP_KEYS

    args = build_parser().parse_args(["run", "--method", "upipe", "--model", "tiny-llama", "--world-size", "2",
                                      "--seq-len", "8K", "--offload-keep", "none", "--fsdp-offload",
                                      "--fused-attn-norm"])
    step = _trial(args, args.seq_len).step
    assert (step.offload_keep, step.fsdp_offload, step.fused_attn_norm) == ("none", True, True)
    assert {"offload_keep", "fsdp_offload", "fused_attn_norm"} <= STEP_KEYS
