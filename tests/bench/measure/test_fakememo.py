"""bench.measure.fakememo: an output rebuilt from its key is FakeTensorMode's own cached answer, and nothing
FakeTensorMode does not answer from its cache with one fresh tensor, one argument or a tuple of fresh tensors is
kept.

Each operator runs below a dispatch mode, as in a simulation: through ``fakememo.call`` (the first call
keeps the output once torch's cache has answered, the second rebuilds it) and passed on to
``FakeTensorMode``. The rebuilt output must agree with torch's in everything a simulation reads: type,
fake mode, fake device, sizes, strides, offset, storage size, dtype, ``requires_grad``, and a storage of
its own. The figures of whole simulations are checked by tests/bench/stackmodel/test_sim_equality.py.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from bench.measure import fakememo
from tests.bench.measure.fakemodes import PassOn, Through, facts

aten = torch.ops.aten


# (name, operator call on tensors a [4, 6] fp32, b [6, 3] fp32 (transposed storage), g [4, 6] requiring grad)
CASES = {
    "mul": lambda a, b, g: a * 2.0,
    "mul-bf16-scalar-int": lambda a, b, g: a.bfloat16() * 3,
    "add-tensors": lambda a, b, g: a + g,
    "mm-transposed": lambda a, b, g: a @ b,
    "to-dtype": lambda a, b, g: b.to(torch.bfloat16),
    "empty-like": lambda a, b, g: torch.empty_like(b),
    "zeros-like-grad": lambda a, b, g: torch.zeros_like(g),
    "cat": lambda a, b, g: torch.cat([a, g], dim=1),
    "clone-transposed": lambda a, b, g: b.clone(),
    "sum-dim": lambda a, b, g: g.sum(dim=0, keepdim=True),
    "empty-on-meta": lambda a, b, g: torch.empty(5, 7, device="meta", dtype=torch.float16),
    "arange": lambda a, b, g: torch.arange(12),
}


def _inputs():
    return torch.empty(4, 6), torch.empty(3, 6).t(), torch.empty(4, 6).requires_grad_()


@pytest.mark.parametrize("name", list(CASES))
def test_a_rebuilt_output_is_fake_tensor_modes_cached_answer(name):
    fakememo.clear()
    op = CASES[name]
    with FakeTensorMode() as mode:
        a, b, g = _inputs()
        with PassOn():
            op(a, b, g)  # torch's cache holds the answer from here on
            want = op(a, b, g)
        with Through(fakememo.call):
            kept = op(a, b, g)  # answered from torch's cache, kept
            assert len(fakememo._outputs) >= 1, "nothing was kept"
            hits = FakeTensorMode.cache_hits
            got = op(a, b, g)  # rebuilt
            assert FakeTensorMode.cache_hits == hits, "the second call reached FakeTensorMode's cache"
    for out in (kept, got):
        assert isinstance(out, FakeTensor) and out.fake_mode is mode
        assert facts(out) == facts(want)
        storages = {t.untyped_storage()._cdata for t in (a, b, g, want)}
        assert out.untyped_storage()._cdata not in storages  # a storage of its own
    assert got.untyped_storage()._cdata != kept.untyped_storage()._cdata


def test_a_key_holds_what_the_output_depends_on():
    """The same operator on other sizes, strides, dtypes, scalars' types or default dtype is another key."""
    fakememo.clear()
    with FakeTensorMode():
        a, b, g = _inputs()
        outs = []
        with Through(fakememo.call):
            for _ in range(2):  # once to fill torch's cache, once to keep
                outs = [a * 2.0, a * 2, b * 2.0, a.bfloat16() * 2.0, torch.empty(4, 6, dtype=torch.float16) * 2.0]
            floats = [torch.empty(3) for _ in range(3)]  # kept under the default dtype float32
            torch.set_default_dtype(torch.float64)
            try:
                doubles = [torch.empty(3) for _ in range(3)]
            finally:
                torch.set_default_dtype(torch.float32)
        assert [o.dtype for o in outs] == [torch.float32, torch.float32, torch.float32, torch.bfloat16,
                                           torch.float16]
        assert outs[2].stride() == (1, 6)
        assert [t.dtype for t in floats + doubles] == [torch.float32] * 3 + [torch.float64] * 3


