"""Every bad input gets a ValueError naming the constraint and the fix, before any communication."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import methods
from methods.core.base import AttentionMethod, MethodOptions
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
        needs = r"method 'needs-lib' needs cpbench_surely_missing_lib.*pip install cpbench-surely-missing-lib"
        with pytest.raises(ValueError, match=needs):
            methods.build("needs-lib", LLAMA)
    finally:
        methods.unregister("needs-lib")


# ----------------------------------------------------------------------- option types
@pytest.mark.parametrize(
    "name,options,message",
    [
        ("upipe", {"chunk_heads": 2.5}, "option chunk_heads of method 'upipe' must be an int or None, got 2.5 (float)"),
        ("upipe", {"chunk_heads": "8"}, "option chunk_heads of method 'upipe' must be an int or None, got '8' (str)"),
        ("upipe", {"chunk_heads": True},
         "option chunk_heads of method 'upipe' must be an int or None, got True (bool)"),
        ("fpdt", {"num_chunks": None}, "option num_chunks of method 'fpdt' must be an int, got None (NoneType)"),
        ("fpdt", {"offload": 1}, "option offload of method 'fpdt' must be a bool, got 1 (int)"),
        ("usp", {"ulysses_degree": 2.0},
         "option ulysses_degree of method 'usp' must be an int or None, got 2.0 (float)"),
        ("ulysses", {"kernel": 1}, "option kernel of method 'ulysses' must be a str or None, got 1 (int)"),
    ],
)
def test_option_of_the_wrong_type_is_refused_in_one_line(name, options, message):
    with pytest.raises(ValueError) as err:
        methods.validate(name, LLAMA, 8, **options)
    assert str(err.value) == message


def test_optional_options_accept_none():
    methods.validate("upipe", LLAMA, 8, chunk_heads=None)
    methods.validate("usp", LLAMA, 8, ulysses_degree=None, kernel=None)
    assert methods.get_info("upipe").cls.parse_options(chunk_heads=None).chunk_heads is None


@dataclass(frozen=True)
class _TypedOptions(MethodOptions):
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    label: str = "x"
    limit: int | None = None


@pytest.fixture
def typed_method():
    """A throw-away method whose options have one field of each kind."""

    @methods.register("typed-options", "test method")
    class Typed(AttentionMethod):
        Options = _TypedOptions

    yield Typed
    methods.unregister("typed-options")


def test_well_typed_options_are_accepted(typed_method):
    got = typed_method.parse_options(count=3, ratio=2, flag=True, label="y", limit=None)  # an int for a float
    assert got == _TypedOptions(count=3, ratio=2, flag=True, label="y", limit=None)
    assert typed_method.parse_options(ratio=0.25, limit=7) == _TypedOptions(ratio=0.25, limit=7)


@pytest.mark.parametrize(
    "name,value,expected",
    [
        ("count", True, "an int"),  # a bool is not a count
        ("count", 2.0, "an int"),
        ("count", None, "an int"),
        ("ratio", False, "a float"),
        ("ratio", "0.5", "a float"),
        ("flag", 1, "a bool"),
        ("label", None, "a str"),
        ("limit", "4", "an int or None"),
    ],
)
def test_each_kind_of_field_refuses_the_wrong_type(typed_method, name, value, expected):
    want = f"option {name} of method 'typed-options' must be {expected}, got {value!r} ({type(value).__name__})"
    with pytest.raises(ValueError) as err:
        typed_method.parse_options(**{name: value})
    assert str(err.value) == want


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
