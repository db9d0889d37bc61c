"""Byte units, defined once (every table, message and preset uses these)."""
from __future__ import annotations

KiB = 2**10
MiB = 2**20
GiB = 2**30
