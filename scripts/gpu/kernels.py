"""Real-GPU kernel rates for the step-time model's two kernel classes (bench.stackmodel.steptime).

Run on a CUDA machine (scripts/gpu/validate.sh does): times, with CUDA events after warm-up,

* the bf16 matrix products of one Llama3-8B block at a tile of tokens (q/k/v/o projections,
  the SwiGLU MLP), as achieved TFLOP/s;
* the attention kernel our methods call on CUDA (``methods.core.kernels`` "torch": PyTorch's
  flash attention, FlashAttention-2's code) forward and backward, causal, GQA, at the per-rank
  shapes of Ulysses (S tokens x H/C heads), as achieved TFLOP/s with the causal FLOP count the
  step-time model uses (forward 4·S²·H·d/2, backward 2.5x forward);

and checks the CUDA kernel's output and gradients against the fp32 math kernel on a small
GQA case (relative error), so the rates belong to a kernel that computes the right thing.
Prints one JSON object per measurement and writes them all to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from methods.core.kernels import get_kernel, softmax_scale  # noqa: E402


def timed_ms(fn, warmup: int = 3, iters: int = 10) -> dict[str, float]:
    """Median/min/max milliseconds of ``fn`` over ``iters`` event-timed calls after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def matmuls(tokens: int, dim: int, ffn: int, q_dim: int, kv_dim: int) -> list[dict]:
    rows = []
    shapes = {"qkv": (dim, q_dim + 2 * kv_dim), "o": (q_dim, dim), "gate_up": (dim, 2 * ffn), "down": (ffn, dim)}
    for name, (k, n) in shapes.items():
        a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        t = timed_ms(lambda a=a, b=b: a @ b)
        flops = 2 * tokens * k * n
        rows.append({"kind": "matmul", "name": name, "m": tokens, "k": k, "n": n, **t,
                     "tflops": flops / (t["median_ms"] * 1e-3) / 1e12})
    return rows


def attention(seq: int, heads: int, kv_heads: int, head_dim: int, iters: int) -> dict:
    kernel = get_kernel("torch")
    scale = softmax_scale(head_dim)
    q = torch.randn(1, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, seq, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out, lse = kernel.forward(q, k, v, True, scale)
    dout = torch.randn_like(out)
    fwd = timed_ms(lambda: kernel.forward(q, k, v, True, scale), warmup=2, iters=iters)
    bwd = timed_ms(lambda: kernel.backward(dout, q, k, v, out, lse, True, scale), warmup=2, iters=iters)
    flops_fwd = 4 * seq * seq * heads * head_dim / 2
    return {"kind": "attention", "kernel": kernel.name, "seq": seq, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "causal": True,
            "fwd": {**fwd, "tflops": flops_fwd / (fwd["median_ms"] * 1e-3) / 1e12},
            "bwd": {**bwd, "tflops": 2.5 * flops_fwd / (bwd["median_ms"] * 1e-3) / 1e12}}


def check_against_math(seq: int = 1024, heads: int = 8, kv_heads: int = 2, head_dim: int = 64) -> dict:
    """Relative error of the CUDA kernel (bf16) against the fp32 math kernel, output and grads."""
    torch.manual_seed(0)
    q = torch.randn(1, seq, heads, head_dim, device="cuda")
    k = torch.randn(1, seq, kv_heads, head_dim, device="cuda")
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    scale = softmax_scale(head_dim)
    results = {}
    for name, dtype in (("math", torch.float32), ("torch", torch.bfloat16)):
        kern = get_kernel(name)
        args = [t.to(dtype) for t in (q, k, v)]
        out, lse = kern.forward(*args, True, scale)
        grads = kern.backward(dout.to(dtype), *args, out, lse, True, scale)
        results[name] = [t.float() for t in (out, *grads)]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    errs = {n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), results["torch"], results["math"], strict=False)}
    return {"kind": "check", "against": "math fp32", "seq": seq, "heads": heads, "kv_heads": kv_heads,
            "rel_err": errs, "ok": all(e < 2e-2 for e in errs.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [{"kind": "device", "name": torch.cuda.get_device_name(), "torch": torch.__version__,
             "cuda": torch.version.cuda}]
    rows.append(check_against_math())
    rows += matmuls(tokens=4096, dim=4096, ffn=14336, q_dim=4096, kv_dim=1024)
    # Ulysses' per-rank attention: the whole sequence, H/C heads (C = 1, 8 of Llama3-8B's 32/8)
    for seq, heads, kv_heads in ((32768, 32, 8), (131072, 32, 8), (131072, 4, 1), (524288, 4, 1)):
        rows.append(attention(seq, heads, kv_heads, 128, iters=5 if seq > 200_000 else 10))
    with args.out.open("w") as f:
        for row in rows:
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
