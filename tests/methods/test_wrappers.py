"""The library wrappers against our own implementation of the same method, on equal weights.

``ds-ulysses``, ``ds-ulysses-hf`` and ``yc-ulysses`` vs ``ulysses``, ``rfa-zigzag`` and ``yc-ring`` vs ``ring``,
``yc-usp`` vs ``usp`` (same Ulysses degree), ``ds-fpdt`` vs ``fpdt`` (offload off, same chunk
count): outputs, dx and every weight gradient, gathered to global order with each method's
own ``unshard`` (so layouts may differ), within the matrix tolerances. On a CPU machine the
flash-attn based wrappers run on the plain-torch stand-in (tests/conftest.py). Also: the
wrappers' layouts, their refusals (with reasons) and what ``python -m methods`` says about
them without the stand-in.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

import methods
from tests.flash_attn_standin import real_flash_attn_available
from tests.methods.cases import BATCH, SEQ_LEN, SPECS, TOLERANCE, rel_err, summed_grads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRAPPERS = ("ds-ulysses", "ds-ulysses-hf", "rfa-zigzag", "ds-fpdt", "yc-ulysses", "yc-ring", "yc-usp")


def compare_methods(group, a: str, opts_a: dict, b: str, opts_b: dict, spec_kwargs: dict, dtype: str,
                    pos_offset: int = 0) -> dict:
    """Relative differences of method ``a`` from method ``b`` (fwd and all grads, global order)."""
    torch.manual_seed(4321)
    dt = getattr(torch, dtype)
    spec = methods.AttnSpec(**spec_kwargs)
    blocks = {a: methods.build(a, spec, group=group, **opts_a)}
    blocks[b] = methods.build(b, spec, group=group, **opts_b)
    blocks[b].load_state_dict(blocks[a].state_dict())
    x = torch.randn(BATCH, SEQ_LEN, spec.dim).to(dt)
    dy = torch.randn(BATCH, SEQ_LEN, spec.dim).to(dt)
    pos = torch.arange(SEQ_LEN) + pos_offset
    got = {}
    for name, block in blocks.items():
        block.to(dt)
        x_loc = block.shard(x, dim=1).requires_grad_()
        y = block(x_loc, positions=block.shard(pos, dim=0))
        y.backward(block.shard(dy, dim=1))
        got[name] = {"out": block.unshard(y.detach(), dim=1), "dx": block.unshard(x_loc.grad, dim=1)}
        got[name].update({"d_" + pname: grad for pname, grad in summed_grads(block, group).items()})
    assert got[a].keys() == got[b].keys(), (got[a].keys(), got[b].keys())
    return {k: rel_err(got[a][k], got[b][k]) for k in got[b]}


# the matrix already checks every wrapper against the reference in every case it accepts;
# these add a direct comparison on the cases that stress the layouts and head handling
CASES = [
    pytest.param(wrapper, {}, "ulysses", {}, spec, causal,
                 id=f"{wrapper}-vs-ulysses-{spec}-{'causal' if causal else 'full'}")
    for wrapper in ("ds-ulysses", "ds-ulysses-hf")
    for spec, causal in (("gqa-kv2", True), ("gqa-qknorm", False))
] + [
    pytest.param("rfa-zigzag", {}, "ring", {}, spec, True, id=f"rfa-zigzag-vs-ring-{spec}")
    for spec in ("gqa", "gqa-kv2", "gqa-qknorm")
] + [
    pytest.param("yc-ulysses", {}, "ulysses", {}, spec, causal,
                 id=f"yc-ulysses-vs-ulysses-{spec}-{'causal' if causal else 'full'}")
    for spec, causal in (("gqa", True), ("mha", False))
] + [
    pytest.param("yc-ring", {}, "ring", {}, spec, True, id=f"yc-ring-vs-ring-{spec}")
    for spec in ("gqa", "gqa-kv2", "gqa-qknorm")
] + [
    pytest.param("yc-usp", {"ulysses_degree": 2}, "usp", {"ulysses_degree": 2}, spec, True,
                 id=f"yc-usp-vs-usp-u2-{spec}")  # ring degree 1 at 2 ranks, 2 at 4 (LongContextAttention)
    for spec in ("gqa", "gqa-qknorm")
] + [
    pytest.param("ds-fpdt", {"num_chunks": k}, "fpdt", {"num_chunks": k, "offload": False}, spec, True,
                 id=f"ds-fpdt-vs-fpdt-{spec}-chunks{k}")
    for spec, k in (("mha", 1), ("mha", 2), ("mha", 4), ("gqa-kv2", 2))
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("a,opts_a,b,opts_b,spec,causal", CASES)
def test_wrapper_matches_our_implementation(pool, a, opts_a, b, opts_b, spec, causal, ws, dtype):
    if b not in methods.available():
        pytest.skip(f"methods/{b}.py not present")  # our counterpart is written separately
    spec_kwargs = dict(SPECS[spec], causal=causal)
    for name, opts in ((a, opts_a), (b, opts_b)):
        methods.validate(name, methods.AttnSpec(**spec_kwargs), ws, **opts)
    per_rank = pool.run(compare_methods, a, opts_a, b, opts_b, spec_kwargs, dtype, world_size=ws)
    tol = TOLERANCE[dtype]
    for rank, errors in enumerate(per_rank):
        bad = {k: v for k, v in errors.items() if not v <= tol}
        assert not bad, f"rank {rank}: {a} differs from {b} by more than {tol}: {bad}"


def test_ds_fpdt_rope_follows_given_positions(pool):
    """Positions other than 0..S-1 reach DeepSpeed's RoPE tables in its segment order."""
    spec_kwargs = dict(SPECS["gqa"], causal=True)
    per_rank = pool.run(compare_methods, "ds-fpdt", {"num_chunks": 2}, "fpdt", {"num_chunks": 2, "offload": False},
                        spec_kwargs, "float32", pos_offset=1000, world_size=4)
    for errors in per_rank:
        assert max(errors.values()) <= TOLERANCE["float32"], errors


