"""``chunk_heads=auto`` for ``upipe`` and ``usp-upipe``: pick U before the trial runs.

UPipe's head chunk U trades memory for speed (paper: larger chunks are faster, use more
memory). ``auto`` is a request (``bench.measure.trial.AutoChunk``) that this module
resolves; the methods themselves only accept an int. Resolution:

* candidates: the U that ``methods.validate`` accepts (multiples of the Ulysses degree u,
  u = C for upipe, dividing H, compatible with the GQA schedule), largest first (fewest
  stages, fastest);
* for each, the trial's own configuration (model, sequence length, world size, levers,
  device preset) is simulated (FakeTensorMode, the worst deciding rank's peak) and compared with the
  preset's usable bytes;
* the first (largest) U that fits is chosen; if none fits, the smallest U, with the reason
  ``no U fits`` (the trial then runs and reports its own ``oom``).

The row of a resolved trial records ``options.chunk_heads`` = the chosen U,
``options.chunk_heads_requested = "auto"`` and a note with the simulated peak of every
candidate tried (GiB) and the usable budget. ``run`` is the entry point for any trial:
it resolves a request when there is one, then runs the trial; a simulated trial run by
``run_trial`` takes the row the resolution simulated for the chosen U (the same trial, so the
same simulation: it is not run twice).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import methods
from records import GiB, Row

from ..measure.run import run_trial
from ..measure.trial import AUTO, AUTO_OPTION, Trial


def with_chunk(trial: Trial, chunk_heads: int | None) -> Trial:
    """``trial`` with ``chunk_heads`` set (None: the method's default, U = u) and no request."""
    return trial.with_options(dataclasses.replace(trial.options, chunk_heads=chunk_heads))


def ulysses_degree(trial: Trial) -> int:
    """u: the ranks a UPipe stage spans (C for upipe; USP's Ulysses degree for usp-upipe)."""
    if trial.method == "upipe":
        return trial.world_size
    probe = with_chunk(trial, None)
    return trial.method_cls().degrees(trial.config().attn_spec(), trial.world_size, probe.options)[0]


def candidates(trial: Trial) -> list[int]:
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


def _simulate(trial: Trial) -> Row:
    return run_trial(dataclasses.replace(trial, mode="simulated"))


def resolve_auto_chunk(trial: Trial, simulate: Callable[[Trial], Row] | None = None) -> tuple[Trial, str]:
    """``(trial_with_U, reason)``; a trial without the request comes back unchanged with
    reason ``""``. ``simulate(trial) -> Row`` runs one simulated trial (tests replace it)."""
    resolved, reason, _ = _resolve(trial, simulate)
    return resolved, reason


def _resolve(trial: Trial, simulate: Callable[[Trial], Row] | None = None) -> tuple[Trial, str, Row | None]:
    """``resolve_auto_chunk``'s answer and the row ``simulate`` gave for the chosen U (None without the request)."""
    if trial.auto_chunk is None:
        return trial, "", None
    trial.validate()
    simulate = simulate or _simulate
    cands = candidates(trial)
    if not cands:
        raise ValueError(f"{trial.method}: no valid chunk_heads for {trial.config().name} at world size "
                         f"{trial.world_size}")
    tried: list[str] = []
    usable = None
    chosen = None
    rows: dict[int, Row] = {}
    for chunk in cands:
        row = rows[chunk] = simulate(with_chunk(trial, chunk))
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
    reason = (f"{AUTO_OPTION}={AUTO} -> {chosen} ({verdict}; candidates {cands}; simulated peaks "
              f"{', '.join(tried)}; {budget})")
    return with_chunk(trial, chosen), reason, rows[chosen]


def run(trial: Trial, runner: Callable[[Trial], Row] = run_trial) -> Row:
    """Run ``trial`` with ``runner``, resolving an auto-chunk request first and recording the
    choice in the row (the row's options then say what was asked and what ran). A simulated trial
    run by ``run_trial`` is the resolution's own simulation of the chosen U (``_simulate`` of the
    same trial): its row, not a second simulation."""
    if trial.auto_chunk is None:
        return runner(trial)
    resolved, reason, simulated = _resolve(trial)
    same = runner is run_trial and trial.mode == "simulated" and simulated is not None
    row = simulated if same else runner(resolved)
    row.options = {**row.options, f"{AUTO_OPTION}_requested": AUTO}
    row.notes = [reason] + list(row.notes)
    return row
