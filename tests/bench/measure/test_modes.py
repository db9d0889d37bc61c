"""The three modes: simulated peak memory agrees with the real one (gloo ranks, MemTracker over
real tensors) within 5%; emulated rows add modelled communication to measured compute; failures
become rows; the link model's arithmetic."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import methods
from bench.measure import run as trial_mod
from bench.measure.config import StepConfig
from bench.measure.result import Measurement, failed
from bench.measure.run import measure_simulated, real_rank, run_trial
from bench.measure.simulate import fake_process_group, fake_tensors, track_peak
from bench.measure.trial import Trial
from bench.stackmodel.hardware import LINKS, CommCounter, get_device
from methods.core import comm
from records import validate_row
from records.workloads.spec import DocsSpec

CANDIDATES = ("ulysses", "upipe", "ring")
COMPARED = sorted(set(methods.available()) & set(CANDIDATES))


def test_the_paper_methods_are_compared():
    assert {"ulysses", "upipe"} <= set(COMPARED)


@pytest.mark.parametrize("method", COMPARED)
@pytest.mark.parametrize("ws,dtype,seq", [(2, "bf16", 1024), (4, "fp32", 512)])
def test_simulated_peak_matches_real_within_5_percent(pool, method, ws, dtype, seq):
    """Real: MemTracker over the real tensors of each gloo rank, one step after a warm-up step
    (CPU has no allocator peak counters; MemTracker counts live tensor storage, as CUDA's
    max_memory_allocated does). Simulated: the same step under FakeTensorMode on rank 0."""
    real = Trial.make(method, "tiny-llama", seq, ws, mode="real", device="cpu", warmup=1, iters=1, smoke=True,
                      step=StepConfig(dtype=dtype))
    results = pool.run(real_rank, real, world_size=ws)
    assert all(r.status == "ok" for r in results), results[0].traceback
    sim = measure_simulated(dataclasses.replace(real, mode="simulated"))
    real_peak = results[0].peak_bytes
    assert abs(sim.peak_bytes - real_peak) <= 0.05 * real_peak, (sim.peak_bytes, real_peak)
    # the categories line up too: same weights, gradients and optimizer state
    for cat in ("parameter", "gradient", "optstate"):
        assert sim.peak_by_category[cat] == results[0].peak_by_category[cat], cat
    assert sim.comm_bytes == results[0].comm_bytes



def send_then_drop_peak(group, n: int) -> int:
    """Peak bytes of: post a send of ``n`` fp32 values around the ring, drop the sender's own
    reference, allocate as much again, then wait (module level: the ranks run it)."""

    def step():
        ring = comm.RingComm(group)
        sent = torch.ones(n)
        received = ring.exchange([sent])
        del sent  # the ring backward drops its dK/dV accumulators this way before the wait
        scratch = torch.ones(n)
        ring.wait()
        del scratch, received

    return track_peak(step).total


def test_a_sent_tensor_lives_until_the_wait_in_both_modes(pool):
    """A real backend keeps a send's buffer until the transfer completes, whatever the sender does
    with its reference; the simulation (fake process group) holds it as long: three buffers of
    n values (sent, received, scratch) at the peak, in both modes."""
    n = 4096
    real = pool.run(send_then_drop_peak, n, world_size=2)
    with fake_process_group(2) as group, fake_tensors(torch.float32, meta_host=False):
        simulated = send_then_drop_peak(group, n)
    assert real == [3 * n * 4] * 2
    assert simulated == real[0]

def test_emulated_row_adds_modelled_communication_to_measured_compute():
    row = run_trial(Trial.make("upipe", "tiny-mha", 512, 4, mode="emulated", device="cpu", iters=1, smoke=True,
                               threads=1))
    f = row.figures
    assert row.status == "ok", row.message
    assert row.mode == "emulated" and row.link["name"] == "cpu-shm"
    assert f.comm_bytes > 0 and f.comm_time_s > 0 and f.compute_time_s > 0
    assert f.step_time_s == pytest.approx(f.compute_time_s + f.comm_time_s)
    assert f.tokens_per_device == 128
    assert f.tokens_per_s_per_device == pytest.approx(128 / f.step_time_s)
    assert f.tflops_per_device == pytest.approx(f.flops_per_device / f.step_time_s / 1e12)
    assert f.peak_bytes > 0 and f.loss is not None
    assert "torch CPU threads per rank: 1" in row.notes


def test_emulated_mode_measures_every_deciding_rank_as_simulation_does(monkeypatch):
    """A zigzag ring with packed documents, emulated with every deciding rank (``$CPAB_SIM_RANKS``
    unset, as outside the suite): each rank runs once on the device with its own process-group
    rank, and its allocated peak (MemTracker over the real tensors on CPU) is the simulation's
    live-tensor peak of the same rank, to the byte; the row is the worst rank's."""
    monkeypatch.delenv("CPAB_SIM_RANKS")
    trial = Trial.make("ring", "tiny-mha", 512, 2, mode="emulated", device="cpu", iters=1, smoke=True, threads=1,
                       docs=DocsSpec(lengths=(50, 462)))
    measured: list[int] = []
    each = trial_mod.emulated_rank

    def counted(t, rank, device):
        measured.append(rank)
        return each(t, rank, device)

    monkeypatch.setattr(trial_mod, "emulated_rank", counted)
    row = run_trial(trial)
    assert row.status == "ok", row.message
    assert measured == [0, 1]
    simulated = dataclasses.replace(trial, mode="simulated")
    sims = {r: measure_simulated(simulated, rank=r) for r in measured}
    assert row.figures.rank_peaks == [[r, sims[r].peak_bytes] for r in measured]
    assert len({p for _, p in row.figures.rank_peaks}) > 1, "the ranks of this case no longer differ: pick one that do"
    worst = max(measured, key=lambda r: (sims[r].peak_bytes, -r))
    assert row.figures.worst_rank == worst and row.figures.peak_bytes == sims[worst].peak_bytes
    assert row.figures.rank_reserved_peaks is None  # no reserved bytes on a CPU
    assert any(n.startswith("emulated on ranks 0-1 ") and f"rank {worst} " in n for n in row.notes), row.notes
    validate_row(row)


