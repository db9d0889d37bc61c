"""Token counts as people write and read them: ``128K``, ``1.5M``, ``6.125M`` (K = 1024).

One place for the CLI's and the sweep specs' parsing and for every table, plan and summary
that prints a length; it imports nothing heavy, so ``analysis`` can use it without torch.
"""
from __future__ import annotations

import re

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*")


def scan(text: object) -> float | None:
    """The number of tokens ``text`` names (``"1.5M"`` -> 1572864.0), or ``None`` when it is not
    a size. The value may be fractional or zero: callers refuse those with their own message."""
    m = _SIZE.fullmatch(str(text))
    return None if m is None else float(m.group(1)) * UNITS[m.group(2).upper()]


def human(n: int) -> str:
    """Tokens as ``128K``/``1.5M``/``6.125M`` (K = 1024) when exact to 3 decimals, else the integer."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and (n * 1000) % size == 0:
            return f"{n / size:g}{unit}"
    return str(n)
