"""A simulation decides on the worst rank (``bench.measure.run.measure_worst_rank``).

A ring trial's row reports the worst of its simulated ranks: each rank is simulated here on its own
(``measure_simulated(rank=r)``) and the row's ``worst_rank``, ``rank_peaks`` and figures must be what
those say. A method whose ranks are symmetric (``rank_symmetric_reason``) is simulated once, and its
row says why. The layer-extrapolated runner extrapolates each rank and takes the worst. The choice of
the worst on hand-made measurements, and the rows: the new figures are omitted when absent (an old
row re-serialises as it was) and checked when present.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

import methods
from bench.measure import run as run_mod
from bench.measure.config import StepConfig
from bench.measure.result import AllocatorReplay, Measurement
from bench.measure.run import deciding_ranks, judged_peak, measure_simulated, run_trial, worst_of
from bench.measure.trial import Trial
from bench.model.config import get_config
from bench.search import extrapolate as extrapolate_mod
from bench.search.extrapolate import layer_extrapolated_runner
from methods.usp import USP
from records import RowError, validate_row

WORLD = 4
SEQ = 4096


def _ring(model: str = "tiny-llama", seq_len: int = SEQ, method: str = "torch-cp") -> Trial:
    """A ring-family trial whose ranks differ: torch-cp's last rank holds more than its first at this size."""
    return Trial.make(method, model, seq_len, WORLD, mode="simulated", device="h100-80g",
                      step=StepConfig(stack="paper"))


@pytest.fixture(autouse=True)
def every_deciding_rank(monkeypatch):
    """This module checks the worst-rank path, which the rest of the suite turns off (tests/conftest.py)."""
    monkeypatch.setenv("CPAB_SIM_RANKS", "deciding")


@pytest.fixture(scope="module")
def ring_ranks() -> dict[int, Measurement]:
    """Each rank of ``_ring()`` simulated on its own, once per module, with its allocation trace (the
    larger simulation of a layer extrapolation keeps it: ``simulated_pair``): the ranks of the row
    below, and the 4-layer simulations of the layer extrapolation test (its model's 4-layer variant is
    ``tiny-llama``'s config, which that test checks before it answers from these)."""
    trial = _ring()
    trial.validate()
    return {r: measure_simulated(trial, keep_trace=True, rank=r) for r in range(WORLD)}


def test_a_ring_row_reports_its_worst_rank(monkeypatch, ring_ranks):
    """Each rank simulated on its own (``ring_ranks``); the row's simulation of the same trial and rank
    reads those (each asked for once, nothing else simulated), so the row is built from exactly these ranks."""
    trial = _ring()
    each = ring_ranks
    expected = [[r, judged_peak(trial, m)] for r, m in each.items()]
    worst = max(range(WORLD), key=lambda r: (expected[r][1], each[r].host_peak_bytes or 0, -r))
    asked: list[int] = []

    def simulated_above(t, keep_trace=False, rank=0):
        assert t == trial and not keep_trace, (t, keep_trace)
        asked.append(rank)
        return dataclasses.replace(each[rank])

    monkeypatch.setattr(run_mod, "measure_simulated", simulated_above)
    row = run_trial(trial)
    assert asked == list(range(WORLD)), "the row did not simulate every rank once"
    assert row.status == "ok", row.message
    assert len({p for _, p in expected}) > 1, "the ranks of this case no longer differ: pick one whose ranks do"
    assert row.figures.rank_peaks == expected
    assert row.figures.worst_rank == worst
    assert max(max(m.peak_reserved_bytes, m.peak_bytes) for m in each.values()) \
        == max(row.figures.peak_reserved_bytes, row.figures.peak_bytes)
    assert row.figures.peak_bytes == each[worst].peak_bytes
    assert row.figures.peak_reserved_bytes == each[worst].peak_reserved_bytes
    assert any(f"the worst rank's, rank {worst}" in n for n in row.notes)
    validate_row(row)


