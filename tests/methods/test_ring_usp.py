"""Ring and USP beyond the reference matrix: layouts, overlap of p2p with compute, constraints.

Layout: zigzag ``shard`` then ``unshard`` is the identity, ring rank r holds chunks r and
2C-1-r, and USP's all-to-all leaves each ring rank its zigzag chunks. Overlap: the next
K/V exchange is posted before the kernel call on the current block, forward and backward
(recorded by a logging ``RingComm`` and kernel inside the ranks). The math kernel (strided
gradients) through both. Constraints: the errors say which number does not divide which,
before any communication. USP on a group smaller than the world, where only the members
build it and its subgroups come from ``new_group(..., use_local_synchronization=True)``.
"""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import methods
from methods.core import comm
from methods.core.layouts import zigzag_index
from tests.methods.cases import SPECS, TOLERANCE, check_against_reference

SPEC = methods.AttnSpec(dim=64, n_heads=8, n_kv_heads=4, head_dim=16)


# ----------------------------------------------------------------------- layouts
def _ring_layout(group, seq_len: int) -> tuple[bool, list[int]]:
    block = methods.build("ring", SPEC, group=group)
    x = torch.arange(seq_len).view(1, seq_len, 1).expand(2, seq_len, 3).contiguous()
    local = block.shard(x, dim=1)
    return torch.equal(block.unshard(local, dim=1), x), local[0, :, 0].tolist()


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_zigzag_shard_unshard_and_chunks(pool, ws):
    seq_len = 48
    got = pool.run(_ring_layout, seq_len, world_size=ws)
    chunks = torch.arange(seq_len).chunk(2 * ws)
    for rank, (roundtrip, tokens) in enumerate(got):
        assert roundtrip, f"rank {rank}: unshard(shard(x)) != x"
        want = torch.cat([chunks[rank], chunks[2 * ws - 1 - rank]]).tolist()
        assert tokens == want, f"rank {rank} holds {tokens}, want chunks {rank} and {2 * ws - 1 - rank}"


def _usp_layout(group, ulysses_degree: int, seq_len: int) -> tuple[bool, int, list[int]]:
    block = methods.build("usp", SPEC, group=group, ulysses_degree=ulysses_degree)
    pos = torch.arange(seq_len)
    local = block.shard(pos, dim=0)
    roundtrip = torch.equal(block.unshard(local, dim=0), pos)
    # what the ring sees: positions after the all-to-all inside the Ulysses group
    heads = local.view(1, -1, 1, 1).expand(1, local.numel(), ulysses_degree, 1).contiguous()
    seen = comm.seq_to_head_(heads, block.ulysses_group)[0, :, 0, 0].tolist()
    return roundtrip, comm.world(block.ring_group)[1], seen


@pytest.mark.parametrize("ws,u", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)])
def test_usp_layout_gives_each_ring_rank_its_zigzag_chunks(pool, ws, u):
    ring = ws // u
    cls = methods.get_info("usp").cls
    seq_len = cls.seq_multiple(ws, cls.parse_options(ulysses_degree=u))  # the smallest allowed
    for rank, (roundtrip, ring_rank, seen) in enumerate(pool.run(_usp_layout, u, seq_len, world_size=ws)):
        assert roundtrip, f"rank {rank}: unshard(shard(x)) != x"
        assert ring_rank == rank // u
        want = zigzag_index(seq_len, ring).chunk(ring)[ring_rank].tolist()
        assert seen == want, f"rank {rank} (ring rank {ring_rank}) attends tokens {seen}, want {want}"


def test_usp_default_degree_is_the_largest_that_fits():
    cls = methods.get_info("usp").cls
    assert cls.default_ulysses_degree(SPEC, 4) == 4
    assert cls.default_ulysses_degree(methods.AttnSpec(dim=96, n_heads=6, head_dim=16), 4) == 2
    assert cls.default_ulysses_degree(methods.AttnSpec(dim=96, n_heads=6, n_kv_heads=3, head_dim=16), 8) == 1
    assert cls.default_ulysses_degree(methods.AttnSpec(dim=96, n_heads=6, n_kv_heads=2, head_dim=16), 8) == 2
    assert cls.seq_multiple(8, cls.parse_options(ulysses_degree=2)) == 8  # lcm(2R, C) with R = 4
    assert cls.seq_multiple(6, cls.parse_options(ulysses_degree=3)) == 12  # lcm(4, 6)
    assert cls.seq_multiple(4, cls.parse_options(ulysses_degree=4)) == 4  # Ulysses' layout


