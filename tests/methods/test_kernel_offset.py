"""Causal attention with a query offset (``kernels.attention(..., q_offset=)``) against a dense reference.

The reference is built by hand: fp64 scores, a boolean mask ``key j <= query i + q_offset``,
softmax, and autograd for the gradients. Every kernel of methods/core/kernels.py runs: ``torch``
(aten's CPU flash op; blockwise for any causal call but offset 0 on equal lengths), ``math``
(explicit mask) and ``flash-attn`` (here the plain-torch stand-in of tests/flash_attn_standin.py,
installed by tests/conftest.py: it checks the kernel's native bottom-right path and its blockwise
path, not Dao's CUDA code). Also: the block split covers the mask exactly, calls without an offset
are bit-for-bit what they were, and bad offsets are refused.
"""
from __future__ import annotations

import pytest
import torch

from methods.core import kernels
from methods.core.kernels import attention, get_kernel, offset_blocks, softmax_scale

KERNEL_NAMES = ["torch", "math", "flash-attn"]
# (query length, key length, offset): q shorter than k at offsets 0, inside, bottom-right
# (Sk - Sq: flash-attn's native alignment), past the end, and equal lengths at 0 and > 0
GEOMETRIES = [(8, 32, 0), (8, 32, 8), (8, 32, 13), (8, 32, 24), (8, 32, 28), (8, 32, 40),
              (16, 16, 0), (16, 16, 5), (32, 8, 0)]
