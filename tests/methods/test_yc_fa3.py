"""``methods.core.yc_fa3``: yunchang's FA3 ring stages bound to ones that pass ``causal`` on.

In this process yunchang found no flash-attn 3, so the flash-attn 3 functions it bound at import
are replaced by recorders here; the simulated trials that run the real wiring (the FA3 stand-in
receiving causal=True on the ring's diagonal blocks, and yc-ring's attention FLOPs equal under fa
and fa3) are in tests/bench/stackmodel/test_simulated_flash_attn.py.
"""
from __future__ import annotations

import importlib.util
import sys
import types
import warnings

import pytest
import torch

from methods.core import yc_fa3

pytestmark = pytest.mark.skipif(importlib.util.find_spec("yunchang") is None, reason="yunchang is not installed")


@pytest.fixture(scope="module")
def yc():
    """yunchang, imported in this process only while these tests run: later tests
    (tests/bench/stackmodel/test_fake_flash_attn.py) check what a process that never imported it sees."""
    before = set(sys.modules)
    with warnings.catch_warnings():  # yunchang's modules call torch.jit.script (deprecated) at import
        warnings.simplefilter("ignore", DeprecationWarning)
        from yunchang import kernels
        from yunchang.kernels import attention

    yield types.SimpleNamespace(kernels=kernels, attention=attention, FA3=kernels.AttnType.FA3,
                                select=kernels.select_flash_attn_impl)
    for name in set(sys.modules) - before:
        if name == "yunchang" or name.startswith("yunchang."):
            del sys.modules[name]


@pytest.fixture
def fa3(monkeypatch, yc):
    """Recorders in place of the flash-attn 3 functions yunchang bound at import: the calls' keywords."""
    calls = []

    def forward(q, k, v, **kwargs):
        calls.append(("fwd", kwargs))
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def backward(dout, q, k, v, out, lse, **kwargs):
        calls.append(("bwd", kwargs))

    monkeypatch.setattr(yc.attention, "HAS_FLASH_ATTN_HOPPER", True)  # yunchang's own stages assert it
    monkeypatch.setattr(yc.attention, "flash_attn_forward_hopper", forward)
    monkeypatch.setattr(yc.attention, "flash_attn_func_hopper_backward", backward)
    return calls


def stage_call(yc, stage: str, causal: bool):
    q = torch.zeros(1, 8, 2, 4)
    fn = yc.select(yc.FA3, stage=stage)
    if stage == "fwd-only":
        return fn(q, q, q, 0.0, 0.5, causal=causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  return_softmax=False)
    lse = torch.zeros(1, 2, 8)
    return fn(q, q, q, q, q, lse, q.clone(), q.clone(), q.clone(), 0.0, 0.5, causal, (-1, -1), 0.0, None, False, None)


def test_yunchang_0_6_4_drops_causal_and_the_binding_passes_it(yc, fa3):
    """Without the binding yunchang's stages tell flash-attn 3 causal=False (what this module is
    for; if a yunchang passes it, this test says so); bound, the caller's flag arrives; afterwards
    yunchang's own functions are back."""
    kernels = yc.kernels
    own = (kernels.flash_attn3_func_forward, kernels.flash_attn3_func_backward)
    stage_call(yc, "fwd-only", True), stage_call(yc, "bwd-only", True)
    assert [kw["causal"] for _, kw in fa3] == [False, False]
    del fa3[:]
    with yc_fa3.fa3_causal():
        assert yc_fa3.is_bound()
        for causal in (True, False):
            stage_call(yc, "fwd-only", causal), stage_call(yc, "bwd-only", causal)
    assert [(kind, kw["causal"]) for kind, kw in fa3] == [("fwd", True), ("bwd", True), ("fwd", False),
                                                          ("bwd", False)]
    assert not yc_fa3.is_bound()
    assert (kernels.flash_attn3_func_forward, kernels.flash_attn3_func_backward) == own
    assert yc.select(yc.FA3, stage="fwd-only") is own[0]


class _Probe(torch.autograd.Function):
    """Stands in for yunchang's call: records whether the binding is in place in forward and backward."""

    seen: list = []

    @staticmethod
    def forward(ctx, q, k, v):
        _Probe.seen.append(("fwd", yc_fa3.is_bound()))
        return q * k + v

    @staticmethod
    def backward(ctx, grad):
        _Probe.seen.append(("bwd", yc_fa3.is_bound()))
        return grad, grad, grad


def test_run_binds_for_the_forward_and_for_its_backward(yc):
    """Two layers: each forward runs bound, nothing is bound between them or before backward, each
    backward runs bound (autograd runs them later), and nothing is bound at the end."""
    _Probe.seen = []
    x = torch.randn(2, 3, requires_grad=True)
    h = yc_fa3.run(_Probe.apply, x, x, x)
    assert not yc_fa3.is_bound()
    y = yc_fa3.run(_Probe.apply, h, h, h)
    assert not yc_fa3.is_bound()
    y.sum().backward()
    assert not yc_fa3.is_bound()
    assert _Probe.seen == [("fwd", True), ("fwd", True), ("bwd", True), ("bwd", True)]
    assert x.grad is not None
    with torch.no_grad():  # no graph: nothing left to bind later
        yc_fa3.run(_Probe.apply, x, x, x)
    assert not yc_fa3.is_bound()


def test_changed_yunchang_internals_are_refused_in_one_line(monkeypatch, yc):
    kernels = yc.kernels
    monkeypatch.setattr(kernels, "flash_attn3_func_forward", lambda q, k, v, causal=False: None)
    with pytest.raises(RuntimeError, match=r"^yunchang 0\.6\.4's FA3 ring stages are not as methods/core/yc_fa3\.py "
                       r"expects .*flash_attn3_func_forward takes") as err:
        yc_fa3.check()
    assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match="flash_attn3_func_forward takes"):
        with yc_fa3.fa3_causal():
            pass
    assert not yc_fa3.is_bound()
    monkeypatch.delattr(kernels, "flash_attn3_func_backward")
    monkeypatch.setattr(kernels, "flash_attn3_func_forward", yc.attention.flash_attn3_func_forward)
    with pytest.raises(RuntimeError, match="flash_attn3_func_backward is missing"):
        yc_fa3.check()


def test_rows_say_the_fix_is_applied():
    from methods.yc_ring import YunchangRing
    from methods.yc_usp import YunchangUSP

    fa3, fa = YunchangRing.Options(attn_type="fa3"), YunchangRing.Options(attn_type="fa")
    assert YunchangRing.run_notes(fa3, 4) == [yc_fa3.NOTE] and YunchangRing.run_notes(fa, 4) == []
    assert YunchangUSP.run_notes(YunchangUSP.Options(attn_type="fa3", ulysses_degree=2), 4) == [yc_fa3.NOTE]
    assert YunchangUSP.run_notes(YunchangUSP.Options(attn_type="fa3", ulysses_degree=4), 4) == []  # no ring
