"""``offload`` and ``fpdt`` beyond the reference matrix: where their saved tensors live, layout, options.

* offload: the pack hook's bookkeeping (``block.stats``) shows what went to host memory in the
  latest forward: with ``what="attention"`` exactly the kernel's q, k, v, out and lse (checked
  byte for byte, one rank and two), with ``what="all"`` those and more, never a parameter.
* fpdt: the chunk store of a forward holds every K/V segment (and Q, O, LSE) as host-memory
  copies when ``offload=True``, none when ``offload=False``, and backward empties it; under
  activation checkpointing the first forward keeps none of them, and gradients are unchanged.
* fpdt's layout: rank r holds global chunks r, r+C, ..., and ``unshard`` inverts ``shard``.
* bad options get ValueErrors naming the option and the fix.
* on CUDA (skipped here): host copies are pinned and results match the no-offload runs.
"""
from __future__ import annotations

import pytest
import torch

import methods
from tests.methods.cases import SPECS

SPEC = methods.AttnSpec(**SPECS["gqa"])  # H=8, G=4, d=16, dim=64
B, S = 2, 32


def _offload_stats(group, what: str, dtype: str) -> tuple[dict, dict]:
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    block = methods.build("offload", SPEC, group=group, what=what).to(dt)
    x = block.shard(torch.randn(B, S, SPEC.dim, dtype=dt), dim=1).requires_grad_()
    y = block(x)
    stats = dict(vars(block.stats))
    y.sum().backward()
    c = block.world_size
    n = S  # head layout: every rank holds all S tokens of H/C query heads and G_e/C KV heads
    es = torch.finfo(dt).bits // 8
    g_eff = max(SPEC.n_kv_heads, c)
    want = {
        # q and out with H/C heads, k and v with G_e/C heads in the input dtype, lse fp32
        "attention_bytes": es * B * n * SPEC.head_dim * (2 * SPEC.n_heads // c + 2 * g_eff // c)
        + 4 * B * n * SPEC.n_heads // c,
        "param_grads": all(p.grad is not None for p in block.parameters()),
    }
    return stats, want


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_attention_moves_exactly_the_kernel_tensors(pool, ws, dtype):
    for stats, want in pool.run(_offload_stats, "attention", dtype, world_size=ws):
        assert stats["offloaded_tensors"] == 5, stats  # q, k, v, out, lse
        assert stats["offloaded_bytes"] == want["attention_bytes"], (stats, want)
        assert stats["host_devices"] == ("cpu",)
        assert stats["kept_tensors"] > 0  # everything else stays where it is
        assert want["param_grads"]


@pytest.mark.parametrize("ws", [1, 2])
def test_offload_all_moves_more_but_no_parameter(pool, ws):
    for stats, want in pool.run(_offload_stats, "all", "float32", world_size=ws):
        assert stats["offloaded_bytes"] > want["attention_bytes"], (stats, want)
        assert stats["offloaded_tensors"] > 5
        assert stats["host_devices"] == ("cpu",)


def test_offload_pack_never_moves_parameters_or_small_tensors():
    block = methods.build("offload", SPEC, what="all", min_bytes=1 << 30)
    block(torch.randn(1, 8, SPEC.dim, requires_grad=True)).sum().backward()
    assert block.stats.offloaded_tensors == 0 and block.stats.kept_tensors > 0
    block = methods.build("offload", SPEC, what="all", min_bytes=0)
    seen = []
    pack = block._pack

    def spy(t):
        packed = pack(t)
        seen.append((isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter), packed[0]))
        return packed

    block._pack = spy
    block(torch.randn(1, 8, SPEC.dim, requires_grad=True)).sum().backward()
    assert any(is_param for is_param, _ in seen), "F.linear saves its weight: the spy should see it"
    assert all(device is None for is_param, device in seen if is_param), "a parameter was offloaded"
    assert all(device is not None for is_param, device in seen if not is_param)


