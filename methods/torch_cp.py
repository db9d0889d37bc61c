"""PyTorch's own context parallelism (``torch.distributed.tensor.experimental``) as a method.

The paper's "Native PyTorch" baseline (its runs call it ``torch_ring_alltoall``): TorchTitan with
``context_parallel`` around SDPA, K/V repeated to the query heads, torch's head-tail load
balancing and the rotate method ``allgather``. Projections, RoPE, QK-norm and ``wo`` are ours on
the shared weights; the attention is torch's. Nothing of the ring is written here.

How the call reaches torch's ring. ``context_parallel`` does two things: it shards buffers
(head-tail, see below) and it makes SDPA on sequence-sharded DTensors go to the ring. The
second is ``_enable_context_parallel_dispatcher()``: DTensor's custom handlers for the six CUDA
SDPA ops (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention`` and their backwards)
become ``_sdpa_handler``, which unwraps the local shards and calls
``_scaled_dot_product_ring_*_attention`` (``_templated_ring_attention`` and its backward); the
CPU op (``_scaled_dot_product_flash_attention_for_cpu``) is not intercepted, which is why this
method runs on CUDA tensors only. ``forward`` does what TorchTitan's module-wrapper path
(``_ContextParallel.sdpa_input_fn``) does: Q/K/V ``[B, H, S/C, d]`` become DTensors
``Shard(2)`` on a 1-D mesh over the method's group (``DeviceMesh.from_group``), SDPA runs on
them with the chosen backend, and the output DTensor's local shard comes back. Autograd records
the SDPA op's own backward node, which dispatches to torch's ring backward the same way.

Torch's options (``_cp_options``) are process-global and read again in the backward:
``rotate_method`` (``set_rotate_method``) and ``enable_load_balance`` (head-tail causal
schedule; torch refuses it without ``is_causal``, so it is on for causal attention and off
otherwise). This method sets both for its forward call (restoring the previous values after
it) and again just before its backward (an identity autograd node on the output). The
dispatcher, once enabled, stays enabled in the process (as in a TorchTitan run).

Layout: torch's ``_HeadTailLoadBalancer`` cuts the sequence into 2C chunks and gives rank r
chunks r and 2C-1-r, in that order: our zigzag layout (``ZigzagLayoutMethod``, checked by the
tests against the balancer's own indices), so ``seq_multiple`` is 2C. With load balancing off
(non-causal) the ring's result does not depend on the order of the keys, so the same layout
serves; RoPE uses each token's global position either way.

Options: ``rotate`` = ``allgather`` (default, the paper's) or ``alltoall``; ``backend`` =
``flash`` (default), ``efficient`` (memory-efficient attention, takes fp32) or ``cudnn``.
K/V are repeated to the H query heads before SDPA, as the paper ran it (torch's CP passes no
GQA flag to the ops); ``repeat_kv=False`` leaves them at the G KV heads, as Transformers'
``sdpa_attention_forward`` hands them to SDPA with ``enable_gqa=True`` (no mask, on CUDA): the
flash and cuDNN ops take G < H KV heads themselves, and torch's ring then gathers and rotates
G heads of K/V instead of H (the ``hf`` stack, ``bench.stackmodel.stack``).

Refusals (one line): any non-CUDA input (in ``forward``, before any communication: torch's
context parallel dispatches only the CUDA SDPA ops); fp32 with ``flash``/``cudnn`` (those CUDA
kernels take fp16/bf16 only); ``head_dim`` not a multiple of 8 or above 256 (the flash/cuDNN
kernels' limits; ``efficient`` takes any multiple of 8); a ``kernel`` option (torch calls SDPA
itself); no process group.

Simulation (``--mode simulated``, fake CUDA tensors and a fake process group). What runs is
torch's code above: the DTensor wrapping, sharding propagation with the CP rules, the handler,
``_templated_ring_attention`` with its rotater (``_AllGatherRotater``: one
``all_gather_single`` of the flattened local K and V per forward and per backward;
``_AllToAllRotater``: a ``permute_tensor`` all-to-all per step), the load-balanced branches
(step 0 causal on both local chunks; i <= rank: first half of the remote K/V; i > rank: second
half of the local Q, ``partial`` merge), the fp32 ``_SDPAMerger``, and in the backward the fp32
dQ/dK/dV accumulators with the dK/dV buffer travelling by all-to-all (``permute_tensor``)
whatever the rotate method. One thing is stood in for: the backend choice. On a GPU
``F.scaled_dot_product_attention`` asks ``aten._fused_sdp_choice`` (CUDA C++ in
``sdp_utils``), which a CPU-only torch does not have, so without a CUDA runtime this method
calls the backend's aten op directly on the DTensors, which is the op the choice returns when
only that backend is enabled (``sdpa_kernel``) and the op the CP handler intercepts; on a GPU it
calls ``F.scaled_dot_product_attention`` under ``sdpa_kernel(backend)``, as TorchTitan does.

What torch's code holds, by its shapes (Llama3-8B: H = 32, G = 8, d = 128; 1M tokens, C = 8,
so n = 128K local tokens; bf16; one [B, H, n, d] tensor is 1 GiB, 2 GiB in fp32). With
``allgather`` torch all-gathers the flattened local K and V (H heads after the repeat) once per
forward and once per backward: ``2 * S * H * d`` values, 16 GiB, alive through the whole ring
(every step's block is a view of it). The backward adds fp32 dQ/dK/dV accumulators (6 GiB),
the fp32 dK/dV buffer sent by all-to-all at every step and the one received (4 + 4 GiB), the
step's bf16 gradients from the flash backward and ``_partial_update``'s concatenated copies.
``alltoall`` holds one remote K/V block and the one in flight instead of the gathered 16 GiB.
The collectives, as torch's code issues them: ``allgather``, per block and direction, one
all-gather of 16 GiB; the dK/dV buffer, C all-to-alls of 4 GiB; ``alltoall``, C-1 steps of 2 GiB
per direction. The simulated peaks of these shapes, beside ``ulysses`` and ``ring``, and the
collectives the simulation counted are in docs/methods.md, section "torch-cp".
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .core.base import MethodOptions, ZigzagLayoutMethod
from .core.registry import MethodFacts, PaperRun, register
from .core.spec import AttnSpec
from .ds_ulysses import require_group

NAME = "torch-cp"
CP_MODULE = "torch.distributed.tensor.experimental._attention"  # torch's CP (a re-export in torch >= 2.9)
ROTATES = ("allgather", "alltoall")
BACKENDS = ("flash", "efficient", "cudnn")
HALF = (torch.float16, torch.bfloat16)
CPU_REFUSAL = (f"{NAME}: torch's context parallel dispatches only the CUDA SDPA kernels; run {NAME} on a GPU, "
               "or with --mode simulated")


@dataclass(frozen=True)
class TorchCPOptions(MethodOptions):
    rotate: str = "allgather"  # torch's set_rotate_method: "allgather" (the paper's) or "alltoall"
    backend: str = "flash"  # the SDPA backend torch's ring calls: "flash", "efficient" or "cudnn"
    repeat_kv: bool = True  # K/V repeated to the H query heads (the paper's); False: G KV heads, as enable_gqa passes


def _cp():
    """torch's context-parallel module (imported when used, never when ``methods`` is imported)."""
    import importlib

    return importlib.import_module(CP_MODULE)


