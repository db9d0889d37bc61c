"""Packed documents: the layout, the kernels' masking rule, the refusals and the document matrix.

* ``Documents``: derived tensors (``cu_seqlens`` int32, document ids, positions restarting at every
  document), hashable, and one-line refusals of zero/negative lengths and of lengths that do not
  sum to the sequence.
* Kernels with documents (every kernel of methods/core/kernels.py: ``torch`` blockwise on CPU,
  ``math`` with its explicit mask, ``flash-attn`` through the tests' stand-in's varlen functions)
  against a dense fp64 reference built by hand from the rule, for query/key windows anywhere in
  the documents: rows with no visible key give 0 and LSE -inf, and merge as empty sets. The CUDA
  varlen path's packing is checked on meta tensors (the op's shapes), its numbers only on a GPU.
* Bad input: one-line errors before any communication (``methods.validate``, ``shard`` and the
  block call), for methods that refuse documents too.
* The matrix (``cases.doc_cases``): every method x world sizes 1, 2, 4 x MHA/GQA x causal or not x
  fp32/bf16 x its option variants, each case checking its layouts in one run on the ranks (fp32: all
  of ``cases.DOC_LAYOUTS``; bf16: ``cases.DOC_LAYOUTS_BF16``, see ``cases.doc_layouts`` for why):
  output, dx and every weight gradient against the reference with the same documents.
  A method that refuses documents is skipped with its reason; one that honours them but ran no
  case fails. Ids start with ``docs-`` (``pytest tests/methods -k docs``).
"""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest
import torch

import methods
from methods import Documents
from methods.core import kernels
from methods.core.kernels import get_kernel, mask_blocks, merge_partials, softmax_scale, varlen_layout, visible
from methods.core.reference import AttentionBlock
from tests.methods.cases import (
    CUDA_ONLY,
    DOC_LAYOUTS,
    SEQ_LEN,
    SPECS,
    TOLERANCE,
    check_documents_against_reference,
    doc_cases,
    doc_layouts,
    ran_none,
    refusal,
    rel_err,
    summed_grads,
)

METHODS = methods.available()
HONOURING = [m for m in METHODS if methods.get_info(m).cls.honours_documents]
DOC_CASES = list(doc_cases(METHODS))
DOC_CASES_PER_METHOD = Counter(case.values[0] for case in DOC_CASES)
REFUSALS: dict[str, list[str | None]] = defaultdict(list)
# a layout the matrix never checks (item "agrees on a layout it was never tested on")
UNSEEN_LAYOUT = (1, 1, 30, 7, 1, 19, 5)


# ------------------------------------------------------------------------ the layout
def test_documents_derive_cu_seqlens_ids_and_positions():
    docs = Documents.from_lengths([3, 1, 4], seq_len=8)
    assert docs.seq_len == 8 and len(docs) == 3 and docs.starts == (0, 3, 4)
    cu = docs.cu_seqlens()
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 8]
    assert docs.doc_ids().tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert docs.positions().tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert docs.spans(2, 6) == [(0, 2, 3), (1, 3, 4), (2, 4, 6)]
    assert hash(docs) == hash(Documents.from_lengths((3, 1, 4)))
    assert docs == Documents.from_lengths(torch.tensor([3, 1, 4]))
    with pytest.raises(AttributeError):
        docs.lengths = (8,)


@pytest.mark.parametrize("lengths,match", [
    ([3, 0, 5], r"document lengths must be positive ints, got \[0\]"),
    ([3, -2, 7], r"document lengths must be positive ints, got \[-2\]"),
    ([2.5, 5.5], r"document lengths must be positive ints"),
    ([], r"non-empty tuple of document lengths"),
    ([3, 4], r"document lengths sum to 7 but the sequence has 8 tokens; give lengths that sum to 8"),
])
def test_bad_lengths_are_refused_in_one_line(lengths, match):
    with pytest.raises(ValueError, match=match) as err:
        Documents.from_lengths(lengths, seq_len=8)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------ the kernels' rule
