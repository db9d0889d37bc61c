"""The simulator's figures equal those of the code the speed work started from, to the byte.

Each trial below (four methods, both accounting stacks, a 3-layer Llama3-8B at 128K tokens on 8
ranks: paper-shaped, small enough to run in seconds) is simulated here and its whole measurement
compared with ``sim_golden.json``: the allocated and reserved peaks, the categories, the host peak,
the collectives' bytes and modelled time, every step count (FLOPs, host copies, memory traffic,
collectives, the methods' events), the allocator replay's events and cache releases, the notes.
Only the replay's own wall time is left out. A speed-up of the simulator (one dispatch mode for
several, less work per operation) must leave every one of them as it was.

The paper stack runs the MLP through DeepSpeed's ``TiledMLP``, which simulation compresses (its
identical middle tiles replayed, ``bench.model.dstiled``); at 128K it has only 4 tiles, so two more
cases have many: UPipe at 1M (32 tiles of a 128K-token rank, all of one size) and Ulysses at
508,000 tokens (16 tiles of a 63,500-token rank, the last shorter than the others), 2 layers each.
Their golden figures were written by the code before that compression (main's ``48f5bbb``), with
the command below, from a worktree of that commit.

Counts of version 4 (``bench.stackmodel.counts.COUNTS_VERSION``: the indexing kernels' bytes are the
rows they index) changed the golden figures on purpose: the file was written again by that commit's
code, and against the file before it every figure of every case was the same except
``step_counts["bytes.memory_bound"]`` (fewer bytes) and the new ``step_counts["counts_version"]``.

The golden file was first written by the base commit's code (``git merge-base main simspeed``), from a
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
# (method, stack, layers, tokens): DeepSpeed's TiledMLP over many tiles, of one size and with a shorter last one
MANY_TILES = (("upipe", "paper", 2, 1 << 20), ("ulysses", "paper", 2, 508_000))


def cases() -> list[tuple[str, str, int, int]]:
    return [(m, s, LAYERS, SEQ_LEN) for m in METHODS for s in STACKS] + list(MANY_TILES)


def figures(method: str, stack: str, directory: str, layers: int = LAYERS, seq_len: int = SEQ_LEN) -> dict:
    """The measurement of one case as JSON (``Measurement.to_dict``), the replay's wall time left out."""
    from bench.measure.config import StepConfig
    from bench.measure.run import measure_simulated
    from bench.measure.trial import Trial
    from bench.model.config import get_config
    from bench.search.extrapolate import layer_variant

    model = layer_variant(get_config("llama3-8b"), layers, directory)
    trial = Trial.make(method, model, seq_len, WORLD, step=StepConfig(stack=stack))
    trial.validate()
    out = measure_simulated(trial).to_dict()
    if "allocator" in out:
        out["allocator"].pop("replay_s")
    return json.loads(json.dumps(out))  # tuples and keys as the file has them


def _key(method: str, stack: str, layers: int = LAYERS, seq_len: int = SEQ_LEN) -> str:
    """``method/stack`` for the 3-layer 128K cases, with ``/<layers>L-<tokens>`` appended for the others."""
    if (layers, seq_len) == (LAYERS, SEQ_LEN):
        return f"{method}/{stack}"
    return f"{method}/{stack}/{layers}L-{seq_len}"


def test_figures_equal_the_base_commits():
    import pytest

    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == sorted(_key(*case) for case in cases()), "sim_golden.json holds other cases"
    with tempfile.TemporaryDirectory() as directory:
        got = {_key(*case): figures(*case[:2], directory, *case[2:]) for case in cases()}
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
        out = {_key(*case): figures(*case[:2], directory, *case[2:]) for case in cases()}
    Path(argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
