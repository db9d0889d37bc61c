"""``torch-cp`` (PyTorch's context parallel) where no GPU is: what can be checked, and how.

torch's context parallel intercepts only the CUDA SDPA ops (flash, memory-efficient, cuDNN), so
the method refuses CPU tensors and the CPU correctness matrix cannot run it
(``tests.methods.cases.CUDA_ONLY``; ``test_correctness`` checks that it refuses). What this
module checks instead:

(a) **torch's ring, numerically, on gloo ranks.** ``_templated_ring_attention`` and
    ``_templated_ring_attention_backward`` (what torch's CP handler calls for the CUDA flash op)
    are called directly with the CPU flash op and its backward in the CUDA op's place (same
    BHSD layout, same LSE, matching keyword names), on Q/K/V sharded in our zigzag layout:
    world sizes 1, 2, 4, causal (torch's head-tail schedule) and not, both rotate methods,
    fp32 and bf16; out, dQ, dK, dV against full attention on the whole sequence. This covers
    torch's ring and merge, its load-balanced schedule and that our layout is the one it
    assumes; not the DTensor dispatch and not the method's projections.
(b) **The layout**: ``shard`` equals torch's ``_HeadTailLoadBalancer`` rearrangement.
(c) **The whole method on simulated CUDA** (``bench.stackmodel.simcuda``; fake tensors, a fake
    process group of 4 ranks), through torch's DTensor dispatch: output shape and dtype, the
    CUDA flash ops run (never the CPU ones), the collectives each rotate method issues and their
    bytes (``CommCounter``), every parameter gets a gradient, torch's global CP options are as
    before afterwards; and the benchmark's simulated trial gives an ok row for both rotate
    methods. Values are not checked (fake tensors have none).
(d) **Refusals** (one line each): CPU input, fp32 with the flash backend, a ``kernel`` option,
    unknown rotate/backend, a head_dim the kernels do not take, no process group.
(e) **On CUDA** (skipped without a GPU, with that reason): forward and backward against the
    single-device reference on one rank, in bf16.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import methods
from bench.measure.config import StepConfig
from bench.measure.run import run_trial
from bench.measure.simulate import fake_process_group, no_param_init
from bench.measure.trial import Trial
from bench.stackmodel import simcuda
from bench.stackmodel.hardware import CommCounter
from methods.core import layouts
from methods.core.comm import world
from methods.core.kernels import attention, get_kernel
from methods.torch_cp import CPU_REFUSAL, _cp, _cp_call, _options_now
from tests.methods.cases import SPECS, TOLERANCE, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GQA = methods.AttnSpec(**SPECS["gqa"])


# ----------------------------------------------------------------------- (a) torch's ring on CPU ops
def torch_ring_vs_full(group, rotate: str, causal: bool, dtype: str) -> dict:
    """torch's ring (CPU flash op) on zigzag shards vs full attention: relative errors."""
    aten = torch.ops.aten
    # the implementation module (torch >= 2.9; the public stub does not re-export the backward)
    cp = importlib.import_module("torch.distributed.tensor.experimental._context_parallel._attention")
    size, rank = world(group)
    dt = getattr(torch, dtype)
    torch.manual_seed(11)
    b, s, h, d = 2, 64, 4, 16
    q, k, v, dout = (torch.randn(b, s, h, d) for _ in range(4))  # BSHD, the same on every rank
    scale = d ** -0.5
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*full, causal, get_kernel("math"), scale)
    want.backward(dout)

    def local(t):  # this rank's zigzag shard in torch's BHSD layout
        return layouts.zigzag_shard(t, 1, rank, size).to(dt).transpose(1, 2)

    ql, kl, vl, dl = (local(t) for t in (q, k, v, dout))
    with _cp_call(rotate, causal):
        out, lse = cp._templated_ring_attention(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu, query=ql, key=kl, value=vl,
            is_causal=causal, scale=scale)[:2]
        dq, dk, dv = cp._templated_ring_attention_backward(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=dl,
            grad_out_name="grad_out", query=ql, key=kl, value=vl, out=out, logsumexp=lse, is_causal=causal,
            dropout_p=0.0, scale=scale)[:3]
    got = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    ref = {"out": want.detach(), "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}
    return {name: rel_err(layouts.zigzag_unshard(got[name].transpose(1, 2).float().contiguous(), 1, group),
                          ref[name]) for name in got}


@pytest.mark.parametrize("ws", [1, 2, 4])
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_ring_on_cpu_ops_matches_full_attention(pool, ws, rotate, causal, dtype):
    for rank, errors in enumerate(pool.run(torch_ring_vs_full, rotate, causal, dtype, world_size=ws)):
        bad = {k: e for k, e in errors.items() if not e <= TOLERANCE[dtype]}
        assert not bad, f"rank {rank}: {bad} (all: {errors})"


# ----------------------------------------------------------------------- (b) the layout
@pytest.mark.parametrize("ws", [1, 2, 4, 8])
def test_layout_is_torchs_head_tail_load_balancer(ws):
    seq = 4 * ws
    order = _cp()._HeadTailLoadBalancer(seq, ws, "cpu")._generate_indices()[0]  # rank r's tokens: block r
    cls = methods.get_info("torch-cp").cls
    assert cls.seq_multiple(ws, cls.Options()) == 2 * ws
    ours = torch.cat([layouts.zigzag_shard(torch.arange(seq), 0, r, ws) for r in range(ws)])
    assert torch.equal(ours, order.long())


# ----------------------------------------------------------------------- (c) simulated CUDA
class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_whole_method_on_simulated_cuda(rotate):
    simcuda.require()
    ws, n, spec = 4, 256, GQA  # 8 query heads, 4 KV heads, head_dim 16
    before = _options_now()
    with fake_process_group(ws) as group, simcuda.runtime(), FakeTensorMode(), no_param_init():
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                block = methods.build("torch-cp", spec, group=group, rotate=rotate)
            x = torch.empty(1, n, spec.dim, device="cuda", requires_grad=True)
            ops, counter = OpNames(), CommCounter()
            with ops, counter:
                y = block(x)
                y.sum().backward()
        finally:
            torch.set_default_dtype(torch.float32)
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and y.device.type == "cuda"
    assert x.grad is not None and x.grad.shape == x.shape
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
    flash = "aten._scaled_dot_product_flash_attention"
    assert {flash, flash + "_backward"} <= ops.names
    assert not any(name.endswith("_for_cpu") for name in ops.names)
    assert _options_now() == before  # torch's process-global options are left as they were
    kv = 2 * n * spec.n_heads * spec.head_dim * 2  # local K and V, repeated to H heads, bf16
    dkv = 2 * kv  # the dK/dV buffer travels in fp32
    by_op = counter.by_op()
    if rotate == "allgather":  # one all-gather of K/V in the forward, one in the backward
        assert by_op == {"all_gather": 2 * ws * kv, "all_to_all": ws * dkv}, by_op
    else:  # C-1 K/V steps in each direction; dK/dV: C steps
        assert by_op == {"all_to_all": 2 * (ws - 1) * kv + ws * dkv}, by_op


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_simulated_trial_gives_an_ok_row(rotate):
    simcuda.require()
    trial = Trial.make("torch-cp", "llama3-8b", 64 << 10, 4, options={"rotate": rotate}, mode="simulated",
                       device="h100-80g", step=StepConfig(scope="attention"))
    row = run_trial(trial)
    assert row.status == "ok", row.message
    assert row.figures.peak_bytes > 0 and "fake cuda tensors" in row.env.device_name
    ops = row.figures.comm_bytes_by_op
    assert ("all_gather" in ops) == (rotate == "allgather") and ops["all_to_all"] > 0, ops



def test_kernel_scratch_is_modelled_on_the_local_ring_calls(monkeypatch):
    """The flash backward's scratch (``kernel_workspace``, the paper stack's term 2) is sized on
    the kernels a rank runs: torch's ring calls the backward on the rank's local Q (whole or its
    second half) once per ring step, never on the DTensor's global shape, which the SDPA op
    carries before DTensor hands it to the ring. Sized on the global shape, the model charged
    16 GiB per block for Llama3-8B at 1M on 8 ranks instead of 2 GiB."""
    from bench.stackmodel import workspace

    simcuda.require()
    seen = []
    sized = workspace.workspace_shapes

    def recording(model, q, k):
        seen.append((tuple(q.shape), tuple(k.shape)))
        return sized(model, q, k)

    monkeypatch.setattr(workspace, "workspace_shapes", recording)
    s, ws = 64 << 10, 4
    trial = Trial.make("torch-cp", "llama3-8b", s, ws, mode="simulated", device="h100-80g",
                       step=StepConfig(scope="attention", kernel_workspace="fa2"))
    row = run_trial(trial)
    assert row.status == "ok", row.message
    local = s // ws
    # rank 0 of the head-tail ring: step 0 on its whole Q and K/V, every later step on its Q's
    # second half against the whole remote K/V (the repeated K/V has the query heads)
    whole, half = (1, 32, local, 128), (1, 32, local // 2, 128)
    assert seen == [(whole, whole)] + [(half, whole)] * (ws - 1)
    plain = run_trial(dataclasses.replace(trial, step=StepConfig(scope="attention")))
    scratch = local * 32 * 128 * 4 + 32 * local * 4  # dq_accum and softmax_d of the whole local Q, fp32
    assert plain.figures.peak_bytes <= row.figures.peak_bytes <= plain.figures.peak_bytes + scratch

# ----------------------------------------------------------------------- (d) refusals
def test_cpu_input_is_refused_in_one_line():
    assert "\n" not in CPU_REFUSAL and "--mode simulated" in CPU_REFUSAL and "GPU" in CPU_REFUSAL


def test_fp32_with_flash_is_refused_before_any_communication():
    simcuda.require()
    with fake_process_group(2) as group, simcuda.runtime(), FakeTensorMode(), no_param_init():
        with torch.device("cuda"):
            block = methods.build("torch-cp", GQA, group=group)
        x = torch.empty(1, 32, GQA.dim, device="cuda")
        counter = CommCounter()
        with counter, pytest.raises(ValueError, match=r"^torch-cp: the CUDA flash SDPA kernel takes float16/bfloat16 "
                                                       r"only, got torch.float32; cast .* backend='efficient'\)$"):
            block(x)
        assert counter.calls == []


@pytest.mark.parametrize("options,spec,match", [
    ({"kernel": "torch"}, GQA, r"kernel='torch' cannot be used: torch's context parallel calls SDPA itself"),
    ({"rotate": "ring"}, GQA, r"rotate='ring' is not one of torch's rotate methods; use one of \['allgather', "
                              r"'alltoall'\]"),
    ({"backend": "math"}, GQA, r"backend='math' is not an SDPA backend torch's context parallel intercepts"),
    ({}, methods.AttnSpec(dim=48, n_heads=4, n_kv_heads=4, head_dim=12), r"head_dim=12 is outside what the CUDA "),
    ({"backend": "cudnn"}, methods.AttnSpec(dim=64, n_heads=1, n_kv_heads=1, head_dim=512), r"head_dim=512"),
])
def test_refusals_name_the_constraint(options, spec, match):
    with pytest.raises(ValueError, match=match) as err:
        methods.validate("torch-cp", spec, 2, **options)
    assert "\n" not in str(err.value)


def test_efficient_backend_takes_large_head_dims_and_no_group_is_refused():
    big = methods.AttnSpec(dim=64, n_heads=1, n_kv_heads=1, head_dim=512)
    methods.validate("torch-cp", big, 2, backend="efficient")
    with pytest.raises(ValueError, match="torch-cp wraps torch's context parallel, which always communicates"):
        methods.build("torch-cp", GQA, group=None)


# ----------------------------------------------------------------------- (e) on CUDA
CUDA_SCRIPT = """
import torch, torch.distributed as dist
import methods
from methods.core.reference import AttentionBlock
from tests.methods.cases import SPECS, rel_err
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
group = dist.new_group([0])
torch.manual_seed(0)
spec = methods.AttnSpec(**dict(SPECS["gqa"], causal={causal}))
block = methods.build("torch-cp", spec, group=group)
ref = AttentionBlock(spec, kernel="math")
ref.load_state_dict(block.state_dict())
block = block.cuda().bfloat16()
ref = ref.cuda()
ref.load_state_dict({{k: v.float() for k, v in block.state_dict().items()}})
x = torch.randn(2, 64, spec.dim, device="cuda")
dy = torch.randn(2, 64, spec.dim, device="cuda")
xr = x.clone().requires_grad_()
ref(xr).backward(dy)
xl = block.shard(x.bfloat16(), 1).detach().requires_grad_()
y = block(xl, positions=block.shard(torch.arange(64, device="cuda"), 0))
y.backward(block.shard(dy.bfloat16(), 1))
errs = {{"out": rel_err(block.unshard(y.detach(), 1), ref(x)), "dx": rel_err(block.unshard(xl.grad, 1), xr.grad)}}
refs = dict(ref.named_parameters())
errs.update({{n: rel_err(p.grad, refs[n].grad) for n, p in block.named_parameters()}})
print("ERRS", errs)
assert max(errs.values()) <= 3.5e-2, errs
dist.destroy_process_group()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch's context parallel runs the "
                    "CUDA SDPA kernels only (the CPU checks above cover its ring on the CPU flash op)")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_on_cuda_matches_the_reference(causal):
    out = subprocess.run([sys.executable, "-c", CUDA_SCRIPT.format(causal=causal)], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