_DISPATCHER = {"enabled": False}


def _enable_dispatcher() -> None:
    if not _DISPATCHER["enabled"]:
        _cp()._enable_context_parallel_dispatcher()
        _DISPATCHER["enabled"] = True


def _options_now() -> tuple[str, bool]:
    opts = _cp()._cp_options
    return ("alltoall" if opts.rotate_method == _cp()._RotateMethod.ALL_TO_ALL else "allgather",
            opts.enable_load_balance)


def _set_options(rotate: str, load_balance: bool) -> None:
    _cp().set_rotate_method(rotate)
    _cp()._cp_options.enable_load_balance = load_balance


# DTensor's sharding propagation runs each op once on fake tensors of the *global* shape to learn
# its output's metadata, in ``detect_fake_mode() or FakeTensorMode()``. On a GPU that is a fresh
# fake mode and allocates nothing; under simulation it would be the simulation's own fake mode,
# so the memory tracker would count those global-shape tensors (a full-sequence Q/K/V/output and,
# in the backward, their gradients) as if the rank held them. While ``_PROPAGATION["own_mode"]``
# is positive (around this method's SDPA call and its backward) the propagation always gets a
# fresh fake mode of its own: what it gets on a GPU anyway, so the method need not know whether
# it is simulated.
_PROPAGATION = {"own_mode": 0, "installed": False}


