"""bench.stackmodel.fake_flash_attn: the simulated flash-attn's shapes, allocations and installation.

The tests' conftest puts the plain-torch stand-in into ``sys.modules`` as ``flash_attn`` for
the whole process; the functions here are called from the module directly, and the
installation tests take ``flash_attn`` out of ``sys.modules`` with ``monkeypatch`` (restored
after each test). Simulated trials of the wrapped libraries run in subprocesses
(tests/bench/stackmodel/test_simulated_flash_attn.py), where nothing else provides flash-attn.
"""
from __future__ import annotations

import importlib.util
import math
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import methods
from bench.measure.simulate import track_peaks
from bench.measure.trial import Trial
from bench.stackmodel import fake_flash_attn as ffa
from bench.stackmodel.workspace import workspace_shapes
from methods.core.base import AttentionMethod

BF16, F32 = torch.bfloat16, torch.float32


def size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensors(b, sq, sk, h, hk, d, dtype=BF16):
    q = torch.empty(b, sq, h, d, dtype=dtype)
    k, v = torch.empty(b, sk, hk, d, dtype=dtype), torch.empty(b, sk, hk, d, dtype=dtype)
    return q, k, v


# ------------------------------------------------------------------------------ shapes and dtypes
@pytest.mark.parametrize("d", [128, 100])
def test_fa2_forward_outputs(d):
    with FakeTensorMode():
        q, k, v = tensors(2, 300, 300, 8, 2, d)
        out, lse, s_dmask, rng = ffa._flash_attn_forward(q, k, v, 0.0, 0.1, True, -1, -1, 0.0, None, False)
        assert out.shape == (2, 300, 8, math.ceil(d / 8) * 8) and out.dtype == BF16  # out_padded
        assert lse.shape == (2, 8, 300) and lse.dtype == F32
        assert rng.shape == (2,) and rng.dtype == torch.int64 and s_dmask.numel() == 0
        assert ffa.flash_attn_func(q, k, v, causal=True).shape == (2, 300, 8, d)


def test_fa2_backward_returns_softmax_d_and_fills_caller_buffers():
    with FakeTensorMode():
        q, k, v = tensors(1, 300, 200, 8, 2, 128)
        out, lse, _, rng = ffa._flash_attn_forward(q, k, v, 0.0, 0.1, False)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        softmax_d = ffa._flash_attn_backward(torch.empty_like(out), q, k, v, out, lse, dq, dk, dv, 0.0, 0.1, False,
                                             -1, -1, 0.0, None, False, rng)
        assert softmax_d.shape == (1, 8, 384) and softmax_d.dtype == F32  # Sq rounded to 128
        # None buffers are allocated (and dropped), as flash_attn_cuda.bwd does
        ffa._flash_attn_backward(torch.empty_like(out), q, k, v, out, lse, None, None, None, 0.0, 0.1, False)


def test_fa2_scratch_matches_the_workspace_model():
    """The fa2 model of bench.stackmodel.workspace (softmax_d counted there as scratch)."""
    for hk in (8, 2):
        with FakeTensorMode():
            q, k, v = tensors(2, 1000, 1000, 8, hk, 128)
            ours = ffa.nbytes(ffa.fa2_backward_scratch(q, k, v)) + math.prod(ffa.fa2_softmax_d_shape(q)) * 4
            model = sum(math.prod(s) * torch.empty((), dtype=dt).element_size()
                        for s, dt in workspace_shapes("fa2", q.transpose(1, 2), k.transpose(1, 2)))
        assert ours == model


def test_fa2_scratch_sizes():
    with FakeTensorMode():
        q, k, v = tensors(1, 1000, 1000, 32, 8, 128)
        shapes = ffa.fa2_backward_scratch(q, k, v)
        assert shapes["dq_accum"] == ((1, 1024, 32, 128), F32)
        assert shapes["dk_expanded"] == shapes["dv_expanded"] == ((1, 1000, 32, 128), BF16)
        det = ffa.fa2_backward_scratch(q, k, v, deterministic=True)
        assert det["dq_accum"] == ((math.ceil(ffa.SM_COUNT / 32), 1, 1024, 32, 128), F32)
        assert "dk_expanded" not in ffa.fa2_backward_scratch(q, k[:, :, :1].expand(1, 1000, 32, 128), v)


