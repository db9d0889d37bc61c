"""Document-length distributions, and packing a sequence with documents drawn from one.

A distribution is named by what it is. The published ones are data files beside this module
(``data/*.json``, each with its source; ``data/README.md``):

* ``pile``, ``prolong64k``, ``prolong512k``: LongCA-bench's histograms of document lengths;
* ``magiattention-cp``: MagiAttention's context-parallel benchmark histogram, where a document
  longer than a quarter of the sequence is cut into quarter-length pieces;
* ``prolong-mix-64k``, ``prolong-mix-512k``: ProLong's data mix by domain (token fractions), the
  long domains as documents of their packed length and the short domains from a stated stand-in.

Two families take their parameters in the name: ``uniform-LO-HI`` (lengths uniform in
``[LO, HI]``, e.g. ``uniform-1K-64K``) and ``fixed-LEN`` (every document ``LEN`` tokens, e.g.
``fixed-4K``); sizes as ``records.sizes`` writes them.

Packing (:func:`sample`) is seeded (``random.Random(seed)``): documents are drawn until the
sequence is full and the last one is truncated to what is left, as LongCA-bench's sampler
does. A mixture fills each domain's share of the tokens that way and then shuffles the
documents. The result is a tuple of positive lengths summing to the sequence length, what
``methods.Documents.from_lengths`` takes. Torch-free: the records layer imports it.
"""
from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..sizes import parse_size

DATA = Path(__file__).with_name("data")
FAMILIES = ("uniform-LO-HI", "fixed-LEN")  # parametric names, as the choices list shows them
_UNIFORM = re.compile(r"uniform-([0-9.]+[kKmMgG]?)-([0-9.]+[kKmMgG]?)")
_FIXED = re.compile(r"fixed-([0-9.]+[kKmMgG]?)")


class Distribution:
    """A named document-length distribution with its source; ``draw`` gives one document's
    length, ``pack`` a whole sequence's."""

    name: str
    description: str
    source: dict[str, Any]

    def draw(self, rng: random.Random, seq_len: int) -> list[int]:
        """One drawn document as the pieces it enters the sequence in (one piece unless capped)."""
        raise NotImplementedError

    def pack(self, seq_len: int, rng: random.Random) -> list[int]:
        """Documents drawn until ``seq_len`` tokens are full, the last truncated."""
        out: list[int] = []
        left = seq_len
        while left > 0:
            for piece in self.draw(rng, seq_len):
                if left == 0:
                    break
                take = min(piece, left)
                out.append(take)
                left -= take
        return out