def test_a_symmetric_method_is_simulated_once(monkeypatch):
    ranks: list[int] = []

    def counted(trial, keep_trace=False, rank=0):
        ranks.append(rank)
        return measure_simulated(trial, keep_trace, rank)

    monkeypatch.setattr(run_mod, "measure_simulated", counted)
    row = run_trial(Trial.make("ulysses", "tiny-llama", SEQ, WORLD, mode="simulated", device="h100-80g"))
    assert row.status == "ok", row.message
    assert ranks == [0]
    assert row.figures.worst_rank == 0 and row.figures.rank_peaks is None
    reason = methods.get_info("ulysses").cls.rank_symmetric_reason
    assert reason and any(f"alone (its ranks are symmetric: {reason})" in n for n in row.notes)


def test_every_method_declares_its_deciding_ranks():
    spec = get_config("tiny-llama").attn_spec()
    for info in methods.all_infos():
        ranks = info.cls.deciding_ranks(8, info.cls.Options(), spec)
        if info.cls.rank_symmetric_reason is not None:
            assert ranks == (0,), info.name
        elif issubclass(info.cls, USP):  # one rank per ring position
            u, _ = info.cls.degrees(spec, 8, info.cls.Options())
            assert ranks == tuple(range(0, 8, u)), info.name
        else:
            assert ranks == tuple(range(8)), info.name
    assert methods.get_info("ring").cls.rank_symmetric_reason is None
    assert methods.get_info("upipe").cls.rank_symmetric_reason is not None
    assert USP.deciding_ranks(8, USP.Options(ulysses_degree=2), spec) == (0, 2, 4, 6)
    assert USP.deciding_ranks(8, USP.Options()) == tuple(range(8))  # the default degree needs the spec


def _memory(m: Measurement) -> tuple:
    return m.status, m.peak_bytes, m.peak_reserved_bytes, m.peak_by_category, m.host_peak_bytes


@pytest.fixture(scope="module")
def three_blocks(tmp_path_factory) -> str:
    """``tiny-llama`` with three blocks, as a model file, for the symmetry checks: a first, a middle and
    a last block, so every checkpoint placement a stack makes (a kept first block, offloaded middle
    ones, a last block kept or not), where each further block is one more of the same per rank."""
    path = tmp_path_factory.mktemp("models") / "tiny3.json"
    path.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": 3}))
    return str(path)


@pytest.mark.parametrize("method", ["ulysses", "upipe", "fpdt", "offload", "no-cp"])
def test_a_symmetric_method_holds_the_same_on_every_rank(method, three_blocks):
    trial = Trial.make(method, three_blocks, SEQ, WORLD, mode="simulated", device="h100-80g")
    trial.validate()
    first = _memory(measure_simulated(trial, rank=0))
    assert first[0] == "ok"
    assert _memory(measure_simulated(trial, rank=WORLD - 1)) == first


def test_the_ranks_of_a_usp_ulysses_group_hold_the_same(three_blocks):
    trial = Trial.make("usp", three_blocks, SEQ, WORLD, {"ulysses_degree": 2}, mode="simulated",
                       device="h100-80g")
    trial.validate()
    each = [_memory(measure_simulated(trial, rank=r)) for r in range(WORLD)]
    assert each[0] == each[1] and each[2] == each[3]
    assert deciding_ranks(trial) == (0, 2)


def test_a_ranks_collectives_are_placed_from_its_own_node():
    """USP's Ulysses groups of 8 on 16 ranks (two nodes of 8): rank 8's group is ranks 8-15, all in rank
    8's node, so its all-to-alls go over NVLink as rank 0's do (counted from rank 0's node, they had no
    member in it and went over InfiniBand)."""
    trial = Trial.make("usp", "tiny-llama", SEQ, 16, {"ulysses_degree": 8}, mode="simulated", device="h100-80g")
    trial.validate()
    kinds = {r: {k for k in measure_simulated(trial, rank=r).step_counts.collectives if k.op == "all_to_all"}
             for r in (0, 8)}
    assert kinds[0] and kinds[8] == kinds[0] and {(k.size, k.in_node) for k in kinds[8]} == {(8, 8)}


