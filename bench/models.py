"""A Llama-style decoder whose attention is any registered context-parallel method.

Architecture (Llama 3): token embedding, ``n_layers`` pre-norm blocks
``h = x + attention(rms_norm(x)); y = h + w2(silu(w1 rms_norm(h)) * w3 rms_norm(h))``,
a final RMSNorm and an untied LM head. The attention block, with its GQA projections,
optional QK-norm and RoPE, is built by ``methods.build(method, spec, group, **options)``,
so RoPE uses the global positions of the method's sequence layout. Weights are random
(no download): the suite measures memory and speed, not quality.

Named configurations (``CONFIGS``) carry the paper's real shapes; ``tiny-*`` ones are for
CPU tests. ``ModelConfig.from_file`` reads the same fields from JSON or YAML.

FLOP convention (``flops_per_step``), used for every TFLOP/s figure of the suite:

    F = 6 * N_matmul * T  +  attention term,       T = batch * seq_len tokens

* ``N_matmul``: parameters that take part in a matrix multiply per token: every layer's
  ``wq, wk, wv, wo, w1, w2, w3`` plus the LM head. Not counted: the embedding (a lookup),
  norms, RoPE, softmax, the loss, optimizer arithmetic. The factor 6 is 2 (multiply-add)
  times 3 (forward, and a backward twice as costly).
* attention term: per layer, the forward ``Q K^T`` and ``P V`` cost ``2 * 2 * S^2 * H * d``
  per sequence, times 3 for forward + backward, halved when causal:
  ``12 * L * H * d * S^2 * batch / 2 = 6 * L * H * d * S^2 * batch`` (causal).
* Model FLOPs, not hardware FLOPs: recomputation (activation checkpointing, tiled MLP,
  UPipe's per-stage recompute, chunked-loss recompute) is **not** counted, so methods
  that recompute more are not rewarded for it.
* Per device: ``F / world_size``. Under context parallelism every token is processed by
  exactly one rank, so each token is counted once: tokens per device = ``batch*S/C``.

Scope ``attention`` counts one attention block: ``6 * (wq+wk+wv+wo) * T`` plus one
layer's attention term.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import methods
from methods.core.spec import AttnSpec

# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ModelConfig:
    """Decoder architecture. All sizes are counts (not bytes)."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    qk_norm: bool = False
    norm_eps: float = 1e-5
    note: str = ""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {self.name!r}: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"model name must be a non-empty string, got {self.name!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model {self.name!r}: n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads} (GQA needs equal query groups)"
            )
        if self.head_dim % 2:
            raise ValueError(f"model {self.name!r}: head_dim={self.head_dim} must be even for RoPE")
        if not isinstance(self.rope_theta, (int, float)) or isinstance(self.rope_theta, bool) or self.rope_theta <= 0:
            raise ValueError(f"model {self.name!r}: rope_theta must be a positive number, got {self.rope_theta!r}")
        if not isinstance(self.norm_eps, (int, float)) or not 0 < self.norm_eps < 1:
            raise ValueError(f"model {self.name!r}: norm_eps must be in (0, 1), got {self.norm_eps!r}")
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"model {self.name!r}: qk_norm must be true or false, got {self.qk_norm!r}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "ModelConfig":
        """Build from a mapping; unknown or missing fields are refused by name."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: a model config must be a mapping of fields, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{source}: unknown model field(s) {unknown}; valid fields: {sorted(fields)}")
        required = [n for n, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in data]
        if missing:
            raise ValueError(f"{source}: missing model field(s) {missing}")
        try:
            return cls(**data)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        except TypeError as err:
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read an architecture from ``.json``, ``.yaml`` or ``.yml`` (the fields of this class).

        ``name`` defaults to the file's stem.
        """
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"model config file {str(path)!r} does not exist")
        text = path.read_text()
        suffix = path.suffix.lower()
        try:
            if suffix == ".json":
                data = json.loads(text)
            elif suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                raise ValueError(f"model config file {str(path)!r}: use a .json, .yaml or .yml file")
        except (json.JSONDecodeError, ImportError) as err:
            raise ValueError(f"model config file {str(path)!r} could not be parsed: {err}") from None
        except Exception as err:  # yaml.YAMLError, without importing yaml up front
            if isinstance(err, ValueError):
                raise
            raise ValueError(f"model config file {str(path)!r} could not be parsed: {err}") from None
        if isinstance(data, dict):
            data = {"name": path.stem, **data}
        return cls.from_dict(data, source=f"model config file {str(path)!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def attn_spec(self, causal: bool = True) -> AttnSpec:
        return AttnSpec(
            dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            causal=causal, qk_norm=self.qk_norm, rope_theta=float(self.rope_theta),
        )

    # ------------------------------------------------------------------ counts
    def param_counts(self) -> dict[str, int]:
        """Parameters by part (elements). ``matmul`` is what the FLOP formula multiplies."""
        d, h, g, hd, f, v = self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn_dim, self.vocab_size
        attn = d * h * hd + 2 * d * g * hd + h * hd * d
        mlp = 3 * d * f
        norms = 2 * d + (2 * hd if self.qk_norm else 0)
        counts = {
            "embedding": v * d,
            "attention_per_layer": attn,
            "mlp_per_layer": mlp,
            "norms": self.n_layers * norms + d,
            "lm_head": v * d,
        }
        counts["matmul"] = self.n_layers * (attn + mlp) + counts["lm_head"]
        counts["total"] = counts["embedding"] + self.n_layers * (attn + mlp) + counts["norms"] + counts["lm_head"]
        return counts

    @property
    def n_params(self) -> int:
        return self.param_counts()["total"]


def flops_per_step(
    cfg: ModelConfig, seq_len: int, batch: int = 1, scope: str = "model", causal: bool = True
) -> int:
    """Model FLOPs of one training step (all ranks together); see the module docstring."""
    if scope not in ("model", "attention"):
        raise ValueError(f"scope must be 'model' or 'attention', got {scope!r}")
    counts = cfg.param_counts()
    layers = cfg.n_layers if scope == "model" else 1
    n = counts["matmul"] if scope == "model" else counts["attention_per_layer"]
    tokens = batch * seq_len
    attn = 12 * layers * cfg.n_heads * cfg.head_dim * seq_len * seq_len * batch
    if causal:
        attn //= 2
    return 6 * n * tokens + attn


def flops_per_device(cfg: ModelConfig, seq_len: int, world_size: int, batch: int = 1,
                     scope: str = "model", causal: bool = True) -> float:
    """Model FLOPs per rank per step: each token counted once, ``F / world_size``."""
    return flops_per_step(cfg, seq_len, batch, scope, causal) / world_size


# The paper's shapes ([C] in PAPER.md) and small CPU configurations.
CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("llama3-8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                    ffn_dim=14336, vocab_size=128256, rope_theta=5e5, norm_eps=1e-5,
                    note="Llama 3 8B shapes"),
        ModelConfig("qwen3-32b", dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
                    ffn_dim=25600, vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, qk_norm=False,
                    note="the paper's 'Qwen3-32B': Llama architecture with Qwen3-32B dimensions, "
                         "NO QK-norm (as in the authors' code); see qwen3-32b-qknorm"),
        ModelConfig("qwen3-32b-qknorm", dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
                    ffn_dim=25600, vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                    note="qwen3-32b with the real Qwen3 per-head QK RMSNorm (not the paper's runs)"),
        ModelConfig("llama3-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                    ffn_dim=28672, vocab_size=128256, rope_theta=5e5, norm_eps=1e-5,
                    note="Llama 3 70B shapes"),
        ModelConfig("tiny-llama", dim=128, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=16,
                    ffn_dim=384, vocab_size=1024, rope_theta=5e5,
                    note="CPU-sized GQA decoder (H/G = 2)"),
        ModelConfig("tiny-mha", dim=128, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=16,
                    ffn_dim=256, vocab_size=512, note="CPU-sized multi-head decoder"),
        ModelConfig("tiny-qknorm", dim=96, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=12,
                    ffn_dim=256, vocab_size=512, rope_theta=1e6, qk_norm=True,
                    note="CPU-sized decoder with QK-norm and 2 KV heads"),
    )
}


