"""``ac_keep_attn``: selective activation checkpointing that keeps each block's attention kernel
outputs (``bench.training.step.keep_attention``), so the recomputation does not run the attention
forward again.

* a real CPU step on one device gives exactly the plain checkpointed step's loss and gradients;
* the attention forward kernel runs once per block (and head stage) per step instead of twice;
* simulated: the kept outputs raise the peak by their bytes, and the modelled step is shorter;
* the flag, its spec key, and the one-line refusals.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import methods
from bench.measure.config import StepConfig
from bench.measure.result import Measurement
from bench.measure.run import build_row, measure_simulated
from bench.measure.trial import Trial
from bench.model.config import get_config
from bench.search.plan import SimCache
from bench.training.step import build_model, make_batch
from records.identity import V1_OMITTED_LEVERS

TINY, SEQ = "tiny-llama", 256
FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default  # methods.core.kernels on CPU
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class KernelCalls(TorchDispatchMode):
    """Counts the CPU flash-attention ops dispatched below every mode a checkpoint pushes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (FORWARD, BACKWARD):
            self.calls[func] += 1
        return func(*args, **(kwargs or {}))


_STEPS: dict[tuple[str, bool], dict] = {}


def one_device_step(method: str, keep: bool) -> dict:
    """Forward and backward of tiny-llama in fp32 on one CPU device (no process group, no FSDP),
    every block checkpointed; the loss, the gradients and the kernel calls."""
    if (method, keep) not in _STEPS:
        torch.manual_seed(0)
        step = StepConfig.plain(dtype="fp32", ac=True, ac_keep_attn=keep)
        model, _ = build_model(get_config(TINY), method, {}, None, step, "cpu", seed=0, seq_len=SEQ)
        batch = make_batch(model, SEQ, 2, "cpu", seed=1)
        with KernelCalls() as counted:
            loss = model(batch.tokens, batch.positions, batch.labels)
            loss.backward()
        _STEPS[method, keep] = {"loss": loss.item(), "calls": counted.calls,
                                "grads": {n: p.grad for n, p in model.named_parameters()}}
    return _STEPS[method, keep]


OURS = ["ulysses", "upipe"]  # upipe: a kernel call per head stage


@pytest.mark.parametrize("method", OURS)
def test_keeping_the_attention_outputs_changes_no_number(method):
    plain, kept = one_device_step(method, False), one_device_step(method, True)
    assert kept["loss"] == plain["loss"]  # fp32, the same kernels on the same inputs: exactly
    assert set(kept["grads"]) == set(plain["grads"])
    for name, g in kept["grads"].items():
        assert torch.equal(g, plain["grads"][name]), name


@pytest.mark.parametrize("method", OURS)
def test_the_attention_forward_runs_once_per_block_instead_of_twice(method):
    plain, kept = one_device_step(method, False)["calls"], one_device_step(method, True)["calls"]
    backward = plain[BACKWARD]
    assert backward > 0 and kept[BACKWARD] == backward  # one backward per kernel call of the forward
    assert plain[FORWARD] == 2 * backward  # forward, and the checkpoint's recomputation
    assert kept[FORWARD] == backward  # forward only: the recomputation takes the kept outputs
    if method == "ulysses":  # one kernel call per block
        assert kept[FORWARD] == get_config(TINY).n_layers


