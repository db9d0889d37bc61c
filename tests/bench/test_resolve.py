"""The resolver (bench.resolve): a request becomes an explicit trial before anything runs, and
its row records the request (identity) and every lever that ran."""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from bench.cli import build_parser, lever_flag, main
from bench.measure.config import StepConfig, lever_fields
from bench.measure.run import run_trial
from bench.measure.trial import Trial
from bench.resolve import Request, resolve
from records import trial_key
from records.identity import V1_OMITTED_LEVERS


def test_a_simulated_trial_resolves_to_the_paper_stack_and_records_what_runs():
    trial = resolve(Request("upipe", "llama3-8b", 1 << 20, 8))
    assert trial.step.stack == "paper" and trial.step.allocator_pools == "per-stream"  # the request, decided
    assert trial.step.allocator_model == "none" and trial.step.rope_table == "auto"  # left to the stack
    ran = trial.resolved().step
    assert ran.allocator_model == "expandable" and ran.allocator_pools == "per-stream"
    assert ran.kernel_workspace == "fa3" and ran.offload_keep == "first" and ran.rope_table == "checkpointed"
    deepspeed = importlib.util.find_spec("deepspeed") is not None
    assert ran.tiled_mlp_impl == ("deepspeed" if deepspeed else "ours")
    assert trial.resolved().presets == ("paper-stack",)
    assert any("offload_first_only" in n for n in trial.resolved().notes)


def test_other_modes_resolve_to_the_lean_stack_unchanged():
    trial = resolve(Request("ulysses", "tiny-llama", 4096, 2, mode="emulated", device="cpu", iters=5), here=False)
    assert trial.step.stack == "lean" and trial.resolved().step == trial.step and trial.resolved().presets == ()


def test_a_named_configuration_is_a_preset_that_travels_with_the_trial():
    trial = resolve(Request("upipe-best", "llama3-8b", 1 << 20, 8))
    assert trial.method == "upipe" and trial.resolved().presets == ("upipe-best", "paper-stack")
    again = Trial.from_json(trial.to_json())
    assert again.resolved() == trial.resolved() and again.key() == trial.key()


def test_a_simulated_row_records_the_levers_that_ran():
    trial = resolve(Request("upipe", "tiny-llama", 2048, 2))
    row = run_trial(trial)
    assert row.status == "ok", row.message
    assert row.levers == trial.step.levers() and row.levers["allocator_model"] == "none"
    assert row.ran == trial.resolved().step.levers() and row.ran["allocator_model"] == "expandable"
    assert row.ran["rope_table"] == "checkpointed" and row.presets == ["paper-stack"]


def test_a_lever_that_another_lever_switched_off_is_refused(capsys):
    with pytest.raises(ValueError, match="offload_keep='first' has no effect with ac_offload=False"):
        StepConfig(ac=False, ac_offload=False, offload_keep="first")
    with pytest.raises(ValueError, match="loss_chunk=4096 has no effect with chunked_loss=False"):
        StepConfig(chunked_loss=False, loss_chunk=4096)
    code = main(["run", "--method", "ulysses", "--model", "tiny-llama", "--seq-len", "2K", "--world-size", "2",
                 "--no-ac", "--offload-keep", "first", "--no-save"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "has no effect with ac_offload=False" in err


def test_allocator_pools_without_an_allocator_model_are_refused(capsys):
    """The pools belong to the modelled caching allocator: under the lean stack, which models none unless
    asked, a choice of pools would do nothing. Refused in one line; with the allocator model, accepted."""
    base = ["run", "--method", "ulysses", "--model", "tiny-llama", "--seq-len", "2K", "--world-size", "2",
            "--stack", "lean", "--allocator-pools", "per-stream", "--no-save"]
    assert main(base) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "allocator_pools='per-stream'" in err and "--allocator-model" in err
    trial = resolve(Request("ulysses", "tiny-llama", 2048, 2,
                            levers={"stack": "lean", "allocator_pools": "per-stream", "allocator_model": "classic"}))
    assert trial.resolved().step.allocator_pools == "per-stream"


def test_every_lever_has_a_flag_and_a_spec_key():
    from sweeps.spec import STEP_KEYS

    text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    for f in lever_fields():
        assert lever_flag(f) in text, f.name
        assert f.name in STEP_KEYS, f.name


def test_a_flag_not_given_leaves_its_lever_to_the_resolver():
    args = build_parser().parse_args(["run", "--method", "ulysses", "--model", "tiny-llama", "--seq-len", "2K",
                                      "--world-size", "2", "--no-ac", "--lr", "1e-3"])
    given = {f.name for f in lever_fields() if hasattr(args, f.name)}
    assert given == {"ac", "lr"} and args.ac is False and args.lr == 1e-3


def test_a_schema_1_row_and_a_schema_2_row_of_one_configuration_are_one_trial():
    trial = resolve(Request("ulysses", "tiny-llama", 2048, 2, levers={"stack": "lean"}))
    full = trial.row_fields()
    old = dict(full, levers={k: v for k, v in full["levers"].items()
                             if k not in V1_OMITTED_LEVERS or v != V1_OMITTED_LEVERS[k]})
    assert old["levers"] != full["levers"] and trial_key(old) == trial_key(full)
    moved = dict(full, levers={**full["levers"], "ring_barrier": True})
    assert trial_key(moved) != trial_key(full)
    assert StepConfig.from_levers("model", 1, "bf16", old["levers"]) == trial.step


def test_measurement_does_not_rewrite_the_trial():
    trial = resolve(Request("ring", "tiny-llama", 2048, 2, levers={"scope": "attention"}))
    before = dataclasses.replace(trial)
    run_trial(trial)
    assert trial == before and trial.step.allocator_model == "none"


def test_a_trial_is_validated_once_per_process(monkeypatch):
    trial = resolve(Request("ulysses", "tiny-llama", 2048, 2, levers={"stack": "lean"}))
    calls = []
    real = Trial.check
    monkeypatch.setattr(Trial, "check", lambda self, *a: calls.append(a) or real(self, *a))
    for _ in range(3):
        trial.validate()
    assert calls == []  # resolve() validated it already
    other = dataclasses.replace(trial, seq_len=3001)  # not a multiple of the ranks: refused, not remembered
    for _ in range(2):
        with pytest.raises(ValueError):
            other.validate()
    assert len(calls) == 2