def test_emulated_ranks_follow_sim_ranks_and_free_the_device_between_them(monkeypatch):
    """Hand-made ranks (no step runs): ``$CPAB_SIM_RANKS=0`` measures rank 0 alone, as in simulation;
    unset, every deciding rank in turn with the device released after each; the worst by allocated
    peak makes the measurement, with each rank's reserved peak where the device reports one; a
    failing rank stops the loop."""
    peaks = {0: (100, 300), 1: (200, 250), 2: (150, 400), 3: (120, 310)}
    calls: list[tuple[str, int]] = []

    def fake_rank(t, rank, device):
        calls.append(("rank", rank))
        allocated, reserved = peaks[rank]
        return Measurement(peak_bytes=allocated, peak_reserved_bytes=reserved, compute_time_s=float(rank))

    monkeypatch.setattr(trial_mod, "emulated_rank", fake_rank)
    monkeypatch.setattr(trial_mod, "release_device", lambda device: calls.append(("release", -1)))
    trial = Trial.make("ring", "tiny-llama", 1024, 4, mode="emulated", device="cpu", iters=1, smoke=True)
    monkeypatch.setenv("CPAB_SIM_RANKS", "0")
    alone = trial_mod._emulated(trial)
    assert calls == [("rank", 0), ("release", -1)]
    assert alone.rank == 0 and alone.rank_peaks is None and alone.rank_reserved_peaks is None
    calls.clear()
    monkeypatch.delenv("CPAB_SIM_RANKS")
    out = trial_mod._emulated(trial)
    assert calls == [c for r in range(4) for c in (("rank", r), ("release", -1))]
    assert out.rank == 1 and out.peak_bytes == 200 and out.compute_time_s == 1.0  # the worst rank's step time too
    assert out.rank_peaks == [[r, peaks[r][0]] for r in range(4)]
    assert out.rank_reserved_peaks == [[r, peaks[r][1]] for r in range(4)]
    row = trial_mod.build_row(trial, out, 1.0)
    validate_row(row)
    assert row.figures.rank_reserved_peaks == out.rank_reserved_peaks
    assert any("rank 1 (figures.worst_rank" in n and "figures.rank_reserved_peaks" in n for n in row.notes), row.notes
    asked: list[int] = []

    def failing(t, rank, device):
        asked.append(rank)
        return failed("oom", "out of memory") if rank == 1 else fake_rank(t, rank, device)

    monkeypatch.setattr(trial_mod, "emulated_rank", failing)
    stopped = trial_mod._emulated(trial)
    assert asked == [0, 1]
    assert stopped.status == "oom" and stopped.rank == 1 and stopped.rank_peaks is None


def test_emulated_row_drops_a_loss_that_is_not_a_number(monkeypatch):
    """A fake process group's collectives leave their outputs unwritten, so an emulated loss can
    be NaN (seen on an H100: Ulysses, Llama3-8B, 256K); the row keeps its memory and time and says
    why the loss is missing, instead of failing its schema check."""
    real = trial_mod._emulated

    def nan_loss(trial):
        return dataclasses.replace(real(trial), loss=float("nan"))

    monkeypatch.setattr(trial_mod, "_emulated", nan_loss)
    row = run_trial(Trial.make("ulysses", "tiny-mha", 512, 2, mode="emulated", device="cpu", iters=1, smoke=True,
                               threads=1))
    assert row.status == "ok", row.message
    assert row.figures.loss is None and row.figures.peak_bytes > 0
    assert any("loss nan not recorded" in n for n in row.notes)


def test_simulated_oom_is_a_row_with_the_budget_in_the_message():
    row = run_trial(Trial.make("ulysses", "llama3-8b", 64 << 20, 8, mode="simulated",
                               step=StepConfig(scope="attention")))
    assert row.status == "oom"
    assert "exceeds the usable" in row.message and "h100-80g" in row.message
    usable = get_device("h100-80g").usable()
    assert row.figures.usable_bytes == usable < row.figures.peak_bytes


