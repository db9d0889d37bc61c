"""The flash op's variable-length rate by document length and heads per call, relative to its dense rate.

A call of the flash op's variable-length form (``aten._flash_attention_forward/backward`` with
cumulative sequence lengths, what ``methods.core.kernels`` issues for a call with documents on CUDA)
schedules its work per (document, 128-row tile, head): each such unit carries a fixed cost (its
launch slot, loading its Q tile, the softmax prologue and epilogue, writing its output and LSE)
beside the arithmetic it does. A long document amortises that cost over many key tiles, a short
one cannot (a 128-token document is one tile against one tile, half of it masked); and the fewer
heads a call has, the fewer units share the launch and fill the device's SMs. So the rate per
counted FLOP falls with shorter documents and with fewer heads per call, the more so in the
backward, which has more per-tile bookkeeping. The step-time model (``bench.stackmodel.steptime``)
charges attention at a dense efficiency; ``relative_rate`` is the factor a varlen call's documents
run at against that, and ``bench.stackmodel.varlencount`` turns it into the extra dense-rate FLOPs
a call costs (``StepCounts.flops_attention_varlen_excess``).

Source: ``RATES_FILE`` (``results/gpu/h200-docs-kernel/varlen_kernel.ndjson``, one NVIDIA H200,
torch's SDPA flash op, bf16, causal, head dim 128, 65536 tokens per call; ``scripts/gpu/varlen.py``).
Its rows of ``kind == "varlen_rate"`` with ``docs == "fixed-L"`` and ``path == "varlen"`` time the
op alone on documents of ``L`` tokens (``fwd_kernel``/``bwd_kernel``: the cumulative lengths already
on the device); the row with ``path == "dense"`` (one 65536-token sequence) gives the dense rate at
the same heads (``fwd``/``bwd``). Rates are TFLOP/s of the (query, key) pairs the mask keeps, so the
ratio is per counted FLOP, as ``varlencount`` counts them. Measured at 1, 4, 8 and 32 query heads per
call (with 1, 1, 2, 8 KV heads) and documents of 128 to 32768 tokens.

``relative_rate`` interpolates linearly in log2(length) between the measured lengths (the dense
length counted as a measured point of ratio 1) and in log2(heads) between the measured head counts;
outside, it clamps: below the shortest length the shortest's ratio, at or above the dense length
1.0, heads below 1 or above 32 the nearest measured count. Ratios are kept as measured: where long
documents at several heads per call measured marginally above the dense rate (within the op's
run-to-run spread), a call of such documents is modelled marginally faster than a dense one.

Assumptions, stated: the relative fall-off measured on FlashAttention 2's code (torch's SDPA flash)
on an H200 is applied to every kernel (FlashAttention 3, whose dense rate the model charges for most
methods, included) and every device; the KV-head ratio is not a separate axis (measured at 1/1, 4/1,
8/2 and 32/8 query/KV heads; a call's KV heads are not read); non-causal varlen calls take the causal
table.

Not covered: a call of mixed lengths is modelled as its documents each at its own length's rate,
which the same file's three published draws (rows ``prolong64k:0``, ``pile:0``,
``magiattention-cp:0``) show too fast, the most at one head per call (``results/gpu/README.md``,
"The step under documents"; a likely cause: the op's grid is sized by the call's longest document,
so short documents leave row tiles idle and the longest ones' last tiles finish alone). A dense call
shorter than the dense length is charged the model's dense rate (the table measures documents within
one call of the dense length, not short dense calls). And a call with documents that does not tile
into one varlen call (a ring step's blocks, ``methods.core.kernels.blockwise_forward``: one dense
call per document block) stays at the dense rate, each block counted at its own FLOPs. The step-time
model has no per-kernel-launch term (its ``latency_s`` is per collective call; the memory-bound
kernels' calls are counted but only their bytes are timed), so the fixed cost of those many small
dense calls is not modelled either.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RATES_FILE = ROOT / "results" / "gpu" / "h200-docs-kernel" / "varlen_kernel.ndjson"
PASSES = ("fwd", "bwd")


@dataclass(frozen=True)
class RateTable:
    """Measured varlen rate over dense rate, on a grid of document lengths and query heads per call."""

    lengths: tuple[int, ...]  # document lengths, ascending; the last is the dense length (ratio 1)
    heads: tuple[int, ...]  # query heads per call, ascending
    ratios: dict[str, tuple[tuple[float, ...], ...]]  # pass -> [heads index][length index]

    @property
    def dense_length(self) -> int:
        return self.lengths[-1]


def _malformed(why: str) -> ValueError:
    return ValueError(f"{RATES_FILE}: {why} (the varlen rate table of bench.stackmodel.varlenrate; "
                      "restore the committed file)")


def _tflops(row: dict, key: str) -> float:
    entry = row.get(key)
    value = entry.get("tflops") if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _malformed(f"row {row.get('docs')!r} at {row.get('heads')} heads has no positive {key}.tflops")
    return float(value)


def parse(lines: list[str]) -> RateTable:
    """The table of ``RATES_FILE``'s lines (module docstring); a ``ValueError`` naming the file when the
    rows do not make a full grid (every head count with a dense row and the same measured lengths)."""
    dense: dict[int, dict] = {}
    fixed: dict[int, dict[int, dict]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise _malformed(f"line {n} is not JSON") from None
        if not isinstance(row, dict) or row.get("kind") != "varlen_rate":
            continue
        docs, heads, path = row.get("docs"), row.get("heads"), row.get("path")
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
            raise _malformed(f"line {n} has no positive integer heads")
        if path == "dense":
            dense[heads] = row
        elif path == "varlen" and isinstance(docs, str) and docs.startswith("fixed-"):
            try:
                length = int(docs.removeprefix("fixed-"))
            except ValueError:
                raise _malformed(f"line {n}: docs {docs!r} is not fixed-<length>") from None
            fixed.setdefault(heads, {})[length] = row
    if not dense or set(dense) != set(fixed):
        raise _malformed(f"heads with a dense row {sorted(dense)} and with fixed-length varlen rows "
                         f"{sorted(fixed)} must be the same, non-empty set")
    heads = tuple(sorted(dense))
    lengths = tuple(sorted(fixed[heads[0]]))
    dense_len = {r.get("seq") for r in dense.values()}
    if len(dense_len) != 1 or not isinstance(next(iter(dense_len)), int):
        raise _malformed(f"the dense rows must share one integer seq, got {sorted(map(str, dense_len))}")
    dense_length = dense_len.pop()
    if any(tuple(sorted(fixed[h])) != lengths for h in heads) or not lengths or lengths[-1] >= dense_length:
        raise _malformed(f"every head count must have varlen rows at the same lengths, all below the dense "
                         f"{dense_length}; got {({h: sorted(fixed[h]) for h in heads})}")
    ratios = {p: tuple(tuple(_tflops(fixed[h][length], f"{p}_kernel") / _tflops(dense[h], p) for length in lengths)
                       + (1.0,) for h in heads) for p in PASSES}
    return RateTable(lengths=lengths + (dense_length,), heads=heads, ratios=ratios)


@lru_cache(maxsize=1)
def table() -> RateTable:
    """``RATES_FILE``'s table, read once; a one-line error naming the file if it is missing or malformed."""
    try:
        text = RATES_FILE.read_text()
    except OSError as err:
        raise FileNotFoundError(f"{RATES_FILE}: cannot read the varlen rate table ({err.strerror}); restore the "
                                "committed file (bench.stackmodel.varlenrate)") from None
    return parse(text.splitlines())