# ----------------------------------------------------------------------- other kernels
@pytest.mark.parametrize("method,options", [("ring", {}), ("usp", {"ulysses_degree": 2})])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_math_kernel(pool, method, options, dtype):
    """The math kernel returns strided gradients: the ring must still send contiguous buffers."""
    spec = dict(SPECS["gqa-qknorm"], causal=True)
    options = dict(options, kernel="math")
    for rank, errors in enumerate(pool.run(check_against_reference, method, spec, options, dtype)):
        assert max(errors.values()) <= TOLERANCE[dtype], (rank, errors)


# ----------------------------------------------------------------------- overlap
EVENTS: list[tuple[str, int]] = []


class RecordingRingComm(comm.RingComm):
    """A RingComm that logs when transfers are posted and completed."""

    created = 0

    def __init__(self, group) -> None:
        super().__init__(group)
        RecordingRingComm.created += 1
        self.id = RecordingRingComm.created

    def exchange(self, tensors):
        EVENTS.append(("exchange", self.id))
        return super().exchange(tensors)

    def wait(self) -> None:
        EVENTS.append(("wait", self.id))
        super().wait()


class RecordingKernel:
    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name

    def forward(self, *args):
        EVENTS.append(("forward", 0))
        return self.inner.forward(*args)

    def backward(self, *args):
        EVENTS.append(("backward", 0))
        return self.inner.backward(*args)


def overlap_violations(events: list[tuple[str, int]], size: int) -> list[str]:
    """Kernel calls of a pass (forward, backward) during which the next K/V was not in flight.

    The K/V channel of a pass is the first ring that posts in it; every kernel call but the
    last must find a K/V exchange posted and not yet waited for, the last must find none.
    """
    problems = []
    for phase in ("forward", "backward"):
        calls = [i for i, (kind, _) in enumerate(events) if kind == phase]
        if len(calls) != size:
            problems.append(f"{phase}: {len(calls)} kernel calls, want {size}")
            continue
        start = 0 if phase == "forward" else max(i for i, (k, _) in enumerate(events) if k == "forward") + 1
        posts = [ident for kind, ident in events[start:] if kind == "exchange"]
        kv = posts[0] if posts else None
        in_flight = False
        for i in range(start, calls[-1] + 1):
            kind, ident = events[i]
            if ident == kv and kind in ("exchange", "wait"):
                in_flight = kind == "exchange"
            elif kind == phase and in_flight != (i != calls[-1]):
                step = calls.index(i)
                problems.append(f"{phase} step {step}: next K/V {'in flight' if in_flight else 'not posted'}")
    return problems


def _record_ring_events(group, method: str, causal: bool, options: dict) -> list[tuple[str, int]]:
    original = comm.RingComm
    comm.RingComm = RecordingRingComm
    EVENTS.clear()
    try:
        torch.manual_seed(0)
        spec = methods.AttnSpec(**dict(SPECS["gqa"], causal=causal))
        block = methods.build(method, spec, group=group, **options)
        block.kernel = RecordingKernel(block.kernel)
        x = block.shard(torch.randn(1, 32, spec.dim), dim=1).requires_grad_()
        block(x).sum().backward()
        return list(EVENTS)
    finally:
        comm.RingComm = original


