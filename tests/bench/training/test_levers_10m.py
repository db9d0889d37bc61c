"""The levers past 10M tokens (issue 18): each one's numerics on gloo ranks against the plain
single-device step (loss and every gradient), and its memory effect under simulation.

* ``offload_keep="none"``: every block's checkpoint on the host, the first and last included;
* ``fsdp_offload``: FSDP2's ``CPUOffloadPolicy`` (sharded fp32 masters, gradients and AdamW
  state on the host, optimizer step on the host);
* ``fused_attn_norm``: the attention's RMSNorm run inside the method, tile by tile, so that its
  output (a full-length tensor the attention would save) never exists;
* ``ac_group``: two-level checkpointing (``bench.training.nested``): the host holds the group
  inputs and one group's re-created block inputs instead of every block's input.
"""
from __future__ import annotations

import json

import pytest

from bench.measure.config import StepConfig
from bench.measure.result import Measurement
from bench.measure.run import measure_simulated
from bench.measure.trial import Trial
from records.identity import V1_OMITTED_LEVERS
from tests.bench.training.test_step import ALL_ON, cp_step, reference_step

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


_SIMS: dict[Trial, Measurement] = {}


def sim(seq_len: int = 8192, **levers) -> Measurement:
    """upipe on tiny-llama, 2 ranks, simulated; once per trial in this module (the default step is
    asked for by two tests: ``offload_keep="first_last"`` is the default)."""
    trial = Trial.make("upipe", "tiny-llama", seq_len, 2, mode="simulated", device="h100-80g",
                       step=StepConfig(**levers))
    if trial not in _SIMS:
        _SIMS[trial] = measure_simulated(trial)
    return _SIMS[trial]


