"""The simulator's figures equal those of the code the speed work started from, to the byte.

Each trial below (four methods, both accounting stacks, a 3-layer Llama3-8B at 128K tokens on 8
ranks: paper-shaped, small enough to run in seconds) is simulated here and its whole measurement
compared with ``sim_golden.json``: the allocated and reserved peaks, the categories, the host peak,
the collectives' bytes and modelled time, every step count (FLOPs, host copies, memory traffic,
collectives, the methods' events), the allocator replay's events and cache releases, the notes.
Only the replay's own wall time is left out. A speed-up of the simulator (one dispatch mode for
several, less work per operation) must leave every one of them as it was.

The golden file was written by the base commit's code (``git merge-base main simspeed``), from a
worktree of that commit, with this file run as a script::

    git worktree add /tmp/simbase $(git merge-base main simspeed)
    cd /tmp/simbase && PYTHONPATH=/tmp/simbase python /path/to/tests/bench/stackmodel/test_sim_equality.py \\
        --write /path/to/tests/bench/stackmodel/sim_golden.json
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import bench  # noqa: F401, I001 - first: the simulated CUDA device loads before torch (as tests/conftest.py)

GOLDEN = Path(__file__).with_name("sim_golden.json")
METHODS = ("ulysses", "upipe", "ring", "fpdt")
STACKS = ("paper", "lean")
LAYERS, SEQ_LEN, WORLD = 3, 128 << 10, 8


def cases() -> list[tuple[str, str]]:
    return [(m, s) for m in METHODS for s in STACKS]


def figures(method: str, stack: str, directory: str) -> dict:
    """The measurement of one case as JSON (``Measurement.to_dict``), the replay's wall time left out."""
    from bench.measure.run import measure_simulated
    from bench.measure.trial import Trial
    from bench.model.config import get_config
    from bench.search.extrapolate import layer_variant
    from bench.training.config import StepConfig

    model = layer_variant(get_config("llama3-8b"), LAYERS, directory)
    trial = Trial.make(method, model, SEQ_LEN, WORLD, step=StepConfig(stack=stack))
    trial.validate()
    out = measure_simulated(trial).to_dict()
    if "allocator" in out:
        out["allocator"].pop("replay_s")
    return json.loads(json.dumps(out))  # tuples and keys as the file has them


def _key(method: str, stack: str) -> str:
    return f"{method}/{stack}"


def test_figures_equal_the_base_commits():
    import pytest

    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == sorted(_key(m, s) for m, s in cases()), "sim_golden.json holds other cases"
    with tempfile.TemporaryDirectory() as directory:
        got = {_key(m, s): figures(m, s, directory) for m, s in cases()}
    for key in golden:
        want, have = golden[key], got[key]
        assert want["status"] == "ok", f"{key}: the golden run failed: {want.get('message')}"
        differing = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        if differing:
            pytest.fail(f"{key}: figures differ from the base commit's in {differing}: "
                        + "; ".join(f"{k}: {want.get(k)!r} -> {have.get(k)!r}" for k in differing)[:2000])


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--write":
        print("usage: test_sim_equality.py --write GOLDEN.json", file=sys.stderr)
        return 2
    from tests.flash_attn_standin import install_if_missing  # as tests/conftest.py does

    install_if_missing()
    with tempfile.TemporaryDirectory() as directory:
        out = {_key(m, s): figures(m, s, directory) for m, s in cases()}
    Path(argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
