"""``make demo``: the suite's main job on its embedded default.

Stage 1 (this file, until the sweep/analysis stages land): every usable method is checked
against the single-device reference on real gloo ranks (world sizes 2 and 4, causal GQA,
fp32 and bf16; output, dx and every weight gradient), and UPipe's memory claim is
simulated for the Llama3-8B and Qwen3-32B attention shapes at 1M tokens on 8 ranks.
"""
from __future__ import annotations

import sys
import time

import torch

import methods
from tests.distpool import RankPool
from tests.methods.cases import SPECS, TOLERANCE, check_against_reference


def correctness(pool: RankPool) -> bool:
    ok = True
    names = methods.available()
    print(f"[real, gloo CPU] checking {len(names)} methods against the reference: {', '.join(names)}")
    print(f"{'method':<12} {'ws':>3} {'dtype':<9} {'worst rel. error':>17}  verdict")
    for name in names:
        for ws in (2, 4):
            for dtype in ("float32", "bfloat16"):
                spec = dict(SPECS["gqa"], causal=True)
                try:
                    methods.validate(name, methods.AttnSpec(**spec), ws)
                except ValueError as err:
                    print(f"{name:<12} {ws:>3} {dtype:<9} {'-':>17}  skipped: {err}")
                    continue
                errs = pool.run(check_against_reference, name, spec, {}, dtype, world_size=ws)
                worst = max(max(e.values()) for e in errs)
                good = worst <= TOLERANCE[dtype]
                ok &= good
                print(f"{name:<12} {ws:>3} {dtype:<9} {worst:>17.2e}  {'ok' if good else 'FAIL'}")
    return ok


def memory() -> None:
    from bench.simulate import fake_process_group, fake_tensors, track_peak

    shapes = {
        "llama3-8b": dict(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128),
        "qwen3-32b": dict(dim=5120, n_heads=64, n_kv_heads=8, head_dim=128),
    }
    seq, ws = 1 << 20, 8
    print(f"\n[simulated] attention block fwd+bwd, bf16, S=1M tokens, C={ws}: peak GiB per rank")
    for shape, kw in shapes.items():
        peaks = {}
        for name in ("ulysses", "upipe"):
            with fake_process_group(ws) as group, fake_tensors(torch.bfloat16):
                block = methods.build(name, methods.AttnSpec(**kw), group=group)
                x = torch.randn(1, seq // ws, kw["dim"], requires_grad=True)
                dy = torch.randn_like(x)
                peaks[name] = track_peak(lambda: block(x).backward(dy), block, x, dy).gib()
        print(f"  {shape:<10} ulysses {peaks['ulysses']:6.2f}   upipe(U=C) {peaks['upipe']:6.2f}")


def main() -> int:
    start = time.time()
    pool = RankPool(4)
    try:
        ok = correctness(pool)
    finally:
        pool.close()
    memory()
    print(f"\ndemo finished in {time.time() - start:.0f}s: {'all methods match the reference' if ok else 'MISMATCHES FOUND'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