def get_config(name_or_path: str) -> ModelConfig:
    """A named config, or a JSON/YAML file path; unknown names list the choices."""
    if name_or_path in CONFIGS:
        return CONFIGS[name_or_path]
    if name_or_path.endswith((".json", ".yaml", ".yml")) or "/" in name_or_path:
        return ModelConfig.from_file(name_or_path)
    raise ValueError(
        f"unknown model {name_or_path!r}; choose one of {sorted(CONFIGS)} or give a .json/.yaml file"
    )


# --------------------------------------------------------------------------- layers


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def norm_mlp(x, norm_w, eps, w1, w2, w3):
    """``swiglu(rms_norm(x))``: the MLP half of a block without its residual."""
    return swiglu(F.rms_norm(x, (x.shape[-1],), norm_w, eps), w1, w2, w3)


def norm_mlp_fn(x, norm_w, w1, w2, w3, eps):
    return norm_mlp(x, norm_w, eps, w1, w2, w3)


def is_fake(t: torch.Tensor) -> bool:
    """True for a FakeTensor (simulation), where values do not exist and only shapes matter."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def tiles_to_run(sizes: list[int], fake: bool) -> list[int]:
    """Indices of the tiles/chunks a loop must process.

    Real tensors: all. Fake tensors (simulation): the first tile creates the gradient
    accumulators, and from the second on every tile of the same size allocates and frees
    exactly the same bytes next to them, so the first two tiles and the last (when its size
    differs) give the same peak as all of them, for a fraction of the simulation time.
    """
    if not fake or len(sizes) <= 3:
        return list(range(len(sizes)))
    return [0, 1] if sizes[-1] == sizes[1] else [0, 1, len(sizes) - 1]


def tile_bounds(n: int, tiles: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``tiles`` near-equal tiles of ``n`` (``tensor_split``'s sizes)."""
    base, extra = divmod(n, tiles)
    out, start = [], 0
    for i in range(tiles):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out


