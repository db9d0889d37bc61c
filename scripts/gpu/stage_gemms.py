"""Real-GPU cost of UPipe's per-stage projections against one full-width projection.

UPipe (``methods.upipe``) projects Q, K and V one head stage at a time and applies ``wo`` per
stage in the backward: at one rank with U = C = 1 that is 32 projections of 128 columns each for
Llama3-8B instead of one of 4096. The step-time model counts their FLOPs at the dense GEMM rate;
this script measures whether skinny GEMMs (and the weight-row gathers a stage makes) run below it.

For ``--tokens`` tokens in bf16 it times, per head-stage width ``U`` (query heads per stage):
the stage's forward projections (x @ wq_rows.T, and K/V for its KV heads), the backward's GEMMs
(dx += dq @ wq_rows, dW_rows = dq.T @ x, dy @ wo_cols), the weight gathers, each summed over the
stages, beside the same work as full-width GEMMs. Prints one JSON object per line and writes
them to ``--out``. ``--device cpu`` runs the logic at a small size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import timed_ms as kernels_timed_ms  # noqa: E402


def timed_ms(fn, device: str, warmup: int = 2, iters: int = 5) -> float:
    """Median milliseconds of ``fn``: CUDA events on a GPU (``kernels.timed_ms``), perf_counter on the CPU."""
    if device == "cuda":
        return kernels_timed_ms(fn, warmup=warmup, iters=iters)["median_ms"]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(tokens: int, dim: int, heads: int, kv_heads: int, head_dim: int, u: int, device: str) -> dict:
    dt = torch.bfloat16
    x = torch.randn(tokens, dim, device=device, dtype=dt)
    wq = torch.randn(heads * head_dim, dim, device=device, dtype=dt)
    wk = torch.randn(kv_heads * head_dim, dim, device=device, dtype=dt)
    wo = torch.randn(dim, heads * head_dim, device=device, dtype=dt)
    stages = heads // u
    kv_per_stage = max(1, kv_heads * u // heads)
    rows = [torch.arange(s * u * head_dim, (s + 1) * u * head_dim, device=device) for s in range(stages)]
    kv_rows = [torch.arange((s * kv_per_stage % kv_heads) * head_dim,
                            (s * kv_per_stage % kv_heads + kv_per_stage) * head_dim, device=device)
               for s in range(stages)]
    dq = torch.randn(tokens, u * head_dim, device=device, dtype=dt)
    dy = torch.randn(tokens, dim, device=device, dtype=dt)
    dx = torch.zeros(tokens, dim, device=device, dtype=dt)

    def fwd_stages():
        for r, kr in zip(rows, kv_rows, strict=True):
            x @ wq.index_select(0, r).t()
            x @ wk.index_select(0, kr).t()
            x @ wk.index_select(0, kr).t()  # V: the same shape as K

    def bwd_stages():
        for r in rows:
            w = wq.index_select(0, r)
            dx.addmm_(dq, w)
            dq.t() @ x
            dy @ wo[:, r]

    def gathers():
        for r, kr in zip(rows, kv_rows, strict=True):
            wq.index_select(0, r)
            wk.index_select(0, kr)
            wo[:, r].contiguous()

    dq_full = torch.randn(tokens, heads * head_dim, device=device, dtype=dt)

    def fwd_full():
        x @ wq.t()
        x @ wk.t()
        x @ wk.t()

    def bwd_full():
        dx.addmm_(dq_full, wq)
        dq_full.t() @ x
        dy @ wo

    out = {"tokens": tokens, "dim": dim, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
           "u": u, "stages": stages, "kv_heads_per_stage": kv_per_stage, "device": device,
           "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    for name, fn in (("fwd_stages_ms", fwd_stages), ("bwd_stages_ms", bwd_stages), ("gathers_ms", gathers),
                     ("fwd_full_ms", fwd_full), ("bwd_full_ms", bwd_full)):
        out[name] = round(timed_ms(fn, device), 4)
    # FLOPs of the stage GEMMs as run (K/V projected once per stage) and of the full-width ones
    fwd_flops = 2 * tokens * dim * head_dim * stages * (u + 2 * kv_per_stage)
    bwd_flops = 3 * 2 * tokens * dim * head_dim * heads
    out["fwd_stages_tflops"] = round(fwd_flops / (out["fwd_stages_ms"] * 1e-3) / 1e12, 2)
    out["bwd_stages_tflops"] = round(bwd_flops / (out["bwd_stages_ms"] * 1e-3) / 1e12, 2)
    out["fwd_full_tflops"] = round(2 * tokens * dim * head_dim * (heads + 2 * kv_heads)
                                   / (out["fwd_full_ms"] * 1e-3) / 1e12, 2)
    out["bwd_full_tflops"] = round(bwd_flops / (out["bwd_full_ms"] * 1e-3) / 1e12, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--u", default="1,2,4,8,32", help="query heads per stage, comma-separated")
    a = p.parse_args()
    dims = (4096, 32, 8, 128) if a.device == "cuda" else (256, 8, 2, 32)
    tokens = a.tokens if a.device == "cuda" else 512
    with open(a.out, "w") as f:
        for u in (int(v) for v in a.u.split(",")):
            if dims[1] % u:
                continue
            row = measure(tokens, *dims, u=u, device=a.device)
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