@torch.library.custom_op("cpab_test_fakememo::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_an_in_place_answer_is_the_argument_and_a_tuple_is_rebuilt_output_by_output():
    """An in-place operator answered from torch's cache is kept as the position of the argument it returned:
    the replay returns that argument of the call at hand (another tensor of the same facts included). A tuple
    of new tensors (``max``'s values and indices) is rebuilt output by output, each as torch's cache builds it,
    on storages of their own."""
    fakememo.clear()
    with FakeTensorMode() as mode:
        a, _, _ = _inputs()
        other = torch.empty(4, 6)
        with PassOn():
            a.add_(1.0)  # torch's cache holds the answers from here on
            want = torch.max(a, dim=1)
            want = torch.max(a, dim=1)
        with Through(fakememo.call):
            assert a.add_(1.0) is a and torch.max(a, dim=1) is not None  # answered from torch's cache, kept
            kinds = sorted(kind for kind, _ in fakememo._outputs.values())
            assert kinds == [fakememo._INPUT, fakememo._TUPLE], fakememo._outputs
            hits = FakeTensorMode.cache_hits
            assert other.add_(1.0) is other and a.add_(1.0) is a
            got = torch.max(a, dim=1)
            assert FakeTensorMode.cache_hits == hits, "a replay reached FakeTensorMode's cache"
    assert type(got) is type(want) and len(got) == len(want) == 2
    storages = {a.untyped_storage()._cdata, *(t.untyped_storage()._cdata for t in want)}
    for g, w in zip(got, want, strict=True):
        assert g.fake_mode is mode and facts(g) == facts(w)
        assert g.untyped_storage()._cdata not in storages
    assert got[0].untyped_storage()._cdata != got[1].untyped_storage()._cdata


@pytest.mark.parametrize("why", ["in place, the output twice an argument", "a tuple of views", "not cached by torch",
                                 "a constant", "a mode in between"])
def test_what_is_not_one_fresh_cached_answer_is_never_kept(why):
    fakememo.clear()
    real = torch.ones(3)
    with FakeTensorMode() as mode:
        a, _, _ = _inputs()
        for _ in range(3):
            if why == "a mode in between":
                with PassOn(), Through(fakememo.call):  # its operators pass PassOn before FakeTensorMode
                    out = a * 2.0
            else:
                with Through(fakememo.call):
                    if why == "in place, the output twice an argument":
                        out = a.add_(a)
                        assert out is a
                    elif why == "a tuple of views":
                        out = a.unbind(0)
                    elif why == "not cached by torch":
                        out = _twice(a)  # not one of torch's own operators: its cache bypasses it
                    elif why == "a constant":
                        c = mode.from_tensor(real)
                        c.constant = real
                        out = c * 2.0
    assert not fakememo._outputs, fakememo._outputs


def test_a_value_answer_and_a_tuple_with_values_are_replayed_as_torch_gives_them():
    """On the simulated CUDA device: ``record_stream`` (its stream keyed by value, as torch keys it) answers
    None, and flash attention's tuple holds new tensors, None and the sequence lengths; once torch's cache has
    answered each, the replays give the same values and tensors of the same facts without reaching it."""
    from bench.stackmodel import simcuda

    fakememo.clear()
    with simcuda.runtime(), FakeTensorMode() as mode:
        a = torch.empty(4, 6, device="cuda")
        q = torch.empty(1, 4, 8, 16, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()

        def both():
            return aten.record_stream(a, stream), aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True)

        with PassOn():
            both()  # torch's cache holds the answers from here on
            want = both()
        with Through(fakememo.call):
            both()  # answered from torch's cache, kept
            assert sorted(kind for kind, _ in fakememo._outputs.values()) == [fakememo._TUPLE, fakememo._VALUE]
            hits = FakeTensorMode.cache_hits
            got = both()
            assert FakeTensorMode.cache_hits == hits, "a replay reached FakeTensorMode's cache"
    assert got[0] is None and want[0] is None
    assert type(got[1]) is type(want[1]) and len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1], strict=True):
        if isinstance(w, torch.Tensor):
            assert g.fake_mode is mode and facts(g) == facts(w) and g.untyped_storage()._cdata != \
                w.untyped_storage()._cdata
        else:
            assert g == w and type(g) is type(w)


def test_an_operator_whose_first_miss_ran_bypassed_pieces_is_kept_from_its_hit():
    """Below autograd (as yunchang's ring merges its partial outputs), ``log_sigmoid_forward`` misses torch's cache
    the first time and runs a decomposition whose composite pieces bypass it; torch caches the operator all the
    same, so its next call is a hit, which is kept and replayed (it was skipped for good after the first call)."""
    fakememo.clear()
    with FakeTensorMode() as mode, torch._C._AutoDispatchBelowAutograd():
        x = torch.empty(4, 8)
        with PassOn():
            want = aten.log_sigmoid_forward.default(x)
        fakememo.clear()
        FakeTensorMode.cache_clear()
        with Through(fakememo.call):
            bypasses = sum(FakeTensorMode.cache_bypasses.values())
            aten.log_sigmoid_forward.default(x)  # a miss, its pieces bypassing
            assert sum(FakeTensorMode.cache_bypasses.values()) > bypasses
            assert aten.log_sigmoid_forward.default not in fakememo._skipped
            aten.log_sigmoid_forward.default(x)  # torch's hit: kept
            hits = FakeTensorMode.cache_hits
            got = aten.log_sigmoid_forward.default(x)
            assert FakeTensorMode.cache_hits == hits, "the replay reached FakeTensorMode's cache"
    assert [kind for kind, _ in fakememo._outputs.values()] == [fakememo._TUPLE]
    for g, w in zip(got, want, strict=True):
        assert g.fake_mode is mode and facts(g) == facts(w)
