"""The step-time model (``bench.stackmodel.stepcount``/``steptime``) and its Table 3 fit
(``bench.stackmodel.steptime_fit``).

FLOP counting against the analytic count, causal masking against a brute-force mask, the
inter-node path of the link model, the fit reproducing the committed constants from the
committed counts, the quadratic interpolation against a direct simulation, the command, and
the row schema.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bench.measure.config import StepConfig
from bench.measure.result import Measurement
from bench.measure.run import guarded, measure_simulated
from bench.measure.simulate import fake_process_group
from bench.measure.trial import Trial
from bench.model.config import flops_per_step, get_config
from bench.stackmodel.counts import COUNTS_VERSION, Collective, HostCopy, StepCounts, Traffic
from bench.stackmodel.hardware import CommCounter, get_device, get_link
from bench.stackmodel.stepcount import MemoryTraffic, causal_pairs
from bench.stackmodel.steptime import (
    EFF_MATMUL_MEASURED,
    FITTED,
    FITTED_V2,
    FITTED_V3,
    STEPTIME_VERSION,
    StepTimeConstants,
    collective_seconds,
    comm_counts,
    scale_counts,
    step_time,
)
from bench.stackmodel.steptime_fit import (
    CHECK_CELL,
    COUNT_LENGTHS,
    COUNTS,
    as_paper_runs,
    fit,
    interpolate,
    is_fit_cell,
    load_counts,
    measured_eff_matmul,
    modelled_tps,
    paper_cells,
    targets,
)
from bench.steptime_command import main
from records import Row, validate_row

NO_LEVERS = dict(ac=False, ac_offload=False, tiled_mlp=False, tiled_norm=False, chunked_loss=False)


_SHARED: dict[Trial, Measurement] = {}


def _simulated_once(trial: Trial) -> Measurement:
    """``measure_simulated`` of ``trial`` once per module, for a trial several tests simulate as it is
    (never one a test simulates under a patched simulation: those call ``measure_simulated`` themselves)."""
    if trial not in _SHARED:
        _SHARED[trial] = guarded(measure_simulated, trial)
    return _SHARED[trial]


def _counts(method: str, seq_len: int, world: int, shared: bool = False, model: str = "tiny-llama",
            **step) -> StepCounts:
    """The step counts of a simulated trial of ``model`` (tiny-llama unless given); ``shared``: through
    ``_simulated_once``."""
    trial = Trial.make(method, model, seq_len, world, mode="simulated", device="h100-80g",
                       step=StepConfig(**step))
    r = _simulated_once(trial) if shared else guarded(measure_simulated, trial)
    assert r.status == "ok", r.message
    return r.step_counts


def _flat(flat: dict[str, float]) -> StepCounts:
    """Hand-made counts in a row's flat form, FLOPs not given taken as 0."""
    return StepCounts.from_flat({"flops.matmul": 0, "flops.attention": 0, "flops.other": 0, **flat})


def test_counted_flops_equal_the_analytic_count():
    """No recompute, no tiling: matmuls = 6·N·T exactly; attention = the causal analytic term with
    flash's backward (5 matmuls, torch's formula) instead of the convention's 2x forward: x 14/12,
    plus the diagonal (S+1)/S."""
    s, w = 4096, 2
    c = _counts("ulysses", s, w, shared=True, **NO_LEVERS)
    cfg = get_config("tiny-llama")
    attn = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * s * s // 2
    assert c.flops_matmul == (flops_per_step(cfg, s) - attn) / w
    assert c.flops_attention == pytest.approx(attn / w * 14 / 12, rel=2 / s)
    assert c.flops_other == 0


def test_checkpoint_recompute_is_counted():
    """Full AC runs every block's forward twice: the layers' matmuls go from 6 to 8 FLOPs per
    parameter and token, attention from 14 to 18 units."""
    s, w = 4096, 2
    plain = _counts("ulysses", s, w, shared=True, **NO_LEVERS)
    ac = _counts("ulysses", s, w, **{**NO_LEVERS, "ac": True})
    assert ac.flops_attention == pytest.approx(plain.flops_attention * 18 / 14, rel=1e-9)
    assert ac.flops_matmul > plain.flops_matmul * 1.2