@pytest.fixture(scope="module")
def shallow_ring(ring_ranks, tmp_path_factory):
    """``_ring()`` on a 6-layer tiny model, and ``simulated(trial, keep_trace, rank)``: each rank's 3- and
    4-layer simulations of it, once per module, recorded in ``simulated.asked`` as (layers, rank). The
    4-layer ones are ``_ring()``'s ranks (``ring_ranks``: the same trial, config and rank), the 3-layer ones
    simulated here with their traces the first time a test asks (the runner's and the planner's layer
    extrapolations ask for the same ones)."""
    path = tmp_path_factory.mktemp("ring6") / "tiny6.json"
    path.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": 6}))
    three: dict[int, Measurement] = {}

    def simulated(trial, keep_trace=False, rank=0):
        layers = trial.config().n_layers
        simulated.asked.append((layers, rank))
        if layers == 4:  # the module's simulation of this very trial and rank, trace included
            assert trial.config().to_dict() == get_config("tiny-llama").to_dict()
            assert dataclasses.replace(trial, model="tiny-llama") == _ring()
            return dataclasses.replace(ring_ranks[rank])
        assert layers == 3 and dataclasses.replace(trial, model="x") == dataclasses.replace(_ring(), model="x")
        if rank not in three:
            three[rank] = measure_simulated(trial, True, rank)
        return dataclasses.replace(three[rank])

    simulated.asked = []
    return _ring(str(path)), simulated


def test_layer_extrapolation_takes_the_worst_extrapolated_rank(tmp_path, monkeypatch, shallow_ring):
    """The runner extrapolates each rank from its own 3- and 4-layer simulations and takes the worst
    (``shallow_ring``'s, asked for and recorded here as the runner asks for them)."""
    trial, simulated = shallow_ring
    simulated.asked.clear()
    per_rank, pair = {}, extrapolate_mod.simulated_pair

    def recorded(trial, how, directory, rank=0):  # each rank's own 3- and 4-layer simulations, extrapolated
        shallow, out = pair(trial, how, directory, rank)
        per_rank[rank] = (shallow, out)
        return shallow, out

    monkeypatch.setattr(extrapolate_mod, "simulated_pair", recorded)
    monkeypatch.setattr(extrapolate_mod, "measure_simulated", simulated)
    row = layer_extrapolated_runner(str(tmp_path))(trial)
    assert row.status == "ok", row.message
    assert sorted(per_rank) == list(range(WORLD))
    assert simulated.asked == [(n, r) for r in range(WORLD) for n in (3, 4)]  # each rank's own simulations
    for shallow, out in per_rank.values():  # extrapolated from them
        assert out.peak_bytes == shallow[0].peak_bytes + (shallow[1].peak_bytes - shallow[0].peak_bytes) * 3
    judged = {r: judged_peak(trial, out) for r, (_, out) in per_rank.items()}
    assert row.figures.rank_peaks == [[r, judged[r]] for r in range(WORLD)]
    assert max(row.figures.peak_reserved_bytes, row.figures.peak_bytes) == max(judged.values())
    assert row.figures.peak_bytes == per_rank[row.figures.worst_rank][1].peak_bytes


def test_the_planner_takes_the_worst_extrapolated_rank(tmp_path, monkeypatch, shallow_ring):
    """``bench plan``'s points (``plan.extrapolated``) decide on the same rank, with the same figures, as the
    runner's row of the same trial: each rank extrapolated from its own 3- and 4-layer simulations (the
    module's), and the worst of them; a point's per-layer increments are each rank's own."""
    from bench.measure.run import budgeted_peak
    from bench.search import plan as plan_mod

    trial, simulated = shallow_ring
    monkeypatch.setattr(plan_mod, "_CACHE", None)
    monkeypatch.setattr(extrapolate_mod, "measure_simulated", simulated)
    row = layer_extrapolated_runner(str(tmp_path))(trial)
    monkeypatch.setattr(plan_mod, "measure_simulated", simulated)
    simulated.asked.clear()
    point = plan_mod.extrapolated(trial, str(tmp_path))
    assert sorted(simulated.asked) == sorted((n, r) for r in range(WORLD) for n in (3, 4))
    assert point.status == row.status == "ok" and point.exact
    assert point.rank == row.figures.worst_rank and len({p for _, p in row.figures.rank_peaks}) > 1
    assert point.peak_bytes == budgeted_peak(trial, row.figures)[1] == max(p for _, p in row.figures.rank_peaks)
    assert point.host_peak_bytes == row.figures.host_peak_bytes
    assert point.row.figures.peak_bytes == row.figures.peak_bytes
    assert sorted(point.slope) == list(range(WORLD)) and point.slope[0] != point.slope[point.rank]
    # a longer point on these increments simulates each rank's 3-layer step only
    simulated.asked.clear()
    longer = plan_mod.extrapolated(trial, str(tmp_path), slope=point.slope)
    assert not longer.exact and longer.peak_bytes == point.peak_bytes and sorted(simulated.asked) == \
        [(3, r) for r in range(WORLD)]


