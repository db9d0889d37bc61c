"""bench.measure.fakeroute: the untracked work before a simulated step (the model built and sharded by FSDP2,
the optimizer primed) gives the same measurement through ``FastFake`` as through ``FakeTensorMode`` alone, and
DTensor's strided-shard flag is scanned once per operator without changing what the original does.

The views and cached answers themselves are checked against FakeTensorMode's by test_fakeview.py and
test_fakememo.py; whole simulations' figures by tests/bench/stackmodel/test_sim_equality.py; the simulated
flash-attn kernels' and barriers' routes by tests/bench/stackmodel/test_simulated_flash_attn.py (a library
method: simulated in a fresh process, which this module's process must not import).
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch._decomp import decomposition_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import _sharding_prop
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from bench.measure import fakeroute, run
from bench.measure.config import StepConfig
from bench.measure.trial import Trial
from tests.bench.measure.fakemodes import PassOn, Through, facts

aten = torch.ops.aten


def _figures(trial: Trial) -> dict:
    out = run.measure_simulated(trial).to_dict()
    out.get("allocator", {}).pop("replay_s", None)  # the replay's own wall time
    return out


@pytest.mark.parametrize("stack", ["paper", "lean"])
def test_a_trial_measures_the_same_with_and_without_the_fast_path(stack, monkeypatch):
    """UPipe on 4 ranks, FSDP2 and AdamW primed: parameters, gradients and optimizer state all come from the
    untracked build and priming, so every figure would move if ``FastFake`` answered differently."""
    trial = Trial.make("upipe", "tiny-llama", 4096, 4, step=StepConfig(stack=stack))
    fast = _figures(trial)
    monkeypatch.setattr(run, "fast_fake", contextlib.nullcontext)
    plain = _figures(trial)
    assert fast == plain
    assert fast["peak_by_category"]["optstate"] > 0 and fast["peak_by_category"]["parameter"] > 0


# (method, the collective its calls are counted under, work handles made per counted call): a ring's
# batch_isend_irecv sends and receives (a receive for every send), a head-parallel method's all-to-alls
WORK_ONLY_CASES = [("ring", "comm.send.", 2), ("upipe", "comm.all_to_all.", 1)]


@pytest.mark.parametrize(("method", "counted", "per_call"), WORK_ONLY_CASES, ids=[m for m, _, _ in WORK_ONLY_CASES])
def test_work_only_collectives_get_their_work_handle_directly_and_measure_the_same(method, counted, per_call,
                                                                                  monkeypatch):
    """On 4 ranks (two-layer tiny model, paper stack): a ring's sends and receives (``c10d.send``/``recv_``) and
    UPipe's all-to-alls (``c10d.alltoall_base_``) are answered with the handle the fake kernel makes
    (``_WORK_ONLY``), every one of them, and every figure is what ``FakeTensorMode``'s own dispatch of them
    gives."""
    trial = Trial.make(method, "tiny-llama", 4096, 4, step=StepConfig(stack="paper"))
    made = []
    original = fakeroute.create_fakework
    monkeypatch.setattr(fakeroute, "create_fakework", lambda *a, **k: made.append(1) or original(*a, **k))
    fast = _figures(trial)
    calls = sum(n for k, n in fast["step_counts"].items() if k.startswith(counted) and k.endswith(".calls"))
    assert calls > 0 and len(made) == per_call * calls, (calls, len(made))
    monkeypatch.setattr(fakeroute, "_WORK_ONLY", {})
    assert _figures(trial) == fast


LAST_ROUTED = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "fsdp::all_gather_copy_in",
               "fsdp::split_with_sizes_copy", "fsdp::chunk_cat", "profiler::_record_function_enter_new")


@pytest.mark.parametrize("stack", ["paper", "lean"])
def test_fsdp_collectives_take_the_last_routes_and_measure_the_same(stack, monkeypatch):
    """On 4 ranks (tiny-llama, both stacks): FSDP2's all-gathers and reduce-scatters (process groups among their
    arguments), its copy-in, split and chunk-cat operators and the profiler's marks are answered by
    ``_run_last_routes``, ``FakeTensorMode`` asked for none of them, and every figure is what its own dispatch of
    them gives."""
    trial = Trial.make("upipe", "tiny-llama", 4096, 4, step=StepConfig(stack=stack))
    asked: list = []
    dispatch = FakeTensorMode.dispatch
    monkeypatch.setattr(FakeTensorMode, "dispatch",
                        lambda self, func, *rest: asked.append(func.name()) or dispatch(self, func, *rest))
    ran: list = []
    original = fakeroute._run_last_routes
    monkeypatch.setattr(fakeroute, "_run_last_routes", lambda func, *a: ran.append(func.name()) or original(func, *a))
    fast = _figures(trial)
    assert set(ran) == set(LAST_ROUTED) and not set(asked) & set(LAST_ROUTED)
    monkeypatch.setattr(fakeroute, "_last_routes", lambda func: None)
    asked.clear()
    assert _figures(trial) == fast
    assert set(LAST_ROUTED) <= set(asked)


class _Schema:
    """An operator's schema as the flag's scan reads it (``args_spec``), counting the scans."""

    def __init__(self, *placements) -> None:
        self.specs = [SimpleNamespace(placements=(p,)) for p in placements]
        self.scans = 0

    @property
    def args_spec(self) -> list:
        self.scans += 1
        return self.specs


class Untouchable:
    """A strategy any read of which fails: the original returns before reading it where no _StridedShard is."""

    def __getattr__(self, name):
        raise AssertionError(f"the strategy's {name} was read")


def test_the_strided_flag_is_scanned_once_and_the_original_runs_where_a_strided_shard_is(monkeypatch):
    calls = []
    original = _sharding_prop._propagate_use_strided_shard_flag
    plain = _Schema(Shard(0), Shard(1))
    original(Untouchable(), plain)  # the original itself: nothing to do without a _StridedShard
    monkeypatch.setattr(_sharding_prop, "_propagate_use_strided_shard_flag",
                        lambda strategy, schema: calls.append((strategy, schema)))
    strided = _Schema(Shard(0), _StridedShard(0, split_factor=2))
    plain.scans = 0
    with fakeroute._strided_flag_once():
        once = _sharding_prop._propagate_use_strided_shard_flag
        for _ in range(3):  # a foreach operator: one call per tensor of its lists, with one schema
            once(Untouchable(), plain)
        for child in range(3):
            once(("child", child), strided)
    assert plain.scans == 1 and strided.scans == 1
    assert calls == [(("child", c), strided) for c in range(3)]  # the original, for the strided schema only
    assert _sharding_prop._propagate_use_strided_shard_flag is not once  # restored on exit


# CompositeImplicitAutograd views (what torch's ring attention calls below autograd, inside DTensor's handler),
# each with the arguments after its input; the input is [4, 6, 8] or its transpose
COMPOSITE_VIEWS = [
    (aten.chunk.default, (3, 1)),
    (aten.reshape.default, ([24, 8],)),
    (aten.flatten.using_ints, (0, 1)),
    (aten.to.dtype, (torch.float32,)),  # the same dtype: the input itself
    (aten.to.dtype, (torch.bfloat16,)),  # another: a copy
    (aten.contiguous.default, ()),
    (aten.unflatten.int, (2, [2, 4])),
    (aten.movedim.int, (0, 2)),
]


@pytest.mark.parametrize("func,rest", COMPOSITE_VIEWS, ids=[f"{f}-{r}" for f, r in COMPOSITE_VIEWS])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_a_composite_view_decomposed_by_call_is_fake_tensor_modes_result(func, rest, transposed):
    """Below autograd, as in the simulated ring, the view reaches the mode above FakeTensorMode; ``call``
    decomposes it itself (its pieces through ``call`` again) and gives what FakeTensorMode's own decomposition
    gives: the same facts, the input's storage where it gives a view, a new one where it copies, the input
    itself where it returns it. FakeTensorMode is not asked for it."""
    assert fakeroute._decomposed_each_time(func)
    with FakeTensorMode() as mode:
        x = torch.empty([8, 6, 4]).transpose(0, 2) if transposed else torch.empty([4, 6, 8])
        with torch._C._AutoDispatchBelowAutograd():
            with PassOn():
                want = func(x, *rest)
            bypasses = sum(FakeTensorMode.cache_bypasses.values())
            with Through(fakeroute.call):
                got = func(x, *rest)
            assert sum(FakeTensorMode.cache_bypasses.values()) == bypasses, "FakeTensorMode was asked for it"
    wants = [want] if isinstance(want, torch.Tensor) else list(want)
    gots = [got] if isinstance(got, torch.Tensor) else list(got)
    assert type(got) is type(want) and len(gots) == len(wants)
    storage = x.untyped_storage()._cdata
    for g, w in zip(gots, wants, strict=True):
        assert g.fake_mode is mode and facts(g) == facts(w)
        assert (g is x) == (w is x)
        assert (g.untyped_storage()._cdata == storage) == (w.untyped_storage()._cdata == storage)


def test_only_views_fake_tensor_mode_decomposes_on_every_call_are_decomposed():
    """Not a plain view (made by its meta kernel), not a composite operator FakeTensorMode caches
    (``log_sigmoid``), not one with a Python decomposition or a meta function."""
    assert not fakeroute._decomposed_each_time(aten.view.default)
    assert not fakeroute._decomposed_each_time(aten.log_sigmoid.default)
    assert not any(fakeroute._decomposed_each_time(f) for f in list(decomposition_table)[:200])



def _adam_calls(params: list, grads: list, avgs: list, sqs: list, steps: list) -> list[tuple]:
    """Adam's in-place foreach operators as its multi-tensor step sends them, each with its arguments."""
    n = len(params)
    return [(aten._foreach_add_.Scalar, (steps, 1), {}),
            (aten._foreach_lerp_.Scalar, (avgs, grads, 0.1), {}),
            (aten._foreach_mul_.Scalar, (sqs, 0.999), {}),
            (aten._foreach_addcmul_.Scalar, (sqs, grads, grads, 0.001), {}),
            (aten._foreach_div_.ScalarList, (sqs, [0.5] * n), {}),
            (aten._foreach_addcdiv_.ScalarList, (params, avgs, sqs, [-0.01] * n), {}),
            (aten._foreach_add_.List, (params, grads), {"alpha": -0.1}),
            (aten._foreach_copy_.default, (params, grads), {"non_blocking": False})]