def dense(q, k, v, mask, scale):
    """fp64 attention with an explicit mask; rows with no visible key: output 0, LSE -inf."""
    groups = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(groups, dim=1), vf.repeat_interleave(groups, dim=1)
    s = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    return (p @ vf).transpose(1, 2), lse


KERNEL_DOCS = Documents.from_lengths([3, 5, 1, 7, 4, 4])
# (query start, query length, key start, key length) in the 24 positions of KERNEL_DOCS: the whole
# sequence, equal windows before/on/after the diagonal, overlapping, no common document, one token
WINDOWS = [(0, 24, 0, 24), (8, 8, 0, 8), (8, 8, 8, 8), (0, 8, 8, 8), (4, 10, 2, 14), (0, 24, 4, 6),
           (16, 8, 0, 16), (5, 3, 9, 6), (8, 1, 8, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", ["torch", "math", "flash-attn"])
def test_kernels_with_documents_match_the_rule(name, causal, dtype):
    kernel, scale = get_kernel(name), softmax_scale(8)
    gen = torch.Generator().manual_seed(5)
    for qs, sq, ks, sk in WINDOWS:
        q = torch.randn(2, sq, 4, 8, generator=gen).to(dtype).requires_grad_()
        k, v = (torch.randn(2, sk, 2, 8, generator=gen).to(dtype).requires_grad_() for _ in range(2))
        dout = torch.randn(2, sq, 4, 8, generator=gen).to(dtype)
        out, lse = kernels.attention_with_lse(q, k, v, causal, kernel, q_offset=qs - ks, docs=KERNEL_DOCS, k_start=ks)
        mask = visible(sq, sk, causal, qs - ks, KERNEL_DOCS, ks)
        want_out, want_lse = dense(q, k, v, mask, scale)
        got = torch.autograd.grad(out, (q, k, v), dout)
        want = torch.autograd.grad(want_out, (q, k, v), dout.double())
        where = f"{name} window q[{qs}:{qs + sq}] k[{ks}:{ks + sk}]"
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), where
        empty = ~mask.any(1)
        assert not out[:, empty].any() and not got[0][:, empty].any(), where
        seen = torch.isfinite(want_lse)
        lse_err = (lse.double()[seen] - want_lse[seen]).abs().max().item() if seen.any() else 0.0
        errs = [(a.double() - b).abs().max().item() for a, b in zip((out, *got), (want_out, *want), strict=True)]
        assert max(errs + [lse_err]) <= 50 * TOLERANCE[str(dtype).removeprefix("torch.")], (where, errs, lse_err)


def test_mask_blocks_tile_the_rule_exactly():
    """Every window of a small document layout: row ranges cover the rows once, blocks are
    unmasked or causal on a square, and together they are exactly the rule's mask."""
    docs = Documents.from_lengths([2, 3, 1, 2])
    n, ids = docs.seq_len, [0, 0, 1, 1, 1, 2, 3, 3]
    for causal in (True, False):
        # by hand, over global positions: same document, and key <= query when causal
        rule = torch.tensor([[ids[p] == ids[r] and (r <= p or not causal) for r in range(n)] for p in range(n)])
        for qs in range(n):
            for sq in range(1, n - qs + 1):
                for ks in range(n):
                    for sk in range(1, n - ks + 1):
                        covered = torch.zeros(sq, sk, dtype=torch.int64)
                        rows_seen = torch.zeros(sq, dtype=torch.int64)
                        for rows, parts in mask_blocks(sq, sk, causal, qs - ks, docs, ks):
                            rows_seen[rows] += 1
                            for cols, square in parts:
                                block = torch.ones(len(range(sq)[rows]), len(range(sk)[cols]), dtype=torch.int64)
                                if square:
                                    assert block.shape[0] == block.shape[1]
                                    block = block.tril()
                                covered[rows, cols] += block
                        assert (rows_seen == 1).all(), (causal, qs, sq, ks, sk)
                        want = rule[qs : qs + sq, ks : ks + sk]
                        assert torch.equal(covered, want.long()), (causal, qs, sq, ks, sk)
                        if (qs + sq + ks + sk) % 7 == 0:  # the math kernel's explicit mask, on a sample
                            assert torch.equal(visible(sq, sk, causal, qs - ks, docs, ks), want)


def test_varlen_layout_is_one_call_for_the_whole_sequence_only():
    docs = Documents.from_lengths([3, 5, 1, 7])
    for causal in (True, False):
        assert varlen_layout(mask_blocks(16, 16, causal, 0, docs, 0), 16, 16) == ([0, 3, 8, 9, 16],) * 2 + (causal,)
    assert varlen_layout(mask_blocks(8, 8, True, 8, docs, 0), 8, 8) is None  # rows with no key
    assert varlen_layout(mask_blocks(8, 8, False, 8, docs, 0), 8, 8) is None
    assert varlen_layout(mask_blocks(16, 16, True, 0), 16, 16) == ([0, 16], [0, 16], True)


def test_cuda_varlen_packing_has_the_ops_shapes():
    """The torch kernel's CUDA varlen path on meta tensors (the ops' meta functions): packed
    ``[B*S, H, d]`` in, out and grads back in BSHD, the op's LSE ``[H, B*S]`` as ``[B, H, S]``."""
    q = torch.empty(2, 16, 4, 8, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 16, 2, 8, device="meta", dtype=torch.bfloat16)
    cu = [0, 3, 8, 9, 16]
    out, lse = kernels.TorchKernel._varlen_forward(q, k, k, cu, cu, True, 0.25)
    assert out.shape == q.shape and lse.shape == (2, 4, 16) and lse.dtype == torch.float32
    grads = kernels.TorchKernel._varlen_backward(out, q, k, k, out, lse, cu, cu, True, 0.25)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
    assert kernels._batched_cu(cu, 2, "cpu").tolist() == [0, 3, 8, 9, 16, 19, 24, 25, 32]


def test_merge_of_empty_rows_stays_empty():
    out = torch.zeros(1, 2, 1, 4)
    lse = torch.tensor([[[float("-inf"), 0.5]]])
    block_lse = torch.tensor([[[float("-inf"), float("-inf")]]])
    merged, merged_lse = merge_partials(out, lse, torch.zeros(1, 2, 1, 4), block_lse, may_be_empty=True)
    assert not merged.isnan().any() and not merged.any()
    assert merged_lse[0, 0, 0] == float("-inf") and merged_lse[0, 0, 1] == 0.5
    assert merge_partials(out, lse, torch.zeros(1, 2, 1, 4), block_lse)[0].isnan().any()  # why the flag exists


# ------------------------------------------------------------------------ bad input
def test_reference_uses_per_document_positions_and_refuses_a_wrong_total():
    spec = methods.AttnSpec(**SPECS["gqa"])
    ref = AttentionBlock(spec)
    x = torch.randn(1, 16, spec.dim)
    docs = Documents.from_lengths([5, 11])
    assert torch.equal(ref(x, docs=docs), ref(x, positions=docs.positions(), docs=docs))
    # the second document alone, at positions from 0, is what the packed sequence gives for it
    assert torch.allclose(ref(x, docs=docs)[:, 5:], ref(x[:, 5:]), atol=1e-6)
    with pytest.raises(ValueError, match=r"document lengths sum to 16 but the reference block's input has 12 tokens"):
        ref(x[:, :12], docs=docs)


@pytest.mark.parametrize("method", [m for m in METHODS if m not in CUDA_ONLY])
def test_documents_are_checked_before_any_communication(method):
    """At world size 1 (no process group): a method that refuses documents says why in one line from
    ``validate``, ``shard`` and the block call (the last two where it builds without a group); one
    that honours them refuses lengths that do not sum to the sequence, in one line, from ``shard``
    and the block call."""
    cls = methods.get_info(method).cls
    spec = methods.AttnSpec(**SPECS["gqa"])
    try:
        block = methods.build(method, spec)
    except ValueError as err:  # a wrapped library that always communicates through a group
        assert "process group" in str(err), str(err)
        block = None
    x = torch.randn(1, SEQ_LEN, spec.dim)
    if not cls.honours_documents:
        docs = Documents.from_lengths(DOC_LAYOUTS["many-short"], SEQ_LEN)
        calls = [lambda: methods.validate(method, spec, 2, docs=docs)]
        if block is not None:
            calls += [lambda: block.shard(x, 1, docs=docs), lambda: block(x, docs=docs)]
        for call in calls:
            with pytest.raises(ValueError, match=rf"method '{method}' refuses packed documents \(docs=\): ") as err:
                call()
            assert "\n" not in str(err.value) and cls.documents_refusal in str(err.value)
        return
    methods.validate(method, spec, 2, docs=Documents.from_lengths(DOC_LAYOUTS["many-short"]))
    short = Documents.from_lengths([10, 20])
    # a method that builds only on a group: the class's check, which its shard and block call make first
    calls = [lambda: cls.check_documents(short, SEQ_LEN)] if block is None else [
        lambda: block.shard(x, 1, docs=short), lambda: block(x, docs=short)]
    for call in calls:
        with pytest.raises(ValueError, match=r"lengths sum to 30 but the global sequence .* has 64 tokens") as err:
            call()
        assert "\n" not in str(err.value)
    if block is not None:
        with pytest.raises(ValueError, match=r"docs must be a methods.Documents"):
            block(x, docs=[64])


@pytest.mark.parametrize("method", ["ring", "usp", "usp-upipe", "allgather-kv"])
def test_layouts_refuse_what_they_cannot_place_before_any_communication(method):
    """``methods.validate`` (no process group): an unknown layout; ``doc-zigzag`` without padding and
    lengths not divisible by 2R; both in one line naming the fix. With padding the same documents pass
    and the padding is counted (``LayoutPlan.padding``)."""
    spec = methods.AttnSpec(**SPECS["gqa"])
    opts = {"ulysses_degree": 1} if method.startswith("usp") else {}
    with pytest.raises(ValueError, match=r"unknown sequence layout 'striped'; choose one of") as err:
        methods.validate(method, spec, 4, layout="striped", **opts)
    assert "\n" not in str(err.value)
    docs = Documents.from_lengths(DOC_LAYOUTS["not-divisible-by-2C"])
    with pytest.raises(ValueError, match=r"'doc-zigzag' layout cuts every document into 8 chunks, .* allow padding "
                                         r"\(pad=True\)") as err:
        methods.validate(method, spec, 4, docs=docs, layout="doc-zigzag", pad=False, **opts)
    assert "\n" not in str(err.value)
    methods.validate(method, spec, 4, docs=docs, layout="doc-zigzag", **opts)
    from methods.core.layouts import plan_layout

    plan = plan_layout("doc-zigzag", SEQ_LEN, 4, 4, docs)
    assert plan.padding == sum(-n % 8 for n in docs.lengths) and plan.padded_len % 8 == 0
    divisible = Documents.from_lengths([16, 8, 40])
    methods.validate(method, spec, 4, docs=divisible, layout="doc-zigzag", pad=False, **opts)


def check_padding_stays_out(group, lengths: tuple[int, ...]) -> dict:
    """rfa-zigzag on documents its layout pads, with padding rows that are not zeros (a step gives them a token's
    embedding) and a gradient on every row: the padding rows' outputs, and every relative error of the real
    tokens (output, dx, weight gradients) against the reference."""
    torch.manual_seed(7)
    spec, docs = methods.AttnSpec(**SPECS["gqa"]), Documents.from_lengths(lengths)
    block = methods.build("rfa-zigzag", spec, group=group)
    ref = AttentionBlock(spec, kernel="math")
    ref.load_state_dict(block.state_dict())
    x, dy = torch.randn(2, SEQ_LEN, spec.dim), torch.randn(2, SEQ_LEN, spec.dim)
    pad = block.shard(torch.ones(1, SEQ_LEN, 1), 1, docs=docs) == 0  # this rank's padding rows
    x_loc = (block.shard(x, 1, docs=docs) + pad * torch.randn(pad.shape[1], spec.dim)).requires_grad_()
    y_loc = block(x_loc, docs=docs)
    y_loc.backward(block.shard(dy, 1, docs=docs) + pad * torch.randn(pad.shape[1], spec.dim))
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref, docs=docs)
    y_ref.backward(dy)
    errors = {"out": rel_err(block.unshard(y_loc.detach(), 1, docs=docs), y_ref),
              "dx": rel_err(block.unshard(x_loc.grad, 1, docs=docs), x_ref.grad)}
    grads = dict(ref.named_parameters())
    errors.update({name: rel_err(grad, grads[name].grad) for name, grad in summed_grads(block, group).items()})
    return {"padding_rows": int(pad.sum()), "padding_out": y_loc.detach()[pad.expand_as(y_loc)].abs().sum().item(),
            "errors": errors}


