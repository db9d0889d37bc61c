"""Packed ring steps (``methods.core.ringpack``): the ``doc-zigzag`` layout's calls as variable-length calls.

* The packing on its own (no ranks): for every ring step of several document layouts, the packed calls see
  exactly what the step's calls see (the kernels' masking rule, as an explicit mask), every row at most
  once per call. Under a causal mask no real token's row or key is ever gathered (only padding documents'
  strays), and where no document needs padding ``doc-zigzag``'s ring steps are two calls (three unmasked),
  each taking its rows and keys as slices, whatever the documents; allgather-kv's one step is at most two
  calls per chunk of a document under a causal mask.
* The ring methods on gloo ranks with a kernel that packs (the tests' flash-attn stand-in, whose varlen
  functions run on CPU): output, dx and every weight gradient against the reference, at 2 and 4 ranks,
  causal and not, fp32 (and bf16 for the ring); the packed calls were made, the per-pair calls were not. With the
  ``torch`` kernel on CPU (no varlen form) the per-pair calls run, as the document matrix checks.
"""
from __future__ import annotations

import pytest
import torch

import methods
from methods import Documents
from methods.core import kernels, layouts, ringpack
from methods.core.kernels import visible
from methods.core.ringloop import RunsSchedule
from tests.methods.cases import SPECS, TOLERANCE, check_documents_against_reference, doc_layouts

LAYOUTS = {"many-short": (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 3),
           "long-among-short": (3, 5, 40, 2, 7, 4, 3),
           "one": (64,),
           "no-padding": (8, 16, 24, 8, 40, 32)}  # multiples of 2R at 2 and 4 ring ranks


def dense(blocks, local_len: int, held_len: int, packed: bool) -> torch.Tensor:
    """What a step's calls see, as a boolean ``[local, held]`` mask (each pair counted once: a pair seen
    twice would be attention counted twice)."""
    seen = torch.zeros(local_len, held_len, dtype=torch.int32)
    if packed:
        for call in blocks:
            rows = [r for start, n in call.rows for r in range(start, start + n)]
            assert len(rows) == len(set(rows)), "a row twice in one call"
            for (r0, nr), (c0, nc) in zip(call.rows, call.cols, strict=True):
                if call.causal:
                    assert nr == nc, "a causal sequence that is not square"
                    seen[r0:r0 + nr, c0:c0 + nc] += torch.tril(torch.ones(nr, nc, dtype=torch.int32))
                else:
                    seen[r0:r0 + nr, c0:c0 + nc] += 1
        return seen
    for blk in blocks:
        nq, nk = len(range(local_len)[blk.rows]), len(range(held_len)[blk.cols])
        seen[blk.rows, blk.cols] += visible(nq, nk, blk.causal, **blk.mask).int()
    return seen


