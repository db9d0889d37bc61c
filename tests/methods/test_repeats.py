"""The loops over identical iterations (``methods.core.tiling``): every iteration unless a simulation says so.

* The policy is off by default, so ``repeated`` and ``run_tiles`` yield every iteration with weight 1;
  ``compressing_repeats`` (which ``bench.measure.simulate.fake_tensors`` enters) turns it on for its
  block only.
* A method on real tensors runs every iteration: FPDT's chunk-pair loops call the kernel for every
  (Q, K/V) segment pair, forward and backward, and the tiled input norm (``methods.core.normtile``)
  fills every tile. The same FPDT step under simulation runs fewer pairs, so the count can tell.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import methods
from bench.measure.simulate import fake_tensors
from methods.core import tiling
from methods.core.normtile import norm_linear
from tests.methods.cases import SPECS

SPEC = methods.AttnSpec(**SPECS["gqa"])  # H=8, G=4, d=16, dim=64
CHUNKS = 8
PAIRS = CHUNKS * (CHUNKS + 1) // 2  # causal: segment i attends to segments 0..i


def test_the_policy_is_off_by_default_and_only_inside_its_block():
    assert not tiling.compressing()
    assert tiling.repeated(8, tail=2) == [(i, 1) for i in range(8)]
    assert [(i, tiling.counted_as()) for i in tiling.run_tiles([3] * 6)] == [(i, 1) for i in range(6)]
    with tiling.compressing_repeats():
        assert tiling.compressing()
        assert tiling.repeated(8, tail=2) == [(0, 1), (1, 5), (6, 1), (7, 1)]
        assert tiling.repeated(8, tail=2, alike=False) == [(i, 1) for i in range(8)]
        assert [(i, tiling.counted_as()) for i in tiling.run_tiles([3] * 6)] == [(0, 1), (1, 5)]
    assert not tiling.compressing()
    with pytest.raises(RuntimeError), tiling.compressing_repeats():
        raise RuntimeError("a failing simulation")
    assert not tiling.compressing()


def test_the_simulated_tensors_switch_the_policy_on():
    with fake_tensors(torch.float32):
        assert tiling.compressing()
    assert not tiling.compressing()


class _CountingKernel:
    """The block's kernel, counting its forward and backward calls (the chunk pairs that ran)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, {"forward": 0, "backward": 0}

    def __getattr__(self, name):
        attr = getattr(self.kernel, name)
        if name in self.calls:
            def counted(*args, **kwargs):
                self.calls[name] += 1
                return attr(*args, **kwargs)
            return counted
        return attr


def _fpdt_pairs(seq: int) -> dict[str, int]:
    block = methods.build("fpdt", SPEC, num_chunks=CHUNKS, offload=False)
    block.kernel = _CountingKernel(block.kernel)
    x = torch.randn(1, seq, SPEC.dim, requires_grad=True)
    block(x).sum().backward()
    assert x.grad is not None
    return block.kernel.calls


def test_fpdt_on_real_tensors_runs_every_chunk_pair():
    assert _fpdt_pairs(CHUNKS * 4) == {"forward": PAIRS, "backward": PAIRS}


def test_fpdt_under_simulation_runs_fewer_chunk_pairs():
    with fake_tensors(torch.float32, meta_host=False):
        calls = _fpdt_pairs(CHUNKS * 4)
    assert 0 < calls["forward"] < PAIRS and 0 < calls["backward"] < PAIRS, calls


def test_the_tiled_input_norm_on_real_tensors_fills_every_tile():
    torch.manual_seed(0)
    dim, tiles = 4, 10  # ceil(40 / 4) = 10 tiles of 4 tokens, all alike
    x, norm_w, w = torch.randn(2, dim * tiles, dim), torch.randn(dim), torch.randn(6, dim)
    want = F.linear(F.rms_norm(x, (dim,), norm_w, 1e-5), w)
    torch.testing.assert_close(norm_linear(x, norm_w, 1e-5, w), want)
