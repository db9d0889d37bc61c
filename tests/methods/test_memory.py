"""The paper's memory claim, simulated: attention block fwd+bwd at S = 1M tokens, C = 8, bf16.

FakeTensorMode + a ``fake`` process group + torch's MemTracker give rank 0's peak without
allocating. UPipe (U = C) must peak below Ulysses, and each method's simulated activation
peak must match its docstring formula (``activation_bytes``) within 10%.
"""
from __future__ import annotations

import pytest
import torch

import methods
from bench.measure.simulate import fake_process_group, fake_tensors, track_peak
from records import GiB

SEQ_LEN = 1 << 20
WORLD = 8
SHAPES = {
    "llama3-8b": dict(dim=4096, n_heads=32, n_kv_heads=8, head_dim=128, rope_theta=5e5),
    "qwen3-32b": dict(dim=5120, n_heads=64, n_kv_heads=8, head_dim=128, rope_theta=1e6),
}


def simulate_block(name: str, spec: methods.AttnSpec, **options) -> tuple[int, int]:
    """(simulated activation bytes, total peak bytes) of one block fwd+bwd on rank 0."""
    with fake_process_group(WORLD) as group, fake_tensors(torch.bfloat16):
        block = methods.build(name, spec, group=group, **options)
        n = SEQ_LEN // WORLD
        x = torch.randn(1, n, spec.dim, requires_grad=True)
        dy = torch.randn(1, n, spec.dim)
        peak = track_peak(lambda: block(x).backward(dy), block, x, dy)
    params = sum(p.numel() * 2 for p in block.parameters())
    # x, dy and the output y (same size) belong to the surrounding model, as do weights and grads
    outside = 3 * x.numel() * 2 + params + peak.by_category.get("gradient", 0)
    return peak.total - outside, peak.total


@pytest.mark.parametrize("shape", list(SHAPES))
def test_upipe_peak_below_ulysses_and_matches_formula(shape, capsys):
    spec = methods.AttnSpec(**SHAPES[shape], causal=True)
    sims, models = {}, {}
    for name in ("ulysses", "upipe"):
        cls = methods.get_info(name).cls
        act, total = simulate_block(name, spec)
        sims[name] = (act, total)
        models[name] = cls.activation_bytes(spec, SEQ_LEN, WORLD, cls.parse_options())
    uly, up = sims["ulysses"][0], sims["upipe"][0]
    paper_reduction = 1 - WORLD / spec.n_heads  # per-stage intermediates, U = C
    # UPipe's stage intermediates: its activations less the persistent pre-wo output and dx
    persistent = 2 * (SEQ_LEN // WORLD) * (spec.n_heads * spec.head_dim + spec.dim)
    with capsys.disabled():
        print(
            f"\n[simulated, bf16, S=1M, C={WORLD}, {shape}] peak per rank: "
            f"ulysses {sims['ulysses'][1] / GiB:.2f} GiB (activations {uly / GiB:.2f}, formula "
            f"{models['ulysses'] / GiB:.2f}); upipe U=C {sims['upipe'][1] / GiB:.2f} GiB (activations "
            f"{up / GiB:.2f}, formula {models['upipe'] / GiB:.2f}); activation reduction "
            f"{1 - up / uly:.1%}, of stage intermediates {1 - (up - persistent) / uly:.1%}; "
            f"paper's per-stage intermediate reduction 1-U/H = {paper_reduction:.1%}"
        )
    assert sims["upipe"][1] < sims["ulysses"][1]
    for name in sims:
        assert abs(sims[name][0] - models[name]) <= 0.10 * sims[name][0], (name, sims[name], models[name])


def test_upipe_memory_grows_with_chunk_size():
    """Larger U trades memory for fewer stages: the simulated peak must rise with U."""
    spec = methods.AttnSpec(**SHAPES["llama3-8b"], causal=True)
    peaks = [simulate_block("upipe", spec, chunk_heads=u)[0] for u in (8, 16, 32)]
    assert peaks[0] < peaks[1] < peaks[2], peaks


@pytest.mark.parametrize("name", ["usp", "usp-upipe"])
def test_hybrids_simulate_in_successive_fake_groups(name):
    """Subgroups cached by a hybrid must not outlive the process group they were cut from
    (max-context searches simulate trial after trial in one process)."""
    spec = methods.AttnSpec(dim=128, n_heads=8, n_kv_heads=2, head_dim=16)
    for _ in range(2):
        with fake_process_group(4) as group, fake_tensors(torch.bfloat16):
            block = methods.build(name, spec, group=group, ulysses_degree=2)
            x = torch.randn(1, 64, spec.dim, requires_grad=True)
            block(x).sum().backward()
            assert x.grad.shape == x.shape


@pytest.mark.parametrize("name,options", [("offload", {}), ("fpdt", {"num_chunks": 4})])
def test_host_offloading_methods_free_device_memory_in_simulation(name, options):
    """In simulation host memory is the meta device: what offload/fpdt move to the host must
    leave the simulated device, so their device peak falls below plain Ulysses'."""
    spec = methods.AttnSpec(**SHAPES["llama3-8b"], causal=True)
    uly, _ = simulate_block("ulysses", spec)
    act, _ = simulate_block(name, spec, **options)
    assert act < uly, (name, act / GiB, uly / GiB)
