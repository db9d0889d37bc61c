"""The suite's vocabulary: one spelling for each mode, scope, dtype, status and kind.

Specs, rows and the CLI all use these values. Each is a ``str`` enum, so a member compares
equal to its spelling (``Mode.SIMULATED == "simulated"``), formats as it and serialises to
JSON as it; rows store the plain string. ``parse`` turns user input into a member with a
one-line error that lists the allowed spellings.
"""
from __future__ import annotations

from enum import Enum


class Vocab(str, Enum):
    """Base of the vocabulary enums: formats and prints as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:  # equal to its spelling, so it hashes as it: {Mode.REAL: 1}["real"] works
        return str.__hash__(self)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value: object, what: str | None = None):
        """The member spelled ``value``; ``ValueError`` naming ``what`` and the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what or cls.__name__.lower()}: {value!r} is not one of "
                             f"{list(cls.values())}") from None


class Mode(Vocab):
    """How a figure was obtained (``bench.measure.run``)."""

    REAL = "real"  # real ranks, real tensors
    EMULATED = "emulated"  # one real rank, fake process group, modelled communication
    SIMULATED = "simulated"  # FakeTensorMode + fake process group: nothing allocated


class Scope(Vocab):
    MODEL = "model"  # embedding -> blocks -> loss, backward, optimizer step
    ATTENTION = "attention"  # one attention block forward + backward


class DType(Vocab):
    BF16 = "bf16"
    FP32 = "fp32"


class Status(Vocab):
    OK = "ok"
    OOM = "oom"
    ERROR = "error"


class Kind(Vocab):
    """What a trial (and its row) is: one measured step, or a max-context search."""

    TRIAL = "trial"
    MAX_CONTEXT = "max_context"


# The note ``bench.stackmodel.fidelity`` adds to a row it simulated for the paper's anchors ("fidelity anchor(s):
# <names>"); analysis recognises those rows by it (a series of anchors only is fidelity.md's, not a figure's).
FIDELITY_ANCHOR_NOTE = "fidelity anchor"


def fidelity_anchor_note(names: list[str]) -> str:
    """The note of a row simulated for these anchors."""
    return f"{FIDELITY_ANCHOR_NOTE}(s): {', '.join(names)}"
