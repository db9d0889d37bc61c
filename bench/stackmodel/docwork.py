"""Per-rank attention work under packed documents: what each rank computes, and the imbalance.

A causal document mask leaves query ``i`` the keys ``j <= i`` of its own document, so the work of a
rank is the number of such (query, key) pairs among the queries it attends for, times the heads it
attends them for. Counted here from the documents and the method's layout, never from a simulation:

* **sequence-sharded methods** (``ring``, ``usp``/``usp-upipe``'s ring, ``allgather-kv``, and the
  wrappers with a fixed zigzag layout; with documents, a wrapper's ``documents_plan`` where it has one,
  ``rfa-zigzag``'s per-document zigzag): ring rank ``j`` attends for the queries of its part of the
  layout (``methods.core.layouts.LayoutPlan.rank_runs``, the runs of global positions the method
  itself shards by; a padding layout's padded documents included, which the kernels compute too)
  against every key of their documents, for ``H / u`` heads (``u`` the Ulysses degree; 1 for a
  pure ring). A ring (every method with more than one ring rank but ``allgather-kv``) splits that
  work into steps: at step ``t`` ring rank ``j`` holds the K/V of ring rank ``(j - t) mod R``
  (``methods.core.ringloop``), and ``steps`` holds each rank's pairs per step;
* **head-parallel methods** (``ulysses``, ``upipe``, ``fpdt``, ``offload``, ``ds-ulysses-hf``):
  every rank holds whole sequences for ``H / C`` heads, so each computes the whole sequence's area
  for its heads: balanced by construction; ``no-cp`` computes all of it, all heads, on every rank.

The layout comes from the method (``SequenceLayoutMethod.plan``'s ``plan_layout`` with the method's
own ring size and options), so a new layout needs no change here.

``imbalance`` is the slowest rank's work over the mean; the other ranks wait for the slowest at the
step's next collective, each for its shortfall: ``idle_s`` is the mean of those waits, at an attention
rate (FLOP/s) the caller gives (``bench.stackmodel.steptime``'s, for a modelled row). A ring waits at
every step for the K/V block from its neighbour; ``step_imbalance`` is the sum over steps of each
step's slowest rank over the mean rank's total, the bound when every step waits (the paper's ring
barriers make it so).

Pairs count a causal flash kernel's work; FLOPs per pair and head are ``4 d`` forward and ``10 d``
backward (torch's ``sdpa_flop_count``/``sdpa_backward_flop_count`` per (query, key) pair), so
``flops`` is forward + backward of every layer, recomputation left out (the ratios do not depend on it).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import methods
from methods.core.base import AttentionMethod, ZigzagLayoutMethod
from methods.core.documents import Documents
from methods.core.layouts import LayoutPlan, Run, plan_layout
from methods.core.seqlayout import SequenceLayoutMethod, layout_of, pad_of
from methods.core.spec import AttnSpec

# a simulated row's note when the step time waits for the slowest rank (bench.measure.run.build_row): its attention
# carried over from the simulated rank by pairs, or the slowest rank's own counts where it was simulated; the rates
_RATES = ("the flash op's varlen calls at their rate measured by document length and heads per call "
          "(bench.stackmodel.varlenrate), blockwise calls at the dense one")
NOTE = ("docs: the modelled step takes the slowest rank's attention, rank {rank}'s ({ratio:.3f} x the simulated "
        "rank {simulated}'s counted attention FLOPs; bench.stackmodel.docwork); " + _RATES)
NOTE_OWN = ("docs: the modelled step is the slowest rank's, rank {rank}'s own counts (its attention FLOPs and their "
            "varlen excess, and the rest of its step; simulated; the peaks are rank {worst}'s, the worst by memory; "
            "bench.stackmodel.docwork); " + _RATES)
FLOPS_PER_PAIR_PER_HEAD_DIM = 4 + 10  # forward 4·d, backward 10·d per (query, key) pair and head


def _prefix(m: int, width: int) -> int:
    """``sum_{x=0}^{m-1} min(x + 1, width)`` for ``m >= 0``: the causal pairs of ``m`` queries from the
    first key of a key run of ``width`` keys."""
    if m <= 0:
        return 0
    if m <= width:
        return m * (m + 1) // 2
    return width * (width + 1) // 2 + (m - width) * width


def causal_pairs(q: tuple[int, int], k: tuple[int, int], causal: bool = True) -> int:
    """(query, key) pairs with key ``<=`` query between query positions ``[q0, q1)`` and key positions
    ``[k0, k1)`` (all pairs when not ``causal``); the runs lie in one document."""
    (q0, q1), (k0, k1) = q, k
    if q1 <= q0 or k1 <= k0:
        return 0
    if not causal:
        return (q1 - q0) * (k1 - k0)
    width = k1 - k0
    return _prefix(q1 - k0, width) - _prefix(q0 - k0, width)


def document_area(docs: Documents, causal: bool = True) -> int:
    """The whole sequence's pairs under the document mask: ``sum l (l + 1) / 2`` (causal)."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in docs.lengths)


def _by_doc(runs: list[Run], docs: Documents) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for start, n in runs:
        for d, lo, hi in docs.spans(start, start + n):
            out[d].append((lo, hi))
    return out


def runs_pairs(queries: list[Run], keys: list[Run] | None, docs: Documents, causal: bool = True) -> int:
    """Pairs of ``queries`` (runs of global positions) with ``keys`` (None: every key of their
    documents) under the document mask."""
    qs = _by_doc(queries, docs)
    ks = _by_doc(keys, docs) if keys is not None else None
    total = 0
    for d, pieces in qs.items():
        whole = [(docs.starts[d], docs.starts[d] + docs.lengths[d])]
        for kr in (ks.get(d, []) if ks is not None else whole):
            total += sum(causal_pairs(qr, kr, causal) for qr in pieces)
    return total


