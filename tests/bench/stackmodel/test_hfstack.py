"""The ``hf`` accounting stack (``bench.stackmodel.hfstack``): a test per term where it acts, the
refusals, and a simulated ``--stack hf`` row at small scale."""
from __future__ import annotations

import importlib.util

import pytest

from bench.measure.config import StepConfig
from bench.measure.run import run_trial
from bench.model.decoder import liger_chunk
from bench.resolve import Request, resolve
from bench.stackmodel import hfstack, stack
from bench.stackmodel.steptime import EFF_SDPA_FLASH_MEASURED, FITTED, stack_constants
from bench.stackmodel.steptime_fit import measured_eff_sdpa_flash

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def hf(method: str, **levers) -> StepConfig:
    return stack.apply(StepConfig(stack="hf", **levers), method)[0]


def test_checkpoint_offload_is_alsts_on_the_sp_path_only():
    for method in hfstack.SP_METHODS:  # ArcticTraining's CheckpointFunctionWithCPUOffload: every layer, pageable
        step = hf(method)
        assert step.ac and step.ac_offload and not step.offload_pin and step.offload_keep == "none", method
    cp = hf("torch-cp")  # Accelerate's fsdp_activation_checkpointing: no offload
    assert cp.ac and not cp.ac_offload and cp.offload_pin and cp.offload_keep == "first_last"


def test_chunked_loss_is_ligers_rule_on_sp_and_trls_256_on_cp():
    assert hf("ds-ulysses-hf").chunked_loss and hf("ds-ulysses-hf").loss_chunk == 0
    assert hf("torch-cp").chunked_loss and hf("torch-cp").loss_chunk == hfstack.TRL_LOSS_CHUNK == 256
    # Liger: next_pow2(ceil(tokens / ceil(V / dim))); Llama-3.1-8B (V 128256, dim 4096: 32) at its anchors
    assert liger_chunk(500_000, 4096, 128256) == 16384
    assert liger_chunk(4096 * 4, 4096, 32000) == 2048  # Liger's own worked example
    assert liger_chunk(1, 4096, 128256) == 1
    with pytest.raises(ValueError, match="loss_chunk must be >= 1 token"):
        StepConfig(loss_chunk=-1)


def test_tiled_mlp_is_deepspeeds_on_sp_and_off_on_cp():
    sp = hf("ds-ulysses-hf")
    assert sp.tiled_mlp and sp.mlp_tiles == 0 and not sp.tiled_norm
    assert sp.tiled_mlp_impl == ("deepspeed" if HAS_DEEPSPEED else "ours")
    cp = hf("torch-cp")
    assert not cp.tiled_mlp and not cp.tiled_norm and cp.tiled_mlp_impl == "ours"


def test_sdpa_backend_scratch_and_gqa():
    assert hf("ds-ulysses-hf").kernel_workspace == hf("upipe").kernel_workspace == "fa2"  # flash_attention_2
    assert hf("torch-cp").kernel_workspace == "none"  # cuDNN: no scratch model, none assumed
    assert hfstack.options("torch-cp", {}) == {"rotate": "allgather", "backend": "cudnn", "repeat_kv": False}
    assert hfstack.options("torch-cp", {"backend": "flash"})["backend"] == "flash"  # the user's option wins
    assert hfstack.options("ds-ulysses-hf", {"kernel": "math"}) == {"kernel": "math"}
    trial = resolve(Request("torch-cp", "tiny-llama", 4096, 2, levers={"stack": "hf"}))
    assert trial.options.backend == "cudnn" and trial.options.repeat_kv is False
    assert resolve(Request("torch-cp", "tiny-llama", 4096, 2)).options.repeat_kv is True  # paper: repeated