@pytest.mark.parametrize("ws", [2, 4])
def test_rfa_zigzag_padding_reaches_no_real_token(pool, ws):
    """ring-flash-attn's varlen zigzag takes each padded document as one sequence (methods/rfa_zigzag.py): the
    padding follows the real tokens, so the causal mask hides it from them, and its outputs are zeroed, so
    neither it nor a gradient it gets reaches a real token."""
    if "rfa-zigzag" not in METHODS:
        pytest.fail("rfa-zigzag is not usable here (the flash-attn stand-in of tests/conftest.py is missing)")
    lengths = DOC_LAYOUTS["not-divisible-by-2C"]
    assert any(n % (2 * ws) for n in lengths)
    per_rank = pool.run(check_padding_stays_out, lengths, world_size=ws)
    assert sum(got["padding_rows"] for got in per_rank) > 0
    for rank, got in enumerate(per_rank):
        assert got["padding_out"] == 0.0, (rank, got)
        bad = {k: v for k, v in got["errors"].items() if not v <= TOLERANCE["float32"]}
        assert not bad, f"rank {rank}: {bad}"


def test_every_own_head_parallel_method_honours_documents():
    assert {"ulysses", "upipe", "no-cp", "offload", "fpdt"} <= set(HONOURING)


def test_every_own_ring_method_honours_documents():
    assert {"ring", "usp", "usp-upipe", "allgather-kv"} <= set(HONOURING)


