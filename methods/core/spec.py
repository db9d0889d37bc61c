"""The shape of one attention block, shared by every method and by the reference.

A frozen dataclass so it can be hashed, logged into result rows and passed to
worker processes unchanged. Divisibility by a world size is *not* checked here:
that is a property of a (method, world size) pair, see each method's ``validate``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class AttnSpec:
    """Attention block geometry.

    Attributes:
        dim: model (hidden) width; input and output feature size of the block.
        n_heads: number of query heads H.
        n_kv_heads: number of key/value heads G (GQA when G < H); defaults to H.
        head_dim: per-head width d; defaults to ``dim // n_heads``.
        causal: causal (decoder) masking.
        qk_norm: RMSNorm on each query/key head before RoPE (Qwen3 style).
        rope_theta: RoPE base frequency.
    """

    dim: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    causal: bool = True
    qk_norm: bool = False
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("dim", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttnSpec.{name} must be a positive int, got {value!r}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(
                    f"dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                    "pass head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        for name in ("dim", "n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttnSpec.{name} must be a positive int, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: "
                "GQA needs every KV head to serve the same number of query heads"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (g = H / G)."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)