def test_the_planner_simulates_one_rank_of_a_symmetric_method(tmp_path, monkeypatch):
    """UPipe's ranks are symmetric: the planner asks for rank 0's simulations only, and its cache key of a
    rank other than 0 names that rank, while rank 0's stays as committed."""
    from bench.search import plan as plan_mod

    path = tmp_path / "tiny6.json"
    path.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": 6}))
    trial = Trial.make("upipe", str(path), SEQ, WORLD, mode="simulated", step=StepConfig(stack="lean"))
    asked: list[tuple[int, int]] = []
    fake = Measurement(status="ok", peak_bytes=1 << 30, host_peak_bytes=0)

    def simulated(t, keep_trace=False, rank=0):
        asked.append((t.config().n_layers, rank))
        return dataclasses.replace(fake, peak_bytes=fake.peak_bytes + t.config().n_layers)

    monkeypatch.setattr(plan_mod, "_CACHE", None)
    monkeypatch.setattr(plan_mod, "measure_simulated", simulated)
    point = plan_mod.extrapolated(trial, str(tmp_path))
    assert asked == [(3, 0), (4, 0)] and point.rank == 0 and sorted(point.slope) == [0]
    key = plan_mod.SimCache.key
    assert "rank" not in json.loads(key(trial, "tiny6", 3)) and json.loads(key(trial, "tiny6", 3, 2))["rank"] == 2


def test_the_planners_search_probes_on_the_worst_rank_and_ends_exact_on_every_rank(tmp_path, monkeypatch):
    """``plan.search_max`` probes on the worst rank of the latest point simulated on every rank, and makes its
    bracket's ends exact on every rank: the answer is the worst rank's, not rank 0's, from fewer simulations than
    every rank at every probe. Made-up figures: a ring whose rank 2 holds the most (as the zigzag ring's middle
    ranks do), on a device where rank 2 fits 10 steps and rank 0 would fit 15."""
    from bench.search import plan as plan_mod
    from bench.stackmodel import hardware

    path = tmp_path / "tiny6.json"
    path.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": 6}))
    extra = {0: 0, 1: 1, 2: 3, 3: 1}  # MiB per step beyond one per layer
    usable = 90 * (1 << 20) + (1 << 19)  # rank 2 at 10 steps: (6 + 3) x 10 MiB
    monkeypatch.setitem(hardware.DEVICES, "t", hardware.DevicePreset("t", "cuda", int(usable / 0.9) + 8, 0.9,
                                                                      "nvlink-h100", "test"))
    trial = Trial.make("ring", str(path), 4096, WORLD, mode="simulated", device="t", step=StepConfig(stack="lean"))
    asked: list[tuple[int, int, int]] = []  # (steps, layers, rank)

    def simulated(t, keep_trace=False, rank=0):
        k, layers = t.seq_len // 4096, t.config().n_layers
        asked.append((k, layers, rank))
        return Measurement(status="ok", peak_bytes=(layers + extra[rank]) * k << 20, host_peak_bytes=0)

    monkeypatch.setattr(plan_mod, "_CACHE", None)
    monkeypatch.setattr(plan_mod, "measure_simulated", simulated)
    found, best, n, step, err = plan_mod.search_max(trial, 4096, 64 * 4096, str(tmp_path), first=4 * 4096)
    assert err is None and step == 4096 and found == 10 * 4096 and best.rank == 2 and best.exact
    ranks_at = {k: {r for kk, _, r in asked if kk == k} for k, _, _ in asked}
    assert ranks_at[10] == set(range(WORLD)) and 2 in ranks_at[11]  # the answer on every rank, the next fails
    assert any(ranks == {2} for ranks in ranks_at.values())  # a probe on the worst rank alone
    assert n == len(set(asked)) < 2 * WORLD * len(ranks_at)  # fewer than every rank at every probed length
    # the plan's entry holds that rank's figures and says which rank decided
    entry = plan_mod._search_entry((plan_mod.Entry("ring", trial), 4096, 64 * 4096, str(tmp_path), 4 * 4096))
    assert entry.max_context == found and entry.rank == 2
    assert entry.extra["rank"] == f"rank 2, the worst of {WORLD} deciding"


