"""Token counts as people write and read them: ``128K``, ``1.5M``, ``6.125M`` (K = 1024).

The one parser of sizes (the CLI's flags, the sweep specs' lengths, the search limits) and the
one formatter (every table, plan, label and summary that prints a length).
"""
from __future__ import annotations

import argparse
import re

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*")


def scan(text: object) -> float | None:
    """The number of tokens ``text`` names (``"1.5M"`` -> 1572864.0), or ``None`` when it is not
    a size. The value may be fractional or zero: ``parse_size`` refuses those."""
    m = _SIZE.fullmatch(str(text))
    return None if m is None else float(m.group(1)) * UNITS[m.group(2).upper()]


def parse_size(value: object, what: str = "size") -> int:
    """A positive whole number of tokens from ``4096``, ``"128K"``, ``"1.5M"``; ``ValueError``
    naming ``what`` otherwise (booleans and fractions of a token are refused)."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size like 4096, 128K, 1.5M, got {value!r}")
    size = float(value) if isinstance(value, int) else scan(value)
    if size is None:
        raise ValueError(f"{what}: expected a size like 4096, 128K, 1.5M, got {value!r}")
    if size != int(size):
        raise ValueError(f"{what}: {value!r} is not a whole number of tokens")
    if size <= 0:
        raise ValueError(f"{what}: must be positive, got {value!r}")
    return int(size)


def positive_int(text: str) -> int:
    """A count given on a command line (ranks, steps, jobs in flight): an ``argparse`` type
    refusing anything but a whole number >= 1, shared by ``python -m bench`` and ``python -m sweeps``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def human(n: int) -> str:
    """Tokens as ``128K``/``1.5M``/``6.125M`` (K = 1024) when exact to 3 decimals, else the integer."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and (n * 1000) % size == 0:
            return f"{n / size:g}{unit}"
    return str(n)
