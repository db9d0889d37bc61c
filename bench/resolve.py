"""Resolve first, then run: a request becomes a fully explicit trial before anything runs.

The CLI (``bench.cli``) and sweep specs (``sweeps.spec``) describe a trial as a
:class:`Request`: the method (or a named configuration such as ``upipe-best``), the options
and the levers the user set, and nothing else. :func:`resolve` turns it into a
``bench.measure.trial.Trial`` whose every field is explicit:

1. a named configuration (``bench.training.presets``) becomes its method, options and levers;
2. the defaults that depend on the mode are decided: a simulated trial that names no stack is
   accounted under the ``paper`` stack, any other under ``lean``; the allocator pools are the
   stack's (``bench.stackmodel.stack.allocator_pools``); a trial without checkpoints has nothing to
   offload. These decided levers are the request a row records as its ``levers`` and its
   identity (``records.trial_key``);
3. the stack's terms fill in what the request left open (``bench.stackmodel.stack.apply``: the
   allocator model, the kernels' scratch, the offload setting, the RoPE table, the ring barrier,
   DeepSpeed's TiledMLP; under the ``hf`` stack ``bench.stackmodel.hfstack``'s levers, and
   ``torch-cp``'s options as Accelerate's cp_size path runs it, which become the trial's options):
   ``Trial.resolution`` holds every lever as it runs and the presets that set them, which the row
   records as ``ran`` and ``presets``;
4. the trial is validated, once, with every refusal a one-line ``ValueError`` (documents
   included: a method that refuses them, lengths that do not tile the sequence).

Measurement never rewrites a resolved trial: it runs ``trial.resolved().step``.
``chunk_heads=auto`` is the one request left for run time, since answering it takes
simulations of the trial itself (``bench.search.autochunk``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from records import Kind, Mode
from records.workloads import DocsSpec

from .measure.config import StepConfig
from .measure.timing import MIN_TIMED_STEPS
from .measure.trial import Resolution, Search, Trial
from .stackmodel import hfstack, stack
from .training.presets import PRESETS, expand

TRIAL_SETTINGS = ("warmup", "iters", "smoke", "threads", "seed")  # per-trial settings beside the levers


@dataclass(frozen=True)
class Request:
    """A trial as a user asks for it: only what they set. ``levers`` holds ``StepConfig``
    fields (``scope``, ``batch`` and ``dtype`` included); anything left out is decided by
    :func:`resolve`."""

    method: str
    model: str
    seq_len: int
    world_size: int
    options: dict[str, Any] = field(default_factory=dict)
    mode: str = Mode.SIMULATED
    device: str = "h100-80g"
    link: str | None = None
    levers: dict[str, Any] = field(default_factory=dict)
    search: Search | None = None
    warmup: int = 1
    iters: int = MIN_TIMED_STEPS
    smoke: bool = False
    threads: int | None = None
    seed: int = 0
    docs: DocsSpec | None = None  # packed documents (a distribution and seed, or lengths); None: one sequence


def decided_levers(levers: dict[str, Any], mode: str) -> dict[str, Any]:
    """``levers`` with the defaults that depend on the mode or on another lever decided."""
    out = dict(levers)
    if out.get("ac") is False:
        out.setdefault("ac_offload", False)  # no checkpoints, nothing to offload (--no-ac)
    out.setdefault("stack", "paper" if mode == Mode.SIMULATED else "lean")
    out.setdefault("allocator_pools", stack.allocator_pools(out["stack"]))
    return out


def resolve(request: Request, here: bool = True, validate: bool = True) -> Trial:
    """The explicit, validated trial of ``request`` (``ValueError``: one line saying what to fix).

    ``here=False`` leaves out the checks only the machine that runs the trial can answer
    (CUDA, GPU count, optional libraries): a sweep resolves its trials on a login node."""
    method, options, levers = expand(request.method, dict(request.options), dict(request.levers))
    step = StepConfig(**decided_levers(levers, request.mode))
    if step.stack == "hf":  # a method the HF stack cannot run is refused here; torch-cp gets Accelerate's options
        options = hfstack.options(method, options)
    trial = Trial.make(
        method, request.model, request.seq_len, request.world_size, options, mode=request.mode,
        device=request.device, step=step, link=request.link, warmup=request.warmup, iters=request.iters,
        smoke=request.smoke, threads=request.threads, seed=request.seed,
        kind=Kind.MAX_CONTEXT if request.search is not None else Kind.TRIAL, search=request.search,
        docs=request.docs)
    named = (request.method,) if request.method in PRESETS else ()
    trial = dataclasses.replace(trial, resolution=Resolution.of(step, method, named))
    if validate:
        trial.validate(here=here)
    return trial
