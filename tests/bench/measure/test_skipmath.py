"""bench.measure.skipmath: emulated runs with the attention arithmetic skipped.

What must hold: the skipped kernels leave exactly what the real ones leave (outputs of the same
shapes, dtypes and strides; the buffers they write; on CUDA the backward's scratch for the length
of the call), nothing else in the step changes, and the lever is refused where it would falsify a
run. The wrapped libraries run in a fresh ``python -m bench`` process, where the memory-faithful
flash-attn is installed (the tests' own process has the plain-torch stand-in, whose calls no
mode can tell from other arithmetic).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import methods
from bench.cli import main
from bench.measure.config import StepConfig
from bench.measure.run import run_trial
from bench.measure.skipmath import NOTE, SkipAttentionMath, is_skipped
from bench.measure.trial import Trial
from bench.stackmodel import fake_flash_attn as ffa
from bench.stackmodel.workspace import workspace_shapes

ROOT = Path(__file__).resolve().parents[3]
aten = torch.ops.aten
BF16 = torch.bfloat16


def _qkv(heads=4, seq=64, d=16, dtype=torch.float32, device="cpu", layout="bhsd"):
    shape = (1, heads, seq, d) if layout == "bhsd" else (1, seq, heads, d)
    return [torch.randn(shape, dtype=dtype, device=device) for _ in range(3)]


def _same_meta(a, b) -> None:
    assert (a.shape, a.dtype, a.stride(), a.device) == (b.shape, b.dtype, b.stride(), b.device)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_flash_kernels_answered_with_zeros_of_the_real_outputs_layout(causal):
    q, k, v = _qkv()
    real = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    dout = torch.randn_like(real[0])
    real_bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, real[0], real[1], 0.0, causal)
    with SkipAttentionMath() as skip:
        out = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out[0], out[1], 0.0, causal)
        other = q @ k.transpose(-1, -2)  # not an attention kernel: computed
    for got, want in zip((*out, *bwd), (*real, *real_bwd), strict=False):
        _same_meta(got, want)
        assert not got.any()
    assert other.abs().sum() > 0
    assert dict(skip.calls) == {"aten._scaled_dot_product_flash_attention_for_cpu": 1,
                                "aten._scaled_dot_product_flash_attention_for_cpu_backward": 1}


def test_simulated_flash_attn_kernels_write_zeros_into_the_callers_buffers():
    q, k, v = _qkv(heads=4, dtype=BF16, layout="bshd")
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()  # GQA: 2 KV heads
    with SkipAttentionMath() as skip:
        out, lse, _, _ = ffa._flash_attn_forward(q, k, v, 0.0, 0.25, True)
        dq, dk, dv = torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)
        softmax_d = ffa._flash_attn_backward(q, q, k, v, out, lse, dq, dk, dv, 0.0, 0.25, True)
        out3, lse3 = ffa.fa3_forward(q, k, v, causal=True)
        dq3 = torch.ones_like(q)
        ffa.fa3_backward(q, q, k, v, out3, lse3, dq=dq3, dk=torch.ones_like(k), dv=torch.ones_like(v), causal=True)
    assert out.shape == q.shape and lse.shape == (1, 4, 64) and lse.dtype == torch.float32
    assert softmax_d.shape == ffa.fa2_softmax_d_shape(q)
    assert not (dq.any() or dk.any() or dv.any() or dq3.any() or out3.any())
    assert set(skip.calls) == {"cpab_sim.fa2_fwd", "cpab_sim.fa2_bwd", "cpab_sim.fa3_fwd", "cpab_sim.fa3_bwd"}


class _Allocations(TorchDispatchMode):
    """The shapes of the device tensors created while it is active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (aten.empty.memory_format, aten.empty_strided.default) and out.device.type == "cuda":
            self.shapes.append(tuple(out.shape))
        return out