def test_counts_under_the_paper_stack_equal_the_lean_stack_as_the_paper_ran():
    """The allocator and scratch models change no count; the paper stack's offload_first_only and
    DeepSpeed TiledMLP and TorchTitan's RoPE table do, and ``as_paper_runs`` sets exactly those (what the
    counts are collected with)."""
    paper = _counts("upipe", 8192, 4, shared=True, stack="paper")
    plain = _counts("upipe", 8192, 4, shared=True, stack="lean")  # the default stack: also the critical-path test's
    # DeepSpeed's TiledMLP and ours both recompute each tile's forward in backward: the same matmuls
    assert plain.flops_matmul == paper.flops_matmul
    assert plain.memory_bound.bytes != paper.memory_bound.bytes  # but not the same elementwise work
    offloaded = HostCopy("offload", "d2h")
    assert plain.host_copies[offloaded].bytes < paper.host_copies[offloaded].bytes  # one more block offloaded
    trial = Trial.make("upipe", "tiny-llama", 8192, 4, mode="simulated", device="h100-80g",
                       step=as_paper_runs(StepConfig(stack="lean"), "upipe"))
    r = guarded(measure_simulated, trial)
    assert r.step_counts == paper


@pytest.mark.parametrize("method", ["ulysses", "upipe"])
def test_tiles_a_simulation_skips_are_counted(method, monkeypatch, tmp_path):
    """Under simulation the tiled MLP and norms, the chunked loss and UPipe's tiled norm run a few
    tiles for all (memory is the same); the counts must be those of a step that runs every tile
    (the simulation without ``methods.core.tiling.compressing_repeats``). Three blocks: the middle
    one's checkpoint is offloaded (the first and last stay on the device), so offloads are counted too."""
    import contextlib

    from bench.measure import simulate

    model = _tiny_llama_layers(tmp_path, 3)
    step = dict(mlp_tiles=8, loss_chunk=512)
    skipped = _counts(method, 8192, 2, model=model, **step)
    monkeypatch.setattr(simulate, "compressing_repeats", contextlib.nullcontext)
    every = _counts(method, 8192, 2, model=model, **step)
    assert every.host_copies[HostCopy("offload", "d2h")].bytes > 0
    for key in ("flops.matmul", "flops.attention", "bytes.memory_bound", "host.offload.d2h_bytes"):
        assert skipped.to_flat()[key] == pytest.approx(every.to_flat()[key], rel=1e-9), key


def _tiny_llama_layers(tmp_path, n_layers: int) -> str:
    """``tiny-llama`` with ``n_layers`` blocks, as a model file (fewer blocks to simulate)."""
    path = tmp_path / f"tiny-llama-{n_layers}l.json"
    path.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": n_layers}))
    return str(path)


@pytest.mark.parametrize("stack", ["lean", "paper"])
def test_fpdt_chunk_pairs_a_simulation_skips_change_no_figure(stack, monkeypatch, tmp_path):
    """Under simulation FPDT runs the first, one middle and the last chunk pairs of each segment's loop
    (``methods.core.tiling.repeated``, compressing under ``compressing_repeats``); every figure must equal
    a simulation that runs them all (the simulation without that policy): device, reserved and host
    peaks, the categories, and every count (FLOPs, memory traffic, host copies, collectives, chunk passes).
    Three blocks: the first and last keep their checkpoints on the device, the middle one offloads.
    6 chunks: the forward's last two segments (5 and 6 pairs) and the backward's second and third K/V
    segments (5 and 4 pairs) are compressed, the middle pairs standing for 2 or 3, which is the mechanism
    at any number of chunks; the pairs a loop runs, not the length, are what a simulation costs.
    1536 tokens (divisible by 2 ranks x 6 chunks): as many chunk pairs as at any length, and few MLP and
    norm tiles (the paper's rule: local tokens / dim), which the simulation that runs every item would
    otherwise run one by one."""
    import contextlib

    from bench.measure import simulate as simulate_module
    from methods.core import tiling

    model = _tiny_llama_layers(tmp_path, 3)

    def simulate():
        trial = Trial.make("fpdt", model, 1536, 2, options={"num_chunks": 6}, mode="simulated",
                           device="h100-80g", step=StepConfig(stack=stack))
        r = guarded(measure_simulated, trial)
        assert r.status == "ok", r.message
        return r

    ran = []
    real_items = tiling.items_to_run
    monkeypatch.setattr(tiling, "items_to_run",
                        lambda n, compress, tail=1: ran.append((n, compress, tail)) or real_items(n, compress, tail))
    skipped = simulate()
    # loops long enough to skip pairs did run, compressed: the forward's last segment (6 pairs, the last two apart),
    # and the backward's second K/V segment (5 pairs, the last apart)
    assert (6, True, 2) in ran and len(real_items(6, True, 2)) < 6
    assert (5, True, 1) in ran and len(real_items(5, True, 1)) < 5
    monkeypatch.setattr(simulate_module, "compressing_repeats", contextlib.nullcontext)
    every = simulate()
    for key in ("peak_bytes", "peak_by_category", "host_peak_bytes", "peak_reserved_bytes", "step_counts"):
        assert getattr(skipped, key) == getattr(every, key), key