# ----------------------------------------------------------------------- layouts
def _layouts(group, seq_len: int) -> dict:
    spec = methods.AttnSpec(**dict(SPECS["gqa"], causal=True))
    out = {}
    for name, opts in (("rfa-zigzag", {}), ("ring", {}), ("ds-fpdt", {"num_chunks": 2}), ("fpdt", {"num_chunks": 2}),
                       ("ds-ulysses", {}), ("ds-ulysses-hf", {}), ("ulysses", {}), ("yc-ulysses", {}), ("yc-ring", {}),
                       ("yc-usp", {"ulysses_degree": 2}), ("usp", {"ulysses_degree": 2})):
        if name not in methods.available():
            continue
        block = methods.build(name, spec, group=group, **opts)
        pos = torch.arange(seq_len)
        local = block.shard(pos, dim=0)
        out[name] = (local.tolist(), torch.equal(block.unshard(local, dim=0), pos))
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_wrapper_layouts_are_their_counterparts(pool, ws):
    for rank, layouts in enumerate(pool.run(_layouts, 32, world_size=ws)):
        for name, (_, roundtrip) in layouts.items():
            assert roundtrip, f"{name} rank {rank}: unshard(shard(x)) != x"
        for wrapper, ours in (("rfa-zigzag", "ring"), ("ds-fpdt", "fpdt"), ("ds-ulysses", "ulysses"),
                              ("ds-ulysses-hf", "ulysses"), ("yc-ulysses", "ulysses"), ("yc-ring", "ring"),
                              ("yc-usp", "usp")):
            if ours in layouts:
                assert layouts[wrapper][0] == layouts[ours][0], (wrapper, ours, rank)
        chunks = torch.arange(32).chunk(2 * ws)
        want = torch.cat([chunks[rank], chunks[2 * ws - 1 - rank]]).tolist()
        for name in ("rfa-zigzag", "yc-ring"):
            assert layouts[name][0] == want, f"{name} rank {rank} must hold chunks {rank}, {2 * ws - 1 - rank}"


# ----------------------------------------------------------------------- refusals
GQA = methods.AttnSpec(**SPECS["gqa"])


@pytest.mark.parametrize(
    "name,spec,ws,options,match",
    [
        ("rfa-zigzag", methods.AttnSpec(**SPECS["gqa"], causal=False), 2, {},
         r"zigzag ring is causal only.*use 'ring'"),
        ("rfa-zigzag", GQA, 2, {"kernel": "torch"}, r"kernel='torch' cannot be used: ring_flash_attn calls flash-attn"),
        ("ds-fpdt", methods.AttnSpec(**SPECS["gqa"], causal=False), 2, {}, r"FPDT_Attention is causal only"),
        ("ds-fpdt", methods.AttnSpec(**SPECS["gqa-qknorm"]), 2, {}, r"FPDT_Attention has no QK-norm"),
        ("ds-fpdt", GQA, 2, {"num_chunks": 0}, r"num_chunks=0 must be an int >= 1"),
        ("ds-fpdt", GQA, 2, {"offload": "yes"},
         r"option offload of method 'ds-fpdt' must be a bool or None, got 'yes'"),
        ("ds-fpdt", GQA, 3, {}, r"ds-fpdt: n_heads=8 is not divisible by the world size 3"),
        ("ds-ulysses", GQA, 3, {}, r"ds-ulysses: n_heads=8 is not divisible by the world size 3"),
        ("ds-ulysses-hf", GQA, 3, {}, r"ds-ulysses-hf: n_heads=8 is not divisible by the world size 3"),
        ("ds-ulysses-hf", methods.AttnSpec(dim=96, n_heads=12, n_kv_heads=6, head_dim=8), 4, {},
         r"ds-ulysses-hf: n_kv_heads=6 and world size 4 do not divide one another.*choose such a world size"),
        ("ds-ulysses-hf", GQA, 2, {"kernel": "nope"}, r"unknown attention kernel 'nope'"),
        ("ds-ulysses-hf", GQA, 2, {"chunks": 2}, r"unknown option\(s\) \['chunks'\] for method 'ds-ulysses-hf'"),
        ("yc-ulysses", methods.AttnSpec(**SPECS["gqa-kv2"]), 4, {},
         r"yc-ulysses: n_kv_heads=2 is not divisible by the world size 4; .*no replication.*divides 2"),
        ("yc-ulysses", GQA, 3, {}, r"yc-ulysses: n_heads=8 is not divisible by the world size 3"),
        ("yc-ulysses", GQA, 2, {"attn_type": "torch_math"}, r"attn_type='torch_math' is not supported; .*'fa3'"),
        ("yc-ring", GQA, 2, {"kernel": "torch"}, r"kernel='torch' cannot be used: yunchang calls flash-attn"),
        ("yc-ring", methods.AttnSpec(**SPECS["gqa"], causal=False), 2, {},
         r"yc-ring: yunchang's zigzag ring is causal only.*use 'ring'"),
        ("yc-usp", methods.AttnSpec(**SPECS["gqa"], causal=False), 4, {}, r"causal only.*use 'usp'"),
        ("yc-usp", GQA, 4, {"ulysses_degree": 3}, r"ulysses_degree=3 does not divide the world size 4.*\[1, 2, 4\]"),
        ("yc-usp", methods.AttnSpec(**SPECS["gqa-kv2"]), 4, {"ulysses_degree": 4},
         r"yc-usp: n_kv_heads=2 is not divisible by the ulysses_degree 4; .*no replication"),
    ],
)
def test_wrapper_refusals_say_why(name, spec, ws, options, match):
    with pytest.raises(ValueError, match=match):
        methods.validate(name, spec, ws, **options)