def test_offload_keep_none_moves_the_first_and_last_checkpoints_to_the_host():
    from bench.model.config import get_config

    cfg = get_config("tiny-llama")
    hidden = 8192 // 2 * cfg.dim * 2  # one block input [1, S/C, dim] bf16
    first = sim(offload_keep="first_last")
    none = sim(offload_keep="none")
    # two more block inputs (first and last) on the host, each with its positions (int64)
    assert none.host_peak_bytes - first.host_peak_bytes == pytest.approx(2 * (hidden + 8192 // 2 * 8),
                                                                                 rel=0.01)
    assert none.peak_bytes < first.peak_bytes


def test_fsdp_offload_moves_masters_and_adam_state_to_the_host():
    from bench.model.config import get_config

    n = get_config("tiny-llama").n_params
    plain, off = sim(), sim(fsdp_offload=True)
    assert plain.peak_by_category["optstate"] > 0
    assert off.peak_by_category["optstate"] == 0
    # fp32 master shard + AdamW's two fp32 states of this rank's half now on the host (at least)
    assert off.host_peak_bytes - plain.host_peak_bytes >= 0.95 * 12 * n / 2
    assert off.peak_bytes < plain.peak_bytes


def test_fsdp_offload_needs_fsdp_and_the_gpu_code_path():
    with pytest.raises(ValueError, match="needs fsdp=True"):
        StepConfig(fsdp=False, fsdp_offload=True)
    with pytest.raises(ValueError, match="sim_device='cpu'"):
        StepConfig(fsdp_offload=True, sim_device="cpu")


def test_new_levers_at_their_defaults_keep_old_rows_identity():
    # schema 2 rows record every lever; a schema 1 row that left it out (at its default) keeps its key
    assert all(StepConfig().levers()[k] == V1_OMITTED_LEVERS[k] for k in ("fsdp_offload", "fused_attn_norm"))
    assert StepConfig(fsdp_offload=True).levers()["fsdp_offload"] is True


@pytest.mark.parametrize("method", ["upipe", "fpdt"])
def test_fused_attn_norm_step_equals_plain_single_device_step(pool, method):
    """upipe folds the norm into its projections tile by tile; fpdt into each chunk's."""
    got = pool.run(cp_step, method, {**ALL_ON, "fused_attn_norm": True}, world_size=2)[0]
    _close(got, _ref(method))


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


# a length at which a block's attention backward holds the peak of
# tiny-llama on 2 ranks, for upipe and for fpdt in 8 chunks: at 8K the loss decides it and the
# normed input is not in the peak, so the two checks below would fail
NORM_SEQ = 32768


def test_fused_attn_norm_removes_the_saved_normed_input():
    from bench.model.config import get_config

    # long enough that the peak is in a block's attention backward (at 8K the loss decides it)
    seq = NORM_SEQ
    hidden = seq // 2 * get_config("tiny-llama").dim * 2
    plain, fused = sim(seq), sim(seq, fused_attn_norm=True)
    # the normed input [1, S/C, dim] bf16 the attention saved is gone from the peak
    assert plain.peak_bytes - fused.peak_bytes == pytest.approx(hidden, rel=0.01)


def test_fused_attn_norm_removes_fpdts_saved_normed_input(tmp_path):
    """fpdt saves the block input and norms each chunk as it projects it: the full-length normed
    input, which the attention would save, is gone from the peak (under the paper stack, the
    default of simulated runs, the peak is in a block's attention backward, where it was saved).
    tiny-llama with two blocks: the saving is one block's, and each block is another chunk pipeline
    to simulate."""
    from bench.model.config import get_config

    seq = NORM_SEQ
    hidden = seq // 2 * get_config("tiny-llama").dim * 2
    model = tmp_path / "tiny-llama-2l.json"
    model.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": 2}))

    def fpdt(**levers):
        trial = Trial.make("fpdt", str(model), seq, 2, mode="simulated", device="h100-80g",
                           options={"num_chunks": 8}, step=StepConfig(stack="paper", **levers))
        return measure_simulated(trial).peak_bytes

    saved = fpdt() - fpdt(fused_attn_norm=True)
    assert hidden * 3 // 4 <= saved <= hidden


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


# ----------------------------------------------------------------------------- ac_group (two-level checkpointing)


@pytest.mark.parametrize("group", [2, 3], ids=["K2-even", "K3-of-4-uneven"])
def test_ac_group_step_equals_plain_single_device_step(pool, group):
    """Groups of 2 and of 3 (+1) over tiny-llama's 4 blocks, with checkpoint offload and the RoPE
    table as an argument of both checkpoint levels."""
    got = pool.run(cp_step, "upipe", {**ALL_ON, "ac_group": group, "rope_table": "checkpointed"},
                   world_size=2)[0]
    _close(got, _ref("upipe"))


def test_ac_group_recomputes_through_the_offload_hooks():
    """On a CPU device the offload is a no-op, so the step above never moves a tensor: here an
    offload that really copies (and counts live copies) shows the group inputs stored in forward
    (n/K), the K re-created block inputs offloaded in backward, and unchanged gradients."""
    import weakref

    import torch
    from torch import nn

    from bench.training.nested import CheckpointedGroup, group_bounds
    from bench.training.step import CheckpointedBlock, HostOffload

    live: dict[int, int] = {}

    class Copying(HostOffload):
        def pack(self, t):
            c = t.detach().clone()
            live[id(c)] = 1
            weakref.finalize(c, live.pop, id(c), None)
            return (t.device, c)

        def unpack(self, packed):
            return packed[1].clone()

    class Lin(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)) / 3)

        def forward(self, x, positions):
            return torch.tanh(x @ self.w) + x

    n, k = 8, 3
    blocks = [Lin(i) for i in range(n)]
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(99), requires_grad=True)
    pos = torch.arange(5)
    y = x
    for b in blocks:
        y = b(y, pos)
    y.square().sum().backward()
    want = [b.w.grad.clone() for b in blocks] + [x.grad.clone()]
    for p in [*(b.w for b in blocks), x]:
        p.grad = None
    off = Copying()
    wrapped = [CheckpointedBlock(b, None) for b in blocks]
    groups = [CheckpointedGroup(tuple(wrapped[i] for i in r), outer=off, inner=off) for r in group_bounds(n, k)]
    y = x
    for g in groups:
        y = g(y, pos)
    # forward: each group's input and positions, nothing of the blocks inside
    assert len(live) == 2 * len(groups)
    peak = []
    for b in blocks:
        b.w.register_hook(lambda g: peak.append(len(live)) or g)
    y.square().sum().backward()
    # live copies at each weight gradient, blocks 7 to 0 (groups [6,7], [3,4,5], [0,1,2]): the inputs
    # and positions of the groups not yet done, plus the block inputs the group re-created and has
    # not used yet. The re-created input of a group's first block is the copy its group keeps, and
    # every re-created block's positions are the group's: only the hidden of blocks 4, 5, 1, 2 is
    # copied again (without that, blocks 7, 5 and 2 would see 8, 8 and 6)
    assert peak == [6, 4, 5, 4, 2, 3, 2, 0]
    for got, w in zip([b.w.grad for b in blocks] + [x.grad], want, strict=False):
        torch.testing.assert_close(got, w)
    assert not live


