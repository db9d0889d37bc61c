"""Named configurations: a method, its options and the training-step levers, under one name.

``upipe-best`` is UPipe as the paper runs it for its records, with the head chunk chosen
for the memory at hand: ``chunk_heads=auto`` (``bench.search.autochunk``: the largest U whose
simulated peak fits), activation checkpoints offloaded to host memory, tiled MLP and
RMSNorm, chunked loss (all ``StepConfig`` levers on).

    python -m bench run --method upipe-best --model llama3-8b --seq-len 4M --world-size 8
    sweeps:  methods: [upipe-best, {name: upipe-best, options: {kernel: math}}]

A preset's options and levers are defaults: options given with it are merged over them;
a lever the preset needs cannot be switched off (that would be another configuration).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..measure.trial import AUTO, AUTO_OPTION


@dataclass(frozen=True)
class Preset:
    name: str
    method: str
    options: dict
    step: dict  # StepConfig fields
    description: str


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("upipe-best", "upipe", {AUTO_OPTION: AUTO},
               {"ac": True, "ac_offload": True, "tiled_mlp": True, "tiled_norm": True, "chunked_loss": True},
               "UPipe + chunk_heads=auto + AC offloaded to host + tiled MLP/norm + chunked loss"),
    )
}


def expand(name: str, options: dict | None = None, step: dict | None = None) -> tuple[str, dict, dict]:
    """``(method, options, step levers)`` of a preset name (others come back unchanged).

    Raises ``ValueError`` when ``step`` switches off a lever the preset needs."""
    preset = PRESETS.get(name)
    options, step = dict(options or {}), dict(step or {})
    if preset is None:
        return name, options, step
    off = sorted(k for k, v in step.items() if k in preset.step and v != preset.step[k])
    if off:
        switched = ", ".join(f"{k}={step[k]}" for k in off)
        raise ValueError(f"{name} is {preset.description}: it cannot run with {switched}"
                         f"; use method {preset.method!r} for another combination")
    return preset.method, {**preset.options, **options}, {**step, **preset.step}