def test_memory_traffic_counts_what_kernels_read_and_write():
    """Inputs read and outputs written, a broadcast input once, views and matmuls not at all, a fill
    or copy only its destination (and a copy its source)."""
    x, row = torch.ones(10, 100), torch.ones(1, 100)
    traffic = MemoryTraffic("cpu")
    with traffic:
        x.view(100, 10).t()
        x @ x.t()
    assert traffic.bytes == 0
    with traffic:
        x + row.expand(10, 100)  # 4000 + 400 read, 4000 written
    assert traffic.bytes == 8400
    with traffic:
        x.zero_()
        x.copy_(torch.empty(10, 100))
    assert traffic.bytes == 8400 + 4000 + 8000
    with traffic:
        x.to(torch.float64)  # a cast on the device: 4000 read, 8000 written
        x.to("meta")  # a copy to another device: not this counter's
    assert traffic.bytes == 8400 + 12000 + 12000
    with traffic:  # a new_* constructor writes its output; its tensor argument gives only dtype and device
        x.new_zeros(5, 100)
        x.new_ones(5, 100)
        x.new_full((5, 100), 2.0)
    assert traffic.bytes == 8400 + 12000 + 12000 + 3 * 2000


def test_indexing_kernels_move_the_rows_they_index_not_the_whole_tensors():
    """A gather reads as many source elements as it writes, plus the index; an in-place scatter reads its
    source and the index and writes the indexed rows (reading them first where it accumulates); a mask,
    whose count is in its data, keeps the whole tensors; a *_like constructor reads nothing."""
    big, idx = torch.ones(1000, 100), torch.arange(0, 1000, 100)  # 400,000 bytes; 10 indices of 8 bytes
    rows = torch.ones(10, 100)  # 4,000 bytes: what the index names
    flat_idx = torch.zeros(10, 100, dtype=torch.int64)  # 8,000 bytes
    mask, zero = big[:, 0] > 0, torch.zeros(())  # 1,000 bytes; 4 bytes
    cases = [
        (lambda: big.index_select(0, idx), 2 * 4000 + 80),
        (lambda: big[idx], 2 * 4000 + 80),  # aten.index
        (lambda: torch.nn.functional.embedding(idx, big), 2 * 4000 + 80),
        (lambda: big.gather(0, flat_idx), 2 * 4000 + 8000),
        (lambda: big.index_copy_(0, idx, rows), 4000 + 80 + 4000),
        (lambda: big.index_add_(0, idx, rows), 4000 + 80 + 2 * 4000),
        (lambda: big.scatter_add_(0, flat_idx, rows), 4000 + 8000 + 2 * 4000),
        (lambda: big.scatter_(0, flat_idx, rows), 4000 + 8000 + 4000),
        (lambda: big.index_put_((idx,), rows), 4000 + 80 + 4000),
        (lambda: big.index_put_((idx,), rows, accumulate=True), 4000 + 80 + 2 * 4000),
        (lambda: big.index_put_((mask,), zero), 400_000 + 1000 + 4 + 400_000),  # a mask: the whole tensors
        (lambda: torch.zeros_like(big), 400_000),
        (lambda: torch.full_like(big, 2.0), 400_000),
    ]
    for i, (run, moved) in enumerate(cases):
        traffic = MemoryTraffic("cpu")
        with traffic:
            run()
        assert traffic.bytes == moved, (i, traffic.bytes, moved)