# ------------------------------------------------------------------------ the matrix
@pytest.mark.parametrize("method,ws,spec,options,dtype", DOC_CASES)
def test_documents_match_reference(pool, method, ws, spec, options, dtype):
    reason = refusal(method, ws, spec, options, docs=Documents.from_lengths(DOC_LAYOUTS["one"]))
    REFUSALS[method].append(reason)
    if reason is not None:
        pytest.skip(f"{method} refuses this case: {reason}")
    layouts = doc_layouts(dtype)
    per_rank = pool.run(check_documents_against_reference, method, spec, options, dtype, layouts, world_size=ws)
    tol = TOLERANCE[dtype]
    for rank, by_layout in enumerate(per_rank):
        assert set(by_layout) == set(layouts)
        bad = {lay: {k: v for k, v in errors.items() if not v <= tol} for lay, errors in by_layout.items()}
        bad = {lay: errs for lay, errs in bad.items() if errs}
        assert not bad, f"rank {rank}: relative errors above {tol} by layout: {bad}"


@pytest.mark.parametrize("method", METHODS)
def test_every_method_ran_a_docs_case(method):
    """After the matrix: a method that honours documents must have run some case; one that refuses
    them is skipped with its reason (a method none of whose cases went through is not judged)."""
    cls = methods.get_info(method).cls
    if not cls.honours_documents:
        pytest.skip(f"{method} refuses documents: {cls.documents_refusal}")
    seen = len(REFUSALS[method])
    if seen < DOC_CASES_PER_METHOD[method]:
        pytest.skip(f"only {seen} of the {DOC_CASES_PER_METHOD[method]} document cases of {method} went "
                    "through the matrix in this session: too few for a verdict")
    failure = ran_none(method, REFUSALS[method])
    assert failure is None, failure


