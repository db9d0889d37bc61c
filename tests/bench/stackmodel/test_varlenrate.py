"""bench.stackmodel.varlenrate: the flash op's varlen rate by document length and heads, and its excess
FLOPs through the counts (``bench.stackmodel.varlencount``, ``StepCounts``) into the step-time model."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from bench.cli import main
from bench.stackmodel import varlencount, varlenrate
from bench.stackmodel.counts import StepCounts
from bench.stackmodel.hardware import get_device, get_link
from bench.stackmodel.steptime import (
    FITTED,
    attention_kernel,
    attention_rate,
    scale_counts,
    slowest_rank_counts,
    step_time,
)
from bench.stackmodel.varlenrate import PASSES, RATES_FILE, relative_rate

aten = torch.ops.aten


def _measured() -> dict[tuple[str, int, int], float]:
    """(pass, heads, length) -> the op's varlen rate over its dense rate at the same heads, read here from
    the committed file (the fixed-length varlen rows against the dense row)."""
    rows = [json.loads(line) for line in RATES_FILE.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("kind") == "varlen_rate"]
    dense = {r["heads"]: r for r in rows if r["path"] == "dense"}
    out = {}
    for r in rows:
        if r["path"] == "varlen" and r["docs"].startswith("fixed-"):
            for p in PASSES:
                out[p, r["heads"], int(r["docs"][6:])] = r[f"{p}_kernel"]["tflops"] / dense[r["heads"]][p]["tflops"]
    return out


MEASURED = _measured()
HEADS = sorted({h for _, h, _ in MEASURED})
LENGTHS = sorted({n for _, _, n in MEASURED})


@pytest.fixture
def rates_file(tmp_path, monkeypatch):
    """Point the module at a file of the test's making; the cached table is dropped before and after."""
    path = tmp_path / "varlen_kernel.ndjson"
    monkeypatch.setattr(varlenrate, "RATES_FILE", path)
    varlenrate.table.cache_clear()
    yield path
    monkeypatch.undo()
    varlenrate.table.cache_clear()


def test_the_measured_points_give_the_measured_ratios():
    assert len(HEADS) >= 2 and len(LENGTHS) >= 2
    for (p, h, n), want in MEASURED.items():
        assert relative_rate(n, h, p) == pytest.approx(want, rel=1e-12), (p, h, n)


def test_the_rate_falls_with_shorter_documents_and_interpolation_keeps_the_data_monotone():
    dense_len = varlenrate.table().dense_length
    for p in PASSES:
        for h in HEADS:
            points = [(n, MEASURED[p, h, n]) for n in LENGTHS] + [(dense_len, 1.0)]
            # the mechanism: short documents run below long ones at every head count
            assert points[0][1] < min(r for _, r in points[1:]), (p, h)
            for (n0, r0), (n1, r1) in zip(points, points[1:], strict=False):
                inside = [round(n0 * (n1 / n0) ** (i / 8)) for i in range(9)]
                values = [relative_rate(n, h, p) for n in inside]
                step = 1 if r1 >= r0 else -1  # monotone between measured points, the way the data goes
                assert all(step * (b - a) >= -1e-12 for a, b in zip(values, values[1:], strict=False)), (p, h, n0)
                assert min(r0, r1) - 1e-12 <= min(values) and max(values) <= max(r0, r1) + 1e-12


def test_interpolation_is_linear_in_log2_of_length_and_heads():
    a, b = LENGTHS[0], LENGTHS[1]
    h0, h1 = HEADS[0], HEADS[1]
    for p in PASSES:
        mid_len = math.sqrt(a * b)  # halfway in log2
        assert relative_rate(mid_len, h0, p) == pytest.approx((MEASURED[p, h0, a] + MEASURED[p, h0, b]) / 2)
        mid_heads = math.sqrt(h0 * h1)
        assert relative_rate(a, mid_heads, p) == pytest.approx((MEASURED[p, h0, a] + MEASURED[p, h1, a]) / 2)