def test_memory_bound_bytes_take_the_device_bandwidth():
    dev, link = get_device("h100-80g"), get_link("nvlink-h100")
    terms = step_time(StepCounts(memory_bound=Traffic(1, dev.hbm_Bps)), dev, link)["terms"]
    assert terms["compute_memory_bound_s"] == pytest.approx(1.0)


@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 7), (7, 3), (1, 4)])
def test_causal_pairs_match_a_mask(sq, sk):
    top_left = torch.ones(sq, sk, dtype=torch.bool).tril()
    bottom_right = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    assert causal_pairs(sq, sk, bottom_right=False) == int(top_left.sum())
    assert causal_pairs(sq, sk, bottom_right=True) == int(bottom_right.sum())


def test_inter_node_groups_go_over_infiniband():
    link = get_link("nvlink-h100")
    b = 1 << 30
    # a ring through two nodes runs at the NIC's speed; the same ring inside a node at NVLink's
    assert collective_seconds("all_gather", b, 16, 8, link) == pytest.approx(b * 15 / 16 / link.inter_Bps)
    assert collective_seconds("all_gather", b, 8, 8, link) == pytest.approx(b * 7 / 8 / link.intra_Bps)
    assert collective_seconds("send", b, 2, 1, link) == pytest.approx(b / link.inter_Bps)
    # an all-to-all over 16 ranks: half its bytes leave the node over IB, which decides
    assert collective_seconds("all_to_all", b, 16, 8, link) == pytest.approx(b * 8 / 16 / link.inter_Bps)


def test_comm_counts_see_which_nodes_a_group_spans():
    """A 2-rank group {0, 8} on 16 ranks is small but crosses nodes; {0..7} stays inside."""
    with fake_process_group(16):
        across = torch.distributed.new_group([0, 8])
        inside = torch.distributed.new_group(list(range(8)))
        counter = CommCounter()
        x = torch.zeros(1024)
        with counter:
            torch.distributed.all_gather_into_tensor(torch.zeros(2048), x, group=across)
            torch.distributed.all_gather_into_tensor(torch.zeros(8192), x, group=inside)
    counts = comm_counts(counter, ranks_per_node=8)
    assert counts[Collective("all_gather", 2, 1)].calls == 1 and counts[Collective("all_gather", 8, 8)].calls == 1
    assert counts[Collective("all_gather", 2, 1)].bytes == 2048 * 4


def test_the_model_refuses_bad_input():
    with pytest.raises(ValueError, match="peak_bf16_flops"):
        step_time(StepCounts(), dataclasses.replace(get_device("h100-80g"), peak_bf16_flops=0.0),
                  get_link("nvlink-h100"))
    with pytest.raises(ValueError, match="efficiencies"):
        StepTimeConstants(1.5, 0.5, 0.5, 0.0)
    with pytest.raises(ValueError, match="kernel"):
        step_time(StepCounts(), get_device("h100-80g"), get_link("nvlink-h100"), FITTED, kernel="fa1")


def test_fpdt_chunk_passes_are_counted_forward_recompute_and_backward(tmp_path):
    """One ``pipeline.chunk_passes`` per chunk in each forward (the checkpoint recompute included,
    which autograd runs on its device thread) and in the backward, in every block (two here); K
    follows ``chunk_tokens``."""
    layers = 2
    model = _tiny_llama_layers(tmp_path, layers)

    def passes(seq_len, **options):
        trial = Trial.make("fpdt", model, seq_len, 2, options, mode="simulated", device="h100-80g",
                           step=StepConfig(**{**NO_LEVERS, "ac": True}))
        r = guarded(measure_simulated, trial)
        assert r.status == "ok", r.message
        return r.step_counts.events["pipeline.chunk_passes"]

    assert passes(4096, num_chunks=4) == 3 * 4 * layers
    eight = passes(4096, chunk_tokens=512)  # K = 4096 / 512
    assert eight == 3 * 8 * layers
    assert passes(2048, chunk_tokens=512) * 2 == eight  # K = 4: half the length, half the chunks


