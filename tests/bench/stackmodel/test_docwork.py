"""bench.stackmodel.docwork: per-rank attention work under packed documents, counted from the methods' layouts."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

import methods
from bench.cli import main
from bench.model.config import get_config
from bench.stackmodel.docwork import causal_pairs, document_area, rank_work, runs_pairs

SPEC = get_config("tiny-llama").attn_spec(causal=True)
S = 4096
ONE = methods.Documents.from_lengths([S])
# skewed: one long document at the end, many short ones before it (a causal mask leaves the last ranks most work)
SKEWED = methods.Documents.from_lengths([64] * 32 + [S - 64 * 32])
MIXED = methods.Documents.from_lengths([100, 901, 33, 1500, 7, 555, 1000])
SEQUENCE = [("ring", {}), ("ring", {"layout": "contiguous"}), ("ring", {"layout": "doc-zigzag"}),
            ("allgather-kv", {}), ("usp", {"ulysses_degree": 2}), ("usp-upipe", {"ulysses_degree": 2})]
HEADS = ["ulysses", "upipe", "fpdt", "offload"]


def brute(q: tuple[int, int], k: tuple[int, int], causal: bool) -> int:
    return sum(1 for i, j in itertools.product(range(*q), range(*k)) if not causal or j <= i)


@pytest.mark.parametrize("q,k", [((0, 5), (0, 5)), ((3, 9), (0, 4)), ((0, 4), (6, 9)), ((5, 12), (2, 20)),
                                 ((10, 11), (0, 30)), ((2, 2), (0, 3))])
@pytest.mark.parametrize("causal", [True, False])
def test_causal_pairs_counts_every_visible_pair(q, k, causal):
    assert causal_pairs(q, k, causal) == brute(q, k, causal)


@pytest.mark.parametrize("docs", [ONE, SKEWED, MIXED], ids=["one", "skewed", "mixed"])
@pytest.mark.parametrize("method,options", SEQUENCE + [(m, {}) for m in HEADS])
def test_the_ranks_share_exactly_the_documents_area(docs, method, options):
    work = rank_work(method, SPEC, 4, docs, options)
    assert len(work.pairs) == 4
    if work.padding:  # a padding layout computes its padding documents too
        assert sum(work.pairs) > document_area(docs) * SPEC.n_heads
    else:
        assert sum(work.pairs) == document_area(docs) * SPEC.n_heads
    if work.steps is not None:  # a ring's steps add up to each rank's work
        assert [sum(s) for s in work.steps] == list(work.pairs)
        assert work.step_imbalance >= work.imbalance - 1e-12


@pytest.mark.parametrize("docs", [ONE, SKEWED, MIXED], ids=["one", "skewed", "mixed"])
def test_rfa_zigzag_with_documents_does_ring_doc_zigzag_work(docs):
    """rfa-zigzag places documents by the per-document zigzag (its ``documents_plan``), not its global zigzag."""
    got, want = rank_work("rfa-zigzag", SPEC, 4, docs), rank_work("ring", SPEC, 4, docs, {"layout": "doc-zigzag"})
    assert (got.layout, got.pairs, got.steps, got.padding) == (want.layout, want.pairs, want.steps, want.padding)
    assert got.pairs != rank_work("ring", SPEC, 4, docs).pairs or docs == ONE


def test_runs_pairs_is_the_sum_over_query_tokens():
    runs = [(90, 30), (1000, 20)]
    want = sum(p - MIXED.starts[d] + 1 for s, n in runs for p in range(s, s + n)
               for d in [max(i for i, st in enumerate(MIXED.starts) if st <= p)])
    assert runs_pairs(runs, None, MIXED) == want


def test_the_zigzag_ring_is_unbalanced_under_skewed_documents_and_head_parallel_is_not():
    zigzag = rank_work("ring", SPEC, 4, SKEWED)
    assert rank_work("ring", SPEC, 4, ONE).imbalance == pytest.approx(1.0)  # balanced for one sequence
    assert zigzag.imbalance > 1.2
    assert rank_work("ring", SPEC, 4, SKEWED, {"layout": "doc-zigzag"}).imbalance < zigzag.imbalance
    assert rank_work("allgather-kv", SPEC, 4, SKEWED).imbalance == pytest.approx(zigzag.imbalance)
    for method in HEADS + ["no-cp"]:
        assert rank_work(method, SPEC, 4, SKEWED).imbalance == 1.0
    assert rank_work("ring", SPEC, 4, ONE, {"layout": "contiguous"}).imbalance > 1.5  # the last rank: 7/4 of the mean
    idle = zigzag.idle_s(1e12)
    assert idle == pytest.approx((max(zigzag.flops) - sum(zigzag.flops) / 4) / 1e12)


def test_a_simulated_row_with_documents_records_the_work_and_the_slowest_rank(capsys, tmp_path):
    """Two blocks of ``tiny-llama`` (its attention, as ``SPEC``): the row's work is every block's."""
    layers = 2
    model = tmp_path / "tiny-llama-2l.json"
    model.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": layers}))
    args = ["run", "--method", "ring", "--model", str(model), "--seq-len", "4K", "--world-size", "4", "--json"]
    assert main(args + ["--docs-lengths", ",".join(map(str, SKEWED.lengths))]) == 0
    assert main(args) == 0
    docs_row, plain_row = (json.loads(line) for line in capsys.readouterr().out.strip().splitlines()[-2:])
    work = docs_row["figures"]["doc_work"]
    want = rank_work("ring", SPEC, 4, SKEWED, n_layers=layers)
    assert work["pairs"] == list(want.pairs) and work["imbalance"] == pytest.approx(want.imbalance, rel=1e-6)
    assert work["idle_s"] > 0 and work["slowest_rank"] == want.slowest_rank
    assert any(n.startswith("docs: the modelled step") for n in docs_row["notes"])
    assert "doc_work" not in plain_row["figures"]


@pytest.mark.parametrize("simulated", [0, 2])
def test_the_slowest_ranks_attention_is_carried_from_the_simulated_rank(simulated):
    """A simulated row's counts are those of the rank it simulated, the worst (``Measurement.rank``): the
    step's attention is carried from that rank's pairs to the slowest rank's, not from rank 0's."""
    from bench.measure.result import Measurement
    from bench.measure.run import build_row
    from bench.measure.trial import Trial
    from bench.stackmodel.counts import StepCounts
    from records.workloads import DocsSpec

    trial = Trial.make("ring", "tiny-llama", S, 4, mode="simulated", docs=DocsSpec(lengths=SKEWED.lengths))
    want = rank_work("ring", SPEC, 4, SKEWED, n_layers=get_config("tiny-llama").n_layers)
    counts = StepCounts(flops_attention=1e12)
    result = Measurement(status="ok", peak_bytes=1 << 30, host_peak_bytes=0, step_counts=counts, rank=simulated)
    row = build_row(trial, result, 1.0)
    [note] = [n for n in row.notes if "slowest rank's attention" in n]
    ratio = max(want.pairs) / want.pairs[simulated]
    assert f"({ratio:.3f} x the simulated rank {simulated}'s counted attention FLOPs" in note, note


def test_the_slowest_ranks_own_attention_is_taken_where_it_was_simulated():
    """Every rank of a ring simulated (the worst by memory is not the slowest): the trial's counts take the
    slowest rank's own attention FLOPs and varlen excess, everything else the worst rank's, and the row's step
    uses them as they are (the excess goes by the calls' document lengths: carrying it by pairs from another
    rank would not give the slowest rank's)."""
    from bench.measure.result import Measurement
    from bench.measure.run import build_row, worst_of
    from bench.measure.trial import Trial
    from bench.stackmodel.counts import StepCounts
    from records.workloads import DocsSpec

    trial = Trial.make("ring", "tiny-llama", S, 4, mode="simulated", docs=DocsSpec(lengths=SKEWED.lengths))
    slow = rank_work("ring", SPEC, 4, SKEWED, n_layers=get_config("tiny-llama").n_layers).slowest_rank
    worst = (slow + 1) % 4  # the largest peak

    def rank(r: int) -> Measurement:
        counts = StepCounts(flops_matmul=1e12 + r, flops_attention=1e11 * (r + 1),
                            flops_attention_varlen_excess=1e9 * r)
        return Measurement(status="ok", peak_bytes=(2 if r == worst else 1) << 30, host_peak_bytes=0,
                           step_counts=counts)

    out = worst_of(trial, {r: rank(r) for r in range(4)})
    assert (out.rank, out.attention_rank) == (worst, slow)
    assert out.step_counts.flops_matmul == 1e12 + slow  # the slowest rank's other terms too: one rank's step
    assert (out.step_counts.flops_attention, out.step_counts.flops_attention_varlen_excess) == (1e11 * (slow + 1),
                                                                                              1e9 * slow)
    row = build_row(trial, out, 1.0)
    assert row.figures.step_time_model["counts"]["flops.attention"] == 1e11 * (slow + 1)  # not carried again
    [note] = [n for n in row.notes if "the slowest rank's, rank" in n]
    assert f"rank {slow}'s own counts" in note and f"the peaks are rank {worst}'s, the worst by memory" in note
    alone = worst_of(trial, {slow: rank(slow), worst: rank(worst)})  # also where only some ranks were simulated
    assert alone.attention_rank == slow
    carried = worst_of(trial, {r: rank(r) for r in range(4) if r != slow})  # the slowest not simulated: carried
    assert carried.attention_rank is None
    usp = Trial.make("usp", "tiny-llama", S, 4, mode="simulated", options={"ulysses_degree": 2},
                     docs=DocsSpec(lengths=SKEWED.lengths))
    pairs = rank_work("usp", SPEC, 4, SKEWED, {"ulysses_degree": 2}).pairs
    top = [r for r in range(4) if pairs[r] == max(pairs)]
    low = next(r for r in range(4) if pairs[r] < max(pairs))
    simulated = {low: rank(low), top[-1]: dataclasses.replace(rank(top[-1]), peak_bytes=1)}  # as a mesh's positions
    assert len(top) == 2 and worst_of(usp, simulated).attention_rank == top[-1]  # a rank with the same pairs
    one_sequence = Trial.make("ring", "tiny-llama", S, 4, mode="simulated")
    assert worst_of(one_sequence, {r: rank(r) for r in range(4)}).attention_rank is None
