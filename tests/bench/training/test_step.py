"""bench/training/step.py: every memory lever does what it says.

Memory effects are checked under simulation (FakeTensorMode + fake process group + MemTracker,
``bench.measure.run.measure_simulated``); numerics on real gloo ranks: one training step with every
lever on (FSDP2, checkpointing, tiled MLP and norms, chunked loss), in fp32, gives the same loss
and the same gradients as the plain single-device step.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import methods
from bench.measure.config import StepConfig
from bench.measure.result import Measurement
from bench.measure.run import measure_simulated
from bench.measure.simulate import fake_process_group
from bench.measure.trial import Trial
from bench.model.config import ModelConfig
from bench.training.step import build_model, make_batch, model_step
from records.identity import V1_OMITTED_LEVERS

# mid-sized so that activations dominate and each simulation takes well under a second
CFG = dict(name="mid", dim=512, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=1536, vocab_size=8192)


@pytest.fixture(scope="module")
def cfg_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "mid.json"
    import json

    path.write_text(json.dumps(CFG))
    return str(path)


_SIMULATED: dict[str, Measurement] = {}  # Trial.to_json() -> its measurement, once per module


def sim(cfg_file, seq_len=32768, ws=4, method="ulysses", **levers) -> Measurement:
    """The simulated measurement of this trial; a trial another test of the module already
    simulated (the same trial, however its levers were spelt) is read back, not simulated again."""
    trial = Trial.make(method, cfg_file, seq_len, ws, mode="simulated", device="h100-80g",
                       step=StepConfig(**levers))
    key = trial.to_json()
    if key not in _SIMULATED:
        _SIMULATED[key] = measure_simulated(trial)
    return _SIMULATED[key]


def test_checkpointing_lowers_activation_memory(cfg_file):
    on = sim(cfg_file, ac=True, ac_offload=False)
    off = sim(cfg_file, ac=False, ac_offload=False)
    act_on = on.peak_by_category["activation"] + on.peak_by_category["temp"]
    act_off = off.peak_by_category["activation"] + off.peak_by_category["temp"]
    assert on.peak_bytes < 0.7 * off.peak_bytes, (on.peak_bytes, off.peak_bytes)
    assert act_on < 0.6 * act_off


def test_offload_moves_checkpoints_to_the_host(cfg_file):
    kept = sim(cfg_file, ac=True, ac_offload=False)
    moved = sim(cfg_file, ac=True, ac_offload=True)
    # on the GPU code path (fake CUDA, bench.stackmodel.simcuda) the host also holds a few bytes of
    # index tensors made there before their copy to the device, as a GPU run does
    small = 4096
    assert kept.host_peak_bytes < small
    # every block but the first and last offloads its inputs: 2 of 4 here, each the hidden
    # states [1, S/C, dim] bf16 and the positions [S/C] int64
    hidden, positions = 32768 // 4 * 512 * 2, 32768 // 4 * 8
    assert 0 <= moved.host_peak_bytes - 2 * (hidden + positions) < small
    # the device keeps the positions (one tensor shared by all blocks) but not the hidden states
    assert moved.peak_bytes <= kept.peak_bytes - 2 * hidden


def test_rope_table_is_held_whole_and_travels_with_the_checkpoints(cfg_file):
    """TorchTitan's RoPE table (complex64 [S, head_dim/2]) is a buffer on every rank; as a block
    argument it is offloaded with each offloaded block's input and comes back as a device copy
    that the block's backward keeps (bench.model.decoder._HoldForBackward)."""
    seq = 32768
    table = seq * (CFG["head_dim"] // 2) * 8
    base = sim(cfg_file, seq, ac=True, ac_offload=True)
    held = sim(cfg_file, seq, ac=True, ac_offload=True, rope_table="checkpointed")
    assert held.peak_by_category["buffer"] - base.peak_by_category["buffer"] == table
    # two of the four blocks are offloaded (first and last kept): one host copy each
    assert held.host_peak_bytes - base.host_peak_bytes == 2 * table
    # with the last block offloaded too, the peak (its attention backward) holds the buffer and
    # the block's unpacked copy
    base_first = sim(cfg_file, seq, ac=True, ac_offload=True, offload_keep="first")
    held_first = sim(cfg_file, seq, ac=True, ac_offload=True, offload_keep="first", rope_table="checkpointed")
    assert held_first.peak_bytes - base_first.peak_bytes == 2 * table
    kept = sim(cfg_file, seq, ac=True, ac_offload=False, rope_table="checkpointed")
    assert kept.host_peak_bytes < 4096  # nothing offloaded: no copies anywhere
    with pytest.raises(ValueError, match="pass build_model"):
        from bench.model.config import get_config
        build_model(get_config("tiny-llama"), "ulysses", {}, None, StepConfig.plain(rope_table="checkpointed"), "cpu")


def test_tiled_mlp_and_norm_lower_memory(cfg_file):
    tiled = sim(cfg_file)
    plain_mlp = sim(cfg_file, tiled_mlp=False)
    plain_norm = sim(cfg_file, tiled_norm=False)
    assert tiled.peak_bytes < plain_mlp.peak_bytes
    assert tiled.peak_bytes < plain_norm.peak_bytes


def test_chunked_loss_lowers_memory(cfg_file):
    chunked = sim(cfg_file)
    full = sim(cfg_file, chunked_loss=False)
    logits = 32768 // 4 * CFG["vocab_size"] * 4  # fp32 logits of the local tokens
    assert full.peak_bytes - chunked.peak_bytes > logits


def test_fsdp_shards_master_weights_and_adam_state(cfg_file):
    n = ModelConfig.from_dict(CFG).n_params
    for ws in (2, 8):
        r = sim(cfg_file, ws=ws, seq_len=8192)
        # fp32 AdamW exp_avg + exp_avg_sq of this rank's shard (FSDP pads each tensor to ws rows)
        assert r.peak_by_category["optstate"] == pytest.approx(8 * n / ws, rel=0.02)
    replicated = sim(cfg_file, ws=8, seq_len=8192, fsdp=False)
    # without FSDP: bf16 states of every parameter on every rank (the peak may also hold the
    # foreach step's temporaries, also counted as optimizer memory)
    assert replicated.peak_by_category["optstate"] >= 0.98 * 2 * 2 * n


def test_mixed_precision_keeps_fp32_masters_and_computes_in_bf16():
    """FSDP2 + bf16: sharded fp32 parameters and AdamW state, bf16 activations (real tensors,
    one rank of a fake 2-rank group)."""
    cfg = ModelConfig.from_dict(dict(CFG, name="small", dim=64, head_dim=8, ffn_dim=128, vocab_size=256))
    seen = []
    with fake_process_group(2) as group:
        model, opt = build_model(cfg, "upipe", {}, group, StepConfig(), "cpu")
        for p in model.parameters():
            assert p.dtype == torch.float32 and type(p).__name__ in ("DTensor", "Parameter")
            assert p.to_local().numel() <= (p.numel() + 1) // 2 + p.shape[-1]  # this rank's shard
        attn = model.attention_module()
        attn.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(args[0].dtype), with_kwargs=True)
        batch = make_batch(model, 64, 1, "cpu")
        model_step(model, opt, batch, StepConfig(), group)
    assert seen and set(seen) == {torch.bfloat16}
    states = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    assert states and all(t.dtype == torch.float32 for t in states)