def test_fa3_backward_buffers():
    with FakeTensorMode():
        q, k, _ = tensors(1, 1000, 1000, 32, 8, 128)
        causal = ffa.fa3_backward_buffers(q, k, causal=True)
        assert causal["dq_accum"] == ((1, 32, 1024 * 128), F32)  # kBlockM 64: 1000 -> 1024
        assert causal["dk_accum"] == causal["dv_accum"] == ((1, 8, 1024 * 128), F32)  # kBlockN 128
        assert causal["softmax_d"] == causal["softmax_lse_log2"] == ((1, 32, 1024), F32)
        assert causal["dq_semaphore"] == ((16, 1, 32), torch.int32)
        full = ffa.fa3_backward_buffers(q, k, causal=False)
        assert full["dq_accum"] == ((1, 32, 1040 * 128), F32)  # kBlockM 80: 1000 -> 1040


# ------------------------------------------------------------------------------ memory under MemTracker
def test_one_fa2_backward_call_peaks_at_inputs_plus_softmax_d_plus_scratch():
    with FakeTensorMode():
        q, k, v = tensors(1, 1000, 1000, 32, 8, 128)
        out, dout = torch.empty_like(q), torch.empty_like(q)
        lse = torch.empty(1, 32, 1000, dtype=F32)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        held = (q, k, v, out, dout, lse, dq, dk, dv)

        def call():
            ffa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.1, True)

        peak = track_peaks(call, *held)["cpu"].total
        scratch = ffa.nbytes(ffa.fa2_backward_scratch(q, k, v))
    assert scratch == 1024 * 32 * 128 * 4 + 2 * 1000 * 32 * 128 * 2
    assert peak == sum(size(t) for t in held) + 32 * 1024 * 4 + scratch


def test_fa2_forward_backward_peak_is_analytic():
    """flash_attn_func forward + backward: inputs, dout, saved out/lse/rng_state, grads, softmax_d, scratch."""
    with FakeTensorMode():
        q, k, v = (t.requires_grad_() for t in tensors(1, 1000, 1000, 32, 8, 128))
        dout = torch.empty_like(q)

        def step():
            ffa.flash_attn_func(q, k, v, causal=True).backward(dout)

        peak = track_peaks(step, q, k, v, dout)["cpu"].total
        scratch = ffa.nbytes(ffa.fa2_backward_scratch(q, k, v))
    inputs, out, lse, rng = 2 * size(q) + 2 * size(k), size(q), 32 * 1000 * 4, 16
    grads, softmax_d = size(q) + 2 * size(k), 32 * 1024 * 4
    assert peak == inputs + out + lse + rng + grads + softmax_d + scratch


def test_one_fa3_backward_call_peak():
    with FakeTensorMode():
        q, k, v = tensors(1, 1000, 1000, 32, 8, 128)
        out, dout = torch.empty_like(q), torch.empty_like(q)
        lse = torch.empty(1, 32, 1000, dtype=F32)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        held = (q, k, v, out, dout, lse, dq, dk, dv)

        def call():
            ffa.fa3_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, softmax_scale=0.1, causal=True)

        peak = track_peaks(call, *held)["cpu"].total
        buffers = ffa.nbytes(ffa.fa3_backward_buffers(q, k, causal=True))
    assert peak == sum(size(t) for t in held) + buffers


def test_real_implementation_refuses():
    q, k, v = tensors(1, 16, 16, 2, 2, 8, dtype=F32)
    with pytest.raises(RuntimeError, match=r"cpab_sim::fa2_fwd exists only for simulated mode"):
        ffa._flash_attn_forward(q, k, v, 0.0, 0.1, True)
    with pytest.raises(RuntimeError, match=r"cpab_sim::fa3_fwd exists only for simulated mode"):
        ffa.fa3_func(q, k, v, causal=True)


