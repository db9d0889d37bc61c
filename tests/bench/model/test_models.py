"""bench/model/: the paper's shapes, config files, counts and FLOPs, and the levers that live
in the model (tiled MLP and norms, chunked loss) computing exactly what the plain versions do."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bench.model import decoder as models
from bench.model.config import CONFIGS, ModelConfig, flops_per_device, flops_per_step, get_config
from bench.model.decoder import (
    FeedForward,
    RMSNorm,
    chunked_cross_entropy,
    full_cross_entropy,
    tile_bounds,
)
from methods.core.tiling import counted_as, run_tiles, tile_weights, tiles_to_run


def test_paper_shapes():
    c = CONFIGS["llama3-8b"]
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size, c.rope_theta) == (
        4096, 32, 32, 8, 128, 14336, 128256, 5e5)
    q = CONFIGS["qwen3-32b"]
    assert (q.dim, q.n_layers, q.n_heads, q.n_kv_heads, q.head_dim, q.ffn_dim, q.vocab_size, q.rope_theta) == (
        5120, 64, 64, 8, 128, 25600, 151936, 1e6)
    assert q.qk_norm is False and "NO QK-norm" in q.note
    assert CONFIGS["qwen3-32b-qknorm"].qk_norm is True
    assert CONFIGS["qwen3-32b-qknorm"].attn_spec().qk_norm is True
    s = CONFIGS["llama3-70b"]
    assert (s.dim, s.n_layers, s.n_heads, s.n_kv_heads, s.ffn_dim) == (8192, 80, 64, 8, 28672)
    # published sizes: Llama 3 8B has 8.03B parameters, 70B 70.6B
    assert abs(c.n_params / 1e9 - 8.03) < 0.01
    assert abs(s.n_params / 1e9 - 70.55) < 0.05


def test_param_counts_match_the_module():
    cfg = CONFIGS["tiny-qknorm"]
    model = models.Decoder(cfg, "ulysses")
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params


def test_flop_formula():
    cfg = CONFIGS["llama3-8b"]
    s, ws = 1 << 20, 8
    n = cfg.param_counts()["matmul"]
    want = 6 * n * s + 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * s * s  # causal: 12*L*H*d*S^2/2
    assert flops_per_step(cfg, s) == want
    assert flops_per_device(cfg, s, ws) == want / ws
    assert flops_per_step(cfg, s, causal=False) == 6 * n * s + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * s * s
    assert flops_per_step(cfg, s, batch=2) == 2 * want
    attn = cfg.param_counts()["attention_per_layer"]
    assert flops_per_step(cfg, s, scope="attention") == 6 * attn * s + 6 * cfg.n_heads * cfg.head_dim * s * s
    assert n == cfg.n_layers * (attn + 3 * cfg.dim * cfg.ffn_dim) + cfg.vocab_size * cfg.dim  # no embedding


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_from_file(tmp_path, suffix):
    fields = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=100,
                  rope_theta=1e4, qk_norm=True)
    path = tmp_path / f"mymodel{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(fields))
    else:
        path.write_text("\n".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()))
    cfg = ModelConfig.from_file(path)
    assert cfg.name == "mymodel" and cfg.qk_norm is True and cfg.n_kv_heads == 2
    assert get_config(str(path)) == cfg


@pytest.mark.parametrize("content,needle", [
    ({"dim": 64}, "missing model field"),
    ({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 3, "head_dim": 16, "ffn_dim": 1, "vocab_size": 9},
     "n_heads=4 is not divisible by n_kv_heads=3"),
    ({"dim": 64, "n_layers": 0, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16, "ffn_dim": 1, "vocab_size": 9},
     "n_layers must be a positive integer"),
    ({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 15, "ffn_dim": 1, "vocab_size": 9},
     "head_dim=15 must be even"),
    ({"dims": 64}, r"unknown model field\(s\) \['dims'\]"),
    ([1, 2], "must be a mapping"),
])
def test_from_file_errors(tmp_path, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_file(path)


def test_file_and_name_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_file(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not be parsed"):
        ModelConfig.from_file(tmp_path / "x.json")
    with pytest.raises(ValueError, match="unknown model 'llama9'.*llama3-8b"):
        get_config("llama9")


def test_tile_bounds_and_shortcut():
    assert tile_bounds(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert tiles_to_run([4, 3, 3, 3], compress=False) == [0, 1, 2, 3]
    assert tiles_to_run([3, 3, 3, 3, 3], compress=True) == [0, 1]
    assert tiles_to_run([4, 4, 4, 3], compress=True) == [0, 1, 3]
    assert tiles_to_run([4, 3, 3], compress=True) == [0, 1, 2]


@pytest.mark.parametrize("sizes", [[4, 3, 3, 3], [3] * 5, [4, 4, 4, 3], [4, 3, 3], [5]])
@pytest.mark.parametrize("fake", [False, True])
def test_the_tiles_that_run_stand_for_all_of_them(sizes, fake):
    """Under simulation a run tile is counted as the skipped ones it stands for: the weights cover
    every tile once, ``counted_as`` says the weight inside the loop body and 1 after it."""
    weights = tile_weights(sizes, fake)
    assert len(weights) == len(tiles_to_run(sizes, fake)) and sum(weights) == len(sizes)
    seen = []
    for i in run_tiles(sizes, fake):
        seen.append((i, counted_as()))
        assert [w for _, w in zip(run_tiles([2, 2, 2, 2], True), range(2), strict=False)] == [0, 1]  # a nested loop...
        assert counted_as() == seen[-1][1]  # ...leaves the outer weight in place
    assert seen == list(zip(tiles_to_run(sizes, fake), weights, strict=False))
    assert counted_as() == 1


def test_nested_tile_loops_multiply():
    inner = []
    for _ in run_tiles([1] * 5, True):  # runs 2 tiles standing for 1 and 4
        inner.append([counted_as() for _ in run_tiles([1] * 3, True)])  # 3 tiles: all run
    assert inner == [[1, 1, 1], [4, 4, 4]]
    with pytest.raises(RuntimeError):
        for _ in run_tiles([1] * 5, True):
            raise RuntimeError("a failing tile")
    assert counted_as() == 1


def _grads(module, x, dy):
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), [x.grad] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("tiles", [0, 3, 7])
def test_tiled_mlp_equals_plain(tiles):
    torch.manual_seed(0)
    mlp = FeedForward(32, 80, 1e-5)
    with torch.no_grad():
        mlp.norm.weight.uniform_(0.5, 1.5)
    x, dy = torch.randn(2, 50, 32), torch.randn(2, 50, 32)
    y0, g0 = _grads(mlp, x, dy)
    mlp.zero_grad()
    mlp.tiles = tiles  # 0: auto = ceil(50 / 32) = 2 tiles
    y1, g1 = _grads(mlp, x, dy)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tiled_norm_equals_plain():
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, dy = torch.randn(3, 41, 16), torch.randn(3, 41, 16)
    y0, g0 = _grads(norm, x, dy)
    norm.zero_grad()
    norm.tiles = 5
    y1, g1 = _grads(norm, x, dy)
    torch.testing.assert_close(y1, y0)
    for a, b in zip(g1, g0, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_loss_equals_full_loss_and_gradient(chunk):
    torch.manual_seed(0)
    h = torch.randn(2, 64, 24, dtype=torch.float64)
    w = torch.randn(50, 24, dtype=torch.float64)
    labels = torch.randint(0, 50, (2, 64))
    labels[0, :5] = -100  # ignored positions
    h0, w0 = h.clone().requires_grad_(), w.clone().requires_grad_()
    full = full_cross_entropy(h0, w0, labels)
    full.backward()
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    chunked = chunked_cross_entropy(h1, w1, labels, chunk=chunk)
    chunked.backward()
    torch.testing.assert_close(chunked, full.to(chunked.dtype))
    torch.testing.assert_close(h1.grad, h0.grad)
    torch.testing.assert_close(w1.grad, w0.grad)
    # and against torch's own cross-entropy on materialised logits
    ref = F.cross_entropy((h @ w.T).reshape(-1, 50), labels.reshape(-1))
    torch.testing.assert_close(chunked.double(), ref)


def test_chunked_loss_never_materialises_the_logits():
    """Simulated peak of the chunked loss stays at a chunk's logits, far below the full ones."""
    from bench.measure.simulate import fake_tensors, track_peak

    n, vocab, dim, chunk = 8192, 32000, 256, 512
    peaks = {}
    with fake_tensors(torch.bfloat16):
        h = torch.empty(1, n, dim, requires_grad=True)
        w = torch.empty(vocab, dim, requires_grad=True)
        labels = torch.zeros(1, n, dtype=torch.long)
        for name, fn in (("full", lambda: full_cross_entropy(h, w, labels).backward()),
                         ("chunked", lambda: chunked_cross_entropy(h, w, labels, chunk).backward())):
            peaks[name] = track_peak(fn, h, w, labels).total
    full_logits = n * vocab * 4
    assert peaks["full"] > full_logits
    assert peaks["chunked"] < full_logits / 4, peaks


def test_example_architecture_file():
    """bench/model_configs/mistral-7b.yaml (the README's example of a user's file) loads under
    its stem and has Mistral-7B-v0.3's published size, 7.25B parameters."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "bench" / "model_configs" / "mistral-7b.yaml"
    cfg = get_config(str(path))
    assert cfg.name == "mistral-7b" and (cfg.n_heads, cfg.n_kv_heads, cfg.n_layers) == (32, 8, 32)
    assert abs(cfg.n_params / 1e9 - 7.248) < 0.01