@dataclass(frozen=True)
class Histogram(Distribution):
    """Lengths from weighted bins ``[lo, hi)``: a bin by weight, then a length in it, uniform
    (``within="uniform"``) or its midpoint (``"midpoint"``). ``cap_fraction``: a document longer
    than that fraction of the sequence enters as pieces of that length and a remainder."""

    name: str
    description: str
    source: dict
    bins: tuple[tuple[int, int, float], ...]
    within: str = "uniform"
    cap_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.within not in ("uniform", "midpoint"):
            raise ValueError(f"{self.name}: within_bin must be uniform or midpoint, got {self.within!r}")
        if not self.bins or any(hi <= lo or lo < 0 or w < 0 for lo, hi, w in self.bins):
            raise ValueError(f"{self.name}: bins must be [lo, hi, weight] with 0 <= lo < hi and weight >= 0")
        if self.cap_fraction is not None and not 0 < self.cap_fraction <= 1:
            raise ValueError(f"{self.name}: cap_fraction must be in (0, 1], got {self.cap_fraction!r}")

    @functools.cached_property
    def _cumulative(self) -> list[float]:
        total, out = 0.0, []
        for _, _, w in self.bins:
            total += w
            out.append(total)
        return out

    def length(self, rng: random.Random) -> int:
        lo, hi, _ = rng.choices(self.bins, cum_weights=self._cumulative)[0]
        lo = max(lo, 1)  # a document has at least one token (a [0, n) bin starts at 1)
        if self.within == "midpoint":
            return max(1, (lo + hi - 1) // 2)
        return rng.randint(lo, max(lo, hi - 1))

    def draw(self, rng: random.Random, seq_len: int) -> list[int]:
        n = self.length(rng)
        if self.cap_fraction is None:
            return [n]
        cap = max(1, int(seq_len * self.cap_fraction))
        return [cap] * (n // cap) + ([n % cap] if n % cap else [])


@dataclass(frozen=True)
class Mixture(Distribution):
    """Domains with fractions of the tokens: a domain with a document length fills its share with
    documents of that length; the domains without one share theirs, filled from ``short``.
    The documents are then shuffled."""

    name: str
    description: str
    source: dict
    components: tuple[tuple[str, float, int | None], ...]
    short: Distribution

    def __post_init__(self) -> None:
        total = sum(f for _, f, _ in self.components)
        if abs(total - 1) > 1e-6 or any(f < 0 for _, f, _ in self.components):
            raise ValueError(f"{self.name}: component fractions must be >= 0 and sum to 1, got {total}")

    def draw(self, rng: random.Random, seq_len: int) -> list[int]:
        raise TypeError(f"{self.name} is a mixture: it packs whole sequences (pack), it draws no single document")

    def pack(self, seq_len: int, rng: random.Random) -> list[int]:
        out: list[int] = []
        used = 0
        for _, fraction, length in self.components:
            if length is None:
                continue
            share = int(seq_len * fraction)
            used += share
            out.extend([length] * (share // length) + ([share % length] if share % length else []))
        if seq_len > used:
            out.extend(self.short.pack(seq_len - used, rng))
        rng.shuffle(out)
        return out


@dataclass(frozen=True)
class Uniform(Distribution):
    """Lengths uniform in ``[lo, hi]``."""

    name: str
    lo: int
    hi: int
    description: str = "document lengths uniform between two bounds"
    source: dict = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.hi < self.lo:
            raise ValueError(f"{self.name}: the upper bound {self.hi} is below the lower bound {self.lo}; "
                             f"write uniform-LO-HI with LO <= HI")
        object.__setattr__(self, "source", self.source or {"what": "parametric: the bounds are in the name"})

    def draw(self, rng: random.Random, seq_len: int) -> list[int]:
        return [rng.randint(self.lo, self.hi)]


@dataclass(frozen=True)
class Fixed(Distribution):
    """Every document ``length`` tokens (the last one truncated)."""

    name: str
    length: int
    description: str = "every document of one length"
    source: dict = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", self.source or {"what": "parametric: the length is in the name"})

    def draw(self, rng: random.Random, seq_len: int) -> list[int]:
        return [self.length]


# ----------------------------------------------------------------------------- the registry

def _load(path: Path) -> Distribution:
    raw = json.loads(path.read_text())
    if raw["kind"] == "histogram":
        return Histogram(raw["name"], raw["description"], raw["source"],
                         tuple((int(lo), int(hi), float(w)) for lo, hi, w in raw["histogram"]),
                         raw.get("within_bin", "uniform"), raw.get("cap_fraction"))
    if raw["kind"] == "mixture":
        return Mixture(raw["name"], raw["description"], raw["source"],
                       tuple((str(d), float(f), None if n is None else int(n)) for d, f, n in raw["components"]),
                       get(raw["short_documents"]))
    raise ValueError(f"{path}: unknown distribution kind {raw['kind']!r}")


@functools.cache
def published() -> dict[str, Path]:
    """The data files' distributions by name."""
    return {json.loads(p.read_text())["name"]: p for p in sorted(DATA.glob("*.json"))}


def names() -> list[str]:
    """Every name :func:`get` takes: the published distributions, then the parametric families."""
    return [*published(), *FAMILIES]


@functools.cache
def get(name: str) -> Distribution:
    """The distribution ``name`` (``ValueError`` listing the choices when there is none)."""
    if not isinstance(name, str):
        raise ValueError(f"a document-length distribution is named by a string, got {name!r}; "
                         f"choose one of {names()}")
    if name in published():
        return _load(published()[name])
    m = _UNIFORM.fullmatch(name)
    if m:
        lo, hi = (parse_size(v, f"distribution {name!r}") for v in m.groups())
        return Uniform(name, lo, hi)
    m = _FIXED.fullmatch(name)
    if m:
        return Fixed(name, parse_size(m.group(1), f"distribution {name!r}"))
    raise ValueError(f"unknown document-length distribution {name!r}; choose one of {names()} "
                     f"(e.g. prolong64k, uniform-1K-64K, fixed-4K)")


@functools.lru_cache(maxsize=256)
def sample(name: str, seq_len: int, seed: int = 0) -> tuple[int, ...]:
    """Document lengths packing ``seq_len`` tokens from distribution ``name``, seeded: the same
    name, length and seed give the same lengths on every machine."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"documents pack a positive number of tokens, got sequence length {seq_len!r}")
    check_seed(seed)
    lengths = tuple(get(name).pack(seq_len, random.Random(seed)))
    assert sum(lengths) == seq_len and min(lengths) >= 1, (name, seq_len, seed)
    return lengths


def check_seed(seed: object, what: str = "seed") -> int:
    """``seed`` if it is an integer (``ValueError`` naming ``what`` otherwise)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"the documents' {what} must be an integer, got {seed!r}")
    return seed


def summary(lengths: tuple[int, ...] | list[int]) -> dict[str, Any]:
    """Count, shortest, longest and mean of document lengths (what a row records)."""
    return {"count": len(lengths), "min": min(lengths), "max": max(lengths),
            "mean": round(sum(lengths) / len(lengths), 3)}
