"""Transformers ``config.json`` files as models (``bench.model.hf``): the published examples map to
the suite's shapes, Transformers itself builds models of the parameter counts we compute, every
refusal is one line naming the file and what is missing or not modelled, tied embeddings share one
weight, and a config.json runs in every mode with its name recorded as the row's model."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from bench.cli import main
from bench.measure.run import run_trial
from bench.model.config import CONFIGS, ModelConfig, get_config
from bench.model.decoder import Decoder
from bench.model.hf import model_name
from bench.resolve import Request, resolve
from sweeps.spec import parse_spec

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "bench" / "model_configs" / "hf"
TINY = "tests/bench/configs/tiny-qwen3/config.json"
SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "rope_theta", "qk_norm",
         "norm_eps", "tie_word_embeddings")


def shape(cfg: ModelConfig) -> dict:
    return {k: getattr(cfg, k) for k in SHAPE}


def example(name: str) -> ModelConfig:
    return get_config(str(EXAMPLES / name / "config.json"))


def test_llama_3_1_8b_is_the_suites_llama3_8b():
    cfg = example("Llama-3.1-8B")
    assert cfg.name == "Llama-3.1-8B"
    assert shape(cfg) == shape(CONFIGS["llama3-8b"])
    assert "RoPE scaling 'llama3' not modelled" in cfg.note


def test_qwen3_32b_is_the_suites_qwen3_32b_with_its_qk_norm():
    """The paper's ``qwen3-32b`` ran without QK-norm; the published model has it: the file equals
    ``qwen3-32b-qknorm`` and differs from ``qwen3-32b`` in nothing else."""
    cfg = example("Qwen3-32B")
    assert shape(cfg) == shape(CONFIGS["qwen3-32b-qknorm"])
    assert shape(dataclasses.replace(cfg, qk_norm=False)) == shape(CONFIGS["qwen3-32b"])


def test_qwen3_8b():
    cfg = example("Qwen3-8B")
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size) == (
        4096, 36, 32, 8, 128, 12288, 151936)
    assert cfg.qk_norm and cfg.rope_theta == 1e6 and cfg.norm_eps == 1e-6 and not cfg.tie_word_embeddings


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Qwen3-8B", "Qwen3-32B"])
def test_transformers_builds_the_parameter_count_we_compute(name):
    """Transformers' own model class, built from the same file on the meta device, has exactly
    ``n_params`` parameters (QK-norm weights included; no biases in these models)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads((EXAMPLES / name / "config.json").read_text())
    hf_cfg = AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    assert sum(p.numel() for p in model.parameters()) == example(name).n_params


def test_tied_embeddings_share_one_weight_and_leave_the_flops_alone():
    cfg = get_config(TINY)
    untied = dataclasses.replace(cfg, tie_word_embeddings=False)
    assert cfg.n_params == untied.n_params - cfg.vocab_size * cfg.dim
    assert cfg.param_counts()["matmul"] == untied.param_counts()["matmul"]
    torch.manual_seed(0)
    model = Decoder(cfg, "ulysses")
    assert model.head.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params
    twin = Decoder(untied, "ulysses")  # the same weights in two parameters
    twin.load_state_dict(model.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (1, 16))
    for m in (model, twin):
        m(tokens, torch.arange(16), tokens.roll(-1, 1)).backward()
    # the one weight's gradient is the sum of the embedding's and the LM head's
    both = twin.tok_embeddings.weight.grad + twin.head.output.weight.grad
    assert torch.allclose(model.tok_embeddings.weight.grad, both, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(both, twin.head.output.weight.grad)


def test_transformers_5_rope_parameters_and_derived_head_dim(tmp_path):
    """Transformers 5 writes ``rope_parameters``; Llama/Mistral/Qwen2 derive head_dim from the width."""
    for kind in ("llama", "mistral", "qwen2"):
        data = dict(model_type=kind, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=128, vocab_size=100, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 12345.0})
        (tmp_path / kind).mkdir()
        path = tmp_path / kind / "config.json"
        path.write_text(json.dumps(data))
        cfg = ModelConfig.from_file(path)
        assert (cfg.name, cfg.head_dim, cfg.rope_theta, cfg.norm_eps, cfg.qk_norm) == (kind, 16, 12345.0, 1e-6, False)
        assert ("q/k/v projection biases not modelled" in cfg.note) == (kind == "qwen2")


def test_a_config_written_by_the_installed_transformers_reads_back(tmp_path):
    from transformers import LlamaConfig, Qwen3Config

    for cls, qk in ((LlamaConfig, False), (Qwen3Config, True)):
        hf_cfg = cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=128, tie_word_embeddings=True)
        hf_cfg.save_pretrained(tmp_path / cls.__name__)
        cfg = ModelConfig.from_file(tmp_path / cls.__name__ / "config.json")
        assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size) == (
            64, 2, 4, 2, 16, 96, 128)
        assert cfg.qk_norm is qk and cfg.tie_word_embeddings is True
        assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"] and cfg.norm_eps == hf_cfg.rms_norm_eps


