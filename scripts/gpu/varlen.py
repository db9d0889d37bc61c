"""Real-GPU rates of the attention kernel under packed documents, by document length.

Run on a CUDA machine (``scripts/gpu/validate.sh OUT varlen`` does). With documents, every
head-parallel method (Ulysses, UPipe) makes one full-sequence call, which our ``torch`` kernel
runs as the CUDA flash op's variable-length form (``methods.core.kernels``: ``varlen_layout``).
This script

* checks that path against the fp32 ``math`` kernel with the same documents (output and the three
  gradients, causal and not, GQA), so the rates belong to a kernel that masks documents right;
* times the forward and backward at Ulysses' per-rank shape of Llama3-8B at 8 ranks (the whole
  sequence, 4 query heads, 1 KV head, head dim 128), causal, on documents of one fixed length
  (``fixed-LEN``, from the shortest to one document: dense) and on draws of the published
  distributions; the achieved TFLOP/s counts only the pairs the mask keeps
  (``bench.stackmodel.docwork``: forward ``4·d`` and backward ``10·d`` per pair and head), so a
  rate below the dense one is what the variable-length form loses per useful FLOP.

Prints one JSON object per measurement and writes them all to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import timed_ms  # noqa: E402

from bench.stackmodel.docwork import document_area  # noqa: E402
from methods.core.documents import Documents  # noqa: E402
from methods.core.kernels import get_kernel, softmax_scale  # noqa: E402
from records.workloads.distributions import sample, summary  # noqa: E402

FIXED_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
DISTRIBUTIONS = ("prolong64k", "pile", "magiattention-cp")
DEVICE = "cuda"  # --device cpu runs the script's logic on the CPU (the blockwise path, not the varlen one)


def check_against_math(causal: bool, seq: int = 4096, heads: int = 8, kv_heads: int = 2, head_dim: int = 64) -> dict:
    """Relative error of the varlen CUDA path (bf16) against the fp32 math kernel, same documents."""
    torch.manual_seed(0)
    docs = Documents.from_lengths([1000, 37, 2500, 559])
    assert docs.seq_len == seq
    q = torch.randn(1, seq, heads, head_dim, device=DEVICE)
    k = torch.randn(1, seq, kv_heads, head_dim, device=DEVICE)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    scale = softmax_scale(head_dim)
    results = {}
    for name, dtype in (("math", torch.float32), ("torch", torch.bfloat16)):
        kern = get_kernel(name)
        args = [t.to(dtype) for t in (q, k, v)]
        out, lse = kern.forward(*args, causal, scale, docs=docs)
        grads = kern.backward(dout.to(dtype), *args, out, lse, causal, scale, docs=docs)
        results[name] = [t.float() for t in (out, *grads)]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    errs = {n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), results["torch"], results["math"], strict=True)}
    return {"kind": "varlen_check", "against": "math fp32", "causal": causal, "doc_lengths": list(docs.lengths),
            "heads": heads, "kv_heads": kv_heads, "rel_err": errs, "ok": all(e < 2e-2 for e in errs.values())}


def untimed_ms(fn, warmup: int, iters: int) -> dict[str, float]:
    """``--device cpu``: calls ``fn`` once and reports no time (a check of the script, not a measurement)."""
    fn()
    return {"median_ms": float("nan"), "min_ms": float("nan"), "max_ms": float("nan")}


def rate(label: str, lengths: tuple[int, ...], heads: int, kv_heads: int, head_dim: int, iters: int) -> dict:
    """Forward and backward of one full-sequence call over these documents, timed."""
    docs = Documents.from_lengths(lengths)
    seq = docs.seq_len
    kernel = get_kernel("torch")
    scale = softmax_scale(head_dim)
    q = torch.randn(1, seq, heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(1, seq, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    dense = len(lengths) == 1
    given = {} if dense else {"docs": docs}  # one document: the dense call the step-time model's rate is of
    out, lse = kernel.forward(q, k, v, True, scale, **given)
    dout = torch.randn_like(out)
    timed = timed_ms if DEVICE == "cuda" else untimed_ms
    fwd = timed(lambda: kernel.forward(q, k, v, True, scale, **given), warmup=2, iters=iters)
    bwd = timed(lambda: kernel.backward(dout, q, k, v, out, lse, True, scale, **given), warmup=2, iters=iters)
    pairs = document_area(docs, True)
    flops_fwd, flops_bwd = 4 * pairs * heads * head_dim, 10 * pairs * heads * head_dim
    kernel_only = {}
    if not dense and DEVICE == "cuda":  # the flash op alone: cumulative lengths built once, outside the timing
        kfwd, kbwd = flash_op_ms(q, k, v, dout, docs, scale, iters)
        kernel_only = {"fwd_kernel": {**kfwd, "tflops": flops_fwd / (kfwd["median_ms"] * 1e-3) / 1e12},
                       "bwd_kernel": {**kbwd, "tflops": flops_bwd / (kbwd["median_ms"] * 1e-3) / 1e12}}
    return {"kind": "varlen_rate", "kernel": kernel.name, "docs": label, "seq": seq, "n_docs": len(lengths),
            "lengths": summary(lengths), "pairs": pairs, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "causal": True,
            "path": "dense" if dense else "varlen" if DEVICE == "cuda" else "blockwise",
            "fwd": {**fwd, "tflops": flops_fwd / (fwd["median_ms"] * 1e-3) / 1e12},
            "bwd": {**bwd, "tflops": flops_bwd / (bwd["median_ms"] * 1e-3) / 1e12}, **kernel_only}


def flash_op_ms(q, k, v, dout, docs: Documents, scale: float, iters: int) -> tuple[dict, dict]:
    """The CUDA flash op's variable-length forward and backward alone (what ``kernels.TorchKernel``
    calls), with the cumulative lengths already on the device: the kernel's own time, without the
    host work of a call (the mask rule, the lengths' copy), which a step overlaps with other kernels."""
    seq, heads, d = q.shape[1], q.shape[2], q.shape[3]
    cu = docs.cu_seqlens(q.device).to(torch.int32)
    longest = max(docs.lengths)
    q2, k2, v2, do2 = q.view(seq, heads, d), k.view(seq, -1, d), v.view(seq, -1, d), dout.view(seq, heads, d)

    def fwd():
        return torch.ops.aten._flash_attention_forward(q2, k2, v2, cu, cu, longest, longest, 0.0, True, False,
                                                       scale=scale)[:2]

    out, lse = fwd()
    seed = torch.zeros((), dtype=torch.int64, device=q.device)

    def bwd():
        return torch.ops.aten._flash_attention_backward(do2, q2, k2, v2, out, lse, cu, cu, longest, longest, 0.0,
                                                        True, seed, seed, scale=scale)

    return timed_ms(fwd, warmup=2, iters=iters), timed_ms(bwd, warmup=2, iters=iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seq", type=int, default=131072, help="tokens per call (default 128K)")
    parser.add_argument("--heads", default="4:1", help="query:KV heads per call, comma-separated (default 4:1)")
    parser.add_argument("--lengths", default=",".join(map(str, FIXED_LENGTHS)), help="fixed document lengths")
    parser.add_argument("--no-distributions", action="store_true", help="time only the fixed lengths")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only checks the script itself")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    rows = [{"kind": "device", "name": name, "torch": torch.__version__, "cuda": torch.version.cuda}]
    rows += [check_against_math(causal) for causal in (True, False)]
    head_dim = 128  # Llama3-8B's; 4:1 heads is its 32/8 over 8 Ulysses ranks, 1:1 one UPipe stage of U = 1
    for pair in args.heads.split(","):
        heads, kv_heads = (int(x) for x in pair.split(":"))
        for length in (int(x) for x in args.lengths.split(",")):
            if length <= args.seq:
                rows.append(rate(f"fixed-{length}", (length,) * (args.seq // length), heads, kv_heads, head_dim, 10))
        for name in () if args.no_distributions else DISTRIBUTIONS:
            rows.append(rate(f"{name}:0", sample(name, args.seq, 0), heads, kv_heads, head_dim, 10))
    with args.out.open("w") as f:
        for row in rows:
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