def _bracket(grid: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """Indices (i, j) of the grid points around ``x`` (clamped) and the weight of j, linear in log2."""
    if x <= grid[0]:
        return 0, 0, 0.0
    if x >= grid[-1]:
        last = len(grid) - 1
        return last, last, 0.0
    j = bisect.bisect_right(grid, x)
    i = j - 1
    if grid[i] == x:
        return i, i, 0.0
    return i, j, (math.log2(x) - math.log2(grid[i])) / (math.log2(grid[j]) - math.log2(grid[i]))


def relative_rate(length: int, heads: int, pass_: str) -> float:
    """The op's measured rate on documents of ``length`` tokens at ``heads`` query heads per call, over
    its dense rate at the same heads (``pass_``: ``"fwd"`` or ``"bwd"``), interpolated and clamped as the
    module docstring says."""
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    if length < 0 or heads < 1:
        raise ValueError(f"relative_rate needs length >= 0 and heads >= 1, got length {length}, heads {heads}")
    grid = table()
    if length >= grid.dense_length:
        return 1.0
    li, lj, lw = _bracket(grid.lengths, length)
    hi, hj, hw = _bracket(grid.heads, heads)
    rows = grid.ratios[pass_]

    def along_length(h: int) -> float:
        return rows[h][li] + lw * (rows[h][lj] - rows[h][li])

    low = along_length(hi)
    return low + hw * (along_length(hj) - low) if hj != hi else low