@pytest.mark.parametrize("ring", [2, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_calls_see_what_the_steps_calls_see(name, causal, ring):
    docs = Documents.from_lengths(LAYOUTS[name])
    plan = layouts.plan_layout("doc-zigzag", docs.seq_len, ring, ring, docs)
    schedule = RunsSchedule([plan.rank_runs(j, ring) for j in range(ring)], causal, plan.docs, pack=True)
    n = plan.local_len
    padding = {i for i, first in enumerate(plan.real) if first < 0}
    doc_of = plan.docs.doc_ids().tolist()
    positions = [[p for start, m in plan.rank_runs(part, ring) for p in range(start, start + m)]
                 for part in range(ring)]  # each ring rank's rows, as global positions
    for rank in range(ring):
        for step in range(ring):
            calls = schedule.packed(step, rank, ring, n)
            pairs = dense(schedule.blocks(step, rank, ring, n), n, n, packed=False)
            assert torch.equal(dense(calls, n, n, packed=True), pairs), (rank, step)
            assert pairs.max() <= 1
            held = (rank - step) % ring
            for call in calls:
                for spans, part in ((call.rows, rank), (call.cols, held)):
                    if isinstance(ringpack.index(spans, n, "cpu"), torch.Tensor) and causal:
                        gathered = {doc_of[positions[part][i]] for start, m in spans for i in range(start, start + m)}
                        assert gathered <= padding, (rank, step, "a real token gathered")
            if not plan.padding:
                # the causal rounds: the whole block's diagonal chunks and the tails against the heads at step 0;
                # from an earlier rank the heads and the tails against the held heads, from a later one the
                # tails against the held heads and tails (unmasked: a third), each in one piece
                assert len(calls) <= (2 if causal else 3), (rank, step, len(calls))
                assert all(not isinstance(ringpack.index(spans, n, "cpu"), torch.Tensor)
                           for call in calls for spans in (call.rows, call.cols)), (rank, step)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", ["many-short", "no-padding"])
def test_all_gathered_keys_pack_into_a_few_calls_per_chunk(name, causal):
    """allgather-kv's one step (``RunsSchedule`` with ``keys``: a rank's queries against the whole sequence
    in layout order) under ``doc-zigzag`` at 4 ranks. The gathered keys are in the ranks' order, so the 2R
    chunks of a document lie apart, each rank's in its head and tail sections: a query section meets each
    earlier chunk's section as a sequence of its own: at most two calls per chunk (4R) under a causal mask,
    whatever the number of documents; where no document needs padding, a call per chunk (one more unmasked),
    every one taking slices. (Unmasked, padding documents shorter than a chunk add stray calls.)"""
    docs = Documents.from_lengths(LAYOUTS[name])
    plan = layouts.plan_layout("doc-zigzag", docs.seq_len, 4, 4, docs)
    for rank in range(4):
        schedule = RunsSchedule([plan.rank_runs(rank)], causal, plan.docs, keys=layouts.merge_runs(list(plan.order)),
                                pack=True)
        calls = schedule.packed(0, rank, 1, plan.local_len)
        pairs = dense(schedule.blocks(0, rank, 1, plan.local_len), plan.local_len, plan.padded_len, packed=False)
        assert torch.equal(dense(calls, plan.local_len, plan.padded_len, packed=True), pairs)
        assert pairs.max() <= 1
        assert not causal or len(calls) <= 4 * 4, len(calls)
        if not plan.padding:
            assert len(calls) <= 2 * 4 + (not causal), len(calls)
            assert all(not isinstance(ringpack.index(spans, total, "cpu"), torch.Tensor) for call in calls
                       for spans, total in ((call.rows, plan.local_len), (call.cols, plan.padded_len)))


def test_the_gather_is_skipped_where_the_rows_are_one_piece():
    assert ringpack.index(((0, 3), (3, 5)), 8, "cpu") is None
    assert ringpack.index(((3, 5), (0, 3)), 8, "cpu").tolist() == [3, 4, 5, 6, 7, 0, 1, 2]
    assert ringpack.index(((0, 3),), 8, "cpu") == slice(0, 3)
    assert ringpack.index(((2, 3), (5, 1)), 8, "cpu") == slice(2, 6)
    assert ringpack.index(((0, 3), (4, 1)), 8, "cpu").tolist() == [0, 1, 2, 4]
    call = ringpack.PackedCall(((0, 3), (5, 2)), ((1, 3), (4, 2)), False)
    assert call.cu_q == [0, 3, 5] and call.cu_k == [0, 3, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_in_place_merge_is_the_merge(dtype):
    """``ringloop._merge_into`` (a packed call's output merged into a slice of the accumulators) against
    ``merge_partials``: rows seen on both sides, on one side only, and on neither (LSE ``-inf``: they stay 0)."""
    from methods.core.kernels import merge_partials
    from methods.core.ringloop import _merge_into

    g = torch.Generator().manual_seed(0)
    out, block = torch.randn(1, 6, 2, 4, generator=g), torch.randn(1, 6, 2, 4, generator=g).to(dtype)
    lse, block_lse = torch.randn(1, 2, 6, generator=g), torch.randn(1, 2, 6, generator=g)
    lse[:, :, 1] = block_lse[:, :, 2] = float("-inf")  # row 1 unseen before, row 2 unseen by the block
    lse[:, :, 3] = block_lse[:, :, 3] = float("-inf")  # row 3 seen by neither
    out[:, 1] = out[:, 3] = 0.0
    want_out, want_lse = merge_partials(out, lse, block, block_lse, may_be_empty=True)
    got_out, got_lse = torch.zeros(1, 8, 2, 4), torch.full((1, 2, 8), float("-inf"))
    got_out[:, 1:7], got_lse[:, :, 1:7] = out, lse
    _merge_into(got_out[:, 1:7], got_lse[:, :, 1:7], block, block_lse)
    torch.testing.assert_close(got_out[:, 1:7], want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse[:, :, 1:7], want_lse)
    assert torch.equal(got_out[:, 4], torch.zeros(1, 2, 4)) and bool(torch.isinf(got_lse[:, :, 4]).all())  # row 3
    assert not got_out[:, [0, 7]].any() and bool(torch.isinf(got_lse[:, :, [0, 7]]).all())  # outside untouched


def test_only_a_kernel_with_a_varlen_form_on_the_device_packs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not kernels.TorchKernel.packs(cpu) and kernels.TorchKernel.packs(cuda)
    assert not hasattr(kernels.MathKernel, "packs")


# What the packed path adds is the same in every ring method (ringloop's gather, merge and scatter); what
# differs is the schedule each hands it: the ring's (ring, and usp's ring dimension, at 2 and 4 ranks), a
# ring kernel's per stage over a 2 x 2 mesh (usp-upipe) and the one-step all-gathered keys (allgather-kv)
PACKED_CASES = {2: [("ring", {}), ("allgather-kv", {})],
                4: [("ring", {}), ("usp", {"ulysses_degree": 2}), ("usp-upipe", {"ulysses_degree": 2})]}


def check_packed(group, runs: list[tuple[str, dict, bool, str]]) -> dict[str, dict]:
    """Each case through the packed calls (a rank's process): relative errors by layout, and how many
    packed and per-pair kernel calls the flash-attn kernel saw."""
    fa = kernels.FlashAttnKernel
    counts = {"varlen": 0, "pairs": 0}
    real_varlen, real_forward = fa.varlen_forward, fa.forward

    def varlen(self, *a, **k):
        counts["varlen"] += 1
        return real_varlen(self, *a, **k)

    def forward(self, *a, **k):
        counts["pairs"] += 1
        return real_forward(self, *a, **k)

    fa.varlen_forward, fa.forward = varlen, forward
    try:
        out = {}
        for name, options, causal, dtype in runs:
            errs = check_documents_against_reference(
                group, name, dict(SPECS["gqa"], causal=causal), {**options, "layout": "doc-zigzag",
                                                                 "kernel": "flash-attn"}, dtype, doc_layouts(dtype))
            out[f"{name}-{options}-{'causal' if causal else 'full'}-{dtype}"] = errs
    finally:
        fa.varlen_forward, fa.forward = real_varlen, real_forward
    return {"errors": out, "calls": counts}


def test_every_ring_method_is_checked_packed():
    ring_family = {name for name in methods.available() if name in ("ring", "usp", "usp-upipe", "allgather-kv")}
    assert {name for cases in PACKED_CASES.values() for name, _ in cases} == ring_family


@pytest.mark.parametrize("ws", [2, 4])
def test_ring_methods_packed_match_the_reference(pool, ws):
    # bf16 adds the rounding of the gathered rows' merges, the same code in every method: the ring's cases
    runs = [(name, options, causal, dtype) for name, options in PACKED_CASES[ws] for causal in (True, False)
            for dtype in ("float32", "bfloat16") if dtype == "float32" or name == "ring"]
    per_rank = pool.run(check_packed, runs, world_size=ws)
    for rank, got in enumerate(per_rank):
        assert got["calls"]["varlen"] > 0 and got["calls"]["pairs"] == 0, (rank, got["calls"])
        for case, by_layout in got["errors"].items():
            tol = TOLERANCE[case.rsplit("-", 1)[1]]
            bad = {lay: {k: v for k, v in errs.items() if not v <= tol} for lay, errs in by_layout.items()}
            assert not any(bad.values()), f"rank {rank} {case}: {bad}"