def _lists(shapes: list, dtype: torch.dtype = torch.float32) -> tuple:
    """Parameters, gradients, both moments (on the simulated GPU) and the steps (host scalars), as fake tensors."""
    on_gpu = [[torch.empty(s, dtype=dtype, device="cuda") for s in shapes] for _ in range(4)]
    return (*on_gpu, [torch.zeros((), dtype=torch.float32) for _ in shapes])


@pytest.fixture
def asked(monkeypatch) -> list:
    """The foreach operators FakeTensorMode is asked for, in order."""
    seen: list = []
    dispatch = FakeTensorMode.dispatch

    def counted(self, func, *rest):
        if func.name().startswith("aten::_foreach_"):
            seen.append(func)
        return dispatch(self, func, *rest)

    monkeypatch.setattr(FakeTensorMode, "dispatch", counted)
    return seen


def test_in_place_foreach_operators_are_answered_without_fake_tensor_mode(asked):
    """The optimizer's in-place foreach operators give None, as FakeTensorMode gives, leave every tensor as it
    was, and FakeTensorMode is not asked for them."""
    with FakeTensorMode():
        lists = _lists([[4, 8], [8], [4, 8], [16, 2]])
        before = [[facts(t) for t in tl] for tl in lists]
        for func, args, kwargs in _adam_calls(*lists):
            assert fakeroute._writes_lists_only(func), func
            with PassOn():
                assert func(*args, **kwargs) is None
            asked.clear()
            with Through(fakeroute.call):
                assert func(*args, **kwargs) is None
            assert asked == [], func
        assert [[facts(t) for t in tl] for tl in lists] == before


