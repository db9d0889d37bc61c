"""bench.stackmodel.simmode's walk of an operator's arguments and outputs (``tensor_leaves``: the traffic
counter's and the memory tracker's) finds the tensors pytree finds, in its order; stepcount's SDPA formulas kept
per shape count what torch's give; and a tensor's span counts each distinct element once."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from bench.stackmodel import simmode, stepcount

Pair = collections.namedtuple("Pair", "first second")


def _trees() -> list:
    a, b, c, d = (torch.empty(n) for n in range(1, 5))
    return [
        a,
        (a, 1, None, [b, 2.0, torch.float32], {"out": c, "alpha": 1}),
        ([], (), {}, torch.Size([2, 3]), "s", torch.device("cpu")),
        ((a, [b, (c,)]), {"x": [d, {"y": a}]}),
        (Pair(a, [b]), collections.OrderedDict(k=c), {"z": Pair(d, 3)}),  # containers left to pytree
    ]


@pytest.mark.parametrize("tree", _trees(), ids=range(len(_trees())))
def test_the_tensor_leaves_are_pytrees(tree):
    want = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    got = simmode.tensor_leaves(tree, [])
    assert len(got) == len(want) and all(g is w for g, w in zip(got, want, strict=True))


def test_the_sdpa_formulas_kept_per_shape_count_torchs():
    q, k, v = (2, 8, 128, 64), (2, 2, 256, 64), (2, 2, 256, 64)
    for _ in range(2):  # computed, then from the cache
        assert stepcount._sdpa_flops(q, k, v) == sdpa_flop_count(q, k, v)
        assert stepcount._sdpa_backward_flops(q, q, k, v) == sdpa_backward_flop_count(q, q, k, v)


def _spanned(t: torch.Tensor) -> int:
    """The elements a tensor spans, a stride-0 dimension once, by definition."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        n *= size if stride else 1
    return n * t.element_size()


SPANS = {
    "contiguous": lambda: torch.empty(4, 6),
    "bf16": lambda: torch.empty(3, 5, dtype=torch.bfloat16),
    "transposed": lambda: torch.empty(4, 6).t(),
    "broadcast": lambda: torch.empty(1, 6).expand(4, 6),
    "size-1 dim, odd stride": lambda: torch.empty_strided((4, 1, 6), (6, 99, 1)),
    "empty": lambda: torch.empty(0, 6),
    "empty, broadcast": lambda: torch.empty(6).expand(0, 6),
    "scalar": lambda: torch.empty(()),
}


@pytest.mark.parametrize("make", list(SPANS.values()), ids=list(SPANS))
def test_span_bytes_counts_each_distinct_element_once(make):
    t = make()
    assert stepcount._span_bytes(t) == _spanned(t)
