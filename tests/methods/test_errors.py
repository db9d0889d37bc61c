"""Every bad input gets a ValueError naming the constraint and the fix, before any communication."""
from __future__ import annotations

import pytest
import torch

import methods
from methods.core.base import AttentionMethod
from methods.core.kernels import get_kernel, select_kernel
from methods.core.reference import AttentionBlock

LLAMA = methods.AttnSpec(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("name", ["ulysses", "upipe"])
def test_heads_not_divisible_by_world_size(name):
    with pytest.raises(ValueError, match=r"n_heads=32 is not divisible by the world size 6.*divides 32"):
        methods.validate(name, LLAMA, 6)


@pytest.mark.parametrize("name", ["ulysses", "upipe"])
def test_kv_heads_and_world_size_must_nest(name):
    spec = methods.AttnSpec(dim=192, n_heads=12, n_kv_heads=3, head_dim=16)
    with pytest.raises(ValueError, match=r"n_kv_heads=3 and world size 4 do not divide one another"):
        methods.validate(name, spec, 4)


def test_upipe_chunk_not_multiple_of_world_size():
    with pytest.raises(ValueError, match=r"chunk_heads=12 is not a multiple of the world size 8.*chunk_heads=8 or 16"):
        methods.validate("upipe", LLAMA, 8, chunk_heads=12)


def test_upipe_chunk_must_divide_heads():
    with pytest.raises(ValueError, match=r"chunk_heads=24 must divide n_heads=32.*\[8, 16, 32\]"):
        methods.validate("upipe", LLAMA, 8, chunk_heads=24)


def test_upipe_chunk_larger_than_heads():
    with pytest.raises(ValueError, match=r"chunk_heads=64 must divide n_heads=32"):
        methods.validate("upipe", LLAMA, 8, chunk_heads=64)


def test_upipe_gqa_schedule_constraint():
    spec = methods.AttnSpec(dim=384, n_heads=24, n_kv_heads=8, head_dim=16)  # 3 query heads per KV head
    with pytest.raises(ValueError, match=r"query heads per rank and 3 query heads per KV head"):
        methods.validate("upipe", spec, 4, chunk_heads=8)


@pytest.mark.parametrize("name", ["ulysses", "upipe"])
def test_sequence_not_divisible(name):
    cls = methods.get_info(name).cls
    with pytest.raises(ValueError, match=r"sequence length 1001 is not divisible by 8.*multiple of 8, e\.g\. 1000"):
        cls.check_seq_len(1001, 8, cls.parse_options())


def test_shard_refuses_indivisible_sequence():
    block = methods.build("ulysses", methods.AttnSpec(dim=32, n_heads=4))
    block.world_size = 4  # shard's check uses the layout's multiple only; no group is touched
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by 4"):
        block.shard(torch.zeros(1, 30, 32), dim=1)


def test_unknown_method_lists_available():
    with pytest.raises(ValueError, match=r"unknown method 'uplipe'; available methods: .*ulysses.*upipe"):
        methods.build("uplipe", LLAMA)


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['chunk_head'\] for method 'upipe'.*chunk_heads"):
        methods.validate("upipe", LLAMA, 8, chunk_head=8)


def test_unknown_kernel():
    with pytest.raises(ValueError, match=r"unknown attention kernel 'flash3'; choose one of"):
        methods.validate("ulysses", LLAMA, 8, kernel="flash3")
    with pytest.raises(ValueError, match=r"unknown attention kernel"):
        select_kernel("flash3")
    with pytest.raises(ValueError, match=r"unknown attention kernel"):
        AttentionBlock(LLAMA, kernel="nope")


def test_flash_attn_kernel_without_flash_attn(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes the import fail even if installed
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    with pytest.raises(ValueError, match=r"kernel 'flash-attn' needs the flash_attn package.*kernel='torch'"):
        get_kernel("flash-attn")


def test_missing_optional_library_names_it_and_the_install():
    @methods.register("needs-lib", "test method", requires=("cpbench_surely_missing_lib",),
                      install_hint="pip install cpbench-surely-missing-lib")
    class NeedsLib(AttentionMethod):
        pass

    try:
        infos = {i.name: i for i in methods.available(detail=True)}
        assert infos["needs-lib"].status == "needs cpbench_surely_missing_lib"
        assert "needs-lib" not in methods.available()
        with pytest.raises(ValueError, match=r"method 'needs-lib' needs cpbench_surely_missing_lib.*pip install cpbench-surely-missing-lib"):
            methods.build("needs-lib", LLAMA)
    finally:
        methods.unregister("needs-lib")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dim=64, n_heads=6, n_kv_heads=4, head_dim=16), r"n_heads=6 is not divisible by n_kv_heads=4"),
        (dict(dim=64, n_heads=4, head_dim=15), r"head_dim=15 must be even"),
        (dict(dim=65, n_heads=4), r"dim=65 is not divisible by n_heads=4; pass head_dim"),
        (dict(dim=64, n_heads=0), r"n_heads must be a positive int"),
    ],
)
def test_bad_spec(kwargs, match):
    with pytest.raises(ValueError, match=match):
        methods.AttnSpec(**kwargs)


def test_positions_shape_checked():
    block = methods.build("upipe", methods.AttnSpec(dim=32, n_heads=4))
    with pytest.raises(ValueError, match=r"positions must be 1-D with one entry per local token \(8\)"):
        block(torch.zeros(1, 8, 32), positions=torch.arange(7))