def _m(peak: int, reserved: int | None = None, host: int = 0, status: str = "ok", oom: str | None = None):
    alloc = None if reserved is None else AllocatorReplay("expandable", "shared", peak, 1, 0.0, 0, oom)
    return Measurement(status=status, message=None if status == "ok" else "x", peak_bytes=peak,
                       peak_reserved_bytes=reserved, allocator=alloc, host_peak_bytes=host)


def test_the_worst_of_hand_made_ranks():
    paper, lean = _ring(), Trial.make("ring", "tiny-llama", 8192, WORLD, mode="simulated", device="h100-80g",
                                      step=StepConfig(stack="lean"))
    ranks = {0: _m(10, 30), 1: _m(20, 25), 2: _m(15, 28)}
    assert worst_of(paper, ranks).rank == 0  # the reserved peak decides under the paper stack
    assert worst_of(paper, ranks).rank_peaks == [[0, 30], [1, 25], [2, 28]]
    assert worst_of(lean, {0: _m(10), 1: _m(20), 2: _m(15)}).rank == 1  # the allocated peak under lean
    assert worst_of(lean, {0: _m(10, host=1), 1: _m(10, host=5)}).rank == 1  # then the host peak
    assert worst_of(lean, {0: _m(10), 1: _m(10)}).rank == 0  # a tie: the lowest rank
    assert worst_of(paper, {0: _m(10, 30), 1: _m(10, 20, oom="out")}).rank == 1  # the allocator ran out
    failed = worst_of(paper, {0: _m(10, 30), 1: _m(0, status="oom"), 2: _m(0, status="error")})
    assert (failed.rank, failed.status, failed.rank_peaks) == (2, "error", None)
    single = worst_of(paper, {0: _m(10, 30)})
    assert (single.rank, single.rank_peaks) == (0, None)


def test_rows_without_ranks_are_written_as_before_and_bad_ones_refused():
    row = run_trial(Trial.make("ulysses", "tiny-llama", 2048, 2, mode="simulated", device="h100-80g"))
    d = row.to_dict()
    d["figures"].pop("worst_rank")
    old = json.dumps(d, sort_keys=True)
    back = validate_row(json.loads(old))
    assert back.figures.worst_rank is None and json.dumps(back.to_dict(), sort_keys=True) == old
    for bad, said in ((dict(worst_rank=2), "worst_rank = 2"), (dict(worst_rank=0, rank_peaks=[[1, 5]]), "rank_peaks"),
                      (dict(worst_rank=0, rank_peaks=[5]), "rank_peaks")):
        with pytest.raises(RowError, match=said):
            validate_row({**d, "figures": {**d["figures"], **bad}})


def test_sim_ranks_names_one_rank_or_every_deciding_one(monkeypatch):
    """``$CPAB_SIM_RANKS``: ``deciding`` (this module's setting) gives the method's deciding ranks, a rank
    number below the world size that rank alone (``scripts/gpu/compare.py`` simulates each rank of an
    emulated row so), anything else an error that says what to use."""
    trial = _ring()
    assert deciding_ranks(trial) == tuple(range(WORLD))
    for rank in (0, WORLD - 1):
        monkeypatch.setenv("CPAB_SIM_RANKS", str(rank))
        assert deciding_ranks(trial) == (rank,)
    for wrong in (str(WORLD), "-1", "all", "1,2"):
        monkeypatch.setenv("CPAB_SIM_RANKS", wrong)
        with pytest.raises(ValueError, match="a rank number below the world size 4"):
            deciding_ranks(trial)