# ----------------------------------------------------------------------------- numerics on real ranks

SEQ = 128
TINY = "tiny-llama"


def _names(model) -> dict[str, torch.nn.Parameter]:
    return {n.replace(".block.", "."): p for n, p in model.named_parameters()}


def cp_step(group, method: str, levers: dict, dtype: str = "fp32", options: dict | None = None,
            docs: methods.Documents | None = None) -> dict:
    """One forward+backward on the ranks of ``group`` with the given levers (fp32 by default)."""
    from bench.model.config import get_config

    torch.manual_seed(0)
    step = StepConfig(dtype=dtype, **levers)
    model, _ = build_model(get_config(TINY), method, options or {}, group, step, "cpu", seed=0, seq_len=SEQ,
                           docs=docs)
    batch = make_batch(model, SEQ, 2, "cpu", seed=1, docs=docs)
    loss = model(batch.tokens, batch.positions, batch.labels)
    loss.backward()
    grads = {}
    for name, p in _names(model).items():
        g = p.grad
        if not step.fsdp:  # average the replicated gradients as FSDP does
            torch.distributed.all_reduce(g, group=group)
            g = g / torch.distributed.get_world_size(group)
        grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    losses = [torch.zeros(()) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(losses, loss.detach(), group=group)
    return {"loss": torch.stack(losses).mean().item(), "grads": grads}


_REFERENCES: dict[tuple, dict] = {}  # (method, docs) -> reference_step's result, once per module
_ON_RANKS: dict[str, dict] = {}  # repr of cp_step's arguments -> rank 0's result, once per module


def reference(method: str, docs: methods.Documents | None = None) -> dict:
    """``reference_step(method, docs)``, computed once per module (several tests compare against
    the same single-device step; the tests only read it)."""
    key = (method, None if docs is None else tuple(docs.lengths))
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_step(method, docs)
    return _REFERENCES[key]


def on_ranks(pool, method: str, levers: dict, dtype: str = "fp32", options: dict | None = None,
             docs: methods.Documents | None = None) -> dict:
    """Rank 0's ``cp_step`` on 2 pool ranks, run once per module for the same arguments (the levers
    test and the DeepSpeed comparison both need upipe's fp32 step with every lever)."""
    key = repr((method, sorted(levers.items()), dtype, sorted((options or {}).items()),
                None if docs is None else tuple(docs.lengths)))
    if key not in _ON_RANKS:
        step = cp_step_with_flash_standin if "flash_attn" in methods.get_info(method).requires else cp_step
        _ON_RANKS[key] = pool.run(step, method, levers, dtype, options, docs, world_size=2)[0]
    return _ON_RANKS[key]


def cp_step_with_flash_standin(group, *args) -> dict:
    """``cp_step`` with the flash-attn stand-in on the rank for the call (a library wrapper that imports
    flash-attn, as ring-flash-attn does; this pool's ranks do not install it)."""
    from tests.flash_attn_standin import installed_for_the_call

    with installed_for_the_call():
        return cp_step(group, *args)


def reference_step(method: str, docs: methods.Documents | None = None) -> dict:
    from bench.model.config import get_config

    torch.manual_seed(0)
    model, _ = build_model(get_config(TINY), method, {}, None, StepConfig.plain(dtype="fp32"), "cpu", seed=0,
                           docs=docs)
    batch = make_batch(model, SEQ, 2, "cpu", seed=1, docs=docs)
    loss = model(batch.tokens, batch.positions, batch.labels)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in _names(model).items()}}