def _mid(tmp_path, n_layers: int = 6) -> str:
    import json

    path = tmp_path / "mid.json"
    path.write_text(json.dumps(dict(name="mid", dim=512, n_layers=n_layers, n_heads=8, n_kv_heads=4, head_dim=64,
                                    ffn_dim=1536, vocab_size=8192)))
    return str(path)


def test_ac_group_host_peak_is_group_inputs_plus_one_group(tmp_path):
    """6 blocks, every checkpoint offloaded: the host peak is max over groups j of (inputs of
    groups 0..j, each a block input and its positions) + (the hidden of the K_j - 1 further block
    inputs that group j re-creates): the group's own input is re-created too, and every re-created
    block's positions are the group's, but both are stored as the copy the outer checkpoint keeps,
    not a second one; the device peak stays that of one checkpoint per block, give or take one
    block input. Groups of 2 (even) and of 4 (uneven: the first, larger group decides the max)."""
    seq, ws = 32768, 4
    hidden = seq // ws * 512 * 2  # [1, S/C, dim] bf16
    ckpt = hidden + seq // ws * 8  # + positions int64
    cfg = _mid(tmp_path)

    def run(k: int, keep: str = "none") -> Measurement:
        trial = Trial.make("upipe", cfg, seq, ws, mode="simulated", device="h100-80g",
                           step=StepConfig(ac_group=k, offload_keep=keep))
        return measure_simulated(trial)

    small = 4096  # besides the checkpoints, a few bytes of index tensors made on the host (test_step's)
    base = run(1)
    assert 0 <= base.host_peak_bytes - 6 * ckpt < small
    # groups [2,2,2]: 3 inputs + 1 hidden; [4,2]: max(1 + 3 hidden, 2 + 1 hidden)
    for k, inputs, hiddens in ((2, 3, 1), (4, 1, 3)):
        r = run(k)
        assert 0 <= r.host_peak_bytes - (inputs * ckpt + hiddens * hidden) < small, k
        assert r.peak_bytes <= base.peak_bytes + ckpt, k
    # offload_keep applies to the group inputs: first and last group stay on the device, and a
    # kept group's re-created input is its device input itself (group 1 + one re-created hidden)
    r = run(2, "first_last")
    assert 0 <= r.host_peak_bytes - (ckpt + hidden) < small
    assert r.peak_bytes <= run(1, "first_last").peak_bytes + ckpt  # and adds nothing on the device


def test_ac_group_refusals_and_cli():
    from bench.cli import _trial, build_parser
    from sweeps.spec import STEP_KEYS

    with pytest.raises(ValueError, match="ac_group must be an integer >= 1"):
        StepConfig(ac_group=0)
    with pytest.raises(ValueError, match="needs ac=True"):
        StepConfig(ac=False, ac_offload=False, ac_group=2)
    trial = Trial.make("upipe", "tiny-llama", 8192, 2, mode="simulated", device="h100-80g",
                       step=StepConfig(ac_group=5))
    with pytest.raises(ValueError, match="has 4 layers; use --ac-group 1..4"):
        trial.validate()
    assert StepConfig().levers()["ac_group"] == V1_OMITTED_LEVERS["ac_group"] == 1  # schema 1 rows keep their keys
    assert StepConfig(ac_group=4).levers()["ac_group"] == 4
    args = build_parser().parse_args(["run", "--method", "upipe", "--model", "tiny-llama", "--world-size", "2",
                                      "--seq-len", "8K", "--ac-group", "3"])
    assert _trial(args, args.seq_len).step.ac_group == 3
    assert "ac_group" in STEP_KEYS
    from bench.cli import UsageError, execute

    grouped = Trial.make("upipe", "tiny-llama", 8192, 2, mode="simulated", device="h100-80g",
                         step=StepConfig(ac_group=2))
    with pytest.raises(UsageError, match="--extrapolate-layers extrapolates linearly"):
        execute(grouped, None, False, in_process=True, extrapolate=True)