def _install_propagation_mode() -> None:
    if _PROPAGATION["installed"]:
        return
    import torch.distributed.tensor._sharding_prop as sharding_prop

    ambient = sharding_prop.detect_fake_mode

    def detect_fake_mode(*args, **kwargs):
        return None if _PROPAGATION["own_mode"] else ambient(*args, **kwargs)

    sharding_prop.detect_fake_mode = detect_fake_mode
    _PROPAGATION["installed"] = True


class _CPCall:
    """torch's CP settings for one call of this method: ``enter`` sets its options (saving the
    process's) and gives the propagation its own fake mode; ``exit`` undoes both. Entered around
    the forward SDPA call and again around its backward."""

    def __init__(self, rotate: str, load_balance: bool) -> None:
        self.settings = (rotate, load_balance)
        self.saved: list[tuple[str, bool]] = []

    def enter(self) -> None:
        self.saved.append(_options_now())
        _set_options(*self.settings)
        _PROPAGATION["own_mode"] += 1

    def exit(self) -> None:
        _PROPAGATION["own_mode"] -= 1
        _set_options(*self.saved.pop())


@contextlib.contextmanager
def _cp_call(rotate: str, load_balance: bool):
    call = _CPCall(rotate, load_balance)
    call.enter()
    try:
        yield call
    finally:
        call.exit()


class _BeforeBackward(torch.autograd.Function):
    """Identity on the attention output. Its backward runs just before the SDPA op's backward
    (torch's ring backward) and enters the call's settings for it."""

    @staticmethod
    def forward(ctx, out, call):
        ctx.call = call
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.call.enter()
        return grad, None


class _AfterBackward(torch.autograd.Function):
    """Identity on Q, K, V before they become DTensors; its backward runs once the SDPA op's
    backward has produced all three gradients, and exits what ``_BeforeBackward`` entered."""

    @staticmethod
    def forward(ctx, call, q, k, v):
        ctx.call = call
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.call.exit()
        return None, dq, dk, dv


def _sdpa_op(backend: str):
    """The aten op ``F.scaled_dot_product_attention`` calls on CUDA for ``backend``, and how to
    call it for ``(q, k, v, causal, scale) -> out`` (the other outputs are the LSE and RNG state)."""
    aten = torch.ops.aten
    if backend == "flash":
        return lambda q, k, v, causal, scale: aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)[0]
    if backend == "efficient":
        return lambda q, k, v, causal, scale: aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[0]
    return lambda q, k, v, causal, scale: aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[0]


@register(NAME, "PyTorch's context parallel (torch.distributed.tensor.experimental): its ring attention "
          "around CUDA SDPA, head-tail layout, K/V repeated to H heads (the paper's Native PyTorch)",
          requires=(CP_MODULE,), install_hint="a torch with torch.distributed (pip install 'torch>=2.9')",
          # SDPA's flash kernel is FlashAttention 2's code; the paper ran it without tiled MLP or norms
          facts=MethodFacts(column="torch-cp", paper_code=True, library="PyTorch", kernel="fa2",
                            levers={"tiled_mlp": False, "tiled_norm": False}, simulates=(PaperRun("torch-cp"),)))
