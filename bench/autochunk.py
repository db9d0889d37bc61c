"""``chunk_heads="auto"`` for ``upipe`` and ``usp-upipe``: pick U before the trial runs.

UPipe's head chunk U trades memory for speed (paper §4: larger chunks are faster, use more
memory). ``auto`` is a request that bench resolves; the methods themselves only accept an
int (``methods.upipe.refuse_auto``). Resolution:

* candidates: the U that ``methods.validate`` accepts (multiples of the Ulysses degree u,
  u = C for upipe, dividing H, compatible with the GQA schedule), largest first (fewest
  stages, fastest);
* for each, the trial's own configuration (model, sequence length, world size, levers,
  device preset) is simulated (FakeTensorMode, rank 0's peak) and compared with the
  preset's usable bytes;
* the first (largest) U that fits is chosen; if none fits, the smallest U, with the reason
  ``no U fits`` (the trial then runs and reports its own ``oom``).

The row of a resolved trial records ``options.chunk_heads`` = the chosen U,
``options.chunk_heads_requested = "auto"`` and a note with the simulated peak of every
candidate tried (GiB) and the usable budget.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import methods

GiB = 2**30
AUTO = "auto"
AUTO_METHODS = ("upipe", "usp-upipe")


def is_auto(trial) -> bool:
    return trial.opts.get("chunk_heads") == AUTO


def _with_opts(trial, opts: dict):
    return dataclasses.replace(trial, options=tuple(sorted(opts.items())))


def with_chunk(trial, chunk_heads):
    """``trial`` with ``chunk_heads`` replaced (None: the method's default, U = u)."""
    opts = dict(trial.opts)
    opts["chunk_heads"] = chunk_heads
    return _with_opts(trial, opts)


def ulysses_degree(trial) -> int:
    """u: the ranks a UPipe stage spans (C for upipe; USP's Ulysses degree for usp-upipe)."""
    if trial.method == "upipe":
        return trial.world_size
    cls = trial.method_cls()
    probe = with_chunk(trial, None)
    return cls.degrees(trial.config().attn_spec(), trial.world_size, cls.parse_options(**probe.opts))[0]


def check_auto(trial) -> None:
    """Validation of an ``auto`` trial: the method must be a UPipe one, and the trial valid
    with the default chunk (every other option is checked there)."""
    if trial.method not in AUTO_METHODS:
        raise ValueError(f"chunk_heads='auto' is only for {list(AUTO_METHODS)}, not {trial.method!r}")
    spec = trial.config().attn_spec()
    methods.validate(trial.method, spec, trial.world_size, **with_chunk(trial, None).opts)
    if not candidates(trial):
        raise ValueError(f"{trial.method}: no valid chunk_heads for {trial.config().name} at world size "
                         f"{trial.world_size}")


def candidates(trial) -> list[int]:
    """Valid U values, largest first."""
    spec = trial.config().attn_spec()
    u = ulysses_degree(trial)
    out = []
    for chunk in range(spec.n_heads - spec.n_heads % u, 0, -u):
        if spec.n_heads % chunk:
            continue
        try:
            methods.validate(trial.method, spec, trial.world_size, **with_chunk(trial, chunk).opts)
        except ValueError:
            continue
        out.append(chunk)
    return out


def _simulate(trial):
    from .trial import run_trial

    return run_trial(dataclasses.replace(trial, mode="simulated"))


def resolve_auto_chunk(trial, simulate: Callable | None = None):
    """``(trial_with_U, reason)``; a trial without ``chunk_heads='auto'`` comes back unchanged
    with reason ``""``. ``simulate(trial) -> Row`` runs one simulated trial (tests replace it)."""
    if not is_auto(trial):
        return trial, ""
    check_auto(trial)
    simulate = simulate or _simulate
    cands = candidates(trial)
    tried: list[str] = []
    usable = None
    chosen = None
    for chunk in cands:
        row = simulate(with_chunk(trial, chunk))
        usable = row.figures.usable_bytes
        peak = row.figures.peak_bytes
        tried.append(f"U={chunk}: " + (f"{peak / GiB:.2f} GiB" if peak is not None else row.status))
        if row.status == "ok":
            chosen = chunk
            break
        if row.status == "error":
            tried[-1] += f" ({row.message})"
    budget = f"{usable / GiB:.2f} GiB usable on {trial.device}" if usable else f"on {trial.device}"
    if chosen is None:
        chosen = cands[-1]
        verdict = f"no U fits: smallest U={chosen}"
    else:
        verdict = f"largest U that fits: U={chosen}"
    reason = (f"chunk_heads=auto -> {chosen} ({verdict}; candidates {cands}; simulated peaks "
              f"{', '.join(tried)}; {budget})")
    return with_chunk(trial, chosen), reason


def run_auto(trial, run: Callable):
    """Resolve ``auto``, run the resolved trial with ``run``, and record the choice in the row."""
    resolved, reason = resolve_auto_chunk(trial)
    row = run(resolved)
    row.options = {**row.options, "chunk_heads_requested": AUTO}
    row.notes = [reason] + list(row.notes)
    return row
