"""UPipe as a Transformers attention function (``methods.integrations.transformers``): one training
step of a tiny ``LlamaForCausalLM`` on 2 and 4 gloo ranks, sequences sharded as ALST shards them,
gives the loss and every gradient of the unsharded model (Transformers' eager attention) within
the correctness matrix's tolerance; bad input is refused in one line before any communication."""
from __future__ import annotations

import copy
import gc
import importlib.util
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from methods.integrations import transformers as upipe_hf
from tests.methods.cases import TOLERANCE

SEQ, BATCH, VOCAB = 32, 2, 96


def tiny_llama(heads: int, kv_heads: int, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=16, intermediate_size=128, vocab_size=VOCAB, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return cfg, LlamaForCausalLM(cfg).float()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt without loss: the ranks hold unequal counts of valid labels
    labels[1, SEQ // 2 - 1] = -100  # and one on a slice boundary at 2 ranks
    return ids, labels


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def train_step(group, heads: int, kv_heads: int, chunk_heads: int | None, tie: bool) -> dict[str, float]:
    """On each rank: the reference step on the whole batch, then the UPipe step on this rank's slice;
    the relative errors of the loss and of every gradient (after summing over the ranks)."""
    cfg, ref = tiny_llama(heads, kv_heads, tie)
    model = copy.deepcopy(ref)
    ref.set_attn_implementation("eager")
    model.set_attn_implementation(upipe_hf.register(group, chunk_heads=chunk_heads, config=cfg, name="upipe-test"))
    ids, labels = batch()
    want = ref(input_ids=ids, labels=labels, use_cache=False).loss
    want.backward()
    out = model(**upipe_hf.shard_batch(ids, labels, group), use_cache=False)
    out.loss.backward()
    upipe_hf.sum_gradients(model, group)
    errors = {"loss": rel_err(upipe_hf.loss_across_shards(out.loss, group), want.detach())}
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        errors[name] = rel_err(p.grad, q.grad)
    return errors


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("heads,kv_heads,chunk_heads,tie", [
    (8, 2, None, False),  # U = C; at 4 ranks the 2 KV heads are replicated
    (8, 4, 8, False),  # U = H: one stage, Ulysses
    (8, 8, 4, True),  # MHA, two or one query heads per rank per stage; tied embeddings
])
def test_one_training_step_matches_the_unsharded_model(pool, ws, heads, kv_heads, chunk_heads, tie):
    results = pool.run(train_step, heads, kv_heads, chunk_heads, tie, world_size=ws)
    tol = TOLERANCE["float32"]
    for rank, errors in enumerate(results):
        assert len(errors) > 10  # loss, embedding, 2 x 9 block weights, final norm (and LM head)
        bad = {k: v for k, v in errors.items() if not v <= tol}
        assert not bad, f"rank {rank}: errors above {tol}: {bad}"


def refusal(group, what: str) -> str:
    cfg, model = tiny_llama(8, 2)
    try:
        if what == "chunk_heads":
            upipe_hf.register(group, chunk_heads=3, config=cfg, name="upipe-test")
        elif what == "heads":
            cfg.num_attention_heads, cfg.num_key_value_heads = 6, 3
            upipe_hf.register(group, config=cfg, name="upipe-test")
        elif what == "seq":
            upipe_hf.shard_batch(torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long), group)
    except ValueError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize("what,needle", [
    ("chunk_heads", "upipe: chunk_heads=3 is not a multiple of the world size 4"),
    ("heads", "upipe: n_heads=6 is not divisible by the world size 4"),
    ("seq", "sequence length 9 is not divisible by the 4 ranks of the sequence-parallel group"),
])
def test_refusals_before_any_communication(pool, what, needle):
    for message in pool.run(refusal, what, world_size=4):
        assert needle in message and "\n" not in message, message


def test_a_mask_or_dropout_is_refused_in_one_line():
    fn = upipe_hf.UPipeAttention(None)
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="takes no attention mask"):
        fn(torch.nn.Module(), q, q, q, torch.ones(1, 1, 8, 8))
    with pytest.raises(ValueError, match="no attention dropout"):
        fn(torch.nn.Module(), q, q, q, None, dropout=0.1)


def test_register_releases_its_group_at_interpreter_exit(monkeypatch):
    """The global registry would hold the group past ``dist.destroy_process_group`` into the
    interpreter's finalization, where gloo's worker thread aborts the process taking the GIL
    (``UPipeAttention.release``): ``register`` leaves an exit hook that drops it, and a call after
    it is refused in one line."""
    from transformers import AttentionInterface

    class Group:  # a stand-in a weak reference can watch; comm.world answers for it
        pass

    hooks = []
    monkeypatch.setattr(upipe_hf.atexit, "register", lambda hook, *args: hooks.append(lambda: hook(*args)))
    monkeypatch.setattr(upipe_hf.comm, "world", lambda group: (1, 0))
    monkeypatch.setitem(AttentionInterface._global_mapping, "upipe-release-test", None)
    group = Group()
    watch = weakref.ref(group)
    name = upipe_hf.register(group, name="upipe-release-test")
    fn = AttentionInterface._global_mapping[name]
    fn.schedule(4, 4, 16, True)
    del group
    gc.collect()
    assert watch() is not None and len(hooks) == 1
    hooks[0]()
    gc.collect()
    assert watch() is None, "the registered function still holds its group after the exit hook"
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(RuntimeError, match="released at interpreter exit") as e:
        fn(torch.nn.Module(), q, q, q, None)
    assert "\n" not in str(e.value)


def test_a_replaced_registration_is_freed_with_its_group(monkeypatch):
    """The exit hook holds the function weakly: registering again under the same name frees the first
    function (and the group it held) at once, as before the hook."""
    from transformers import AttentionInterface

    class Group:
        pass

    monkeypatch.setattr(upipe_hf.comm, "world", lambda group: (1, 0))
    monkeypatch.setitem(AttentionInterface._global_mapping, "upipe-release-test", None)
    group = Group()
    watch = weakref.ref(group)
    upipe_hf.register(group, name="upipe-release-test")
    upipe_hf.register(Group(), name="upipe-release-test")
    del group
    gc.collect()
    assert watch() is None, "the replaced registration still holds its group"


DOC = Path(__file__).resolve().parents[2] / "docs" / "upipe-in-transformers.md"


def doc_example(tmp_path: Path) -> Path:
    m = re.search(r"<!-- file: upipe_transformers\.py -->\s*```python\n(.*?)```", DOC.read_text(), re.S)
    assert m, "docs/upipe-in-transformers.md lost its example block"
    path = tmp_path / "upipe_transformers.py"
    path.write_text(m.group(1))
    return path


@pytest.mark.slow
def test_the_documented_example_runs_under_torchrun_and_matches_the_unsharded_model(tmp_path):
    """The page's block, as a user saves it, on 2 CPU ranks under torchrun; its printed loss and
    gradient norm against the same model and batch (the block's own functions) run unsharded."""
    path = doc_example(tmp_path)
    repo = DOC.parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"^loss (\S+) grad_norm (\S+)$", p.stdout, re.M)
    assert m, p.stdout
    spec = importlib.util.spec_from_file_location("upipe_transformers", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    _, model = example.build_model()
    model.set_attn_implementation("eager")
    input_ids, labels = example.make_batch()
    loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    tol = TOLERANCE["float32"]
    assert abs(float(m.group(1)) - loss.item()) <= tol * abs(loss.item())
    assert abs(float(m.group(2)) - norm.item()) <= tol * abs(norm.item())