# ----------------------------------------------------------------------- fpdt store
def _fpdt_store(group, offload: bool, num_chunks: int, causal: bool) -> dict:
    torch.manual_seed(0)
    spec = methods.AttnSpec(**SPECS["gqa"], causal=causal)
    block = methods.build("fpdt", spec, group=group, num_chunks=num_chunks, offload=offload)
    x = block.shard(torch.randn(B, S, spec.dim), dim=1).requires_grad_()
    y = block(x)
    store = block.last_store
    keys = store.keys()
    report = {
        "kv_keys": sorted(k for k in keys if k[0] in ("k", "v")),
        "in_host": sorted(k for k in keys if store.in_host_memory(k)),
        "host_bytes": store.host_bytes(),
        "all_cpu": all(store.location(k).type == "cpu" for k in keys),
    }
    del store
    y.sum().backward()
    report["store_after_backward"] = block.last_store
    return report


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ws,num_chunks", [(1, 4), (2, 2), (4, 2)])
def test_fpdt_offload_keeps_kv_chunks_in_host_memory(pool, ws, num_chunks, causal):
    # keys (name, K/V group, segment): without head stages there is one K/V group
    kv = sorted((name, 0, i) for name in ("k", "v") for i in range(num_chunks))
    # held per rank after forward, over all segments (head layout, fp32): q and o with H/C heads,
    # k and v with G_e/C heads (G_e = max(G, C): KV heads replicated when fewer than ranks), lse
    h, g_eff, d = SPEC.n_heads // ws, max(SPEC.n_kv_heads, ws) // ws, SPEC.head_dim
    held = 4 * B * S * (d * (2 * h + 2 * g_eff) + h)
    for rank, r in enumerate(pool.run(_fpdt_store, True, num_chunks, causal, world_size=ws)):
        assert r["kv_keys"] == kv, r
        assert set(kv) <= set(r["in_host"]), f"rank {rank}: K/V segments not in host memory: {r}"
        assert r["all_cpu"]
        assert r["host_bytes"] == held, (r, held)
        assert r["store_after_backward"] is None, "backward must release the chunk store"
    for r in pool.run(_fpdt_store, False, num_chunks, causal, world_size=ws):
        assert r["kv_keys"] == kv and r["in_host"] == [] and r["host_bytes"] == 0, r