def test_names():
    assert model_name(Path("/x/Qwen3-8B/config.json")) == "Qwen3-8B"
    assert model_name(Path("/c/models--Qwen--Qwen3-8B/snapshots/abc123/config.json")) == "Qwen3-8B"
    assert model_name(Path("/x/my-llama.json")) == "my-llama"


BASE = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=256, rope_theta=1e6)
REFUSED = [
    ({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
     r"mixture-of-experts layers \(num_experts=8, moe_intermediate_size=32, num_experts_per_tok=2\) are not modelled"),
    ({"model_type": "mixtral", "num_local_experts": 8}, r"mixture-of-experts layers \(num_local_experts=8\)"),
    ({"layer_types": ["linear_attention", "full_attention"]},
     r"linear-attention layers \(layer_types \['linear_attention'\]\) are not modelled"),
    ({"linear_num_value_heads": 32}, r"linear-attention layers \(linear_num_value_heads\)"),
    ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1},
     r"sliding-window attention in 1 of 2 layers \(sliding_window=4096\) is not modelled"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, r"sliding-window attention in 1 of 2 layers"),
    ({"model_type": "mistral"}, r"sliding-window attention in 2 of 2 layers \(sliding_window=4096\)"),  # default
    ({"model_type": "mistral", "sliding_window": 4096}, r"sliding-window attention in 2 of 2 layers"),
    ({"model_type": "gemma3"}, r"model_type 'gemma3' is not supported; supported: \['llama', 'mistral', 'qwen2', "
                               r"'qwen3'\]"),
    ({"model_type": None}, r"missing field 'model_type'"),
    ({"hidden_size": None}, r"missing field 'hidden_size'"),
    ({"num_key_value_heads": None}, r"missing field 'num_key_value_heads'"),
    ({"head_dim": None}, r"missing field 'head_dim'"),
    ({"vocab_size": None}, r"missing field 'vocab_size'"),
    ({"rope_theta": None}, r"missing field 'rope_theta' \(or 'rope_parameters' with 'rope_theta'\)"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not modelled"),
    ({"num_key_value_heads": 3}, r"n_heads=4 is not divisible by n_kv_heads=3"),
    ({"tie_word_embeddings": "yes"}, r"tie_word_embeddings must be true or false"),
]


@pytest.mark.parametrize("change,needle", REFUSED, ids=[r[1][:40] for r in REFUSED])
def test_refusals_are_one_line_naming_the_file(tmp_path, change, needle):
    data = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=needle) as err:
        get_config(str(path))
    assert str(err.value).startswith(f"model config file {str(path)!r}: ") and "\n" not in str(err.value)


def test_a_file_that_does_not_parse(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match=r"model config file .*config\.json' could not be parsed"):
        get_config(str(path))


def test_refused_in_the_resolver_and_the_cli_before_any_work(tmp_path, capsys):
    path = tmp_path / "moe" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**BASE, "num_experts": 4}))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        resolve(Request("upipe", str(path), 1024, 2, mode="simulated"))
    assert main(["run", "--method", "upipe", "--model", str(path), "--seq-len", "1K", "--world-size", "2",
                 "--out", str(tmp_path / "rows")]) == 2
    err = capsys.readouterr().err
    assert "mixture-of-experts" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "rows").exists()


def test_a_sweep_spec_takes_a_config_json():
    raw = dict(name="hf", kind="trial", mode="simulated", models=[TINY, str(EXAMPLES / "Qwen3-8B" / "config.json")],
               seq_lens=["1K"], world_sizes=[2], methods=["upipe"])
    spec = parse_spec(raw)
    assert spec.problems() == []
    assert [t.row_fields()["model"] for t in spec.trials()] == ["tiny-qwen3", "Qwen3-8B"]
    bad = dict(raw, models=[str(EXAMPLES / "Qwen3-8B" / "nope.json")])
    assert any("does not exist" in p for p in parse_spec(bad).problems())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["real", "emulated", "simulated"])
def test_a_config_json_runs_in_every_mode(mode):
    """The tiny Qwen3 config (QK-norm, tied embeddings, Transformers 5 ``rope_parameters``) through the
    resolver and a run on 2 CPU ranks; the row records the folder's name as its model and the
    whole architecture, so the trial's identity does not depend on where the file lies."""
    trial = resolve(Request("upipe", TINY, 256, 2, mode=mode, device="cpu", iters=1, smoke=True, threads=1))
    row = run_trial(trial)
    assert row.status == "ok", row.message
    assert row.model == "tiny-qwen3" and trial.key()[3] == "tiny-qwen3"
    assert row.model_arch == get_config(TINY).to_dict() and row.model_arch["tie_word_embeddings"] is True
    assert row.figures.peak_bytes > 0
    if mode != "simulated":
        assert row.figures.loss > 0
    moved = resolve(Request("upipe", str(REPO / TINY), 256, 2, mode=mode, device="cpu", iters=1, smoke=True,
                            threads=1))
    assert moved.key() == trial.key()