ALL_ON = dict(fsdp=True, ac=True, ac_offload=True, tiled_mlp=True, tiled_norm=True, mlp_tiles=3,
              chunked_loss=True, loss_chunk=40)


NO_LEVERS = dict(fsdp=False, ac=False, ac_offload=False, tiled_mlp=False, tiled_norm=False, chunked_loss=False)


@pytest.mark.parametrize("method", sorted(set(methods.available()) & {"ulysses", "upipe", "ring"}))
@pytest.mark.parametrize("levers", [ALL_ON, {**ALL_ON, "rope_table": "checkpointed"}, NO_LEVERS],
                         ids=["all-levers", "all-levers+rope-table", "no-levers"])
def test_step_with_levers_equals_plain_single_device_step(pool, method, levers):
    ref = reference(method)
    got = on_ranks(pool, method, levers)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in got["grads"].items():
        want = ref["grads"][name]
        err = ((g - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        assert err < 1e-4, (name, err)


# packed documents in the step: every attention block keeps within the documents, at per-document positions.
# Lengths divisible by 2C = 4, so the doc-zigzag layout pads nothing and every rank keeps SEQ/2 labelled tokens
DOCS = methods.Documents.from_lengths([40, 8, 56, 24])


@pytest.mark.parametrize("method,options", [("ulysses", {}), ("upipe", {}), ("ring", {}),
                                            ("ring", {"layout": "doc-zigzag"}), ("ring", {"layout": "contiguous"}),
                                            ("allgather-kv", {}), ("fpdt", {}), ("rfa-zigzag", {})],
                         ids=["ulysses", "upipe", "ring-zigzag", "ring-doc-zigzag", "ring-contiguous",
                              "allgather-kv", "fpdt", "rfa-zigzag"])
def test_step_with_documents_equals_the_single_device_step_with_them(pool, method, options):
    ref = reference("no-cp", DOCS)
    plain = reference("no-cp")
    assert abs(ref["loss"] - plain["loss"]) > 1e-4  # the documents change the attention, so the loss
    got = on_ranks(pool, method, ALL_ON, "fp32", options, DOCS)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for name, g in got["grads"].items():
        want = ref["grads"][name]
        err = ((g - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        assert err < 1e-4, (name, err)


def test_padded_documents_are_ignored_labels():
    """doc-zigzag pads documents to a multiple of 2C: the padding tokens' labels are ignored."""
    from bench.model.config import get_config

    docs = methods.Documents.from_lengths([37, 91])  # neither divisible by 2C = 4
    with fake_process_group(2) as group:
        model, _ = build_model(get_config(TINY), "ring", {"layout": "doc-zigzag"}, group, StepConfig.plain(),
                               "cpu", seed=0, docs=docs)
        batch = make_batch(model, SEQ, 1, "cpu", seed=1, docs=docs)
    padding = model.attention_module().padding(docs)
    assert padding > 0 and batch.tokens.shape[1] == (SEQ + padding) // 2
    assert 0 < int((batch.labels == -100).sum()) <= padding


# DeepSpeed's tiled MLP and tiled loss against ours: the same step (every lever on, tiles and loss
# chunks of unequal sizes) with one implementation swapped; fp32 to the tolerances above, bf16 to
# a few bf16 roundings (2**-8 relative each), since tiles of other sizes sum in another order
IMPL_TOL = {"fp32": (1e-5, 1e-4), "bf16": (1e-3, 3e-2)}  # (loss relative, gradient relative to its max)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("lever", ["tiled_mlp_impl", "chunked_loss_impl"])
def test_deepspeed_tiled_levers_equal_ours(pool, lever, dtype):
    pytest.importorskip("deepspeed")
    ours = on_ranks(pool, "upipe", ALL_ON, dtype)
    theirs = on_ranks(pool, "upipe", {**ALL_ON, lever: "deepspeed"}, dtype)
    loss_tol, grad_tol = IMPL_TOL[dtype]
    assert theirs["loss"] == pytest.approx(ours["loss"], rel=loss_tol)
    assert set(theirs["grads"]) == set(ours["grads"])
    for name, g in theirs["grads"].items():
        want = ours["grads"][name]
        err = ((g - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        assert err < grad_tol, (name, err)


def test_deepspeed_impl_needs_its_lever_and_a_known_value(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    hidden = lambda name, *a: None if name == "deepspeed" else find_spec(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)  # a machine without DeepSpeed
    with pytest.raises(ValueError, match="needs DeepSpeed, which is not installed: pip install deepspeed"):
        StepConfig(tiled_mlp_impl="deepspeed")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="tiled_mlp_impl must be one of"):
        StepConfig(tiled_mlp_impl="liger")
    with pytest.raises(ValueError, match="picks the implementation of chunked_loss, which is off"):
        StepConfig(chunked_loss=False, chunked_loss_impl="deepspeed")
    # rows written before these levers existed keep their identity: a schema 1 row that left them out
    # (at their default) keys as a schema 2 row that records them
    assert all(StepConfig().levers()[k] == V1_OMITTED_LEVERS[k] for k in ("tiled_mlp_impl", "chunked_loss_impl"))


def test_deepspeed_levers_from_the_cli_and_the_simulated_refusal():
    pytest.importorskip("deepspeed")
    from bench.cli import _trial, build_parser

    argv = ["run", "--method", "upipe", "--model", TINY, "--seq-len", "8K", "--world-size", "2",
            "--tiled-mlp-impl", "deepspeed", "--chunked-loss-impl", "deepspeed"]
    args = build_parser().parse_args(argv + ["--mode", "emulated", "--device", "cpu"])
    step = _trial(args, 8192).step
    assert (step.tiled_mlp_impl, step.chunked_loss_impl) == ("deepspeed", "deepspeed")
    # TiledFusedLogitsLoss.backward reads its incoming gradient's value, which fake tensors lack
    with pytest.raises(ValueError, match="chunked_loss_impl='deepspeed' cannot be simulated"):
        Trial.make("upipe", TINY, 8192, 2, mode="simulated", step=step).validate()
    Trial.make("upipe", TINY, 8192, 2, mode="simulated", step=StepConfig(tiled_mlp_impl="deepspeed")).validate()


def full_step_runs(group, method: str) -> float:
    """The benchmark's own step (bf16, every lever, AdamW) runs and gives a finite loss."""
    from bench.model.config import get_config

    model, opt = build_model(get_config(TINY), method, {}, group, StepConfig(), "cpu", seed=0)
    batch = make_batch(model, SEQ, 1, "cpu")
    losses = [model_step(model, opt, batch, StepConfig(), group).item() for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    return losses[-1]


def test_bf16_step_with_optimizer_runs(pool):
    losses = pool.run(full_step_runs, "upipe", world_size=4)
    assert len(losses) == 4


def test_step_config_validation():
    with pytest.raises(ValueError, match="scope must be one of"):
        StepConfig(scope="layer")
    with pytest.raises(ValueError, match="ac_offload .* needs ac=True"):
        StepConfig(ac=False, ac_offload=True)
    with pytest.raises(ValueError, match="dtype must be one of"):
        StepConfig(dtype="fp16")
    assert StepConfig.plain().levers()["fsdp"] is False
    lev = StepConfig().levers()
    assert StepConfig.from_levers("model", 1, "bf16", lev) == StepConfig()
    assert dataclasses.asdict(StepConfig())["ac_offload"] is True


def test_meta_init_materialises_only_the_shards_and_trains():
    """``meta_init`` (emulated ranks on a GPU): built on meta, sharded, then only this rank's
    shards exist on the device, with finite random values; a step runs and gives a finite loss.
    The same levers without FSDP (nothing would be sharded) are refused before any work."""
    cfg = ModelConfig.from_dict(dict(CFG, name="small", dim=64, head_dim=8, ffn_dim=128, vocab_size=256))
    with fake_process_group(4) as group:
        model, opt = build_model(cfg, "ulysses", {}, group, StepConfig(), "cpu", meta_init=True)
        for p in model.parameters():
            local = p.to_local()
            assert local.device.type == "cpu" and local.numel() <= (p.numel() + 3) // 4 + p.shape[-1]
            assert torch.isfinite(local).all()
            if p.dim() == 1:
                assert bool((local == 1).all())
            elif local.numel() > 1:
                assert local.std() > 0
        assert not any(b.is_meta for b in model.buffers())
        loss = model_step(model, opt, make_batch(model, 64, 1, "cpu"), StepConfig(), group)
    assert loss is not None
    with pytest.raises(ValueError, match="meta_init .* needs fsdp=True"):
        build_model(cfg, "ulysses", {}, None, StepConfig(fsdp=False), "cpu", meta_init=True)