class _Tiled(torch.autograd.Function):
    """``fn(x, *weights)`` (shape-preserving, token-wise) over sequence tiles, saving only inputs.

    Forward runs tile by tile without autograd; backward recomputes each tile under autograd,
    so the full-sequence intermediates of ``fn`` never exist (only one tile's at a time).
    Weight gradients are accumulated over tiles.
    """

    @staticmethod
    def forward(ctx, fn, tiles, x, *weights):
        out = torch.empty_like(x)
        bounds = tile_bounds(x.shape[1], tiles)
        for i in tiles_to_run([length for _, length in bounds], is_fake(x)):
            start, length = bounds[i]
            out.narrow(1, start, length).copy_(fn(x.narrow(1, start, length), *weights))
        ctx.save_for_backward(x, *weights)
        ctx.fn, ctx.tiles = fn, tiles
        return out

    @staticmethod
    def backward(ctx, dout):
        x, *weights = ctx.saved_tensors
        dx = torch.empty_like(x)
        grads: list[torch.Tensor | None] = [None] * len(weights)
        bounds = tile_bounds(x.shape[1], ctx.tiles)
        for i in tiles_to_run([length for _, length in bounds], is_fake(x)):
            start, length = bounds[i]
            leaf = x.narrow(1, start, length).detach().requires_grad_()
            wl = [w.detach().requires_grad_() for w in weights]
            with torch.enable_grad():
                y = ctx.fn(leaf, *wl)
            g = torch.autograd.grad(y, [leaf] + wl, dout.narrow(1, start, length))
            del y
            dx.narrow(1, start, length).copy_(g[0])
            for j, gj in enumerate(g[1:]):
                grads[j] = gj if grads[j] is None else grads[j].add_(gj)
            del g, gj, leaf, wl  # else the next tile's gradients coexist with this tile's
        return (None, None, dx, *grads)


def auto_tiles(local_len: int, dim: int) -> int:
    """The paper's (ALST) tile count: ``ceil(local tokens / dim)``."""
    return max(1, math.ceil(local_len / dim))


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that can run tiled over the sequence (``tiles``: None/1 plain, 0 auto).

    Tiling matters beyond memory savings: on CPU (and so under simulation) ``F.rms_norm``
    is a composite whose backward holds several fp32 copies of its input, where CUDA runs
    one fused kernel; tiled, those temporaries are one tile's.
    """

    tiles: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = 1 if self.tiles is None else (auto_tiles(x.shape[1], x.shape[-1]) if self.tiles == 0
                                          else min(self.tiles, x.shape[1]))
        if n <= 1 or x.dim() != 3 or not torch.is_grad_enabled():
            return super().forward(x)
        return _Tiled.apply(partial(_rms, eps=self.eps), n, x, self.weight)


def _rms(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class FeedForward(nn.Module):
    """SwiGLU MLP with its pre-norm; ``tiles`` > 1: tiled over the sequence (recomputing)."""

    def __init__(self, dim: int, ffn_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=eps)  # applied inside the (tiled) MLP
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.eps = eps
        self.tiles: int | None = None  # None/1: plain autograd; 0: auto (ceil(local tokens / dim))

    def n_tiles(self, local_len: int) -> int:
        if self.tiles is None:
            return 1
        if self.tiles == 0:
            return auto_tiles(local_len, self.w1.in_features)
        return max(1, min(self.tiles, local_len))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles = self.n_tiles(x.shape[1])
        args = (self.norm.weight, self.w1.weight, self.w2.weight, self.w3.weight)
        if tiles == 1 or not torch.is_grad_enabled():
            return norm_mlp(x, args[0], self.eps, *args[1:])
        return _Tiled.apply(partial(norm_mlp_fn, eps=self.eps), tiles, x, *args)


class Block(nn.Module):
    """One pre-norm decoder block: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``."""

    def __init__(self, cfg: ModelConfig, attention: nn.Module) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = attention
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), positions=positions)
        return h + self.feed_forward(h)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Logits and the softmax in fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_starts(n: int, chunk: int, fake: bool) -> list[int]:
    starts = list(range(0, n, chunk))
    return [starts[i] for i in tiles_to_run([min(chunk, n - s) for s in starts], fake)]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ w.T`` against ``labels`` in chunks of tokens.

    Forward keeps one chunk's fp32 logits at a time and saves only the per-token
    log-sum-exp; backward recomputes each chunk's logits, forms ``softmax - onehot`` and
    accumulates ``dh`` (per chunk) and ``dw`` (``addmm_``). The full ``[tokens, vocab]``
    logits never exist. Labels equal to ``ignore_index`` contribute nothing. Under
    simulation only the first (and a shorter last) chunk run, see ``tiles_to_run``.
    """

    @staticmethod
    def forward(ctx, h, w, labels, chunk, ignore_index):
        n = h.shape[0]
        acc = _acc_dtype(h)
        lse = torch.empty(n, dtype=acc, device=h.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0)
        for start in _chunk_starts(n, chunk, is_fake(h)):
            sl = slice(start, min(n, start + chunk))
            logits = F.linear(h[sl], w).to(acc)
            lse[sl] = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, safe[sl, None]).squeeze(1)
            total += ((lse[sl] - target) * valid[sl]).sum()
            del logits
        count = valid.sum().clamp_min(1).to(acc)
        ctx.save_for_backward(h, w, safe, valid, lse, count)
        ctx.chunk = chunk
        return total / count

    @staticmethod
    def backward(ctx, dloss):
        h, w, safe, valid, lse, count = ctx.saved_tensors
        acc = lse.dtype
        scale = (dloss / count).to(acc)
        dh = torch.empty_like(h)
        dw = torch.zeros_like(w)
        n = h.shape[0]
        for start in _chunk_starts(n, ctx.chunk, is_fake(h)):
            sl = slice(start, min(n, start + ctx.chunk))
            logits = F.linear(h[sl], w).to(acc)
            grad = logits.sub_(lse[sl, None]).exp_()  # softmax, in place
            grad.scatter_add_(1, safe[sl, None], -torch.ones_like(lse[sl, None]))
            grad.mul_((scale * valid[sl])[:, None])
            grad = grad.to(h.dtype)
            torch.mm(grad, w, out=dh[sl])
            dw.addmm_(grad.t(), h[sl])
            del grad, logits
        return dh, dw, None, None, None


