"""The outputs that ``bench`` computes, regenerated from committed data by ``python -m analysis figs``.

Three commands of ``bench`` compute what they show and hand it to analysis to render
(``fidelity_report``, ``steptime_report``, ``plan_report``). Their committed outputs are
regenerated here from committed data through the same computation and the same renderers,
with no simulation:

* ``fidelity.md``/``.png``: every anchor judged on the committed rows ``fidelity/fidelity.jsonl``
  (what ``python -m bench fidelity --from-rows`` does), with the real-GPU checks of ``gpu/``;
* ``table3_model.md``/``.csv``: the step-time model fitted on the committed counts
  ``fidelity/steptime.jsonl`` (``python -m bench steptime``);
* ``plan_*.md``/``.png`` (``plans=True``, ``--plans``: each re-renders a whole plan from the
  committed simulation cache ``plan/sims.ndjson``, tens of seconds): each of ``PLANS`` with
  ``bench.search.plan.plan``, which may not simulate (``SimCache.allow``). A plan whose trials
  are not all in the cache is not written and says which trial is missing.

Each reads its data under the ``--results`` folder; an output whose data is absent there is
skipped (a results folder of rows only, as the tests make, gets the row-based outputs alone).
"""
from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock


@dataclass(frozen=True)
class CommittedPlan:
    """One committed plan: ``python -m bench plan`` with these arguments (paper_figs/README.md)."""

    model: str
    gpus: int
    nodes: int = 1
    pools: str | None = "per-stream"  # None: the stack's own (the hf stack refuses the option)
    device: str = "h100-80g"
    stack: str = "paper"
    wall_times: bool = True  # False: its .md holds no wall seconds, so a re-rendering is byte for byte the same
    # the ranks simulated ($CPAB_SIM_RANKS): "deciding", or "0" for a plan whose cache holds rank 0 only (its
    # header says so); every committed plan now holds every deciding rank
    sim_ranks: str = "deciding"

    def command(self) -> str:
        nodes = f" --nodes {self.nodes}" if self.nodes > 1 else ""
        pools = f" --allocator-pools {self.pools}" if self.pools not in ("per-stream", None) else ""
        stack = f" --stack {self.stack}" if self.stack != "paper" else ""
        env = f"CPAB_SIM_RANKS={self.sim_ranks} " if self.sim_ranks != "deciding" else ""
        return (f"{env}python -m bench plan --model {self.model} --gpus {self.gpus}{nodes} --device {self.device}"
                f"{stack}{pools} --cache results/plan/sims.ndjson --out-dir paper_figs")


PLANS = (CommittedPlan("llama3-8b", 8), CommittedPlan("llama3-8b", 16, 2, "shared"),
         CommittedPlan("qwen3-32b", 16, 2, "shared"),
         CommittedPlan("bench/model_configs/hf/Llama-3.1-8B/config.json", 8, pools=None, stack="hf",
                       wall_times=False))


def fidelity(results_dir: Path, out_dir: Path) -> list[Path]:
    """``fidelity.md``/``.png`` from ``results_dir/fidelity/fidelity.jsonl``; [] without that file."""
    results_dir = results_dir.resolve()  # real_checks names its GPU rows relative to the repository
    rows = results_dir / "fidelity" / "fidelity.jsonl"
    if not rows.is_file():
        return []
    from bench.stackmodel import fidelity as fid

    from .fidelity_report import write_report

    results = fid.run_anchors(fid.load_anchors(), runner=fid.rows_runner([rows]), log=lambda line: None)
    return list(write_report(results, fid.real_checks(results, results_dir / "gpu"), out_dir))


def table3_model(results_dir: Path, out_dir: Path) -> list[Path]:
    """``table3_model.md``/``.csv`` fitted on ``results_dir/fidelity/steptime.jsonl``; [] without that file."""
    counts = results_dir / "fidelity" / "steptime.jsonl"
    if not counts.is_file():
        return []
    from bench.stackmodel.steptime_fit import load_counts, model_table3

    from .steptime_report import render, write_table3_model

    records, constants = model_table3(load_counts(counts), max_context_rows=results_dir / "bench" / "simulated.jsonl")
    return [Path(p) for p in write_table3_model(records, out_dir, render(records, constants, True))]


def plans(results_dir: Path, out_dir: Path, log: Callable[[str], None] = print) -> list[Path]:
    """Every plan of ``PLANS`` re-rendered from ``results_dir/plan/sims.ndjson`` (no simulation); a plan
    the cache cannot answer is logged and skipped. [] without that file."""
    cache = results_dir / "plan" / "sims.ndjson"
    if not cache.is_file():
        return []
    from bench.search.plan import plan

    from .plan_report import write_plan

    written: list[Path] = []
    repo = Path(__file__).resolve().parents[1]
    for p in PLANS:
        model = str(repo / p.model) if (repo / p.model).is_file() else p.model  # a config file of the repository
        try:
            with mock.patch.dict(os.environ, {"CPAB_SIM_RANKS": p.sim_ranks}):  # the ranks its cache holds
                res = plan(model, p.gpus, p.device, p.nodes, pools=p.pools, cache=None, stack=p.stack,
                           committed=cache, simulate=False, progress=io.StringIO())  # no progress lines
        except LookupError as err:
            log(f"not regenerated: `{p.command()}`: {err}")
            continue
        written += [Path(f) for f in write_plan(res, out_dir, p.wall_times)]
    return written


# (name, builder, data it reads under --results): in the order make_all writes them
DERIVED: tuple[tuple[str, Callable[[Path, Path], list[Path]], str], ...] = (
    ("fidelity", fidelity, "fidelity/fidelity.jsonl"),
    ("table3_model", table3_model, "fidelity/steptime.jsonl"),
)