def test_cuda_flash_backward_holds_flash_attn_2_scratch_during_the_call():
    """torch's CUDA flash backward is flash-attn 2's mha_bwd: its dq accumulator and softmax_d are
    allocated for the call besides the gradients, and nothing else (fake CUDA tensors)."""
    with FakeTensorMode():
        q, k, v = _qkv(heads=4, seq=256, d=128, dtype=BF16, device="cuda")
        out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
        with _Allocations() as seen, SkipAttentionMath():
            aten._scaled_dot_product_flash_attention_backward(
                torch.ones_like(out), q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset)
    scratch = [shape for shape, _ in workspace_shapes("fa2", q, k)]
    assert scratch and all(shape in seen.shapes for shape in scratch)
    assert seen.shapes.count(tuple(q.shape)) == 3  # dq, dk, dv (MHA: all of q's shape)
    assert len(seen.shapes) == 3 + len(scratch)


def test_every_skipped_op_has_an_implementation_on_meta():
    """The mode takes the outputs' layout from the op's meta implementation."""
    for op in (aten._scaled_dot_product_flash_attention.default, ffa.fa2_fwd._opoverload, ffa.fa3_bwd._opoverload):
        assert is_skipped(op)
    assert not is_skipped(aten.mm.default)


def _trial(attention_math: str, mode: str = "emulated", method: str = "ulysses") -> Trial:
    step = StepConfig(attention_math=attention_math)
    return Trial.make(method, "tiny-llama", 1024, 2, {}, mode=mode, device="cpu", step=step, warmup=1, iters=1,
                      smoke=True)


def test_an_emulated_step_holds_the_same_memory_with_the_arithmetic_skipped():
    computed, skipped = run_trial(_trial("compute")), run_trial(_trial("skip"))
    assert computed.status == skipped.status == "ok", (computed.message, skipped.message)
    assert skipped.figures.peak_bytes == computed.figures.peak_bytes > 0
    assert skipped.figures.peak_by_category == computed.figures.peak_by_category
    assert skipped.levers["attention_math"] == "skip" and computed.levers["attention_math"] == "compute"
    assert computed.figures.loss is not None and skipped.figures.loss is None
    note = next(n for n in skipped.notes if n.startswith(NOTE))
    assert "_scaled_dot_product_flash_attention_for_cpu_backward x" in note


def test_a_method_whose_kernels_are_not_skipped_makes_an_error_row():
    step = StepConfig(attention_math="skip")
    trial = Trial.make("ulysses", "tiny-llama", 1024, 2, {"kernel": "math"}, mode="emulated", device="cpu",
                       step=step, warmup=1, iters=1, smoke=True)
    row = run_trial(trial)
    assert row.status == "error" and "no attention kernel" in row.message
    assert "drop --attention-math skip" in row.message


@pytest.mark.parametrize("mode", ["simulated", "real"])
def test_skip_is_refused_outside_emulated_mode(mode):
    with pytest.raises(ValueError, match="attention_math='skip'.*use --mode emulated"):
        _trial("skip", mode=mode).validate()


def test_cli_refuses_skip_in_simulated_mode_in_one_line(capsys):
    code = main(["run", "--mode", "simulated", "--device", "cpu", "--model", "tiny-llama", "--method", "ulysses",
                 "--seq-len", "1024", "--world-size", "2", "--attention-math", "skip", "--no-save"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "use --mode emulated" in err


@pytest.mark.skipif(bool(methods.get_info("yc-usp").missing(provided=("flash_attn", "flash_attn_interface"))),
                    reason="yunchang is not installed (pip install -e '.[yunchang]')")
def test_a_wrapped_library_runs_emulated_on_the_memory_faithful_flash_attn(tmp_path):
    """yunchang's USP (Ulysses 2 x ring 2) with flash-attn 3, emulated with the arithmetic skipped,
    in a fresh process: every flash-attn call goes to the memory-faithful kernels and is answered."""
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "run", "--mode", "emulated", "--device", "cpu", "--model", "tiny-llama",
         "--method", "yc-usp", "--opt", "attn_type=fa3", "--opt", "ulysses_degree=2", "--world-size", "4",
         "--seq-len", "2048", "--attention-math", "skip", "--ring-barrier", "--warmup", "1", "--iters", "1",
         "--smoke", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["status"] == "ok", row["message"]
    note = next(n for n in row["notes"] if n.startswith(NOTE))
    assert "cpab_sim.fa3_fwd x" in note and "cpab_sim.fa3_bwd x" in note
    assert any("bench.stackmodel.fake_flash_attn" in n for n in row["notes"])