def test_a_layout_never_in_the_matrix_agrees(pool):
    """Every method that honours documents, on ``UNSEEN_LAYOUT`` (single tokens, a document across
    every shard), at 4 ranks, GQA, causal and not (where the method takes both: rfa-zigzag is causal only),
    bf16: all in one run per world size."""
    assert UNSEEN_LAYOUT not in DOC_LAYOUTS.values() and sum(UNSEEN_LAYOUT) == SEQ_LEN
    docs = Documents.from_lengths(UNSEEN_LAYOUT)
    runs = [(name, causal) for name in HONOURING for causal in (True, False)
            if refusal(name, 4, dict(SPECS["gqa"], causal=causal), {}, docs) is None]  # rfa-zigzag: causal only
    assert {name for name, _ in runs} == set(HONOURING)
    results = pool.run(check_unseen_layout, runs, world_size=4)
    for rank, by_case in enumerate(results):
        bad = {case: errs for case, errs in by_case.items() if max(errs.values()) > TOLERANCE["bfloat16"]}
        assert not bad, f"rank {rank}: {bad}"


def check_unseen_layout(group, runs: list[tuple[str, bool]]) -> dict[str, dict]:
    out = {}
    for name, causal in runs:
        errs = check_documents_against_reference(group, name, dict(SPECS["gqa"], causal=causal), {}, "bfloat16",
                                                 {"unseen": UNSEEN_LAYOUT})
        out[f"{name}-{'causal' if causal else 'full'}"] = errs["unseen"]
    return out


