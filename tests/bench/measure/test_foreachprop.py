"""bench.measure.foreachprop: a foreach operator's sharding propagated once per distinct element gives every
index the spec DTensor's whole propagation gives, and the cases it does not take go to DTensor whole.

The whole trial's figures with and without ``fast_fake`` (which enters it) are compared by
test_fakeroute.py's ``test_a_trial_measures_the_same_with_and_without_the_fast_path``.
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from bench.measure import foreachprop, run
from bench.measure.config import StepConfig
from bench.measure.trial import Trial

aten = torch.ops.aten


@pytest.fixture(scope="module")
def primed() -> list[tuple[OpSchema, object, object]]:
    """Each foreach schema the priming step of a simulated trial (UPipe, tiny model, 4 ranks, AdamW over
    FSDP2's parameters) propagated, with the answer of ``foreachprop.propagated`` and of DTensor's whole
    propagation (which the trial goes on with)."""
    seen: list[tuple[OpSchema, object, object]] = []
    original = ShardingPropagator.propagate_op_sharding_non_cached

    def both(self, op_schema):
        whole = original(self, op_schema)
        if foreachprop.reduced_schema(op_schema) is not None:
            seen.append((op_schema, foreachprop.propagated(original, self, op_schema), whole))
        return whole

    @contextlib.contextmanager
    def asking_both():  # in place of once_per_element, where fast_fake enters it
        ShardingPropagator.propagate_op_sharding_non_cached = both
        try:
            yield
        finally:
            ShardingPropagator.propagate_op_sharding_non_cached = original

    # DTensor's caches (C++ and Python) may hold these schemas from an earlier simulation in this process
    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(foreachprop, "once_per_element", asking_both)
        run.measure_simulated(Trial.make("upipe", "tiny-llama", 4096, 4, step=StepConfig(stack="lean")))
    return seen


def test_every_foreach_operator_of_the_priming_gets_the_whole_propagations_specs(primed):
    ops = {str(schema.op) for schema, _, _ in primed}
    assert {"aten._foreach_lerp_.Scalar", "aten._foreach_addcdiv_.ScalarList", "aten._foreach_sqrt.default"} <= ops
    for schema, reduced, whole in primed:
        assert reduced == whole, schema.op  # the dataclass's fields: every spec by value, nothing redistributed
        if whole.output_spec is not None:
            assert len(reduced.output_spec) == len(schema.args_schema[0])


def test_the_lists_shrink_to_their_distinct_elements(primed):
    for schema, _, _ in primed:
        reduced, index = foreachprop.reduced_schema(schema)
        lists = [i for i, a in enumerate(schema.args_schema) if isinstance(a, list | tuple)]
        distinct = len(reduced.args_schema[lists[0]])
        assert distinct < len(schema.args_schema[lists[0]]) and len(index) == len(schema.args_schema[lists[0]])
        for i in lists:
            assert [reduced.args_schema[i][j] for j in index] == list(schema.args_schema[i])


def _replaced(schema: OpSchema, at: int, value) -> OpSchema:
    args = list(schema.args_schema)
    args[at] = value
    return OpSchema(schema.op, tuple(args), schema.kwargs_schema, schema_info=schema.schema_info)


def _one(primed, name: str) -> OpSchema:
    return next(schema for schema, _, _ in primed if str(schema.op) == name)


def test_a_tensor_shared_by_every_index_or_lists_of_distinct_elements_go_whole(primed):
    addcmul = _one(primed, "aten._foreach_addcmul_.Scalar")  # (self, tensor1, tensor2, value)
    spec = addcmul.args_schema[0][0]
    assert foreachprop.reduced_schema(_replaced(addcmul, 3, spec)) is None  # a spec, not a plain value
    assert foreachprop.reduced_schema(_replaced(addcmul, 3, torch.ones(1))) is None
    shortened = _replaced(addcmul, 1, addcmul.args_schema[1][:-1])  # lists of different lengths
    assert foreachprop.reduced_schema(shortened) is None
    distinct = foreachprop.reduced_schema(addcmul)[1]
    firsts = [distinct.index(j) for j in sorted(set(distinct))]
    only_distinct = OpSchema(addcmul.op, tuple([a[j] for j in firsts] if isinstance(a, list | tuple) else a
                                               for a in addcmul.args_schema),
                             addcmul.kwargs_schema, schema_info=addcmul.schema_info)
    assert foreachprop.reduced_schema(only_distinct) is None  # nothing to gain


def test_scalars_that_differ_keep_their_indices_apart(primed):
    div = _one(primed, "aten._foreach_div_.ScalarList")  # (self, scalars)
    n = len(div.args_schema[0])
    zeros = foreachprop.reduced_schema(_replaced(div, 1, [0.0] * n))[1]
    shared = next(j for j in range(n) if zeros.count(zeros[j]) > 1)  # a parameter with the shape of another
    signed = foreachprop.reduced_schema(_replaced(div, 1, [-0.0 if j == shared else 0.0 for j in range(n)]))[1]
    assert max(signed) == max(zeros) + 1 and signed.count(signed[shared]) == 1


def test_an_answer_that_moves_a_tensor_is_not_expanded(primed):
    schema, reduced, _ = primed[0]
    index = foreachprop.reduced_schema(schema)[1]
    distinct = max(index) + 1
    small = dataclasses.replace(reduced, output_spec=None if reduced.output_spec is None
                                else tuple(reduced.output_spec[:distinct]))
    assert foreachprop.expanded(dataclasses.replace(small, needs_redistribute=True), index, distinct) is None
    assert foreachprop.expanded(dataclasses.replace(small, redistribute_schema=schema), index, distinct) is None
    assert foreachprop.expanded(dataclasses.replace(small, use_val_from_redistribute_schema=True),
                                index, distinct) is None
    assert foreachprop.expanded(small, index, distinct) is not None


def test_a_non_foreach_operator_goes_whole(primed):
    schema = primed[0][0]
    assert foreachprop.reduced_schema(OpSchema(aten.add.Tensor, schema.args_schema, {})) is None
