"""chunk_heads='auto' (bench.search.autochunk): resolved in bench, refused by the methods."""

import pytest

import methods
from bench import cli
from bench.measure.trial import Trial
from bench.search.autochunk import candidates, resolve_auto_chunk, run
from bench.stackmodel import hardware

MODEL, SEQ, WS = "tiny-llama", 65536, 4  # H=8, G=4: U in {8, 4} at C=4


@pytest.fixture(scope="module")
def u_peaks():
    """The simulated peaks of U=8 and U=4 at ``SEQ`` on ``WS`` ranks (once per module: the devices below)."""
    return {u: run(Trial.make("upipe", MODEL, SEQ, WS, {"chunk_heads": u})).figures.peak_bytes for u in (8, 4)}


@pytest.fixture
def small_device(u_peaks, monkeypatch):
    """A simulated accelerator whose usable bytes sit between the peaks of U=4 and U=8."""
    peaks = dict(u_peaks)
    assert peaks[4] < peaks[8]

    def add(name, usable):
        monkeypatch.setitem(hardware.DEVICES, name, hardware.DevicePreset(
            name, "cuda", int(usable / 0.9) + 1, 0.9, "nvlink-h100", "test device"))
    add("mid", (peaks[4] + peaks[8]) / 2)
    add("big", peaks[8] * 2)
    add("small", peaks[4] / 2)
    return peaks


def test_methods_refuse_auto():
    spec = methods.AttnSpec(dim=128, n_heads=8, n_kv_heads=4, head_dim=16)
    for name in ("upipe", "usp-upipe"):
        with pytest.raises(ValueError, match="must be an int"):
            methods.validate(name, spec, 4, chunk_heads="auto")


def test_candidates_largest_first():
    assert candidates(Trial.make("upipe", MODEL, SEQ, WS, {"chunk_heads": "auto"})) == [8, 4]
    usp = Trial.make("usp-upipe", MODEL, SEQ, 4, {"chunk_heads": "auto", "ulysses_degree": 2})
    assert candidates(usp) == [8, 4, 2]


@pytest.mark.parametrize("device,expected,fits", [("big", 8, True), ("mid", 4, True), ("small", 4, False)])
def test_resolve_picks_largest_fitting(small_device, device, expected, fits):
    trial = Trial.make("upipe", MODEL, SEQ, WS, {"chunk_heads": "auto"}, device=device)
    resolved, reason = resolve_auto_chunk(trial)
    assert resolved.opts["chunk_heads"] == expected
    assert ("no U fits" in reason) == (not fits)
    assert "GiB" in reason and f"U={expected}" in reason


def test_row_records_choice(small_device):
    row = run(Trial.make("upipe", MODEL, SEQ, WS, {"chunk_heads": "auto"}, device="mid"))
    assert row.status == "ok"
    assert row.options["chunk_heads"] == 4 and row.options["chunk_heads_requested"] == "auto"
    assert row.notes[0].startswith("chunk_heads=auto -> 4")
    from records import validate_row
    validate_row(row.to_dict())


def test_auto_other_method_is_refused():
    with pytest.raises(ValueError, match="only for"):
        Trial.make("ulysses", MODEL, SEQ, WS, {"chunk_heads": "auto"}).validate()


def test_unchanged_without_auto():
    trial = Trial.make("upipe", MODEL, SEQ, WS, {"chunk_heads": 8})
    assert resolve_auto_chunk(trial) == (trial, "")


def test_cli_prints_choice(capsys):
    rc = cli.main(["run", "--method", "upipe", "--model", MODEL, "--seq-len", "64K", "--world-size", "4",
                   "--device", "cpu", "--opt", "chunk_heads=auto", "--no-save"])
    assert rc == 0
    assert "chunk_heads=auto -> 8" in capsys.readouterr().err


# --------------------------------------------------------------------------- upipe-best (bench.training.presets)


def test_upipe_best_cli(capsys):
    rc = cli.main(["run", "--method", "upipe-best", "--model", MODEL, "--seq-len", "64K", "--world-size", "4",
                   "--no-save", "--json"])
    assert rc == 0
    out, err = capsys.readouterr()
    import json
    row = json.loads(out.strip().splitlines()[-1])
    assert row["method"] == "upipe" and row["options"]["chunk_heads_requested"] == "auto"
    assert all(row["levers"][k] for k in ("ac", "ac_offload", "tiled_mlp", "tiled_norm", "chunked_loss"))
    assert "chunk_heads=auto ->" in err


def test_upipe_best_refuses_lever_off(capsys):
    assert cli.main(["run", "--method", "upipe-best", "--model", MODEL, "--seq-len", "64K", "--world-size", "4",
                     "--no-save", "--no-tiled-mlp"]) == 2
    assert "upipe-best" in capsys.readouterr().err


def test_upipe_best_in_sweeps():
    from sweeps.spec import SpecError, parse_spec

    base = {"name": "t", "kind": "trial", "mode": "simulated", "models": [MODEL], "seq_lens": ["64K"],
            "world_sizes": [4]}
    spec = parse_spec({**base, "methods": ["upipe-best", {"name": "upipe-best", "options": {"kernel": "math"}}]})
    (a, b) = spec.methods
    assert a.name == "upipe" and a.options_dict == {"chunk_heads": "auto"}
    assert dict(a.step)["ac_offload"] is True and dict(a.step)["tiled_mlp"] is True
    assert b.options_dict == {"chunk_heads": "auto", "kernel": "math"}
    with pytest.raises(SpecError, match="upipe-best"):
        parse_spec({**base, "methods": [{"name": "upipe-best", "step": {"ac_offload": False}}]})


@pytest.mark.parametrize("mode", ["real", "emulated"])
def test_upipe_best_runs_in_the_measuring_modes(mode, capsys):
    """upipe-best with real ranks (2 gloo processes) and emulated (one rank, fake peers) on CPU:
    auto resolves U by simulation against the CPU preset, then the step really runs with it. At 1K
    (512 tokens per rank): the choice and the step go through the same code at any length, and the
    step's cost (per-op dispatch through the memory tracker, tiles, chunks) grows with it."""
    import json

    rc = cli.main(["run", "--method", "upipe-best", "--model", MODEL, "--seq-len", "1K", "--world-size", "2",
                   "--mode", mode, "--device", "cpu", "--warmup", "1", "--iters", "1", "--smoke", "--no-save",
                   "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    row = json.loads(out.strip().splitlines()[-1])
    assert row["mode"] == mode and row["status"] == "ok" and row["figures"]["step_time_s"] > 0
    assert row["options"]["chunk_heads_requested"] == "auto" and row["options"]["chunk_heads"] in (2, 4, 8)
    assert all(row["levers"][k] for k in ("ac", "ac_offload", "tiled_mlp", "tiled_norm", "chunked_loss"))
