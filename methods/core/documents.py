"""Packed documents: one global sequence cut into documents that do not attend to one another.

Long-context training packs several documents into one sequence; attention then stays within
each document (causal inside it when the block is causal), and RoPE positions restart at 0 at
every document, as Transformers' ``position_ids`` do for packed sequences. ``Documents`` is that
layout, given by the global document lengths, and everything derived from it:

* ``cu_seqlens``: the cumulative lengths ``[0, l0, l0 + l1, ..., S]`` (int32), what the flash
  kernels' variable-length entry points take;
* ``doc_ids``: per token, the index of its document;
* ``positions``: per token, its position inside its document (the RoPE positions).

The layout is global: a method's ``shard`` cuts the per-token tensors as it cuts the sequence,
and its kernels receive the same ``Documents`` with the global position of their first key
(``methods.core.kernels``). A frozen dataclass of ints, so it hashes, compares and pickles
(it travels to worker processes unchanged).
"""
from __future__ import annotations

import bisect
import functools
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    """Document lengths of one packed sequence, in order; they sum to the sequence length."""

    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        lengths = self.lengths
        if not isinstance(lengths, tuple) or not lengths:
            raise ValueError(
                f"Documents needs a non-empty tuple of document lengths, got {lengths!r}; "
                "build it with Documents.from_lengths([...])"
            )
        bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0]
        if bad:
            raise ValueError(
                f"document lengths must be positive ints, got {bad[:4]} among {len(lengths)} lengths; "
                "drop empty documents and give each document's token count"
            )
        object.__setattr__(self, "lengths", tuple(int(n) for n in lengths))

    @classmethod
    def from_lengths(cls, lengths: Iterable[int], seq_len: int | None = None) -> Documents:
        """The layout of documents of these lengths; with ``seq_len``, they must sum to it."""
        if isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        docs = cls(tuple(lengths))
        if seq_len is not None:
            docs.check_seq_len(seq_len)
        return docs

    # ------------------------------------------------------------------ geometry (ints)
    @functools.cached_property
    def seq_len(self) -> int:
        return self.starts[-1] + self.lengths[-1]

    @functools.cached_property
    def starts(self) -> tuple[int, ...]:
        """Global position of each document's first token (computed once: the kernels' masking rule and the
        ring's schedules look documents up by position in every call)."""
        out, at = [], 0
        for n in self.lengths:
            out.append(at)
            at += n
        return tuple(out)

    def __len__(self) -> int:
        return len(self.lengths)

    def check_seq_len(self, seq_len: int, what: str = "the sequence") -> None:
        """Refuse a sequence these documents do not tile exactly, naming both lengths."""
        if self.seq_len != seq_len:
            raise ValueError(
                f"document lengths sum to {self.seq_len} but {what} has {seq_len} tokens; "
                f"give lengths that sum to {seq_len} (e.g. add a document of the remaining tokens)"
            )

    def spans(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The documents met by global positions ``[start, stop)``: ``(doc, lo, hi)`` with the
        part ``[lo, hi)`` of document ``doc`` inside the range, in order."""
        if not 0 <= start <= stop <= self.seq_len:
            raise ValueError(
                f"positions [{start}, {stop}) are outside the {self.seq_len} tokens of these documents"
            )
        starts = self.starts
        out = []
        d = max(0, bisect.bisect_right(starts, start) - 1)
        while d < len(starts) and starts[d] < stop:
            lo, hi = max(start, starts[d]), min(stop, starts[d] + self.lengths[d])
            if lo < hi:
                out.append((d, lo, hi))
            d += 1
        return out

    # ------------------------------------------------------------------ per-token tensors
    def cu_seqlens(self, device=None) -> torch.Tensor:
        """``[0, l0, l0 + l1, ..., S]`` as int32, what the varlen flash kernels take."""
        return torch.tensor((*self.starts, self.seq_len), dtype=torch.int32).to(device)

    def doc_ids(self, device=None) -> torch.Tensor:
        """Per token, the index of its document (int64, ``[S]``)."""
        return torch.repeat_interleave(torch.arange(len(self)), torch.tensor(self.lengths)).to(device)

    def positions(self, device=None) -> torch.Tensor:
        """Per token, its position inside its document, restarting at 0 (int64, ``[S]``)."""
        starts = torch.repeat_interleave(torch.tensor(self.starts), torch.tensor(self.lengths))
        return (torch.arange(self.seq_len) - starts).to(device)
