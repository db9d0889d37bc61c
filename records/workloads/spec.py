"""``DocsSpec``: a trial's packed documents, as the CLI, a sweep spec and a row write them.

Either a distribution and a seed (``prolong64k:3``: the lengths are sampled for the trial's
sequence length, ``records.workloads.distributions.sample``), or explicit lengths (written
out, or read from a lengths file) that must sum to the sequence length. No ``DocsSpec`` means
one sequence.

A row records ``fields(seq_len)``: the identity (``{"distribution", "seed"}`` or
``{"lengths"}``, what ``records.trial_key`` adds to a trial's key) and the summary of the
lengths (count, min, max, mean). ``DocsSpec.from_fields`` reads it back. Every bad input is a
one-line ``ValueError`` that names the constraint and the fix.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..sizes import parse_size
from .distributions import check_seed, get, sample, summary

IDENTITY_KEYS = ("distribution", "seed", "lengths")
SUMMARY_KEYS = ("count", "min", "max", "mean")


@dataclass(frozen=True)
class DocsSpec:
    """A distribution name and a seed, or explicit document lengths (exactly one of the two)."""

    distribution: str | None = None
    seed: int = 0
    lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.distribution is None) == (self.lengths is None):
            raise ValueError("documents are a distribution (with a seed) or explicit lengths, exactly one of the two; "
                             "e.g. --docs prolong64k:1 or --docs-lengths 4K,4K,8K")
        check_seed(self.seed)
        if self.distribution is not None:
            get(self.distribution)
        else:
            lengths = self.lengths
            if not isinstance(lengths, tuple) or not lengths or any(
                    isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
                raise ValueError(f"explicit document lengths must be a non-empty list of positive token counts, "
                                 f"got {_short(lengths)}")
            if self.seed != 0:
                raise ValueError("explicit document lengths take no seed (nothing is sampled); drop the seed")

    # ------------------------------------------------------------------ parsing
    @classmethod
    def parse(cls, text: str) -> DocsSpec:
        """``NAME`` or ``NAME:SEED`` (the CLI's ``--docs``, a sweep spec's string entry)."""
        name, sep, seed = str(text).strip().partition(":")
        if not sep:
            return cls(name)
        try:
            value = int(seed)
        except ValueError:
            raise ValueError(f"documents {text!r}: the seed after ':' must be an integer, got {seed!r} "
                             f"(e.g. {name}:1)") from None
        return cls(name, value)

    @classmethod
    def from_lengths_text(cls, text: str, what: str = "document lengths") -> DocsSpec:
        """Lengths written out: commas or whitespace between them, sizes as ``4096`` or ``4K``,
        or a JSON list."""
        return cls(lengths=parse_lengths(text, what))

    @classmethod
    def from_lengths_file(cls, path: str | Path) -> DocsSpec:
        """Lengths read from a file (as :meth:`from_lengths_text` takes them)."""
        path = Path(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"lengths file {path} cannot be read: {type(err).__name__}: "
                             f"{getattr(err, 'strerror', None) or err}") from None
        return cls(lengths=parse_lengths(text, f"lengths file {path}"))

    @classmethod
    def from_argument(cls, text: str) -> DocsSpec:
        """``--docs-lengths``: a lengths file if one exists at ``text``, else the lengths written out."""
        if Path(text).is_file():
            return cls.from_lengths_file(text)
        try:
            return cls.from_lengths_text(text)
        except ValueError as err:
            raise ValueError(f"{err} (and no file {text!r} exists)") from None

    @classmethod
    def from_value(cls, raw: Any, where: str = "docs") -> DocsSpec | None:
        """A sweep spec's entry: ``null``/``none`` (one sequence), ``NAME[:SEED]``,
        ``{distribution: NAME, seed: N}``, ``{lengths: [...]}`` or ``{lengths_file: PATH}``."""
        if raw is None or raw == "none":
            return None
        try:
            if isinstance(raw, str):
                return cls.parse(raw)
            if isinstance(raw, dict):
                keys = set(raw)
                if keys and keys <= {"distribution", "seed"} and "distribution" in keys:
                    return cls(raw["distribution"], raw.get("seed", 0))
                if keys == {"lengths"}:
                    values = raw["lengths"]
                    if not isinstance(values, list):
                        raise ValueError(f"lengths must be a list of token counts, got {_short(values)}")
                    return cls(lengths=tuple(parse_size(v, "a document length") for v in values))
                if keys == {"lengths_file"}:
                    return cls.from_lengths_file(raw["lengths_file"])
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        raise ValueError(f"{where}: expected none, NAME[:SEED], {{distribution: NAME, seed: N}}, {{lengths: [...]}} "
                         f"or {{lengths_file: PATH}}, got {_short(raw)}")

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> DocsSpec:
        """From a row's ``docs`` (or a trial's JSON): its identity keys; the summary is derived."""
        if not isinstance(fields, dict):
            raise ValueError(f"docs must be an object, got {_short(fields)}")
        if fields.get("lengths") is not None:
            return cls(lengths=tuple(fields["lengths"]))
        return cls(fields.get("distribution"), fields.get("seed", 0))

    # ------------------------------------------------------------------ views
    def lengths_for(self, seq_len: int) -> tuple[int, ...]:
        """The document lengths of a ``seq_len``-token sequence (sampled, or the explicit ones
        checked against it)."""
        if self.distribution is not None:
            return sample(self.distribution, seq_len, self.seed)
        longest = max(self.lengths)
        if longest > seq_len:
            raise ValueError(f"a document of {longest} tokens is longer than the {seq_len}-token sequence; "
                             f"give lengths that sum to {seq_len}")
        total = sum(self.lengths)
        if total != seq_len:
            raise ValueError(f"the {len(self.lengths)} document lengths sum to {total} but the sequence has "
                             f"{seq_len} tokens; give lengths that sum to {seq_len} (or set the length to {total})")
        return self.lengths

    def documents(self, seq_len: int):
        """``methods.Documents`` of a ``seq_len``-token sequence (imports torch: the benchmark's side)."""
        from methods import Documents

        return Documents.from_lengths(self.lengths_for(seq_len), seq_len)

    def identity(self) -> dict[str, Any]:
        """What makes two trials' documents the same (``records.trial_key`` adds it)."""
        if self.lengths is not None:
            return {"lengths": list(self.lengths)}
        return {"distribution": self.distribution, "seed": self.seed}

    def fields(self, seq_len: int | None = None) -> dict[str, Any]:
        """A row's ``docs``: the identity, and with ``seq_len`` the lengths' summary."""
        out = self.identity()
        if seq_len is not None:
            out.update(summary(self.lengths_for(seq_len)))
        return out

    @property
    def label(self) -> str:
        if self.lengths is not None:
            return f"lengths[{len(self.lengths)}]"
        return f"{self.distribution}:{self.seed}"


def identity(fields: dict[str, Any]) -> dict[str, Any]:
    """The identity part of a row's ``docs`` (its summary left out)."""
    return {k: fields[k] for k in IDENTITY_KEYS if k in fields}


def check_fields(fields: Any) -> None:
    """Refuse a row's ``docs`` that is not what :meth:`DocsSpec.fields` writes (``ValueError``)."""
    if not isinstance(fields, dict):
        raise ValueError(f"docs must be an object, got {_short(fields)}")
    unknown = sorted(set(fields) - set(IDENTITY_KEYS) - set(SUMMARY_KEYS))
    if unknown:
        raise ValueError(f"docs: unknown key(s) {unknown}; allowed: {list(IDENTITY_KEYS + SUMMARY_KEYS)}")
    spec = DocsSpec.from_fields(fields)
    if spec.lengths is not None and set(fields) & {"distribution", "seed"}:
        raise ValueError("docs: explicit lengths come without a distribution or seed")


def parse_lengths(text: str, what: str = "document lengths") -> tuple[int, ...]:
    """Positive token counts from text: a JSON list, or values separated by commas or whitespace."""
    body = text.strip()
    if not body:
        raise ValueError(f"{what}: empty; write the lengths separated by commas or one per line (e.g. 4096, 8K)")
    if body.startswith("["):
        try:
            values = json.loads(body)
        except json.JSONDecodeError as err:
            raise ValueError(f"{what}: not a JSON list ({err.msg} at line {err.lineno}); "
                             f"write [4096, 8192] or one length per line") from None
        if not isinstance(values, list):
            raise ValueError(f"{what}: expected a list of token counts, got {_short(values)}")
    else:
        values = [v for v in body.replace(",", " ").split() if v]
    out = []
    for i, v in enumerate(values):
        try:
            out.append(parse_size(v, "length"))
        except ValueError:
            raise ValueError(f"{what}: entry {i + 1} ({v!r}) is not a positive token count; "
                             f"write lengths such as 4096 or 8K, separated by commas or one per line") from None
    return tuple(out)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
