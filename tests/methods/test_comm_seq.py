"""methods.core.comm's sequence all-gather and reduce-scatter: values, gradients, and that they are counted.

On gloo ranks at world sizes 1, 2 and 4, fp32 and bf16, along the batch, sequence and last
dimensions. Every rank's input and upstream gradient are small integers drawn from a seed
that any rank can redraw, so each rank computes the expected result of the whole group
itself and the comparison is exact (sums of a few small integers are exact in bf16 too,
whatever order the backend adds them in). The benchmark's ``CommCounter`` must see both
collectives, on real gloo ranks and under simulation (fake process group, fake tensors).
"""
from __future__ import annotations

import pytest
import torch

from bench.measure.simulate import fake_process_group, fake_tensors
from bench.stackmodel.hardware import CommCounter
from methods.core import comm

pytestmark = pytest.mark.slow  # spawns a rank pool (tests/conftest.py's meaning of slow)

SHAPE = (2, 4, 3, 2)  # [B, S/C, h, d] on each rank


def draw(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in bf16, and so are sums of a few of them) from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)


def gathered_shape(dim: int, size: int) -> tuple[int, ...]:
    shape = list(SHAPE)
    shape[dim] *= size
    return tuple(shape)


def check_all_gather(group, dtype: str, dim: int) -> dict:
    """Forward: every rank's input in rank order. Backward: the sum over ranks of their
    upstream gradients, this rank's slice. Both exact; also the collectives counted."""
    dt = getattr(torch, dtype)
    size, rank = comm.world(group)
    x = draw(100 + rank, SHAPE, dt).requires_grad_()
    counter = CommCounter()
    with counter:
        y = comm.all_gather_seq(x, group, dim)
        y.backward(draw(200 + rank, gathered_shape(dim, size), dt))
    want_y = torch.cat([draw(100 + r, SHAPE, dt) for r in range(size)], dim=dim)
    grads = sum(draw(200 + r, gathered_shape(dim, size), dt).float() for r in range(size))
    want_dx = grads.chunk(size, dim=dim)[rank].to(dt)
    return {"y_exact": torch.equal(y.detach(), want_y), "dx_exact": torch.equal(x.grad, want_dx),
            "y_dtype": y.dtype == dt, "calls": counter.calls, "nbytes": y.numel() * y.element_size()}


def check_reduce_scatter(group, dtype: str, dim: int) -> dict:
    """Forward: the sum over ranks, this rank's chunk. Backward: every rank's upstream
    gradient in rank order (the all-gather). Both exact."""
    dt = getattr(torch, dtype)
    size, rank = comm.world(group)
    x = draw(300 + rank, gathered_shape(dim, size), dt).requires_grad_()
    counter = CommCounter()
    with counter:
        y = comm.reduce_scatter_seq(x, group, dim)
        y.backward(draw(400 + rank, SHAPE, dt))
    total = sum(draw(300 + r, gathered_shape(dim, size), dt).float() for r in range(size))
    want_y = total.chunk(size, dim=dim)[rank].to(dt)
    want_dx = torch.cat([draw(400 + r, SHAPE, dt) for r in range(size)], dim=dim)
    return {"y_exact": torch.equal(y.detach(), want_y), "dx_exact": torch.equal(x.grad, want_dx),
            "y_dtype": y.dtype == dt, "calls": counter.calls, "nbytes": x.numel() * x.element_size()}


def refuses_uneven_length(group) -> str:
    """A reduce-scatter of a length the group does not divide fails before any communication."""
    try:
        comm.reduce_scatter_seq(torch.zeros(2, 5, 3), group, 1)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_all_gather_seq(pool, ws, dtype, dim):
    for rank, got in enumerate(pool.run(check_all_gather, dtype, dim, world_size=ws)):
        assert got["y_exact"] and got["dx_exact"] and got["y_dtype"], (rank, got)
        # the forward all-gather and the backward reduce-scatter, both of the full gathered tensor;
        # one rank is the identity and communicates nothing
        want = [("all_gather", got["nbytes"], ws), ("reduce_scatter", got["nbytes"], ws)] if ws > 1 else []
        assert got["calls"] == want, got


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_reduce_scatter_seq(pool, ws, dtype, dim):
    for rank, got in enumerate(pool.run(check_reduce_scatter, dtype, dim, world_size=ws)):
        assert got["y_exact"] and got["dx_exact"] and got["y_dtype"], (rank, got)
        want = [("reduce_scatter", got["nbytes"], ws), ("all_gather", got["nbytes"], ws)] if ws > 1 else []
        assert got["calls"] == want, got


def test_one_device_is_the_identity_and_uneven_lengths_are_refused(pool):
    x = torch.randn(SHAPE, requires_grad=True)
    assert comm.all_gather_seq(x, None, 1) is x and comm.reduce_scatter_seq(x, None, 1) is x
    messages = pool.run(refuses_uneven_length, world_size=2)
    assert all("length 5 is not a multiple of the group size 2" in m for m in messages), messages


def test_simulation_counts_both_collectives():
    """Under bench's simulated mode (fake process group of 8, fake tensors), as a method's
    all-gathered K/V would be: forward all-gather and backward reduce-scatter, full-size bytes."""
    with fake_process_group(8) as group, fake_tensors(torch.bfloat16):
        k = torch.empty(1, 1024, 8, 128, requires_grad=True)
        counter = CommCounter()
        with counter:
            full = comm.all_gather_seq(k, group, 1)
            assert full.shape == (1, 8 * 1024, 8, 128)
            full.sum().backward()
            assert k.grad.shape == k.shape
            part = comm.reduce_scatter_seq(full.detach(), group, 1)
            assert part.shape == k.shape
    nbytes = 8 * k.numel() * 2
    assert counter.calls == [("all_gather", nbytes, 8), ("reduce_scatter", nbytes, 8), ("reduce_scatter", nbytes, 8)]
    assert counter.by_op() == {"all_gather": nbytes, "reduce_scatter": 2 * nbytes}


def test_the_counter_hands_dtensor_ops_back_to_dtensor():
    """``CommCounter`` returns ``NotImplemented`` for ops with DTensor arguments (DTensor then runs its
    local ops, collectives included, through the counter); it finds the DTensor type without
    importing its module (``hardware._any_dtensor``), which FSDP2 has loaded wherever one exists."""
    from torch.distributed.tensor import DTensor

    from bench.stackmodel import hardware

    assert hardware._any_dtensor((torch.Tensor, DTensor)) and not hardware._any_dtensor((torch.Tensor,))
    with fake_process_group(8), fake_tensors(torch.bfloat16):
        x = torch.empty(4, 16)
        assert CommCounter().__torch_dispatch__(torch.ops.aten.add.Tensor, (DTensor,), (x, x)) is NotImplemented