def test_outside_the_measured_range_it_clamps():
    dense_len = varlenrate.table().dense_length
    for p in PASSES:
        for h in HEADS:
            assert relative_rate(0, h, p) == relative_rate(LENGTHS[0] // 2, h, p) == MEASURED[p, h, LENGTHS[0]]
            assert relative_rate(dense_len, h, p) == relative_rate(dense_len * 16, h, p) == 1.0
        assert relative_rate(LENGTHS[2], HEADS[-1] * 4, p) == relative_rate(LENGTHS[2], HEADS[-1], p)
        assert relative_rate(LENGTHS[2], 1, p) == relative_rate(LENGTHS[2], HEADS[0], p)


@pytest.mark.parametrize("args,needle", [((128, 4, "both"), "pass_ must be one of"),
                                         ((-1, 4, "fwd"), "length >= 0"), ((128, 0, "bwd"), "heads >= 1")])
def test_bad_arguments_are_one_line(args, needle):
    with pytest.raises(ValueError, match=needle) as err:
        relative_rate(*args)
    assert "\n" not in str(err.value)


def test_a_missing_or_malformed_file_is_one_line_naming_it(rates_file):
    with pytest.raises(FileNotFoundError) as err:
        relative_rate(512, 4, "fwd")
    assert str(rates_file) in str(err.value) and "\n" not in str(err.value)
    rows = [json.loads(line) for line in RATES_FILE.read_text().splitlines() if line.strip()]
    for broken in ("{not json\n",  # not JSON
                   "\n".join(json.dumps(r) for r in rows if r.get("path") != "dense"),  # no dense rows
                   "\n".join(json.dumps(r) for r in rows if r.get("docs") != "fixed-512" or r.get("heads") != 4),
                   "\n".join(json.dumps({**r, "fwd_kernel": {}} if r.get("path") == "varlen" else r) for r in rows)):
        rates_file.write_text(broken)
        varlenrate.table.cache_clear()
        with pytest.raises(ValueError) as err:
            relative_rate(512, 4, "fwd")
        assert str(rates_file) in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_table_is_read_once(rates_file):
    rates_file.write_text(RATES_FILE.read_text())
    assert relative_rate(512, 4, "fwd") == pytest.approx(MEASURED["fwd", 4, 512])
    rates_file.unlink()  # cached: no second read
    assert relative_rate(1024, 8, "bwd") == pytest.approx(MEASURED["bwd", 8, 1024])


@pytest.mark.parametrize("backward", [False, True])
def test_a_varlen_calls_excess_is_each_documents_flops_over_its_rate(backward):
    """``excess_flops`` of one varlen call: ``sum flops_doc (1 / relative_rate - 1)``, each document's
    FLOPs its causal pairs x 4 d (forward) or 10 d (backward) per query head."""
    docs, h_q, h_k, d = [100, 683, 4096, 70000], 8, 2, 64
    total = sum(docs)
    with varlencount.tracking() as mode:
        q = torch.empty(total, h_q, d, device="meta")
        k = v = torch.empty(total, h_k, d, device="meta")
        cu = torch.empty(len(docs) + 1, dtype=torch.int32, device="meta")
        mode.values[cu] = [sum(docs[:i]) for i in range(len(docs) + 1)]  # as if made from host ints
        if backward:
            args = (q, q, k, v, q, None, cu, cu, max(docs), max(docs), 0.0, True)
            packet = aten._flash_attention_backward
        else:
            args = (q, k, v, cu, cu, max(docs), max(docs), 0.0, True, False)
            packet = aten._flash_attention_forward
        got = varlencount.excess_flops(packet, args, {})
        assert varlencount.excess_flops(aten._scaled_dot_product_flash_attention, (q, k, v), {}) == 0.0
    per_pair = (10 if backward else 4) * d * h_q
    pass_ = "bwd" if backward else "fwd"
    want = sum(per_pair * n * (n + 1) // 2 * (1 / relative_rate(n, h_q, pass_) - 1) for n in docs)
    assert got == pytest.approx(want, rel=1e-9) and got > 0


def test_the_flat_form_keeps_the_excess_only_when_it_is_not_zero():
    base = {"flops.attention": 10, "flops.matmul": 5, "flops.other": 0}
    assert "flops.attention_varlen_excess" not in StepCounts.from_flat(base).to_flat()
    with_excess = {**base, "flops.attention_varlen_excess": 2.5}
    counts = StepCounts.from_flat(with_excess)
    assert counts.flops_attention_varlen_excess == 2.5 and counts.to_flat() == dict(sorted(with_excess.items()))
    with pytest.raises(ValueError, match="leaves it out"):
        StepCounts.from_flat({**base, "flops.attention_varlen_excess": 0})
    # carried like the attention FLOPs: to another length (S²) and to the slowest rank (its pairs' ratio)
    assert scale_counts(counts, 1, 2).flops_attention_varlen_excess == 10.0
    slowest = slowest_rank_counts(counts, 4, 6)
    assert slowest.flops_attention_varlen_excess / counts.flops_attention_varlen_excess == pytest.approx(1.5)
    assert slowest.flops_attention / counts.flops_attention == pytest.approx(1.5)


@pytest.fixture(scope="module")
def rows():
    """A simulated head-parallel step with documents and the same step as one sequence (tiny model, GPU code
    path, where a call with documents is one varlen call)."""
    import io
    from contextlib import redirect_stdout

    args = ["run", "--mode", "simulated", "--method", "ulysses", "--model", "tiny-llama", "--seq-len", "4K",
            "--world-size", "1", "--device", "h100-80g", "--no-save", "--json"]
    out = {}
    for name, extra in (("docs", ["--docs-lengths", "128,384,512,1024,2048"]), ("plain", [])):
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main(args + extra) == 0
        out[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
    return out


def test_a_docs_step_carries_an_excess_and_one_sequence_none(rows):
    docs = rows["docs"]["figures"]["step_time_model"]["counts"]
    plain = rows["plain"]["figures"]["step_time_model"]["counts"]
    assert docs["flops.attention_varlen_excess"] > 0
    assert "flops.attention_varlen_excess" not in plain
    assert StepCounts.from_flat(plain).flops_attention_varlen_excess == 0


def test_the_modelled_docs_step_grows_by_exactly_the_excess_over_the_rate(rows):
    row = rows["docs"]
    model = row["figures"]["step_time_model"]
    counts = StepCounts.from_flat(model["counts"])
    device, link = get_device(row["device"]), get_link(model["constants"]["link"])
    kernel = attention_kernel(row["method"])
    with_excess = step_time(counts, device, link, FITTED, kernel)
    without = step_time(dataclasses.replace(counts, flops_attention_varlen_excess=0.0), device, link, FITTED, kernel)
    grown = counts.flops_attention_varlen_excess / attention_rate(device, FITTED, kernel)
    assert with_excess["step_time_s"] == pytest.approx(row["figures"]["step_time_s"], rel=1e-12)
    assert with_excess["terms"]["compute_attention_s"] - without["terms"]["compute_attention_s"] == \
        pytest.approx(grown, rel=1e-9)
    assert without["terms"]["comm_overlapped_s"] == 0  # one rank: no collective to hide it behind, the step grows by it
    assert with_excess["step_time_s"] - without["step_time_s"] == pytest.approx(grown, rel=1e-9)