def test_foreach_calls_whose_checks_could_fail_go_to_fake_tensor_mode(asked):
    """Operators that return lists, integer tensors written, tensors that broadcast or do not fit: FakeTensorMode
    is asked, and what it refuses is refused."""
    assert not fakeroute._writes_lists_only(aten._foreach_sqrt.default)
    assert not fakeroute._writes_lists_only(aten._foreach_norm.Scalar)
    assert not fakeroute._writes_lists_only(aten.add_.Tensor)
    with FakeTensorMode(), Through(fakeroute.call):
        params, grads, *_ = _lists([[4, 8], [8]])
        ints = [torch.zeros([3], dtype=torch.int64, device="cuda")]
        with pytest.raises(RuntimeError):  # a float result cannot be written to an integer tensor
            aten._foreach_add_.Scalar(ints, 1.5)
        complex_grads = [torch.empty(t.shape, dtype=torch.complex64, device="cuda") for t in grads]
        # nor a complex one to a real tensor: a GPU refuses it, FakeTensorMode's meta kernel does not; it is asked
        aten._foreach_add_.List(params, complex_grads)
        rows = [torch.empty([1, 8], device="cuda"), torch.empty([8], device="cuda")]
        assert aten._foreach_add_.List(params, rows) is None  # a row broadcast: valid, but not alike
        with pytest.raises(RuntimeError):
            aten._foreach_add_.List(params, [torch.empty([5], device="cuda"), grads[1]])
    assert asked == [aten._foreach_add_.Scalar] + [aten._foreach_add_.List] * 3