# ------------------------------------------------------------------------------ installation
@pytest.fixture
def no_flash_attn(monkeypatch):
    """A process without any flash-attn (sys.modules entries restored afterwards)."""
    for name in ffa.FA2_MODULES + (ffa.FA3_MODULE,):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(ffa, "real_available", lambda name: False)
    return monkeypatch


def test_installed_provides_the_module_tree_and_removes_it(no_flash_attn):
    with ffa.installed(check=False) as added:
        assert added == ["flash_attn", "flash_attn.flash_attn_interface", "flash_attn_interface"]
        spec = importlib.util.find_spec("flash_attn")
        assert spec is not None and spec.origin == ffa.__file__
        assert importlib.util.find_spec("flash_attn.flash_attn_interface") is not None
        import flash_attn
        from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward
        from packaging import version
        assert version.parse(flash_attn.__version__) >= version.parse("2.7.0")
        assert (_flash_attn_forward, _flash_attn_backward) == (ffa._flash_attn_forward, ffa._flash_attn_backward)
        assert sys.modules["flash_attn_interface"]._flash_attn_backward is ffa.fa3_backward
    assert not {"flash_attn", "flash_attn_interface"} & set(sys.modules)


def test_install_is_a_no_op_when_a_real_flash_attn_is_importable(no_flash_attn):
    no_flash_attn.setattr(ffa, "real_available", lambda name: True)
    with ffa.installed() as added:
        assert added == [] and "flash_attn" not in sys.modules


def test_install_leaves_an_imported_flash_attn_alone():
    """The tests' stand-in is in sys.modules: it stays (a real one would too)."""
    before = sys.modules.get("flash_attn")
    with ffa.installed(check=False) as added:
        assert "flash_attn" not in added and sys.modules.get("flash_attn") is before


def test_library_imported_before_installation_is_refused(no_flash_attn):
    stale = types.ModuleType("yunchang.globals")
    stale.HAS_FLASH_ATTN = False
    no_flash_attn.setitem(sys.modules, "yunchang.globals", stale)
    with pytest.raises(ValueError, match=r"yunchang.globals was imported .* fresh process: python -m bench run"):
        ffa.check_fresh()
    with pytest.raises(ValueError, match=r"yunchang \(imported without flash-attn\).* fresh process"):
        with ffa.installed():
            pass
    assert "flash_attn" not in sys.modules  # removed again after the refusal


# ------------------------------------------------------------------------------ validation
def test_simulated_mode_accepts_a_method_missing_only_flash_attn(no_flash_attn):
    spec = methods.AttnSpec(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, causal=True)
    if importlib.util.find_spec("yunchang") is None:
        pytest.skip("yunchang is not installed")
    with pytest.raises(ValueError, match=r"method 'yc-ulysses' needs flash_attn"):
        methods.validate("yc-ulysses", spec, 8)
    methods.validate("yc-ulysses", spec, 8, provided=ffa.PROVIDES)
    Trial.make("yc-ulysses", "llama3-8b", 1 << 17, 8, mode="simulated").validate()
    with pytest.raises(ValueError, match=r"method 'yc-ulysses' needs flash_attn"):
        Trial.make("yc-ulysses", "llama3-8b", 1 << 17, 8, mode="emulated", device="cpu").validate()


def test_simulated_mode_still_needs_the_wrapped_library(no_flash_attn):
    @methods.register("needs-lib-and-fa", "test method", requires=("cpbench_surely_missing_lib", "flash_attn"),
                      install_hint="pip install cpbench-surely-missing-lib")
    class NeedsLib(AttentionMethod):
        pass

    try:
        trial = Trial.make("needs-lib-and-fa", "llama3-8b", 1 << 17, 8, mode="simulated")
        with pytest.raises(ValueError, match=r"needs cpbench_surely_missing_lib, which .*pip install cpbench-surely"):
            trial.validate()
    finally:
        methods.unregister("needs-lib-and-fa")
