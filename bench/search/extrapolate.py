"""Simulated trials of deep models from 3- and 4-layer simulations, extrapolated over layers.

A full simulation of a 32-64 layer model at millions of tokens takes minutes on one core
under the paper stack (the allocator trace grows with the layers), and a max-context search
runs many. The layers of a decoder are identical, so what one more layer adds to rank 0's
peak is a constant: its sharded parameters, gradients and optimizer state, and its offloaded
checkpoint (host). With 3 or more layers the step is in one regime (the first block keeps its
checkpoint on the device, and under ``offload_keep="first_last"`` the last too; the others
are offloaded; under ``offload_keep="none"`` all are, and under ``fsdp_offload`` each layer's
sharded state adds to the host instead of the device), so

    figure(L) = figure(3) + (figure(4) - figure(3)) * (L - 3)

for the peak, each tracker category, the host peak, the modelled communication and the
step-time counts (FLOPs, collectives, host copies: ``bench.measure.stepcount``). The
reserved peak (paper stack) is not linear in the layers: the allocator's slack above the live
bytes is what its cache holds around the peak moment, inside one block's backward, so it is
taken from the 4-layer simulation and added to the extrapolated peak,
``reserved(L) = peak(L) + (reserved(4) - peak(4))``. The same rule as ``bench.search.plan``
(``tests/bench/test_extrapolate.py`` checks it against a full simulation). A row made this way
says so in its notes.
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from records import Row

from ..measure.run import build_row, guarded, measure_simulated
from ..measure.trial import Trial

LOW = 3  # layer counts simulated: 3 and 4 (step.py keeps the first and last block's checkpoints on
# the device and offloads the others only when there are more than 2 blocks, so L >= 3 is one regime)


def layer_variant(cfg, n_layers: int, directory: str) -> str:
    """A JSON config file of ``cfg`` with ``n_layers`` layers (same name)."""
    path = Path(directory) / f"{cfg.name.replace('/', '_')}_L{n_layers}.json"
    if not path.exists():
        path.write_text(json.dumps({**cfg.to_dict(), "n_layers": n_layers}))
    return str(path)


LINEAR = ("peak_bytes", "host_peak_bytes", "comm_bytes", "comm_time_s")


def extrapolate(r3: dict[str, Any], r4: dict[str, Any], layers: int) -> dict[str, Any]:
    """The full model's simulated result from the 3- and 4-layer ones (``layers`` > 4)."""
    n = layers - LOW
    out = dict(r4)
    for key in LINEAR:
        if r3.get(key) is not None and r4.get(key) is not None:
            value = r3[key] + (r4[key] - r3[key]) * n
            out[key] = value if isinstance(r3[key], float) else int(value)
    if r4.get("peak_reserved_bytes") is not None:
        out["peak_reserved_bytes"] = out["peak_bytes"] + max(0, r4["peak_reserved_bytes"] - r4["peak_bytes"])
    c3, c4 = r3.get("step_counts") or {}, r4.get("step_counts") or {}
    if c3 or c4:  # FLOPs, collectives and host copies per layer are identical: linear too
        out["step_counts"] = {k: c3.get(k, 0) + (c4.get(k, 0) - c3.get(k, 0)) * n for k in set(c3) | set(c4)}
    cats = set(r3.get("peak_by_category") or {}) | set(r4.get("peak_by_category") or {})
    out["peak_by_category"] = {c: int(r3["peak_by_category"].get(c, 0)
                                      + (r4["peak_by_category"].get(c, 0) - r3["peak_by_category"].get(c, 0)) * n)
                               for c in cats}
    alloc3, alloc4 = r3.get("allocator"), r4.get("allocator")
    if alloc4:
        out["allocator"] = {**alloc4, "oom": (alloc4.get("oom") or (alloc3 or {}).get("oom")),
                            "peak_allocated_bytes": out.get("peak_bytes", alloc4["peak_allocated_bytes"])}
    return out


def layer_extrapolated_runner(workdir: str | None = None) -> Callable[[Trial], Row]:
    """A runner for ``bench.search.maxctx.search``: simulated trials of models deeper than 4
    layers are extrapolated from 3- and 4-layer simulations; others are simulated whole."""
    directory = workdir or tempfile.mkdtemp(prefix="cpab-layers-")

    def runner(trial: Trial) -> Row:
        if trial.mode != "simulated":
            raise ValueError("layer extrapolation is for simulated trials only")
        cfg = trial.config()
        t0 = time.perf_counter()
        if cfg.n_layers <= LOW + 1:
            return build_row(trial, guarded(measure_simulated, trial), time.perf_counter() - t0)
        results = [guarded(measure_simulated, dataclasses.replace(trial, model=layer_variant(cfg, n, directory)))
                   for n in (LOW, LOW + 1)]
        failed = next((r for r in results if r["status"] == "error"), None)
        result = failed or extrapolate(results[0], results[1], cfg.n_layers)
        if not failed:
            result["status"] = "ok"  # the budget is judged on the extrapolated figures (build_row)
            result["stack_notes"] = list(result.get("stack_notes") or []) + [
                f"extrapolated over layers: figure({cfg.n_layers}) = figure(3) + (figure(4) - figure(3)) x "
                f"{cfg.n_layers - LOW}, from 3- and 4-layer simulations (bench.search.extrapolate)"]
        return build_row(trial, result, time.perf_counter() - t0)

    return runner
