"""Session-wide test set-up: the flash-attn stand-in, installed before any test is collected.

Without flash-attn (no CPU build exists) the ``rfa-zigzag`` and ``ds-fpdt`` wrappers would be
unusable and drop out of ``methods.available()``, so the correctness matrix would never run
them. Installing the plain-torch stand-in at import time of this conftest (before collection
imports the test modules) makes them usable here; the rank pools install it on each rank
(tests/methods/conftest.py). It does nothing where a real flash-attn is importable.
"""
from tests.flash_attn_standin import install_if_missing

install_if_missing()