def test_ds_fpdt_sync_is_paid_per_chunk_pass_only_for_deepspeeds_fpdt():
    link, dev = get_link("nvlink-h100"), get_device("h100-80g")
    counts = _flat({"flops.matmul": 1e15, "pipeline.chunk_passes": 96})
    c = dataclasses.replace(FITTED, ds_fpdt_chunk_s=0.01)
    ours = step_time(counts, dev, link, c)
    ds = step_time(counts, dev, link, c, ds_fpdt_sync=True)
    assert ds["step_time_s"] - ours["step_time_s"] == pytest.approx(0.96)
    assert ds["terms"]["ds_fpdt_sync_s"] == pytest.approx(0.96) and ours["terms"]["ds_fpdt_sync_s"] == 0
    with pytest.raises(ValueError, match="ds_fpdt_chunk_s"):
        dataclasses.replace(FITTED, ds_fpdt_chunk_s=-1.0)


def test_eff_matmul_is_the_measured_gemm_rate():
    """Not fitted: the FLOP-weighted rate of the committed real H100 GEMM rows."""
    assert FITTED.eff_matmul == EFF_MATMUL_MEASURED
    assert measured_eff_matmul() == pytest.approx(EFF_MATMUL_MEASURED, rel=1e-5)


def test_latency_is_paid_per_call():
    link, dev = get_link("nvlink-h100"), get_device("h100-80g")
    few = StepCounts(collectives={Collective("all_to_all", 8, 8): Traffic(4, 1e9)})
    many = StepCounts(collectives={Collective("all_to_all", 8, 8): Traffic(400, 1e9)})
    c = StepTimeConstants(0.5, 0.5, 0.5, 1e-4)
    assert step_time(many, dev, link, c)["step_time_s"] - step_time(few, dev, link, c)["step_time_s"] \
        == pytest.approx(396 * 1e-4)


def test_a_barrier_costs_barrier_s_on_the_critical_path_not_latency_s():
    """The paper's ring-step barriers (paper stack term 9) are priced at their own constant and
    waited on (the fit's twin prices them alike: ``test_the_fit_times_steps_as_the_model_does``)."""
    link, dev = get_link("nvlink-h100"), get_device("h100-80g")
    base = _flat({"flops.matmul": 1e15, "comm.send.8.8.bytes": 1e9, "comm.send.8.8.calls": 8})
    synced = dataclasses.replace(base, collectives={**base.collectives, Collective("barrier", 8, 8): Traffic(100, 0)})
    c = StepTimeConstants(0.5, 0.5, 0.5, 1e-5, 0.0, 3e-3)
    extra = step_time(synced, dev, link, c)["step_time_s"] - step_time(base, dev, link, c)["step_time_s"]
    assert extra == pytest.approx(100 * 3e-3)  # not hidden behind compute as the sends are
    terms = step_time(synced, dev, link, c)["terms"]
    assert terms["comm_barrier_calls"] == 100 and terms["comm_critical_calls"] == 100


def test_scale_counts_by_leading_power():
    c = scale_counts(_flat({"flops.attention": 4.0, "flops.matmul": 2.0, "comm.x.8.8.calls": 3,
                            "comm.x.8.8.bytes": 10.0, "host.offload.d2h_calls": 5, "host.offload.d2h_bytes": 7.0}),
                     100, 200)
    assert c == _flat({"flops.attention": 16.0, "flops.matmul": 4.0, "comm.x.8.8.calls": 3, "comm.x.8.8.bytes": 20.0,
                       "host.offload.d2h_calls": 5, "host.offload.d2h_bytes": 14.0})


# --------------------------------------------------------------------------- the committed counts and fit


@pytest.fixture(scope="module")
def committed():
    if not COUNTS.exists():
        pytest.skip(f"no committed counts at {COUNTS} (python -m bench steptime --collect)")
    return load_counts(COUNTS)