@pytest.mark.parametrize(
    "method,ws,options",
    [("ring", 2, {}), ("ring", 4, {}), ("usp", 2, {"ulysses_degree": 1}), ("usp", 4, {"ulysses_degree": 2})],
    ids=["ring-ws2", "ring-ws4", "usp-ws2-1x2", "usp-ws4-2x2"],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_next_exchange_is_posted_before_the_current_attention(pool, method, ws, options, causal):
    size = ws // options.get("ulysses_degree", 1)  # ring degree
    for rank, events in enumerate(pool.run(_record_ring_events, method, causal, options, world_size=ws)):
        assert not overlap_violations(events, size), (rank, overlap_violations(events, size), events)


def test_overlap_check_catches_a_serial_ring():
    serial = [("forward", 0), ("exchange", 1), ("wait", 1), ("forward", 0)]
    serial += [("exchange", 2), ("wait", 2), ("backward", 0), ("exchange", 3), ("backward", 0), ("wait", 3)]
    assert overlap_violations(serial, 2) == [
        "forward step 0: next K/V not posted",
        "backward step 0: next K/V not posted",
    ]
    overlapped = [("exchange", 1), ("forward", 0), ("wait", 1), ("forward", 0)]
    overlapped += [("exchange", 2), ("backward", 0), ("exchange", 3), ("wait", 2), ("backward", 0)]
    overlapped += [("wait", 3), ("exchange", 3), ("wait", 3)]
    assert overlap_violations(overlapped, 2) == []


# ----------------------------------------------------------------------- constraints
def test_ring_sequence_must_be_a_multiple_of_2c():
    cls = methods.get_info("ring").cls
    with pytest.raises(ValueError, match=r"sequence length 100 is not divisible by 8, which method 'ring' "
                                         r"needs at world size 4.*multiple of 8, e\.g\. 96"):
        cls.check_seq_len(100, 4, cls.parse_options())
    cls.check_seq_len(104, 4, cls.parse_options())


def test_ring_has_no_head_constraint():
    methods.validate("ring", methods.AttnSpec(dim=96, n_heads=6, n_kv_heads=3, head_dim=16), 4)
    methods.validate("ring", methods.AttnSpec(dim=64, n_heads=8, n_kv_heads=1, head_dim=8), 8)


def _odd_local_length(group) -> str:
    block = methods.build("ring", SPEC, group=group)
    qkv = torch.zeros(1, 7, 4, 16)
    try:
        methods.ring.ring_attention(qkv, qkv, qkv, True, block.kernel, block.scale, group)
    except ValueError as err:
        return str(err)
    return "no error"


def test_ring_refuses_an_odd_local_length(pool):
    for message in pool.run(_odd_local_length, world_size=2):
        assert "7 local tokens cannot form the two zigzag chunks" in message, message


def test_usp_degree_must_divide_world_size():
    with pytest.raises(ValueError, match=r"ulysses_degree=3 does not divide the world size 4.*\[1, 2, 4\]"):
        methods.validate("usp", SPEC, 4, ulysses_degree=3)
    with pytest.raises(ValueError, match=r"ulysses_degree=0 does not divide"):
        methods.validate("usp", SPEC, 4, ulysses_degree=0)


def test_usp_heads_must_split_over_the_ulysses_degree():
    spec = methods.AttnSpec(dim=96, n_heads=6, head_dim=16)
    with pytest.raises(ValueError, match=r"ulysses_degree=4 does not fit the heads.*n_heads=6.*in \[1, 2\]"):
        methods.validate("usp", spec, 4, ulysses_degree=4)
    gqa = methods.AttnSpec(dim=192, n_heads=12, n_kv_heads=3, head_dim=16)
    with pytest.raises(ValueError, match=r"ulysses_degree=2 does not fit the heads.*n_kv_heads=3.*in \[1\]"):
        methods.validate("usp", gqa, 4, ulysses_degree=2)
    methods.validate("usp", spec, 4)  # the default degree (2) fits


def test_usp_sequence_multiple_follows_the_layout():
    cls = methods.get_info("usp").cls
    with pytest.raises(ValueError, match=r"sequence length 36 is not divisible by 8, which method 'usp'"):
        cls.check_seq_len(36, 4, cls.parse_options(ulysses_degree=1))
    cls.check_seq_len(36, 4, cls.parse_options(ulysses_degree=2))  # lcm(2*2, 4) = 4


# ----------------------------------------------------------------------- subgroups of a subgroup
def _local_sync_worker(rank: int, size: int, port: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=30))
    parent = dist.new_group(list(range(size - 1)))  # the last rank stays out and idle
    if rank < size - 1:
        for u in (2, 1, 4):
            spec = dict(SPECS["gqa"], causal=True)
            errors = check_against_reference(parent, "usp", spec, {"ulysses_degree": u}, "float32")
            assert max(errors.values()) <= TOLERANCE["float32"], (u, errors)
    dist.destroy_process_group()


def test_usp_on_a_group_smaller_than_the_world():
    """Only the group's members build USP; its subgroups come from use_local_synchronization."""
    import torch.multiprocessing as mp

    from bench.measure.launch import host_store

    store = host_store()
    ctx = mp.start_processes(
        _local_sync_worker, args=(5, store.port), nprocs=5, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("USP on a 4-rank subgroup of 5 ranks hung creating its subgroups")
