"""DTensor's sharding propagation of a foreach operator, done once per distinct element of its lists.

The optimizer's priming step (``bench.measure.step.maybe_prime_optimizer``) sends Adam's foreach operators
(``_foreach_lerp_``, ``_foreach_addcdiv_``, ...) over every parameter of the model to DTensor, whose sharding
propagation of an operator it has not seen expands a strategy for each element of the lists, one after the
other, with new ``DTensorSpec``s and a fake run of the whole operator for the output's metadata
(``ShardingPropagator.propagate_op_sharding_non_cached``; its foreach strategy,
``single_dim_strategy._expand_single_dim_strategy_to_mesh``, asks each index alone). A model's parameters have
few distinct elements (one layer's shapes, repeated per layer), so most of that work is repeated (what it cost:
results/speed/README.md).

Each element's answer depends on that element alone: its strategy is built from the index's own specs and
scalars. ``once_per_element`` therefore propagates a schema whose lists hold each distinct element once (the
first index of each, in order) and gives every index its representative's output spec: the same specs,
compared by value, as the whole schema gives. It takes only the cases where that holds plainly, and gives the
operator to DTensor whole otherwise:

- the operator is a foreach or fused one (DTensor's own test for the per-index strategy) returning nothing or
  one list of tensors;
- every list has the same length, and every argument that is not a list is a plain value, neither a tensor
  nor a spec (a tensor shared by every index may be indexed by position, as ``_foreach_addcdiv_.Tensor``'s
  scalars are);
- the answer moves nothing: no redistribution, no rewritten arguments (the redistribution's schema would
  have to be rebuilt index by index).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

_PREFIXES = ("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")


def _key(value: Any) -> Any:
    """An element's identity: a spec by value (its placements, mesh and tensor metadata), a number by its exact
    text (so that -0.0 and 0.0 stay apart), anything else by itself."""
    if isinstance(value, float):
        return float, repr(value)
    return type(value), value


def _returns_one_list_or_nothing(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return not returns or (len(returns) == 1 and str(returns[0].type) == "List[Tensor]")


def representatives(keys: list) -> tuple[list[int], list[int]]:
    """For each index's key: the first index of each distinct key, in order, and for every index the place of its
    key's first index among them (where its element sits in lists reduced to the first indices)."""
    position: dict = {}  # a key -> its place in the reduced lists
    firsts: list[int] = []
    index: list[int] = []
    for j, key in enumerate(keys):
        if key not in position:
            position[key] = len(firsts)
            firsts.append(j)
        index.append(position[key])
    return firsts, index


def reduced_schema(op_schema: Any) -> tuple[Any, list[int]] | None:
    """The schema with each distinct element of its lists once, and for each index of the original lists the
    position of its representative; None where the operator must be propagated whole (module docstring)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema

    op = op_schema.op
    if not op.name().startswith(_PREFIXES) or not _returns_one_list_or_nothing(op):
        return None
    args = op_schema.args_schema
    if any(isinstance(v, (list, tuple, DTensorSpec, torch.Tensor)) for v in op_schema.kwargs_schema.values()):
        return None
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    if not lists or not any(args[i] and isinstance(args[i][0], DTensorSpec) for i in lists):
        return None
    length = len(args[lists[0]])
    if any(len(args[i]) != length for i in lists):
        return None
    if any(isinstance(a, (DTensorSpec, torch.Tensor)) for i, a in enumerate(args) if i not in lists):
        return None
    try:
        firsts, index = representatives([tuple(_key(args[i][j]) for i in lists) for j in range(length)])
    except TypeError:  # an element that cannot be a key
        return None
    if len(firsts) == length:
        return None
    reduced = tuple(type(a)(a[j] for j in firsts) if i in lists else a for i, a in enumerate(args))
    schema = OpSchema(op, reduced, op_schema.kwargs_schema, schema_info=op_schema.schema_info)
    return schema, index


def expanded(sharding: Any, index: list[int], distinct: int) -> Any | None:
    """The reduced schema's answer given back index by index, or None where it cannot be (module docstring)."""
    if sharding.needs_redistribute or sharding.redistribute_schema is not None:
        return None
    if sharding.use_val_from_redistribute_schema:
        return None
    spec = sharding.output_spec
    if spec is None:
        return sharding
    if not isinstance(spec, tuple) or len(spec) != distinct:
        return None
    return dataclasses.replace(sharding, output_spec=tuple(spec[j] for j in index))


def propagated(original: Any, propagator: Any, op_schema: Any) -> Any:
    """``original`` (DTensor's ``propagate_op_sharding_non_cached``) asked for the reduced schema where this
    module takes the operator, else for the whole one."""
    reduced = reduced_schema(op_schema)
    if reduced is not None:
        schema, index = reduced
        answer = expanded(original(propagator, schema), index, max(index) + 1)
        if answer is not None:
            return answer
    return original(propagator, op_schema)


@contextlib.contextmanager
def once_per_element() -> Iterator[None]:
    """Within this context a foreach operator's sharding is propagated once per distinct element of its lists
    (module docstring); every other operator, and every case it does not take, as before."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator.propagate_op_sharding_non_cached

    def propagate(self, op_schema):
        return propagated(original, self, op_schema)

    ShardingPropagator.propagate_op_sharding_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator.propagate_op_sharding_non_cached = original