HEADS = {"mha": (4, 4), "gqa": (4, 2)}
# max|got - want| / max|want| against the fp64 reference on the same (rounded) inputs
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def hand_mask(sq: int, sk: int, q_offset: int) -> torch.Tensor:
    """``[sq, sk]`` boolean, True where query i may see key j (j <= i + q_offset)."""
    return torch.tensor([[j <= i + q_offset for j in range(sk)] for i in range(sq)])


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """BSHD attention in fp64 with an explicit mask (None: none); GQA by repeating KV heads."""
    groups = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(groups, dim=1), vf.repeat_interleave(groups, dim=1)
    s = qf @ kf.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vf).transpose(1, 2)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def test_offset_blocks_tile_the_mask_exactly():
    """Every (sq, sk, offset) up to small sizes: the blocks are disjoint, cover exactly the
    visible keys of their rows, and each is unmasked or causal on a square block."""
    for sq in range(1, 7):
        for sk in range(1, 10):
            for off in range(0, 12):
                covered = torch.zeros(sq, sk, dtype=torch.int64)
                rows_seen = torch.zeros(sq, dtype=torch.int64)
                for rows, parts in offset_blocks(sq, sk, off):
                    rows_seen[rows] += 1
                    for cols, causal in parts:
                        n_rows, n_cols = len(range(sq)[rows]), len(range(sk)[cols])
                        block = torch.ones(n_rows, n_cols, dtype=torch.int64)
                        if causal:
                            assert n_rows == n_cols, (sq, sk, off, rows, cols)
                            block = block.tril()
                        covered[rows, cols] += block
                assert (rows_seen == 1).all(), (sq, sk, off)
                assert torch.equal(covered, hand_mask(sq, sk, off).long()), (sq, sk, off)


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"q{a}-k{b}-off{c}" for a, b, c in GEOMETRIES])
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_causal_offset_matches_dense_reference(name, geometry, dtype, heads):
    sq, sk, off = geometry
    hq, hk = HEADS[heads]
    gen = torch.Generator().manual_seed(sq * 1000 + sk * 10 + off)
    q, k, v = (torch.randn(2, n, h, 16, generator=gen).to(dtype).requires_grad_()
               for n, h in ((sq, hq), (sk, hk), (sk, hk)))
    dout = torch.randn(2, sq, hq, 16, generator=gen).to(dtype)
    scale = softmax_scale(16)

    out = attention(q, k, v, True, get_kernel(name), q_offset=off)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    ref = dense(q, k, v, hand_mask(sq, sk, off), scale)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), dout.double()))

    assert out.dtype == dtype and out.shape == q.shape
    errors = {n: rel_err(g, w) for n, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=False)}
    assert max(errors.values()) <= TOLERANCE[dtype], errors
    # keys no query may see get no gradient at all
    hidden = ~hand_mask(sq, sk, off).any(0)
    assert not got[2][:, hidden].any() and not got[3][:, hidden].any()


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_offset_is_ignored_without_causal(name):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, n, 2, 8, generator=gen) for n in (4, 12, 12))
    kernel = get_kernel(name)
    out = attention(q, k, v, False, kernel)
    assert torch.equal(attention(q, k, v, False, kernel, q_offset=5), out)
    assert rel_err(out, dense(q, k, v, None, softmax_scale(8))) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_calls_without_an_offset_are_unchanged(causal, dtype):
    """Equal lengths at offset 0 (every existing method call) reach aten's op exactly as before
    the offset existed: same output, LSE and gradients, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 16, h, 8, generator=gen).to(dtype).requires_grad_() for h in (4, 2, 2))
    dout = torch.randn(2, 16, 4, 8, generator=gen).to(dtype)
    scale = softmax_scale(8)
    out, lse = kernels.attention_with_lse(q, k, v, causal, get_kernel("torch"))
    grads = torch.autograd.grad(out, (q, k, v), dout)

    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
    raw_out, raw_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, causal, scale=scale)
    raw_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2), qt, kt, vt, raw_out, raw_lse, 0.0, causal, scale=scale)
    assert torch.equal(out, raw_out.transpose(1, 2)) and torch.equal(lse, raw_lse)
    for got, want in zip(grads, raw_grads, strict=False):
        assert torch.equal(got, want.transpose(1, 2))


class OldSignatureKernel:
    """A kernel wrapper written before ``q_offset`` existed (as methods/offload.py's recorder is)."""

    def __init__(self) -> None:
        self.inner, self.name, self.calls = get_kernel("torch"), "old", 0

    def forward(self, q, k, v, causal, scale):
        self.calls += 1
        return self.inner.forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        self.calls += 1
        return self.inner.backward(dout, q, k, v, out, lse, causal, scale)


def test_a_wrapper_without_q_offset_still_serves_calls_without_one():
    wrapper = OldSignatureKernel()
    q = torch.randn(1, 8, 2, 8, requires_grad=True)
    attention(q, q, q, True, wrapper).sum().backward()
    k = torch.randn(1, 16, 2, 8)
    want = dense(q, k, k, hand_mask(8, 16, 0), softmax_scale(8))  # unequal lengths at offset 0: top-left
    assert rel_err(attention(q, k, k, True, wrapper), want) <= TOLERANCE[torch.float32]
    assert wrapper.calls == 3


@pytest.mark.parametrize("bad", [2.0, True, None])
def test_bad_offsets_are_refused(bad):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"q_offset must be an int .*got " + repr(bad).replace(".", r"\.")):
        attention(q, q, q, True, get_kernel("math"), q_offset=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("off", [-1, -3, -8], ids=lambda o: f"off{o}")
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_negative_offsets_hide_keys_from_the_first_rows(name, off, dtype):
    """``q_offset < 0``: query i sees keys j <= i + q_offset (-1 on equal lengths: the strictly
    causal block, key j < query i). The first -q_offset rows see no key: output 0, LSE -inf,
    and no gradient reaches them; the other rows match the dense reference."""
    sq = sk = 8
    gen = torch.Generator().manual_seed(100 - off)
    q, k, v = (torch.randn(2, sq, h, 16, generator=gen).to(dtype).requires_grad_() for h in (4, 2, 2))
    dout = torch.randn(2, sq, 4, 16, generator=gen).to(dtype)
    out, lse = kernels.attention_with_lse(q, k, v, True, get_kernel(name), q_offset=off)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    mask = hand_mask(sq, sk, off)
    empty = ~mask.any(1)
    assert empty.sum().item() == min(sq, -off)
    assert not out[:, empty].any() and torch.isneginf(lse[:, :, empty]).all()
    assert torch.isfinite(lse[:, :, ~empty]).all()
    assert not got[1][:, empty].any()
    if empty.all():
        return
    seen = ~empty
    ref = dense(q[:, seen], k, v, mask[seen], softmax_scale(16))
    want = torch.autograd.grad(ref, (q, k, v), dout[:, seen].double())
    errors = {"out": rel_err(out[:, seen], ref), "dq": rel_err(got[1][:, seen], want[0][:, seen]),
              "dk": rel_err(got[2], want[1]), "dv": rel_err(got[3], want[2])}
    assert max(errors.values()) <= TOLERANCE[dtype], errors