def test_a_failing_trial_is_an_error_row_and_the_next_trial_runs(monkeypatch):
    """The next trial's simulation runs on a new fake process group after one that raised inside its own;
    tiny-mha (two blocks): the model is not what is checked."""
    calls = []

    def boom(trial, *args):
        calls.append(trial)
        with fake_process_group(trial.world_size):
            raise RuntimeError("kernel exploded")

    monkeypatch.setattr(trial_mod, "measure_simulated", boom)
    row = run_trial(Trial.make("upipe", "tiny-mha", 1024, 2))
    assert row.status == "error" and "RuntimeError: kernel exploded" in row.message
    monkeypatch.undo()
    ok = run_trial(Trial.make("upipe", "tiny-mha", 1024, 2))  # the fake process group was released
    assert ok.status == "ok" and calls


def test_attention_scope_counts_one_block():
    row = run_trial(Trial.make("upipe", "llama3-8b", 1 << 20, 8, step=StepConfig(scope="attention")))
    assert row.status == "ok" and row.scope == "attention"
    # one block, weights in bf16: well under the whole model's memory
    assert row.figures.peak_bytes < 20 * 2**30
    assert any("scope attention" in n for n in row.notes)


def test_link_model_arithmetic():
    nv = LINKS["nvlink-h100"]
    b = 1 << 30
    assert nv.time("all_to_all", b, 8) == pytest.approx(b * 7 / 8 / 450e9 + 10e-6)
    # 16 ranks over two nodes: half of the bytes leave the node at 50 GB/s
    assert nv.time("all_to_all", b, 16) == pytest.approx(b * 8 / 16 / 50e9 + 10e-6)
    assert nv.time("all_gather", b, 8) == pytest.approx(b * 7 / 8 / 450e9 + 10e-6)
    assert nv.time("all_reduce", b, 8) == pytest.approx(2 * b * 7 / 8 / 450e9 + 10e-6)
    assert nv.time("all_to_all", b, 1) == 0.0


def test_comm_counter_records_collectives():
    with fake_process_group(8) as group:
        x = torch.empty(1024, 16)
        counter = CommCounter()
        with counter:
            torch.distributed.all_to_all_single(torch.empty_like(x), x, group=group)
            torch.distributed.all_reduce(x, group=group)
    assert counter.calls == [("all_to_all", x.numel() * 4, 8), ("all_reduce", x.numel() * 4, 8)]
    assert counter.bytes == 2 * x.numel() * 4
    assert counter.time(LINKS["nvlink-h100"]) > 0


def test_kernel_workspace_model_adds_the_flash_backward_scratch():
    """Ulysses attention block at 1M on 8 ranks (q: 4 heads per rank, k/v: 1): the fa3 model adds
    dQ's fp32 accumulator, the two fp32 row statistics and GQA's fp32 dK/dV accumulators while the
    backward kernel runs; the peak rises, by at most that much (the block may peak elsewhere)."""
    from bench.stackmodel.workspace import workspace_shapes

    s, ws = 1 << 20, 8
    base = Trial.make("ulysses", "llama3-8b", s, ws, step=StepConfig(scope="attention"))
    plain = measure_simulated(base).peak_bytes
    fa3 = measure_simulated(dataclasses.replace(base, step=StepConfig(scope="attention", kernel_workspace="fa3")))
    q = torch.empty(1, 4, s, 128, device="meta")
    k = torch.empty(1, 1, s, 128, device="meta")
    scratch = sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                  for shape, dt in workspace_shapes("fa3", q, k))
    assert scratch == 4 * s * 128 * 4 + 2 * 4 * s * 4 + 2 * s * 128 * 4
    assert plain + scratch // 2 < fa3.peak_bytes <= plain + scratch
    with pytest.raises(ValueError, match="kernel_workspace must be one of"):
        StepConfig(kernel_workspace="fa4")
    with pytest.raises(ValueError, match="in emulated mode the real kernel"):
        Trial.make("ulysses", "tiny-llama", 1024, 2, mode="emulated", device="cpu",
                   step=StepConfig(kernel_workspace="fa3")).validate()


def test_host_memory_budget_under_simulation():
    """Offloaded checkpoints beyond the preset's host memory per GPU make the trial not fit."""
    from bench.stackmodel.hardware import DEVICES

    row = run_trial(Trial.make("upipe", "tiny-llama", 2048, 2))
    assert row.status == "ok" and row.figures.host_usable_bytes == DEVICES["h100-80g"].host_usable()
    result = Measurement(peak_bytes=1, host_peak_bytes=300 * 2**30)
    over = trial_mod.build_row(Trial.make("upipe", "llama3-8b", 1 << 20, 8), result, 0.0)
    assert over.status == "oom" and over.message.startswith("host memory: offloads of 300.00 GiB")
