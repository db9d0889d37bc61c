"""Model configurations: the decoder's shape, named configs, parameter and FLOP counts.

Named configurations (``CONFIGS``) carry the paper's real shapes; ``tiny-*`` ones are for
CPU tests. ``ModelConfig.from_file`` reads the same fields from JSON or YAML, or a Transformers
``config.json`` (``bench.model.hf``: Llama, Qwen2, Qwen3, Mistral).

``tie_word_embeddings``: the LM head multiplies by the embedding's weight (one ``[vocab, dim]``
matrix, as Transformers ties them): the parameter count, and with it the weights, gradients and
optimizer states a step holds, lose ``vocab * dim`` elements; the FLOPs do not change, since the
LM head's matrix multiply still runs.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from methods.core.spec import AttnSpec

from . import hf

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
    tie_word_embeddings: bool = False  # the LM head's weight is the embedding's
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
        for name in ("qk_norm", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model {self.name!r}: {name} must be true or false, got {getattr(self, name)!r}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> ModelConfig:
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
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read an architecture from ``.json``, ``.yaml`` or ``.yml``: the fields of this class, or
        a Transformers config (``bench.model.hf``).

        ``name`` defaults to the file's stem (a Transformers config: ``hf.model_name``).
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
                data = yaml.safe_load(text)
            else:
                raise ValueError(f"model config file {str(path)!r}: use a .json, .yaml or .yml file")
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise ValueError(f"model config file {str(path)!r} could not be parsed: {err}") from None
        source = f"model config file {str(path)!r}"
        if hf.is_transformers_config(data):
            return cls.from_dict({"name": hf.model_name(path), **hf.fields(data, source)}, source=source)
        if isinstance(data, dict):
            data = {"name": path.stem, **data}
        return cls.from_dict(data, source=source)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def attn_spec(self, causal: bool = True) -> AttnSpec:
        return AttnSpec(
            dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            causal=causal, qk_norm=self.qk_norm, rope_theta=float(self.rope_theta),
        )

    # ------------------------------------------------------------------ counts
    def param_counts(self) -> dict[str, int]:
        """Parameters by part (elements). ``matmul`` is what the FLOP formula multiplies; a tied
        LM head (``tie_word_embeddings``) multiplies by the embedding, so it is counted there and
        in ``matmul``, but not again in ``total``."""
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
        own_head = 0 if self.tie_word_embeddings else counts["lm_head"]
        counts["total"] = counts["embedding"] + self.n_layers * (attn + mlp) + counts["norms"] + own_head
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


# The paper's shapes ([C] in docs/paper.md, section "Models") and small CPU configurations.
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


