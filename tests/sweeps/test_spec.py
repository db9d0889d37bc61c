"""Sweep specs: validation messages name the bad key and the allowed values; expansion is exact."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from sweeps.spec import SpecError, load_spec, parse_size, parse_spec

CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("sweeps", "configs").glob("*.yaml"))
BASE = dict(name="t", mode="simulated", models=["llama3-8b"], seq_lens=["128K"], world_sizes=[8],
            methods=["upipe"])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_names_its_table_or_figure(path):
    spec = load_spec(path)
    assert spec.trials(), path
    first_comment = path.read_text().splitlines()[0]
    assert first_comment.startswith("# Regenerates"), f"{path.name} must say what it regenerates"


def test_paper_experiments_have_cpu_variants():
    names = {p.stem for p in CONFIGS}
    paper = {n for n in names if not n.endswith("-cpu") and not n.startswith("demo-")}  # demo-*: make demo's own
    missing = sorted(n for n in paper if f"{n}-cpu" not in names)
    assert not missing, f"no *-cpu.yaml variant for {missing}"


def test_expansion_is_the_cross_product():
    spec = parse_spec(dict(BASE, seq_lens=["128K", "1M"], world_sizes=[4, 8],
                           methods=["ulysses", {"name": "upipe", "options": {"chunk_heads": 16}}]))
    trials = spec.trials()
    assert len(trials) == 2 * 2 * 2
    assert {t.seq_len for t in trials} == {131072, 1048576}
    assert trials[-1].options.chunk_heads == 16 and trials[-1].opts == {"chunk_heads": 16}


def test_max_context_kind_has_one_trial_per_method_model_world():
    spec = parse_spec(dict(BASE, kind="max_context", seq_lens=None, max_context={"granularity": "64K"}))
    (trial,) = spec.trials()
    assert trial.kind == "max_context" and trial.search.granularity == 65536


def test_entry_step_overrides_spec_step():
    spec = parse_spec(dict(BASE, step={"ac": True, "fsdp": True},
                           methods=[{"name": "ulysses", "step": {"ac": False}}]))
    step = spec.trials()[0].step
    assert (step.ac, step.fsdp) == (False, True)


def test_simulated_specs_default_to_the_paper_stack_with_a_pool_per_stream():
    """As on the CLI: a simulated spec runs the paper stack, whose allocator keeps a pool per
    stream (checked on an H100, results/gpu); a spec can ask for the shared pool or the lean
    stack, and a real spec keys neither."""
    step = parse_spec(BASE).trials()[0].step
    assert (step.stack, step.allocator_pools) == ("paper", "per-stream")
    shared = parse_spec(dict(BASE, step={"allocator_pools": "shared"})).trials()[0].step
    assert shared.allocator_pools == "shared"
    lean = parse_spec(dict(BASE, step={"stack": "lean"})).trials()[0].step
    assert (lean.stack, lean.allocator_pools) == ("lean", "shared")
    real = parse_spec(dict(BASE, mode="real", seq_lens=["1K"], models=["tiny-llama"], world_sizes=[2],
                           device="cpu")).trials()[0].step
    assert (real.stack, real.allocator_pools) == ("lean", "shared")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"mode": "sim"}, r"mode: 'sim' is not allowed; choose one of \['real', 'emulated', 'simulated'\]"),
        ({"kind": "sweep"}, r"kind: 'sweep' is not allowed; choose one of \['trial', 'max_context'\]"),
        ({"scope": "layer"}, r"scope: 'layer' is not allowed"),
        ({"dtype": "fp8"}, r"dtype: 'fp8' is not allowed; choose one of \['bf16', 'fp32'\]"),
        ({"seq_lens": ["12Q"]}, r"seq_lens: expected a size like 4096, 128K, 1.5M, got '12Q'"),
        ({"world_sizes": [0]}, r"world_sizes: each entry must be a positive int, got 0"),
        ({"world_sizes": []}, r"world_sizes: expected a non-empty list"),
        ({"methods": [{"nam": "x"}]}, r"methods\[0\]: expected a method name or"),
        ({"slurm": {"partion": "gpu"}}, r"slurm: unknown key\(s\) \['partion'\]; allowed: .*partition"),
        ({"colour": 1}, r"unknown key\(s\) \['colour'\]; allowed keys"),
        ({"name": "has space"}, r"name: expected a file-name-safe string"),
        ({"seq_lens": None}, r"seq_lens: missing \(kind: trial needs"),
    ],
)
def test_bad_specs_name_the_key(change, match):
    with pytest.raises(SpecError, match=match):
        parse_spec(dict(BASE, **change))


def test_sizes():
    assert parse_size("128K") == 131072 and parse_size("1.5M") == 1572864 and parse_size(4096) == 4096
    with pytest.raises(SpecError, match="not a whole number"):
        parse_size("1.3K")


def test_overrides_and_missing_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(BASE))
    spec = load_spec(path, {"slurm.partition": "h100", "mode": "real"})
    assert spec.slurm["partition"] == "h100" and spec.mode == "real"
    with pytest.raises(SpecError, match="no such sweep spec"):
        load_spec(tmp_path / "nope.yaml")
    path.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(path)


MAXCTX = dict(BASE, kind="max_context", seq_lens=None, max_context={"granularity": "1M"})


def _extrapolates(**changes) -> list[bool]:
    spec = parse_spec({**MAXCTX, **changes})
    return [spec.extrapolates(t) for t in spec.trials()]


def test_simulated_searches_of_deep_models_are_extrapolated_over_layers_by_default():
    assert _extrapolates() == [True]  # llama3-8b: 32 layers
    assert _extrapolates(max_context={"granularity": "1M", "layers": "full"}) == [False]
    assert _extrapolates(max_context={"granularity": "1M", "layers": "extrapolate"}) == [True]
    assert _extrapolates(models=["tiny-llama"]) == [False]  # 4 layers: simulated whole, as before
    assert _extrapolates(step={"ac_group": 2}) == [False]  # not linear in the layers: the whole model
    assert _extrapolates(mode="emulated", device="cpu", models=["tiny-llama"]) == [False]
    assert parse_spec(dict(BASE)).extrapolates(parse_spec(dict(BASE)).trials()[0]) is False  # kind: trial


def test_a_trial_spec_extrapolates_over_layers_only_when_it_says_so():
    trial_spec = dict(BASE, mode="simulated")
    assert [parse_spec(trial_spec).extrapolates(t) for t in parse_spec(trial_spec).trials()] == [False]
    spec = parse_spec(dict(trial_spec, layers="extrapolate"))
    (trial,) = spec.trials()
    assert spec.extrapolates(trial)
    from sweeps.jobs import bench_argv
    assert bench_argv(trial, Path("r.jsonl"), spec.extrapolates(trial))[-1] == "--extrapolate-layers"
    assert not parse_spec(dict(trial_spec, layers="full")).extrapolates(trial)
    shallow = parse_spec(dict(trial_spec, layers="extrapolate", models=["tiny-llama"]))
    assert [shallow.extrapolates(t) for t in shallow.trials()] == [False]  # 4 layers: simulated whole


def test_the_flag_reaches_the_bench_command():
    from sweeps.jobs import bench_argv
    (trial,) = parse_spec(MAXCTX).trials()
    assert bench_argv(trial, Path("r.jsonl"), True)[-1] == "--extrapolate-layers"
    assert "--extrapolate-layers" not in bench_argv(trial, Path("r.jsonl"))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"max_context": {"layers": "some"}}, r"max_context.layers: 'some' is not allowed; choose one of "
                                              r"\['extrapolate', 'full'\]"),
        ({"max_context": {"layers": "extrapolate"}, "mode": "emulated"},
         r"max_context.layers: extrapolate extrapolates simulations, and this spec's mode is emulated"),
        ({"max_context": {"layers": "extrapolate"}, "step": {"ac_group": 2}},
         r"methods\[0\] \(upipe\): max_context.layers: extrapolate is linear in the layers and ac_group 2"),
        ({"max_context": {"granulrity": "1M"}}, r"max_context: unknown key\(s\) \['granulrity'\]; allowed: .*layers"),
    ],
)
def test_bad_max_context_options_are_one_line_errors(change, match):
    with pytest.raises(SpecError, match=match) as err:
        parse_spec({**MAXCTX, **change})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"layers": "some"}, r"^layers: 'some' is not allowed; choose one of \['extrapolate', 'full'\]"),
        ({"layers": "extrapolate", "mode": "emulated"},
         r"^layers: extrapolate extrapolates simulations, and this spec's mode is emulated"),
        ({"layers": "extrapolate", "step": {"ac_group": 2}},
         r"methods\[0\] \(upipe\): layers: extrapolate is linear in the layers and ac_group 2"),
    ],
)
def test_bad_trial_layers_are_one_line_errors(change, match):
    with pytest.raises(SpecError, match=match) as err:
        parse_spec({**BASE, "mode": "simulated", **change})
    assert "\n" not in str(err.value)


def test_a_search_says_its_layers_in_max_context():
    with pytest.raises(SpecError, match=r"^layers: a max_context spec says how its probes are simulated in "
                                        r"max_context.layers; move it there$"):
        parse_spec({**MAXCTX, "layers": "full"})


def test_an_empty_spec_or_one_without_required_keys_says_which_keys(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# to be written\n")
    with pytest.raises(SpecError) as err:
        load_spec(empty, {"out": "x.jsonl"})
    assert str(err.value) == (f"{empty}: the spec is empty; write its required key(s) name:, mode:, models:, "
                              f"world_sizes:, methods:, seq_lens: (see sweeps/configs/ for complete specs)")
    with pytest.raises(SpecError, match=r"the spec is empty; write its required key\(s\) mode:, models:"):
        load_spec(empty, {"name": "t"})
    partial = {k: v for k, v in BASE.items() if k not in ("models", "seq_lens")}
    with pytest.raises(SpecError, match=r"^<spec>: missing required key\(s\) models:, seq_lens: \(see"):
        parse_spec(partial)
    with pytest.raises(SpecError, match=r"^<spec>: missing required key\(s\) models: \(see"):
        parse_spec(dict(partial, kind="max_context"))  # a search needs no lengths


TABLE3 = Path(__file__).resolve().parents[2] / "sweeps" / "configs" / "table3-llama3-8b.yaml"


def test_optional_libraries_are_the_compute_nodes_to_check_unless_this_machine_runs_the_trials(
        no_flash_attn, tmp_path):
    """A login node without flash-attn submits the Table 3 sweep (problems() leaves the libraries
    to the compute node, as CUDA); a local executor checks them here; the trial itself checks
    them where it runs (Trial.validate)."""
    spec = load_spec(TABLE3, {"out": str(tmp_path / "rows.jsonl")})
    assert spec.problems() == []
    here = spec.problems(libraries=True)
    assert {line.split("[")[0].split(" ")[0] for line in here} == {"yc-usp", "ds-fpdt"}, here
    assert all("needs flash_attn, which is not importable here" in line for line in here), here
    trial = next(t for t in spec.trials() if t.method == "yc-usp")
    assert trial.needs() == ("yunchang", "flash_attn")
    trial.validate(here=False, libraries=False)
    with pytest.raises(ValueError, match="'yc-usp' needs flash_attn, which is not importable here"):
        trial.validate()  # on the compute node: here and libraries both checked
    simulated = dataclasses.replace(trial, mode="simulated")
    assert "flash_attn" not in simulated.needs()  # simulated mode supplies flash-attn itself