def test_a_subclass_whose_forward_takes_no_docs_does_not_inherit_honouring():
    """A method built on an honouring one (the guide's example subclasses Ulysses) but whose own forward has no
    ``docs`` cannot pass documents on: it refuses them in one line instead of failing inside its forward."""
    parent = methods.get_info("ulysses").cls
    assert parent.honours_documents

    class NoDocs(parent):
        def forward(self, x, positions=None):
            return super().forward(x, positions)

    class WithDocs(parent):
        def forward(self, x, positions=None, docs=None):
            return super().forward(x, positions, docs=docs)

    assert not NoDocs.honours_documents and "forward takes no docs=" in NoDocs.documents_refusal
    assert WithDocs.honours_documents and parent.honours_documents
    with pytest.raises(ValueError, match=r"refuses packed documents \(docs=\): its forward takes no docs="):
        NoDocs.check_documents(methods.Documents.from_lengths([4, 4]), 8)


def test_a_block_call_with_the_wrong_share_of_padded_documents_says_how_to_shard():
    """``doc-zigzag``'s block check (``layouts.check_local_share``, rfa-zigzag's too): a rank's input that
    is not the layout's share of the documents is refused in one line naming the shard to use."""
    ring = methods.build("ring", methods.AttnSpec(**SPECS["gqa"], causal=True), layout="doc-zigzag")
    docs = Documents.from_lengths([3, 5, 7])
    ring.check_local_documents(docs, ring.plan(docs.seq_len, docs).local_len)  # the right share passes
    with pytest.raises(ValueError, match=r"^ring: the input has 99 tokens on this rank, but the 'doc-zigzag' "
                                         r"layout of these 15 tokens puts 15 on each rank \(0 padding tokens\); "
                                         r"shard it with the method's shard\(x, dim, docs=docs\)$") as err:
        ring.check_local_documents(docs, 99)
    assert "\n" not in str(err.value)