class TorchCP(ZigzagLayoutMethod):
    documents_refusal = "PyTorch's context-parallel SDPA ring takes no document mask (a library limit)"
    Options = TorchCPOptions
    cuda_only_reason = "torch's context parallel dispatches only the CUDA SDPA kernels"
    calls_suite_kernel = False  # torch's ring calls SDPA itself, on DTensors

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: TorchCPOptions) -> None:
        if options.kernel is not None:
            raise ValueError(f"{NAME}: kernel={options.kernel!r} cannot be used: torch's context parallel calls "
                             "SDPA itself; choose its SDPA backend with backend=... and leave kernel unset")
        super().validate(spec, world_size, options)
        if options.rotate not in ROTATES:
            raise ValueError(f"{NAME}: rotate={options.rotate!r} is not one of torch's rotate methods; "
                             f"use one of {list(ROTATES)}")
        if options.backend not in BACKENDS:
            raise ValueError(f"{NAME}: backend={options.backend!r} is not an SDPA backend torch's context parallel "
                             f"intercepts; use one of {list(BACKENDS)}")
        d = spec.head_dim
        if d % 8 or (options.backend != "efficient" and d > 256):
            raise ValueError(f"{NAME}: head_dim={d} is outside what the CUDA {options.backend} SDPA kernel takes "
                             "(a multiple of 8, at most 256 for flash/cudnn); use such a head_dim")

    @classmethod
    def seq_multiple(cls, world_size: int, options: TorchCPOptions) -> int:
        """2C, at every world size: torch's head-tail balancer cuts the sequence into 2C chunks (and
        leaves it unbalanced otherwise, which its causal schedule then does not expect)."""
        return 2 * world_size

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        require_group(group, NAME, "torch's context parallel")
        self._meshes: dict[str, object] = {}
        self._repeat = spec.n_heads // spec.n_kv_heads

    def mesh(self, device_type: str):
        """The 1-D DeviceMesh over this method's group (built once per device type; real rank ids
        even under fake tensors, so outside fake mode)."""
        if device_type not in self._meshes:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch.distributed.device_mesh import DeviceMesh

            with unset_fake_temporarily():
                self._meshes[device_type] = DeviceMesh.from_group(self.group, device_type=device_type)
        return self._meshes[device_type]

    def check_input(self, x: torch.Tensor) -> None:
        """The one-line refusals that depend on the input (before any communication)."""
        if x.device.type != "cuda":
            raise ValueError(CPU_REFUSAL)
        if x.dtype not in HALF and self.options.backend != "efficient":
            raise ValueError(f"{NAME}: the CUDA {self.options.backend} SDPA kernel takes float16/bfloat16 only, got "
                             f"{x.dtype}; cast the block and its input to bfloat16 (or use backend='efficient')")

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """SDPA on ``[B, H, S/C, d]`` DTensors: through ``F.scaled_dot_product_attention`` when a CUDA
        runtime exists, else the backend's op itself (see the module docstring)."""
        causal, backend = self.spec.causal, self.options.backend
        if torch.cuda.is_available():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                      "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
            with sdpa_kernel(chosen):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.scale)
        return _sdpa_op(backend)(q, k, v, causal, self.scale)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        self.check_input(x)
        from torch.distributed.tensor import DTensor, Shard

        cos, sin = self.rope_for(x, positions)
        q, k, v = self.project_qkv(x, cos, sin)  # [B, n, H or G, d]
        if self._repeat > 1 and self.options.repeat_kv:  # K/V to the query heads (head i reads KV head i // repeat)
            k, v = (t.repeat_interleave(self._repeat, dim=2) for t in (k, v))
        mesh = self.mesh(x.device.type)
        _enable_dispatcher()
        _install_propagation_mode()
        # torch balances (and accepts load balancing for) causal attention only
        with _cp_call(self.options.rotate, self.spec.causal) as call:
            q, k, v = _AfterBackward.apply(call, q, k, v)
            q, k, v = (DTensor.from_local(t.transpose(1, 2), mesh, [Shard(2)], run_check=False) for t in (q, k, v))
            out = self.sdpa(q, k, v).to_local()  # [B, H, n, d]
        out = _BeforeBackward.apply(out, call)
        return self.wo(out.transpose(1, 2).flatten(2))