def _fsdp_calls() -> list[tuple]:
    """FSDP2's custom operators as its all-gather and reduce-scatter send them (one parameter group of two
    parameters on 4 ranks, rank 1), each with its arguments, made under the active fake mode."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (registers the fsdp operators)

    fsdp = torch.ops.fsdp
    shards = [torch.empty([6], dtype=torch.bfloat16, device="cuda"), torch.empty([2], dtype=torch.bfloat16,
                                                                               device="cuda")]
    gathered = torch.empty([32], dtype=torch.bfloat16, device="cuda")
    unsharded = [torch.empty([4, 6], dtype=torch.bfloat16, device="cuda"),  # each parameter viewed per rank
                 torch.empty([4, 2], dtype=torch.bfloat16, device="cuda")]
    grads = [torch.empty([4, 6], device="cuda"), torch.empty([4, 2], device="cuda")]
    flat = torch.empty([4, 8], device="cuda")  # the reduce-scatter's input viewed per rank
    return [(fsdp.all_gather_copy_in.default, (shards, gathered, [6, 2], 8, 1), {}),
            (fsdp.split_with_sizes_copy.default, (gathered.view(4, 8), [6, 2]), {"dim": 1, "out": unsharded}),
            (fsdp.chunk_cat.default, (grads, 0, 4), {"out": flat})]


def test_fsdp_operators_run_their_meta_kernel_as_fake_tensor_mode_runs_it():
    """FSDP2's copy-in, split and chunk-cat: ``call`` runs each one's Meta kernel itself and answers what
    FakeTensorMode answers (the same facts, the same tensor returned where it returns an argument, a view of the
    same storage), without asking FakeTensorMode; a call whose arguments do not fit raises as it does."""
    seen: list = []
    dispatch = FakeTensorMode.dispatch
    with FakeTensorMode():
        for func, args, kwargs in _fsdp_calls():
            assert fakeroute._last_routes(func) == (), func  # no fake-tensor implementation: the Meta kernel
            with PassOn():
                want = func(*args, **kwargs)
            FakeTensorMode.dispatch = lambda self, f, *rest: seen.append(f) or dispatch(self, f, *rest)
            try:
                with Through(fakeroute.call):
                    got = func(*args, **kwargs)
            finally:
                FakeTensorMode.dispatch = dispatch
            assert seen == [], func
            wants = list(want) if isinstance(want, tuple) else [want]
            gots = list(got) if isinstance(got, tuple) else [got]
            assert type(got) is type(want) and len(gots) == len(wants)
            for g, w in zip(gots, wants, strict=True):
                if w is None:
                    assert g is None
                    continue
                assert facts(g) == facts(w)
                flat_args = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                assert [g is a for a in flat_args] == [w is a for a in flat_args]
                assert g.untyped_storage()._cdata == w.untyped_storage()._cdata
        func, (shards, gathered, sizes, numel, rank), _ = _fsdp_calls()[0]
        for above in (PassOn(), Through(fakeroute.call)):
            with above, pytest.raises(IndexError, match="start out of range"):
                func(shards, gathered, sizes, 40, rank)  # a shard past the gathered tensor's end


def test_only_operators_fake_tensor_mode_answers_by_its_last_routes_are_answered_so_here():
    """torch's own operators (cached) and a composite one are not, nor a custom operator with a fake
    implementation of its own; one with only a Meta kernel is."""
    assert fakeroute._last_routes(aten.mm.default) is None
    assert fakeroute._last_routes(aten._foreach_copy_.default) is None
    assert fakeroute._last_routes(aten.reshape.default) is None
    lib = torch.library.Library("cpab_test_meta", "FRAGMENT")
    try:
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CPU")
        lib.impl("twice", lambda x: torch.empty_like(x), "Meta")
        assert fakeroute._last_routes(torch.ops.cpab_test_meta.twice.default) == ()
        lib.define("thrice(Tensor x) -> Tensor")
        torch.library.register_fake("cpab_test_meta::thrice", lambda x: torch.empty_like(x), lib=lib)
        assert fakeroute._last_routes(torch.ops.cpab_test_meta.thrice.default) is None
    finally:
        lib._destroy()


def test_record_function_is_entered_as_fake_tensor_mode_enters_it():
    """The profiler's ``_record_function_enter_new`` (FSDP2's and the optimizer's ``record_function``): answered
    by FakeTensorMode's own implementation of it, run here without asking FakeTensorMode: the real operator's
    handle, which the exit operator accepts, and recorded by a profiler as FakeTensorMode's is."""
    enter = torch.ops.profiler._record_function_enter_new.default
    assert len(fakeroute._last_routes(enter)) == 1
    seen: list = []
    dispatch = FakeTensorMode.dispatch
    with FakeTensorMode(), torch.profiler.profile() as prof:
        with PassOn():
            theirs = enter("cpab::theirs", None)
            torch.ops.profiler._record_function_exit._RecordFunction(theirs)
        FakeTensorMode.dispatch = lambda self, f, *rest: seen.append(f) or dispatch(self, f, *rest)
        try:
            with Through(fakeroute.call):
                ours = enter("cpab::ours", None)
        finally:
            FakeTensorMode.dispatch = dispatch
        with Through(fakeroute.call):
            torch.ops.profiler._record_function_exit._RecordFunction(ours)
    assert seen == []
    assert type(ours) is type(theirs) and ours._type().qualified_name() == theirs._type().qualified_name()
    names = {e.name for e in prof.events()}
    assert {"cpab::ours", "cpab::theirs"} <= names