@dataclass(frozen=True)
class RankWork:
    """Each rank's attention work under one method, layout and set of documents (module docstring)."""

    method: str
    layout: str  # the sequence layout, or "heads" for a head-parallel method
    pairs: tuple[int, ...]  # per rank: causal-within-document (query, key) pairs x heads attended
    flops: tuple[float, ...]  # per rank: attention FLOPs, forward + backward, every layer
    steps: tuple[tuple[int, ...], ...] | None = None  # ring methods: per rank, pairs x heads per ring step
    padding: int = 0  # tokens a padding layout adds (their documents' pairs are in ``pairs``)

    @property
    def imbalance(self) -> float:
        """The slowest rank's work over the mean (1: balanced)."""
        mean = sum(self.pairs) / len(self.pairs)
        return max(self.pairs) / mean if mean else 1.0

    @property
    def step_imbalance(self) -> float | None:
        """A ring's sum over steps of each step's slowest rank, over the mean rank's total (None: no ring)."""
        if self.steps is None:
            return None
        mean = sum(self.pairs) / len(self.pairs)
        bound = sum(max(rank[t] for rank in self.steps) for t in range(len(self.steps[0])))
        return bound / mean if mean else 1.0

    @property
    def slowest_rank(self) -> int:
        return max(range(len(self.pairs)), key=self.pairs.__getitem__)

    def idle_s(self, flops_per_s: float) -> float:
        """The mean time the other ranks wait for the slowest one's attention, at ``flops_per_s``."""
        top = max(self.flops)
        return sum(top - f for f in self.flops) / len(self.flops) / flops_per_s

    def to_dict(self, flops_per_s: float | None = None) -> dict[str, Any]:
        """The row's form (``records.schema.Figures.doc_work``); ``idle_s`` when a rate is given."""
        d = asdict(self)
        d["pairs"], d["flops"] = list(self.pairs), list(self.flops)
        d["steps"] = [list(s) for s in self.steps] if self.steps is not None else None
        d["imbalance"] = round(self.imbalance, 6)
        d["step_imbalance"] = round(self.step_imbalance, 6) if self.steps is not None else None
        d["slowest_rank"] = self.slowest_rank
        if flops_per_s:
            d["idle_s"] = self.idle_s(flops_per_s)
        return {k: v for k, v in d.items() if v is not None}


def _plan(cls: type[AttentionMethod], spec: AttnSpec, world_size: int, options, docs: Documents) -> \
        tuple[LayoutPlan, int, str]:
    """(plan, ring size, layout name) of a sequence-sharded method."""
    if issubclass(cls, SequenceLayoutMethod):
        ring = cls.ring_size_of(world_size, options, spec)
        layout = layout_of(options)
        return plan_layout(layout, docs.seq_len, ring, world_size, docs, pad_of(options), cls.method_name), ring, \
            layout
    plan_of = getattr(cls, "documents_plan", None)  # a wrapper whose library places documents itself
    if plan_of is not None:
        return plan_of(world_size, docs), world_size, "doc-zigzag"
    return plan_layout("zigzag", docs.seq_len, world_size, world_size, None, True, cls.method_name), world_size, \
        "zigzag"


def rank_work(method: str, spec: AttnSpec, world_size: int, docs: Documents, options: dict | None = None,
              n_layers: int = 1, batch: int = 1) -> RankWork:
    """Each rank's attention work for ``method`` (its options as for ``methods.build``) on ``docs``."""
    cls = methods.get_info(method).cls
    opts = cls.parse_options(**(options or {}))
    cls.validate(spec, world_size, opts)
    flop = FLOPS_PER_PAIR_PER_HEAD_DIM * spec.head_dim * n_layers * batch
    if not issubclass(cls, (SequenceLayoutMethod, ZigzagLayoutMethod)):
        heads = spec.n_heads if not cls.splits_sequence else spec.n_heads // world_size
        pairs = (document_area(docs, spec.causal) * heads,) * world_size
        return RankWork(method, "heads", pairs, tuple(float(p * flop) for p in pairs))
    plan, ring, layout = _plan(cls, spec, world_size, opts, docs)
    pdocs = plan.docs if plan.docs is not None else docs
    heads = spec.n_heads * ring // world_size  # H / u, u = C / R ranks per Ulysses group
    parts = [plan.rank_runs(j, ring) for j in range(ring)]
    per_ring = [runs_pairs(parts[j], None, pdocs, spec.causal) * heads for j in range(ring)]
    steps = None
    if ring > 1 and getattr(cls, "passes_kv_by_steps", True):
        steps = tuple(tuple(runs_pairs(parts[j], parts[(j - t) % ring], pdocs, spec.causal) * heads
                            for t in range(ring)) for j in range(ring))
    # a ring rank's part is split contiguously over the next u = C / R ranks (methods.core.seqlayout), which
    # share its queries by heads: world rank r does ring rank r // u's work
    u = world_size // ring
    rank_of = [r // u for r in range(world_size)]
    pairs = tuple(per_ring[j] for j in rank_of)
    return RankWork(method, layout, pairs, tuple(float(p * flop) for p in pairs),
                    tuple(steps[j] for j in rank_of) if steps is not None else None, plan.padding)



def trial_work(trial) -> RankWork | None:
    """The per-rank work of a trial (``bench.measure.trial.Trial``) with documents (None without): its
    method and options, its model's attention, every layer and batch row."""
    docs = trial.documents()
    if docs is None:
        return None
    cfg = trial.config()
    return rank_work(trial.method, cfg.attn_spec(causal=True), trial.world_size, docs, trial.opts,
                     n_layers=cfg.n_layers if trial.step.scope == "model" else 1, batch=trial.step.batch)