def test_interpolation_matches_a_direct_simulation(committed):
    model, method, s = CHECK_CELL
    direct = committed[(model, method, s)]
    est = interpolate({n: committed[(model, method, n)] for n in COUNT_LENGTHS[model]}, s).to_flat()
    direct = direct.to_flat()
    for key in ("flops.matmul", "flops.attention"):
        assert est[key] == pytest.approx(direct[key], rel=1e-3), key
    for key in direct:
        assert est.get(key, 0) == pytest.approx(direct[key], rel=1e-3, abs=1), key


def test_the_fit_reproduces_the_committed_constants(committed):
    cells = [c for c in paper_cells() if c["status"] == "ok" and is_fit_cell(c["model"], int(c["seq_len"]))]
    got = fit(cells, committed)
    assert got.eff_matmul == FITTED.eff_matmul  # held at the measured rate
    assert got.eff_attention == pytest.approx(FITTED.eff_attention, rel=1e-3)
    assert got.eff_attention_fa2 == pytest.approx(FITTED.eff_attention_fa2, rel=1e-3)
    assert got.latency_s == pytest.approx(FITTED.latency_s, rel=1e-2, abs=1e-7)
    assert got.ds_fpdt_chunk_s == pytest.approx(FITTED.ds_fpdt_chunk_s, rel=1e-2)
    assert got.barrier_s == pytest.approx(FITTED.barrier_s, rel=1e-2)


