"""Simulation on the GPU code path (``bench.stackmodel.simcuda``) against the CPU code path.

What is checked: the shim is loaded in this process (``tests/conftest.py`` imports ``bench``
before torch); autograd runs on fake CUDA tensors and executes the CUDA flash-attention ops,
not the CPU ones; a simulated trial on either path gives nearly the same peak on a small case
(the CUDA op's fake allocates two extra philox scalars per call; nothing else differs for our
own methods); the choice is recorded in the row and refused outside simulated mode; a process
that imported torch first gets a one-line error naming the fix.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import methods
from bench.measure.config import StepConfig
from bench.measure.run import run_trial
from bench.measure.simulate import no_param_init
from bench.measure.trial import Trial
from bench.model.config import get_config
from bench.stackmodel import simcuda

ROOT = Path(__file__).resolve().parents[3]
NO_COMPILER = shutil.which("c++") is None and shutil.which("g++") is None and not os.environ.get("CXX")


def test_shim_is_loaded_here():
    if NO_COMPILER:
        pytest.skip("no C++ compiler on this machine: the GPU code path cannot be built (CPU path only)")
    simcuda.require()  # raises with the reason if the shim did not load
    assert simcuda.active()


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["ulysses", "upipe"])
def test_fake_cuda_runs_the_cuda_flash_ops(method):
    simcuda.require()
    spec = get_config("tiny-llama").attn_spec(causal=True)
    with FakeTensorMode(), no_param_init(), simcuda.runtime():
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                block = methods.build(method, spec, group=None)
            x = torch.empty(1, 256, spec.n_heads * spec.head_dim, device="cuda", requires_grad=True)
            ops = OpNames()
            with ops:
                block(x).sum().backward()
        finally:
            torch.set_default_dtype(torch.float32)
    assert x.grad is not None and x.grad.device.type == "cuda"
    assert "aten._scaled_dot_product_flash_attention" in ops.names
    assert "aten._scaled_dot_product_flash_attention_backward" in ops.names
    assert not any(name.endswith("_for_cpu") for name in ops.names)


class BackwardArgs(TorchDispatchMode):
    """Records the arguments of the CUDA flash backward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) == "aten._scaled_dot_product_flash_attention_backward":
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


def test_the_cuda_backward_takes_the_dense_path():
    """The CUDA flash backward must get *undefined* cumulative sequence lengths (None): a defined
    one, even empty, selects flash-attn's varlen backward, which refuses with "batch size must be
    positive". That is what every real CUDA step did until it was run on an H100 (the fake's meta
    function ignores these arguments, so only this check catches it here)."""
    simcuda.require()
    kernel = methods.core.kernels.get_kernel("torch")
    with FakeTensorMode(), simcuda.runtime(), torch.device("cuda"):
        q = torch.empty(1, 128, 8, 16, dtype=torch.bfloat16)
        k = v = torch.empty(1, 128, 2, 16, dtype=torch.bfloat16)
        out, lse = kernel.forward(q, k, v, True, 0.25)
        recorded = BackwardArgs()
        with recorded:
            kernel.backward(torch.empty_like(out), q, k, v, out, lse, True, 0.25)
    assert len(recorded.calls) == 1
    cum_seq_q, cum_seq_k = recorded.calls[0][6:8]
    assert cum_seq_q is None and cum_seq_k is None


@pytest.mark.parametrize("method,model,scope", [("ulysses", "llama3-8b", "attention"),
                                                ("upipe", "llama3-8b", "attention"),
                                                ("upipe", "tiny-llama", "model")])
def test_gpu_and_cpu_code_paths_agree_on_a_small_case(method, model, scope):
    simcuda.require()
    rows = {}
    for sim_device in ("auto", "cpu"):
        trial = Trial.make(method, model, 64 << 10, 4, mode="simulated", device="h100-80g",
                           step=StepConfig(scope=scope, sim_device=sim_device))
        rows[sim_device] = run_trial(trial)
    gpu, cpu = rows["auto"], rows["cpu"]
    assert gpu.status == cpu.status == "ok", (gpu.message, cpu.message)
    assert "fake cuda tensors" in gpu.env.device_name and "fake cpu tensors" in cpu.env.device_name
    # same tensors but the CUDA op's two philox scalars per call: within 0.5%
    assert abs(gpu.figures.peak_bytes - cpu.figures.peak_bytes) <= 0.005 * cpu.figures.peak_bytes
    if scope == "model":  # checkpoint offload: host memory counted on both paths, equally
        assert gpu.figures.host_peak_bytes > 0
        assert abs(gpu.figures.host_peak_bytes - cpu.figures.host_peak_bytes) <= 0.005 * cpu.figures.host_peak_bytes
    assert gpu.levers["sim_device"] == "auto" and cpu.levers["sim_device"] == "cpu"  # schema 2: every lever recorded


def test_sim_device_is_refused_outside_simulation():
    trial = Trial.make("ulysses", "tiny-llama", 1024, 2, mode="real", device="cpu", step=StepConfig(sim_device="cpu"))
    with pytest.raises(ValueError, match="sim_device='cpu' picks the fake device of a simulation"):
        trial.validate()
    with pytest.raises(ValueError, match="sim_device must be one of"):
        StepConfig(sim_device="tpu")


def test_torch_imported_first_gives_a_one_line_error():
    code = ("import torch\nimport bench.stackmodel.simcuda as s\n"
            "try:\n    s.require()\nexcept s.SimCudaError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("ERR ") and "\n" not in line
    assert "--sim-device cpu" in line and "torch was imported before" in line


def test_chunk_stores_share_one_copy_stream():
    """Every offloading chunk store of a device copies on one side stream (the caching allocator
    keeps a pool per stream; a stream per store cached chunks on many: results/gpu/h100-ws1)."""
    from methods.core.chunkstore import ChunkStore

    simcuda.require()
    with FakeTensorMode(), simcuda.runtime():
        first, second = ChunkStore("cuda:0", offload=True), ChunkStore("cuda:0", offload=True)
        assert first.stream is not None and first.stream is second.stream
        with torch.cuda.stream(first.stream):
            assert simcuda.stream_id() > 0
    assert ChunkStore("cpu", offload=True).stream is None


def test_prefetched_chunks_are_allocated_on_the_compute_stream():
    """A chunk coming back from the host is allocated on the compute stream and filled on the side
    stream: the caching allocator keeps a pool per stream, and copies allocated on the side stream
    stayed cached in a pool the compute stream never reuses (docs: methods/core/chunkstore.py)."""
    from bench.stackmodel.allocator import ALLOC, TraceRecorder
    from methods.core.chunkstore import ChunkStore

    simcuda.require()
    with FakeTensorMode(), simcuda.runtime():
        store = ChunkStore("cuda:0", offload=True)
        store.put("k", torch.empty(1 << 20, device="cuda:0"))
        recorder = TraceRecorder()
        with recorder:
            store.prefetch("k")
            back = store.get("k")
        assert back.device.type == "cuda" and back.shape == (1 << 20,)
    device_allocs = [e for e in recorder.trace.events if e.action == ALLOC and e.device.startswith("cuda")]
    assert [e.nbytes for e in device_allocs] == [4 << 20]
    assert device_allocs[0].stream == 0, "the prefetched copy was allocated on the side stream"