def _fpdt_under_checkpoint(group, offload: bool) -> dict:
    """The store after a checkpointed forward, and gradients with and without the checkpoint."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    spec = methods.AttnSpec(**SPECS["gqa"], causal=True)
    block = methods.build("fpdt", spec, group=group, num_chunks=2, offload=offload).double()
    x0 = block.shard(torch.randn(B, S, spec.dim, dtype=torch.float64), dim=1)
    out = {}
    for name, run in (("plain", block), ("checkpointed", lambda x: checkpoint(block, x, use_reentrant=False))):
        block.zero_grad()
        x = x0.clone().requires_grad_()
        y = run(x)
        out[f"{name}_held_after_forward"] = len(block.last_store.keys())
        y.pow(2).sum().backward()
        out[name] = [x.grad] + [p.grad.clone() for p in block.parameters()]
    return out


@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("ws", [1, 2])
def test_fpdt_chunks_are_freed_by_activation_checkpointing(pool, ws, offload):
    """Under torch's non-reentrant checkpoint the first forward keeps no chunk (they were kept through
    ctx and stayed on the host for every layer until its backward); the recompute brings them back."""
    for rank, r in enumerate(pool.run(_fpdt_under_checkpoint, offload, world_size=ws)):
        assert r["plain_held_after_forward"] > 0, r
        assert r["checkpointed_held_after_forward"] == 0, f"rank {rank}: checkpoint left chunks alive: {r}"
        for a, b in zip(r["plain"], r["checkpointed"], strict=False):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_chunk_store_take_back_refuses_what_hand_over_did_not_give():
    from methods.core.chunkstore import ChunkStore

    store = ChunkStore("cpu", offload=False)
    store.put("k", torch.ones(2))
    held = store.hand_over()
    assert store.keys() == ["k"]  # still alive in `held`
    with pytest.raises(RuntimeError, match="expected the 1 tensors hand_over gave, got 2"):
        store.take_back(held + held)
    store.take_back(held)
    assert torch.equal(store.get("k"), torch.ones(2))
    del held
    assert store.keys() == ["k"]  # held again after take_back


def _fpdt_layout(group, num_chunks: int, seq_len: int) -> tuple[list[int], bool]:
    block = methods.build("fpdt", SPEC, group=group, num_chunks=num_chunks)
    pos = torch.arange(seq_len)
    local = block.shard(pos, dim=0)
    return local.tolist(), torch.equal(block.unshard(local, dim=0), pos)


@pytest.mark.parametrize("ws,num_chunks", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_fpdt_layout_global_chunk_c_on_rank_c_mod_C(pool, ws, num_chunks):
    seq_len = 48
    chunks = torch.arange(seq_len).chunk(ws * num_chunks)
    for rank, (tokens, roundtrip) in enumerate(pool.run(_fpdt_layout, num_chunks, seq_len, world_size=ws)):
        assert roundtrip, f"rank {rank}: unshard(shard(x)) != x"
        want = torch.cat([chunks[c] for c in range(rank, ws * num_chunks, ws)]).tolist()
        assert tokens == want, f"rank {rank} holds {tokens}, want global chunks {rank}, {rank}+{ws}, ..."


# ----------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "name,options,match",
    [
        ("offload", {"what": "everything"}, r"offload: what='everything' is not one of \('all', 'attention'\)"),
        ("offload", {"min_bytes": -1}, r"offload: min_bytes=-1 must be an int >= 0"),
        ("fpdt", {"num_chunks": 0}, r"fpdt: num_chunks=0 must be an int >= 1"),
        ("fpdt", {"num_chunks": 2.5}, r"option num_chunks of method 'fpdt' must be an int, got 2\.5 \(float\)"),
        ("fpdt", {"offload": "host"}, r"option offload of method 'fpdt' must be a bool, got 'host' \(str\)"),
        ("fpdt", {"chunks": 2}, r"unknown option\(s\) \['chunks'\] for method 'fpdt'.*num_chunks"),
        ("fpdt", {"chunk_tokens": 3}, r"fpdt: chunk_tokens=3 must be 0 \(use num_chunks\) or a positive multiple "
                                      r"of the world size 2"),
        ("fpdt", {"chunk_tokens": -2}, r"fpdt: chunk_tokens=-2 must be 0"),
        ("fpdt", {"chunk_tokens": 8, "num_chunks": 4}, r"fpdt: give num_chunks or chunk_tokens, not both"),
        ("fpdt", {"chunk_heads": -2}, r"fpdt: chunk_heads=-2 must be 0 \(all heads at once\) or UPipe's stage size"),
        ("fpdt", {"chunk_heads": 3}, r"fpdt: chunk_heads runs UPipe's head stages; upipe: chunk_heads=3 is not a "
                                     r"multiple of the world size 2.*chunk_heads=2 or 4"),
        ("fpdt", {"chunk_heads": 6}, r"fpdt: chunk_heads runs UPipe's head stages; upipe: chunk_heads=6 must divide "
                                     r"n_heads=8.*\[2, 4, 8\]"),
    ],
)
def test_bad_options_are_refused_with_the_fix(name, options, match):
    with pytest.raises(ValueError, match=match):
        methods.validate(name, SPEC, 2, **options)


def test_fpdt_head_stages_take_upipes_gqa_check():
    """24 query heads over 8 KV heads (3 per KV head) at world size 2: stages of 4 heads give each rank
    2 query heads, which neither divides 3 nor is a multiple of it; UPipe's schedule refuses that."""
    spec = methods.AttnSpec(dim=96, n_heads=24, n_kv_heads=8, head_dim=4)
    with pytest.raises(ValueError, match=r"fpdt: chunk_heads runs UPipe's head stages; upipe: "
                                         r"chunk_heads/world_size=2 query heads per rank and 3 query heads"):
        methods.validate("fpdt", spec, 2, chunk_heads=4)
    methods.validate("fpdt", spec, 2, chunk_heads=6)  # 3 per rank: one KV head's queries