def test_ds_ulysses_hf_refuses_an_old_transformers(monkeypatch):
    """UlyssesSPAttentionHF raises below transformers 4.51.3 in its constructor; validate says so first."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "4.50.0" if d == "transformers" else real(d))
    with pytest.raises(ValueError, match=r"ds-ulysses-hf: UlyssesSPAttentionHF needs transformers>=4\.51\.3, "
                                         r"found 4\.50\.0; pip install -U 'transformers>=4\.51\.3'"):
        methods.validate("ds-ulysses-hf", GQA, 2)


def test_ds_ulysses_hf_without_transformers_says_what_to_install(monkeypatch):
    from methods.core import registry

    real = registry._importable
    monkeypatch.setattr(registry, "_importable", lambda mod: mod != "transformers" and real(mod))
    info = methods.get_info("ds-ulysses-hf")
    assert info.status == "needs transformers" and "ds-ulysses-hf" not in methods.available()
    with pytest.raises(ValueError, match=r"needs transformers.*pip install -e '\.\[deepspeed,hf\]'"):
        methods.validate("ds-ulysses-hf", GQA, 2)


@pytest.mark.parametrize("name", WRAPPERS)
def test_wrappers_need_a_process_group(name):
    with pytest.raises(ValueError, match=r"always communicates through a process group.*1-rank group"):
        methods.build(name, GQA)


def _ds_fpdt_offload_on_cpu(group):
    block = methods.build("ds-fpdt", GQA, group=group, offload=True)
    x = block.shard(torch.randn(1, SEQ_LEN, GQA.dim), dim=1).requires_grad_()
    try:
        block(x)
    except ValueError as err:
        return str(err)
    return "no error"


def test_ds_fpdt_offload_refused_on_cpu(pool):
    (msg,) = pool.run(_ds_fpdt_offload_on_cpu, world_size=1)
    assert "offload=True needs a CUDA input" in msg and "Stream is None" in msg, msg


# ----------------------------------------------------------------------- registry and CLI
def test_wrappers_usable_with_the_standin():
    for name in WRAPPERS:
        info = methods.get_info(name)
        assert info.usable, (name, info.status)
    assert set(WRAPPERS) <= set(methods.available())


def test_cli_lists_every_method_with_its_status_without_the_standin():
    """``python -m methods`` in a fresh process (no stand-in): every method is listed, the
    flash-attn wrappers say what they need, and no optional library was imported
    (``-X importtime`` lists every module the process imported on stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "methods"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    for lib in ("deepspeed", "transformers", "ring_flash_attn", "flash_attn", "yunchang"):
        assert lib not in imported, f"`import methods` imported {lib}: wrappers must import their library lazily"
    lines = {line.split()[0]: line for line in done.stdout.splitlines()[1:] if line.strip()}
    for info in methods.available(detail=True):
        assert info.name in lines, f"{info.name} missing from `python -m methods`"
    for name in ("fpdt", "offload", "ulysses"):
        assert " ok " in lines[name], lines[name]
    hf = methods.get_info("ds-ulysses-hf")  # ok, or "needs transformers" (deepspeed) where missing here
    assert f" {hf.status} " in lines["ds-ulysses-hf"], lines["ds-ulysses-hf"]
    if not real_flash_attn_available():
        for name in ("ds-fpdt", "rfa-zigzag", "yc-ulysses", "yc-ring", "yc-usp"):
            assert "needs flash_attn" in lines[name], lines[name]
    else:
        assert "needs flash_attn" not in lines["ds-fpdt"]
