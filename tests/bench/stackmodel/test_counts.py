"""The typed step counts (``bench.stackmodel.counts``) and their flat form on disk.

Every count committed under ``results/`` (rows' ``figures.step_time_model.counts``, the planner's
cached ``step_counts``) reads into the records and writes back to the same JSON, byte for byte;
a simulated step's records survive the trip too. Read through the records, every committed row
made with the current step-time model gets its modelled step time back to the bit, and every
committed paper-stack row its NCCL buffers (its usable bytes). Malformed flat forms are refused
with the key named.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.measure.config import StepConfig
from bench.measure.run import guarded, measure_simulated
from bench.measure.trial import Trial
from bench.model.config import get_config
from bench.stackmodel import stack
from bench.stackmodel.counts import COUNTS_VERSION, Collective, HostCopy, StepCounts, Traffic
from bench.stackmodel.hardware import get_device, get_link
from bench.stackmodel.steptime import (
    FITTED,
    FITTED_V3,
    STEPTIME_VERSION,
    constants_for,
    counts_version,
    figures_from_counts,
    scale_counts,
    step_time,
)

RESULTS = Path(__file__).resolve().parents[3] / "results"


def _committed() -> list[tuple[str, dict, dict]]:
    """(where, the JSON line, its flat counts) for every count committed under results/."""
    out = []
    for path in sorted([*RESULTS.rglob("*.jsonl"), *RESULTS.rglob("*.ndjson")]):
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            d = json.loads(line)
            counts = ((d.get("figures") or {}).get("step_time_model") or {}).get("counts") \
                or (d.get("result") or {}).get("step_counts")
            if counts:
                out.append((f"{path.relative_to(RESULTS)}:{i + 1}", d, counts))
    return out


COMMITTED = _committed()


def test_committed_counts_are_found():
    files = {where.split(":")[0] for where, _, _ in COMMITTED}
    assert {"fidelity/steptime.jsonl", "plan/sims.ndjson", "bench/simulated.jsonl"} <= files
    assert len(COMMITTED) > 500


def test_every_committed_count_round_trips_byte_for_byte():
    for where, _, flat in COMMITTED:
        typed = StepCounts.from_flat(flat)
        again = typed.to_flat()
        # the same JSON as stored: values (ints stay ints), and where the file keeps them sorted, the order
        assert json.dumps(again, sort_keys=True) == json.dumps(flat, sort_keys=True), where
        if list(flat) == sorted(flat):
            assert json.dumps(again) == json.dumps(flat), where
        assert StepCounts.from_flat(again) == typed, where


def test_a_simulated_steps_counts_round_trip(tmp_path):
    """torch's CP (the attention's own all-gathers, host copies of neither kind) and FPDT (its chunk
    passes, its own host copies): every kind of record a step makes, through the flat form and back.
    Two blocks of ``tiny-llama``: every block makes the same kinds of record (its collectives, its
    checkpoint's host copies, FPDT's chunk passes and copies), so more blocks add counts, not kinds."""
    model = tmp_path / "tiny-llama-2l.json"
    model.write_text(json.dumps({**get_config("tiny-llama").to_dict(), "n_layers": 2}))
    for method, options in (("torch-cp", {}), ("fpdt", {"num_chunks": 4})):
        trial = Trial.make(method, str(model), 4096, 2, options, mode="simulated", device="h100-80g",
                           step=StepConfig(stack="paper"))
        r = guarded(measure_simulated, trial)
        assert r.status == "ok", r.message
        counts = r.step_counts
        assert counts.memory_bound is not None and counts.collectives and counts.host_copies
        flat = counts.to_flat()
        assert StepCounts.from_flat(flat) == counts
        assert StepCounts.from_flat(json.loads(json.dumps(flat))) == counts
        if method == "torch-cp":
            assert any(k.attention for k in counts.collectives)
            assert any(k.startswith("comm_attn.all_gather.") for k in flat)
        else:
            assert counts.events["pipeline.chunk_passes"] > 0 and HostCopy("method", "h2d") in counts.host_copies


def _current_model(d: dict) -> bool:
    """A row of this model's version whose constants are those fitted on its counts' version (``FITTED`` for
    counts of this version, ``FITTED_V3`` for the rows simulated before it)."""
    model = d["figures"]["step_time_model"]
    fitted = constants_for(StepCounts.from_flat(model["counts"]))
    return model.get("version") == STEPTIME_VERSION and all(
        model["constants"].get(k) == v for k, v in dataclasses.asdict(fitted).items())


def test_committed_rows_get_their_step_time_back_from_the_records():
    """Read from a row, the counts give its step time to the bit and its terms to rounding (a row timed
    when it was measured summed its collectives in the order the step issued them, the row keeps them
    sorted)."""
    rows = [(where, d) for where, d, _ in COMMITTED if "figures" in d and d["mode"] == "simulated"
            and _current_model(d)]
    assert len(rows) > 100
    for where, d in rows:
        model = d["figures"]["step_time_model"]
        dev = get_device(d["device"])
        counts = StepCounts.from_flat(model["counts"])
        figs = figures_from_counts(counts, dev, get_link((d.get("link") or {}).get("name") or dev.link),
                                   d["figures"]["tokens_per_device"], d["method"], constants_for(counts))
        assert figs["step_time_s"] == d["figures"]["step_time_s"], where
        assert figs["step_time_model"]["terms"] == pytest.approx(model["terms"], rel=1e-12), where
        assert figs["step_time_model"]["counts"] == model["counts"], where


def test_nccl_buffers_of_committed_paper_rows_from_the_records():
    """A paper-stack row's usable bytes are the device less the CUDA context and NCCL's buffers for
    the collectives it issued: the same from its counts read into the records."""
    rows = [(where, d, flat) for where, d, flat in COMMITTED if "figures" in d and d["mode"] == "simulated"
            and (d.get("levers") or {}).get("stack") == "paper" and get_device(d["device"]).kind == "cuda"]
    assert len(rows) > 100
    some = 0
    for where, d, flat in rows:
        nccl = stack.nccl_buffer_bytes(StepCounts.from_flat(flat))
        some += nccl > 0
        assert d["figures"]["usable_bytes"] == stack.usable_bytes(get_device(d["device"]), "paper", nccl=nccl), where
    assert some == len(rows)


def test_the_records_keep_the_order_collectives_came_in():
    flat = {"flops.matmul": 1, "flops.attention": 2, "flops.other": 0,
            "comm.send.4.4.bytes": 8, "comm.send.4.4.calls": 1,
            "comm_attn.all_gather.4.4.bytes": 4, "comm_attn.all_gather.4.4.calls": 1,
            "comm.all_gather.4.4.bytes": 12, "comm.all_gather.4.4.calls": 3}
    counts = StepCounts.from_flat(flat)
    assert list(counts.collectives) == [Collective("send", 4, 4), Collective("all_gather", 4, 4, attention=True),
                                        Collective("all_gather", 4, 4)]
    assert counts.collectives[Collective("all_gather", 4, 4)] == Traffic(3, 12)
    assert list(counts.to_flat()) == sorted(flat)


def test_the_model_reads_the_records_as_it_read_the_keys():
    """Hand-made counts: each record lands in its term."""
    dev, link = get_device("h100-80g"), get_link("nvlink-h100")
    counts = StepCounts(flops_matmul=1e15, host_copies={HostCopy("offload", "d2h"): Traffic(2, 63e9),
                                                         HostCopy("method", "h2d"): Traffic(1, 1e9)},
                        collectives={Collective("all_to_all", 8, 8): Traffic(10, 0)})
    terms = step_time(counts, dev, link, FITTED)["terms"]
    assert terms["host_offload_s"] == pytest.approx(63e9 / (32e9 * 16 / 8 * 128 / 130))
    assert terms["host_method_s"] == pytest.approx(1e9 / (32e9 * 16 / 8 * 128 / 130))
    assert terms["comm_critical_calls"] == 10 and terms["comm_critical_s"] == pytest.approx(10 * FITTED.latency_s)


FLOPS = {"flops.matmul": 1, "flops.attention": 2, "flops.other": 0}


@pytest.mark.parametrize("flat,named", [
    ({**FLOPS, "comm.all_gather.8.bytes": 1, "comm.all_gather.8.calls": 1}, "comm.all_gather.8.bytes"),
    ({**FLOPS, "comm.all_gather.x.8.bytes": 1}, "comm.all_gather.x.8.bytes"),
    ({**FLOPS, "comm.all_gather.8.8.bytes": 1}, "comm.all_gather.8.8"),  # its calls missing
    ({**FLOPS, "comm.all_gather.4.8.bytes": 1, "comm.all_gather.4.8.calls": 1}, "in_node"),
    ({**FLOPS, "comm.all_gather.08.8.bytes": 1}, "comm.all_gather.8.8.bytes"),  # one key per kind
    ({**FLOPS, "flops.tensor": 1}, "flops.tensor"),
    ({"flops.matmul": 1, "flops.attention": 2}, "flops.other"),
    ({**FLOPS, "host.offload.d2h_calls": 1}, "host.offload.d2h"),
    ({**FLOPS, "host.disk.d2h_calls": 1, "host.disk.d2h_bytes": 1}, "host.disk.d2h_calls"),
    ({**FLOPS, "bytes.memory_bound_calls": 1}, "bytes.memory_bound"),
    ({**FLOPS, "bytes.other": 1}, "bytes.other"),
    ({**FLOPS, "pipeline.chunk_passes": "12"}, "pipeline.chunk_passes"),
    ({**FLOPS, "counts_version": 3}, "counts_version"),  # version 3 did not write it
    ({**FLOPS, "counts_version": 4.0}, "counts_version"),
    ({**FLOPS, "counts_version": COUNTS_VERSION + 1}, "counts_version"),
])
def test_malformed_flat_counts_are_refused_naming_the_key(flat, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")) as err:
        StepCounts.from_flat(flat)
    assert "\n" not in str(err.value)


def test_the_counts_version_is_written_read_kept_and_mixed_counts_are_old():
    """Counts of this version carry it through the flat form, scaling and combining; counts from before it
    was written are known by their content (3 with the memory-bound bytes, 2 without); counts of two
    versions combine into counts of the oldest (taken as old, so a planner simulates them again), empty counts
    join any."""
    new = StepCounts(flops_matmul=1, memory_bound=Traffic(1, 10), version=COUNTS_VERSION)
    flat = new.to_flat()
    assert flat["counts_version"] == COUNTS_VERSION and StepCounts.from_flat(flat) == new
    old = dataclasses.replace(new, version=None)
    assert "counts_version" not in old.to_flat() and old.known_version() == 3
    assert dataclasses.replace(old, memory_bound=None).known_version() == 2
    assert counts_version(StepCounts()) == COUNTS_VERSION
    assert scale_counts(new, 1, 2).version == COUNTS_VERSION
    assert StepCounts.combine([new, StepCounts()], lambda a, b: a + b).version == COUNTS_VERSION
    assert StepCounts.combine([old, old], lambda a, b: a + b).version is None
    assert StepCounts.combine([old, new], lambda a, b: a + b).known_version() == 3
    assert constants_for(new) is FITTED and constants_for(old) is FITTED_V3


def test_an_event_named_like_a_count_is_refused_on_writing():
    with pytest.raises(ValueError, match="flops.matmul"):
        StepCounts(events={"flops.matmul": 1}).to_flat()
