"""Simulation on the GPU code path: fake CUDA tensors on a CPU-only PyTorch.

Why. A simulated trial should execute the branches a GPU run executes: the CUDA SDPA ops
(``aten._scaled_dot_product_flash_attention`` and its backward, not the CPU op), the
libraries' ``if x.is_cuda`` branches, FSDP2's stream and event choreography, pinned host
buffers. ``FakeTensorMode`` creates fake ``cuda`` tensors on a CPU-only build, but autograd
aborts on them (no CUDA device guard, no CUDA "accelerator"). ``shim.cpp`` supplies both: a
device guard with one device and one always-complete stream, and CUDA hooks that say CUDA is
available. It is compiled here with the system C++ compiler against the installed torch's
headers (once per torch version, a few seconds; cached under ``$CPAB_CACHE`` or
``~/.cache/cpab``) and must be loaded **before** ``import torch`` (the hooks are created once,
when torch first asks for them, and ``import torch`` does): ``preload()`` is called by
``bench/__init__.py`` and ``tests/conftest.py`` for that reason, and does nothing when torch
was imported first, when torch is a CUDA build (the real runtime serves fake CUDA tensors
then), or when no compiler is found. ``require()`` is what a simulation calls: it raises a
one-line ``SimCudaError`` naming the fix when the GPU code path is not available.

What cannot exist without a GPU runtime, and how simulation stands in for it
(``runtime()``, entered only around a simulated step):

* **Streams** (``torch.cuda.Stream``, ``current_stream``, ``stream(...)``): generic
  ``torch.Stream`` objects of the shim's device that complete at once. Code that orders work
  across streams (FSDP2's all-gather and reduce-scatter streams, a method's copy stream) runs
  its normal branch; memory that a real run would hold until another stream catches up is
  freed when Python drops it, i.e. the simulation assumes the streams keep up (FSDP2 itself
  keeps its buffers referenced until the consuming event, so its prefetch overlap is still
  seen). Which stream is *current* is tracked, though (``stream(s)`` enters ``s``,
  ``current_stream()`` returns it, ``stream_id()`` numbers it: 0 for the default stream, 1, 2
  ... for the streams made here in order of creation), because the CUDA caching allocator
  keys its cached blocks by the stream current at allocation (``Block::stream``; a free
  block is reused only by an allocation on the same stream), so the allocator model
  (``bench.stackmodel.allocator``) needs each allocation's stream to keep FSDP2's all-gather
  buffers, made on its copy-in stream, out of the compute stream's pool, as on a GPU.
* **Events** (``torch.cuda.Event``): generic ``torch.Event`` objects, always complete;
  ``elapsed_time`` is not available (no timing in simulation).
* **record_stream** (``Tensor.record_stream``: the allocator defers reusing a block until the
  recorded stream's pending work is done): a no-op kernel for fake tensors. The block is free
  when Python drops the tensor, as if the side stream had finished; on a GPU it can be held a
  little longer.
* **Pinned host memory** (``pin_memory=True``): host tensors are fake ``cpu`` tensors; the
  tracker counts them as host memory; pinning itself costs nothing here.
* **CUDA memory statistics** (``torch.cuda.max_memory_allocated`` ...): not available; the
  memory tracker measures instead (``bench.measure.simulate``).
* **Device properties, NCCL**: the process group is ``fake`` (collectives return at once).

``torch.cuda.is_available()`` stays ``False`` (the Python side of the CPU build has no CUDA
module), so libraries that pick a backend by asking it (DeepSpeed's accelerator) still pick
CPU; their tensor-device branches see CUDA.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).with_name("shim.cpp")
ENV_CACHE = "CPAB_CACHE"


class SimCudaError(RuntimeError):
    """The GPU code path of simulation is not available here (one line, names the fix)."""


_STATE: dict[str, object] = {"loaded": False, "reason": "not attempted"}


def _torch_dir() -> Path | None:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _cuda_build(torch_dir: Path) -> bool:
    """A CUDA build of torch ships libc10_cuda; it serves fake CUDA tensors itself."""
    return any((torch_dir / "lib").glob("libc10_cuda*"))


def _cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cpab")
    return Path(root) / "simcuda"


def _library_path(torch_dir: Path) -> Path:
    version = (torch_dir / "version.py").read_text() if (torch_dir / "version.py").exists() else ""
    tag = hashlib.sha1((version + str(torch_dir) + SOURCE.read_text()).encode()).hexdigest()[:12]
    return _cache_dir() / f"libsimcuda-{tag}.so"


def _abi_flag(torch_dir: Path) -> str:
    """The C++ ABI torch was built with (asked of torch in a child process: not importable here)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"],
                         capture_output=True, text=True, timeout=300, check=True)
    return f"-D_GLIBCXX_USE_CXX11_ABI={out.stdout.strip() or '1'}"