def test_table3_fpdt_cells_count_the_papers_chunks(committed):
    """The FPDT counts are of the paper's chunk size (65,536 tokens: K = S / 65536 per rank), so the
    chunk passes grow with the length, and the cell's model pays DeepSpeed's per-chunk term."""
    from bench.stackmodel.steptime_fit import counts_for

    for model, layers in (("llama3-8b", 32), ("qwen3-32b", 64)):
        for s in COUNT_LENGTHS[model]:
            assert committed[(model, "fpdt", s)].events["pipeline.chunk_passes"] == 3 * (s // 65536) * layers
    counts = counts_for(committed, "llama3-8b", "fpdt", 1 << 20)
    _, res = modelled_tps(counts, "llama3-8b", "fpdt", 1 << 20, FITTED)
    assert res["terms"]["ds_fpdt_sync_s"] == pytest.approx(3 * 16 * 32 * FITTED.ds_fpdt_chunk_s, rel=1e-6)


def test_the_fit_times_steps_as_the_model_does(committed):
    """The fit's differentiable twin of ``step_time`` gives the same total on every committed count."""
    from bench.stackmodel.steptime_fit import _step_time_t, _TensorConstants

    dev, link = get_device("h100-80g"), get_link("nvlink-h100")
    fa3 = (FITTED.eff_matmul, FITTED.eff_attention, FITTED.latency_s, FITTED.ds_fpdt_chunk_s, FITTED.barrier_s)
    twin = _TensorConstants(*(torch.tensor(v, dtype=torch.float64) for v in fa3))
    for counts in committed.values():
        for ds_fpdt in (False, True):
            assert float(_step_time_t(counts, dev, link, twin, ds_fpdt)) == pytest.approx(
                step_time(counts, dev, link, FITTED, "fa3", ds_fpdt_sync=ds_fpdt)["step_time_s"], rel=1e-12)


def test_the_command_writes_the_table(committed, tmp_path, capsys):
    assert main(["--no-fit", "--figs", str(tmp_path), "--out", str(tmp_path / "cells.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "validation:" in out and "upipe" in out and "targets (met or not" in out
    lines = (tmp_path / "table3_model.csv").read_text().splitlines()
    assert len(lines) == 1 + len([c for c in paper_cells()])
    assert "simulated, h100-80g, modelled step time" in lines[1]
    cells = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert len(cells) == len(lines) - 1 and all(c["model_tps"] > 0 for c in cells)


def _cell(model, method, seq_len, paper, modelled, fit=False):
    return {"model": model, "method": method, "seq_len": seq_len, "paper_tps": paper, "model_tps": modelled,
            "residual": modelled / paper - 1, "fit": fit}


def test_targets_are_judged_on_the_cells_and_say_which_one_misses():
    K = 131072
    good = [_cell("llama3-8b", "ulysses", 4 * K, 100, 101), _cell("llama3-8b", "upipe", 4 * K, 99, 100),
            _cell("llama3-8b", "fpdt", K, 50, 52), _cell("llama3-8b", "ulysses", K, 200, 200),
            _cell("qwen3-32b", "ulysses", K, 100, 100), _cell("qwen3-32b", "upipe", K, 89, 88)]
    verdicts = {name: (value, met) for name, value, met in targets(good)}
    assert all(met for _, met in verdicts.values()), verdicts
    # one cell off by 40% misses the max target and is named; a fit cell never counts
    bad = good + [_cell("qwen3-32b", "torch-cp", K, 100, 140), _cell("llama3-8b", "ring", K, 100, 300, fit=True)]
    (value, met), = [(v, m) for name, v, m in targets(bad) if "above" in name]
    assert not met and value == "qwen3-32b torch-cp 128K +40.0%"
    # the qwen ratio 0.70 against the paper's 0.89 misses its tolerance; llama's band is judged from 512K on
    off = [c if (c["model"], c["method"]) != ("qwen3-32b", "upipe") else _cell("qwen3-32b", "upipe", K, 89, 70)
           for c in good]
    missed = [name for name, _, met in targets(off) if not met]
    assert missed == ["qwen3-32b modelled UPipe/Ulysses within 0.03 of the paper's at every length"]


def test_the_command_refuses_missing_counts(tmp_path, capsys):
    assert main(["--counts", str(tmp_path / "none.jsonl"), "--no-fit", "--out", str(tmp_path / "c.jsonl")]) == 2
    assert "--collect" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--figs", "--out"])
def test_the_command_refuses_an_output_it_cannot_write_before_any_work(flag, tmp_path, capsys, monkeypatch):
    """--figs naming a file (or --out a folder): one line, exit 2, before the table is computed."""
    import bench.stackmodel.steptime_fit as steptime_fit

    a_file = tmp_path / "table.md"
    a_file.write_text("x")
    monkeypatch.setattr(steptime_fit, "load_counts", lambda *a: pytest.fail("counts read before the check"))
    bad, needle = {"--figs": (["--figs", str(a_file), "--out", str(tmp_path / "c.jsonl")],
                              "is a file, not a directory"),
                   "--out": (["--out", str(tmp_path)], "is a directory")}[flag]
    assert main(["--no-fit", *bad]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"python -m bench steptime: error: {flag} ") and needle in err, err
    assert a_file.read_text() == "x" and not (tmp_path / "c.jsonl").exists()


def test_rows_round_trip_with_the_model(committed):
    from records import read_rows

    rows = [r for r in read_rows(COUNTS) if r.figures.step_time_model]
    for r in rows:  # the committed rows carry the current model (python -m bench steptime --refresh)
        model = r.figures.step_time_model
        assert model["version"] == STEPTIME_VERSION
        assert {k: model["constants"][k] for k in dataclasses.asdict(FITTED)} == dataclasses.asdict(FITTED)
    row = rows[0]
    again = validate_row(json.loads(json.dumps(row.to_dict())))
    assert again.figures.step_time_model == row.figures.step_time_model
    assert again.figures.step_time_s == row.figures.step_time_s > 0
    old = row.to_dict()
    del old["figures"]["step_time_model"]  # rows written before the model stay valid
    assert isinstance(validate_row(old), Row)


def test_the_plan_times_with_this_model():
    """``bench.search.plan``'s modelled step time is this model over the entry's counts carried to the
    length, with the constants fitted on counts of their version (the plan's cache holds older ones)."""
    from bench.search.plan import Entry, modelled_time

    old = _flat({"flops.matmul": 1e15, "flops.attention": 2e15, "comm.all_to_all.8.8.bytes": 1e10,
                 "comm.all_to_all.8.8.calls": 100, "host.offload.d2h_bytes": 1e9, "host.offload.d2h_calls": 4,
                 "host.offload.h2d_bytes": 1e9, "host.offload.h2d_calls": 4})
    v3 = dataclasses.replace(old, memory_bound=Traffic(1000, 1e13))
    v4 = dataclasses.replace(v3, version=COUNTS_VERSION)
    for counts, constants in ((old, FITTED_V2), (v3, FITTED_V3), (v4, FITTED)):
        e = Entry("upipe", Trial.make("upipe", "llama3-8b", 1 << 20, 8), max_context=1 << 20, step_counts=counts)
        want = step_time(scale_counts(counts, 1 << 20, 1 << 19), get_device("h100-80g"), get_link("nvlink-h100"),
                         constants, "fa3")
        assert modelled_time(e, "h100-80g", 1 << 19) == pytest.approx(want["step_time_s"])
    assert modelled_time(dataclasses.replace(e, step_counts=None), "h100-80g", 1 << 19) is None


@pytest.mark.parametrize("method", ["torch-cp", "upipe"])
def test_counting_changes_no_memory_figure(method, monkeypatch):
    """The counters run inside the memory tracker: the peaks must be those of an uncounted step."""
    import contextlib

    from bench.stackmodel import stepcount

    trial = Trial.make(method, "tiny-llama", 8192, 4, mode="simulated", device="h100-80g",
                       step=StepConfig(stack="paper"))
    # simulated once: upipe's is also the paper-stack counts test's, torch-cp's the critical-path test's
    counted = _simulated_once(trial)
    monkeypatch.setattr(stepcount.StepCounter, "counting", lambda self: contextlib.nullcontext(self))
    monkeypatch.setattr(stepcount.StepCounter, "counts", lambda self: StepCounts())
    plain = guarded(measure_simulated, trial)
    for key in ("peak_bytes", "host_peak_bytes", "peak_reserved_bytes", "peak_by_category", "comm_bytes_by_op"):
        assert getattr(counted, key) == getattr(plain, key), key


def test_collectives_the_attention_issues_are_on_the_critical_path():
    """torch's CP all-gathers K/V itself (blocking its ring); FSDP's all-gathers are issued by the step.
    torch-cp's trial is the paper stack's (an accounting of memory: the collectives are the same), simulated
    once with ``test_counting_changes_no_memory_figure``'s."""
    cp = _counts("torch-cp", 8192, 4, shared=True, stack="paper")
    up = _counts("upipe", 8192, 4, shared=True)  # the lean stack's: also the paper-stack counts test's
    assert cp.collectives[Collective("all_gather", 4, 4, attention=True)].calls > 0
    assert cp.collectives[Collective("all_gather", 4, 4, attention=True)].calls \
        < cp.collectives[Collective("all_gather", 4, 4)].calls  # FSDP's stay overlapped
    assert not any(k.attention for k in up.collectives)
    link, dev = get_link("nvlink-h100"), get_device("h100-80g")
    counts = {"comm.all_gather.8.8.bytes": 8e9, "comm.all_gather.8.8.calls": 2}
    blocking = {**counts, "comm_attn.all_gather.8.8.bytes": 8e9, "comm_attn.all_gather.8.8.calls": 2}
    c = StepTimeConstants(0.5, 0.5, 0.5, 1e-5)
    hidden = step_time(_flat({**counts, "flops.matmul": 1e15}), dev, link, c)["terms"]
    shown = step_time(_flat({**blocking, "flops.matmul": 1e15}), dev, link, c)["terms"]
    assert hidden["comm_critical_s"] == 0 and hidden["comm_overlapped_exposed_s"] == 0
    assert shown["comm_critical_s"] == pytest.approx(collective_seconds("all_gather", 8e9, 8, 8, link) + 2e-5)
    assert shown["comm_overlapped_s"] == pytest.approx(0, abs=1e-12)


def test_events_count_into_the_innermost_counter_and_merge_outward():
    from methods.core import events

    with events.counting() as outer:
        with events.counting():  # ends as empty as the outer one (equal dicts): the outer stays on
            pass
        with events.counting() as inner:
            events.note(events.CHUNK_PASSES, 2)
        assert inner == {events.CHUNK_PASSES: 2}
        events.note(events.CHUNK_PASSES)
    assert outer == {events.CHUNK_PASSES: 3}
    events.note(events.CHUNK_PASSES)  # no counter on: nothing to count into, no error