def test_simulated_peak_holds_the_kept_outputs_and_the_modelled_step_is_shorter():
    """UPipe, tiny-llama at 512K on 2 ranks, on the GPU code path (the CUDA flash op's fake).

    Each block keeps out [S/C, H, d] bf16 and lse fp32 [H, S/C] (over all of its head stages). The
    peak with them is in the first block's backward, while the other L - 1 blocks' outputs are
    still kept (the kept bytes fall by one block per block, more than anything else grows). The
    plain step's peak is in the same kernel's backward of a later block, where a little more is
    live (gradients, about two blocks' fp32 here: 1.5 MB), so the difference is (L - 1) kept
    blocks less that: within 1% at this length. Attention FLOPs per kernel call: forward 4,
    recomputation 4, backward 10 (stepcount's formulas), so 4 + 10 of 4 + 4 + 10 remain."""
    cfg = get_config(TINY)
    seq, ws = 524288, 2

    def sim(keep: bool) -> tuple[Measurement, object]:
        trial = Trial.make("upipe", TINY, seq, ws, mode="simulated", device="h100-80g",
                           step=StepConfig(ac_keep_attn=keep))
        trial.validate()
        result = measure_simulated(trial)
        return result, build_row(trial, result, 0.0).figures

    (plain, plain_f), (kept, kept_f) = sim(False), sim(True)
    per_block = seq // ws * cfg.n_heads * cfg.head_dim * 2 + cfg.n_heads * seq // ws * 4
    more = kept.peak_bytes - plain.peak_bytes
    assert 0.99 * (cfg.n_layers - 1) * per_block <= more <= (cfg.n_layers - 1) * per_block
    # created in forward and held to the backward: counted as activations
    more_act = kept.peak_by_category["activation"] - plain.peak_by_category["activation"]
    assert more_act >= (cfg.n_layers - 1) * per_block
    flops = plain.step_counts.flops_attention, kept.step_counts.flops_attention
    assert flops[1] / flops[0] == pytest.approx(14 / 18, rel=1e-9)
    assert kept_f.step_time_s < plain_f.step_time_s


def test_refusals_flag_and_keys(capsys):
    from bench.cli import build_parser, main
    from sweeps.spec import STEP_KEYS

    with pytest.raises(ValueError, match="ac_keep_attn=True has no effect with ac=False"):
        StepConfig(ac=False, ac_offload=False, ac_keep_attn=True)
    with pytest.raises(ValueError, match="ac_keep_attn with ac_group=2"):
        StepConfig(ac_group=2, ac_keep_attn=True)
    torch_cp = Trial.make("torch-cp", TINY, 8192, 2, mode="simulated", device="h100-80g",
                          step=StepConfig(ac_keep_attn=True))
    with pytest.raises(ValueError, match="its library calls its attention kernel itself"):
        torch_cp.validate()
    math = Trial.make("ulysses", TINY, 8192, 2, options={"kernel": "math"}, mode="simulated", device="h100-80g",
                      step=StepConfig(ac_keep_attn=True))
    with pytest.raises(ValueError, match="kernel 'math' runs no torch flash-attention op"):
        math.validate()
    Trial.make("upipe", TINY, 8192, 2, mode="simulated", device="h100-80g",
               step=StepConfig(ac_keep_attn=True)).validate()
    # a method whose library calls flash-attn says so (a class attribute, not a list of names)
    for info in methods.all_infos():
        if "flash_attn" in info.requires:
            assert not info.cls.calls_suite_kernel, info.name

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "--ac-keep-attn" in capsys.readouterr().out
    code = main(["run", "--method", "ulysses", "--model", TINY, "--seq-len", "2K", "--world-size", "2",
                 "--no-ac", "--ac-keep-attn", "--no-save"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "ac_keep_attn=True has no effect with ac=False" in err
    args = build_parser().parse_args(["run", "--method", "upipe", "--model", TINY, "--world-size", "2",
                                      "--seq-len", "8K", "--ac-keep-attn"])
    assert args.ac_keep_attn is True and "ac_keep_attn" in STEP_KEYS
    # rows and the planner's committed cache written before the lever existed keep their keys
    assert StepConfig().levers()["ac_keep_attn"] is V1_OMITTED_LEVERS["ac_keep_attn"] is False
    trial = Trial.make("upipe", TINY, 8192, 2, mode="simulated")
    keyed = json.loads(SimCache.key(trial, "tiny", 3))["step"]
    assert "ac_keep_attn" not in keyed and "fsdp" in keyed  # keyed only away from its default