def build(torch_dir: Path | None = None) -> Path:
    """Compile ``shim.cpp`` (if not cached) and return the library's path."""
    torch_dir = torch_dir or _torch_dir()
    if torch_dir is None:
        raise SimCudaError("torch is not installed")
    lib = _library_path(torch_dir)
    if lib.exists():
        return lib
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise SimCudaError("no C++ compiler found to build the simulated CUDA device (install g++, "
                           "e.g. apt-get install g++), or simulate on the CPU path: --sim-device cpu")
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [compiler, "-O1", "-shared", "-fPIC", "-std=c++17", _abi_flag(torch_dir),
           f"-I{torch_dir / 'include'}", str(SOURCE), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", tmp]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        first = (done.stderr.strip().splitlines() or ["?"])[0]
        raise SimCudaError(f"building the simulated CUDA device failed ({first}); "
                           "simulate on the CPU path instead: --sim-device cpu")
    os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written file
    return lib


def preload() -> bool:
    """Load the shim if that can still work (torch not imported yet, CPU build, compiler
    present); record why not otherwise. Never raises: ``require`` reports."""
    if _STATE["loaded"]:
        return True
    torch_dir = _torch_dir()
    if torch_dir is None:
        _STATE["reason"] = "torch is not installed"
        return False
    if _cuda_build(torch_dir):
        _STATE.update(loaded=True, reason="CUDA build of torch: its own runtime serves fake CUDA tensors")
        return True
    if "torch" in sys.modules:
        _STATE["reason"] = ("torch was imported before bench.stackmodel.simcuda.preload(); the simulated "
                            "CUDA device must be loaded first (run through `python -m bench`, or import "
                            "bench before torch), or simulate on the CPU path: --sim-device cpu")
        return False
    try:
        ctypes.CDLL(str(build(torch_dir)), mode=ctypes.RTLD_GLOBAL)
    except (SimCudaError, OSError, subprocess.SubprocessError) as err:
        _STATE["reason"] = str(err)
        return False
    _STATE.update(loaded=True, reason="shim loaded")
    return True


def active() -> bool:
    return bool(_STATE["loaded"])


def require() -> None:
    """Raise ``SimCudaError`` (one line, with the fix) unless fake CUDA tensors can run autograd."""
    if not active():
        raise SimCudaError(f"simulation on the GPU code path is not available: {_STATE['reason']}")


_LIBRARIES: list = []  # keeps the op registrations alive


def _register_record_stream() -> None:
    """``aten::record_stream`` has no fake (Meta) kernel in torch; give it a no-op one."""
    if _LIBRARIES:
        return
    import torch

    lib = torch.library.Library("aten", "IMPL")
    lib.impl("record_stream", lambda self, stream: None, "Meta")
    _LIBRARIES.append(lib)


_STREAMS: list = []  # the streams made under runtime(), in order of creation (kept alive: ids stay unique)
_ACTIVE: list = []  # the stack of streams entered with torch.cuda.stream(...)


def stream_id() -> int:
    """The current simulated stream as the allocator model keys it: 0 for the default stream,
    ``n`` for the n-th stream made under ``runtime()``. Always 0 outside ``runtime()``."""
    if not _ACTIVE:
        return 0
    current = _ACTIVE[-1]
    for i, made in enumerate(_STREAMS):
        if made is current:
            return i + 1
    return 0  # a stream not made here (the default stream entered explicitly)


@contextlib.contextmanager
def runtime() -> Iterator[None]:
    """Stand-ins for the Python-level CUDA runtime during a simulated step (see the module
    docstring); everything is restored on exit. A no-op when torch has real CUDA."""
    import torch

    if torch.cuda.is_available():
        yield
        return

    def current_stream(device=None):
        return _ACTIVE[-1] if _ACTIVE else torch.accelerator.current_stream()

    @contextlib.contextmanager
    def stream(s=None):
        if s is None:
            yield s
            return
        _ACTIVE.append(s)
        try:
            yield s
        finally:
            _ACTIVE.pop()

    def new_stream(device=None, priority: int = 0, **_):
        made = torch.Stream("cuda", priority=priority)
        _STREAMS.append(made)
        return made

    def new_event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return torch.Event("cuda", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)

    _register_record_stream()
    stand_ins = {
        "Stream": new_stream,
        "Event": new_event,
        "current_stream": current_stream,
        "default_stream": current_stream,
        "stream": stream,
        "synchronize": lambda device=None: None,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "device_count": lambda: 1,
    }
    saved = {name: getattr(torch.cuda, name) for name in stand_ins}
    for name, fn in stand_ins.items():
        setattr(torch.cuda, name, fn)
    _STREAMS.clear()
    _ACTIVE.clear()
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        _STREAMS.clear()
        _ACTIVE.clear()