def chunked_cross_entropy(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                          chunk: int = 2048, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``h @ w.T`` (``h``: ``[..., dim]``) without full logits."""
    return _ChunkedCrossEntropy.apply(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1), chunk, ignore_index)


def full_cross_entropy(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                       ignore_index: int = -100) -> torch.Tensor:
    """The plain version: materialises ``[tokens, vocab]`` logits (fp32 for the softmax)."""
    logits = F.linear(h.reshape(-1, h.shape[-1]), w).to(_acc_dtype(h))
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index)


class LMHead(nn.Module):
    """Final RMSNorm, untied output projection and the loss (chunked or full)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.loss_chunk: int | None = None  # tokens per chunk; None: full logits

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.loss_chunk:
            return chunked_cross_entropy(h, self.output.weight, labels, self.loss_chunk)
        return full_cross_entropy(h, self.output.weight, labels)


class Decoder(nn.Module):
    """Llama-style decoder on this rank's part of the sequence.

    ``forward(tokens, positions, labels)`` takes this rank's tokens ``[B, S/C]`` in the
    attention method's layout (``model.shard``), their global positions, and next-token
    labels in the same layout; it returns the mean loss over the local tokens (with equal
    token counts per rank, averaging gradients over ranks, as FSDP does, gives the
    gradient of the global mean).

    ``layer_wrapper`` (set by ``bench.step``) runs each block, e.g. under activation
    checkpointing; by default a block is called directly.
    """

    def __init__(self, cfg: ModelConfig, method: str, group=None, **method_options) -> None:
        super().__init__()
        self.cfg = cfg
        self.method = method
        spec = cfg.attn_spec(causal=True)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(
            Block(cfg, methods.build(method, spec, group=group, **method_options)) for _ in range(cfg.n_layers)
        )
        self.head = LMHead(cfg)

    def attention_module(self) -> nn.Module:
        """The first block's attention method (through any wrapper around the block)."""
        layer = self.layers[0]
        while not isinstance(layer, Block):
            layer = layer.block
        return layer.attention

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of a full-sequence tensor in the attention method's layout."""
        return self.attention_module().shard(x, dim)

    def set_mlp_tiles(self, tiles: int | None) -> None:
        """None: plain MLP; 0: the paper's auto rule ceil(local tokens / dim); n: n tiles."""
        for layer in self.layers:
            layer.feed_forward.tiles = tiles

    def set_norm_tiles(self, tiles: int | None) -> None:
        """Tiling of the attention norms and the final norm (None: plain; 0: auto)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.tiles = tiles

    def set_loss_chunk(self, chunk: int | None) -> None:
        self.head.loss_chunk = chunk

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.head(x, labels)