def test_gqa_leaves_kv_at_their_heads_in_torchs_ring():
    """enable_gqa: torch's all-gather moves the G KV heads, not the H repeated ones (Llama3-8B: H/G = 4)."""
    def gathered(repeat_kv: bool) -> float:
        trial = resolve(Request("torch-cp", "llama3-8b", 16384, 2, options={"repeat_kv": repeat_kv, "backend": "cudnn"},
                                levers={"scope": "attention", "stack": "lean"}))
        row = run_trial(trial)
        assert row.status == "ok", row.message
        return row.figures.comm_bytes_by_op["all_gather"]

    assert gathered(True) == pytest.approx(4 * gathered(False))


def test_sharding_allocator_and_rope():
    sp, cp = hf("ds-ulysses-hf"), hf("torch-cp")
    assert sp.fsdp and sp.fsdp_offload  # ZeRO-3 with the optimizer on the host
    assert cp.fsdp and not cp.fsdp_offload  # Accelerate's FSDP2
    assert sp.allocator_model == "expandable" and cp.allocator_model == "classic"  # only ALST sets expandable
    assert sp.allocator_pools == cp.allocator_pools == "per-stream"
    assert sp.rope_table == cp.rope_table == "none" and not sp.ring_barrier and not cp.ring_barrier
    assert stack.allocator_pools("hf") == "per-stream" and stack.reserved("hf") and not stack.reserved("lean")


def test_the_trials_own_levers_win():
    step = hf("ds-ulysses-hf", ac_offload=False)
    assert not step.ac_offload and step.offload_pin and step.offload_keep == "first_last"
    assert hf("ds-ulysses-hf", allocator_model="classic").allocator_model == "classic"
    assert hf("torch-cp", loss_chunk=1024).loss_chunk == 1024
    no_loss = hf("ds-ulysses-hf", chunked_loss=False)
    assert not no_loss.chunked_loss and no_loss.loss_chunk == StepConfig().loss_chunk


def test_step_time_runs_the_measured_sdpa_rate():
    assert measured_eff_sdpa_flash() == pytest.approx(EFF_SDPA_FLASH_MEASURED, rel=1e-5)
    constants, kernel = stack_constants("hf")
    assert kernel == "fa2" and constants.eff_attention_fa2 == EFF_SDPA_FLASH_MEASURED
    assert constants.eff_matmul == FITTED.eff_matmul
    assert stack_constants("paper") == (FITTED, None)


def test_methods_the_hf_stack_cannot_run_are_refused_in_one_line():
    for method in ("ring", "ulysses", "fpdt", "yc-usp", "usp-upipe", "offload"):
        with pytest.raises(ValueError, match=f"--stack hf runs only .*'{method}' has no Hugging Face integration"):
            resolve(Request(method, "tiny-llama", 4096, 2, levers={"stack": "hf"}))
    assert hfstack.path_of("upipe") == "sp" and hfstack.path_of("torch-cp") == "cp"


@pytest.mark.parametrize("method", ["ds-ulysses-hf", "torch-cp"])
def test_a_simulated_hf_row_carries_its_terms_and_step_time(method):
    row = run_trial(resolve(Request(method, "tiny-llama", 8192, 2, levers={"stack": "hf"})))
    assert row.status == "ok", row.message
    assert row.levers["stack"] == "hf" and "hf-stack" in row.presets
    assert row.ran["allocator_pools"] == "per-stream"
    terms = [n for n in row.notes if n.startswith("hf stack:")]
    assert any("sdpa_backend" in n for n in terms) and any("chunked_loss" in n for n in terms)
    assert any(n.startswith("simulated, hf stack") for n in row.notes)
    f = row.figures
    assert f.peak_reserved_bytes and f.peak_reserved_bytes >= f.peak_bytes
    assert f.step_time_s and f.step_time_model["constants"]["eff_attention_fa2"] == EFF_SDPA_FLASH_MEASURED
    assert f.step_time_model["constants"]["attention_kernel"] == "fa2"
    if method == "ds-ulysses-hf":
        assert row.ran["offload_keep"] == "none" and f.host_peak_bytes > 0
    else:
        assert row.options == {"backend": "cudnn", "repeat_kv": False}