def test_fpdt_sequence_must_be_a_multiple_of_world_size_times_chunks():
    cls = methods.get_info("fpdt").cls
    msg = r"sequence length 60 is not divisible by 16.*'fpdt' needs at world size 4.*e\.g\. 48"
    with pytest.raises(ValueError, match=msg):
        cls.check_seq_len(60, 4, cls.parse_options(num_chunks=4))
    block = methods.build("fpdt", SPEC, num_chunks=4)
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by 4"):
        block.shard(torch.zeros(1, 30, SPEC.dim), dim=1)
    with pytest.raises(ValueError, match=r"local sequence length 30 cannot be cut into num_chunks=4; .*multiple of 4"):
        block(torch.zeros(1, 30, SPEC.dim))


def test_fpdt_chunk_tokens_sets_the_chunks_per_rank_from_the_length():
    """DeepSpeed's knob: K = S / chunk_tokens, so the sequence must be a multiple of chunk_tokens."""
    cls = methods.get_info("fpdt").cls
    opts = cls.parse_options(chunk_tokens=16)
    assert opts.chunks_per_rank(64) == 4 and opts.chunks_per_rank(256) == 16
    assert cls.seq_multiple(4, opts) == 16
    with pytest.raises(ValueError, match=r"sequence length 40 is not divisible by 16.*e\.g\. 32"):
        cls.check_seq_len(40, 2, opts)
    block = methods.build("fpdt", SPEC, chunk_tokens=16)
    with pytest.raises(ValueError, match=r"cannot be cut into chunk_tokens=16 \(0 chunks per rank\)"):
        block(torch.zeros(1, 8, SPEC.dim))
    with pytest.raises(ValueError, match=r"cannot be cut into chunk_tokens=16 \(2 chunks per rank\)"):
        block(torch.zeros(1, 40, SPEC.dim))  # 2 segments of 20 tokens would pass for 16: refused


def test_fpdt_and_offload_inherit_ulysses_head_constraints():
    for name in ("fpdt", "offload"):
        with pytest.raises(ValueError, match=r"n_heads=8 is not divisible by the world size 3"):
            methods.validate(name, SPEC, 3)


# ----------------------------------------------------------------------- CUDA (device tool)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,options", [("fpdt", {"num_chunks": 4}), ("offload", {"what": "all"}),
                                          ("offload", {"what": "attention"})])
def test_cuda_offload_pins_host_copies_and_matches(name, options):
    torch.manual_seed(0)
    spec = methods.AttnSpec(**SPECS["gqa"], causal=True)
    ref = methods.build("fpdt" if name == "fpdt" else "ulysses", spec,
                        **({"num_chunks": 4, "offload": False} if name == "fpdt" else {})).cuda().bfloat16()
    block = methods.build(name, spec, **options).cuda().bfloat16()
    block.load_state_dict(ref.state_dict())
    x = torch.randn(B, S, spec.dim, device="cuda", dtype=torch.bfloat16)
    results = []
    for m in (ref, block):
        xi = x.clone().requires_grad_()
        y = m(xi)
        if m is block and name == "fpdt":
            store = m.last_store
            assert all(store.in_host_memory(k) and store.is_pinned(k) for k in store.keys())
        if m is block and name == "offload":
            assert m.stats.offloaded_tensors > 0 and m.stats.host_devices == ("cpu",)
        y.float().sum().backward()
        results.append((y.detach().float(), xi.grad.float()))
    for a, b in zip(*results, strict=False):
        assert (a - b).abs().max() <= 1e-2 * b.abs().max(), (a - b).abs().max()
