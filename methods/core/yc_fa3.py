"""yunchang's FlashAttention-3 ring stages with the caller's ``causal`` passed to the kernel.

Why. yunchang's zigzag ring (``yunchang/ring/zigzag_ring_flash_attn.py``, used by ``yc-ring`` and
by ``yc-usp``'s ``LongContextAttention``) computes each block with the function
``select_flash_attn_impl(attn_type, stage="fwd-only" | "bwd-only")`` returns, and asks for
``causal=True`` on the diagonal block (ring step 0), ``False`` on the others. For ``AttnType.FA3``
those functions are ``flash_attn3_func_forward`` and ``flash_attn3_func_backward`` of
``yunchang/kernels/attention.py`` (yunchang 0.6.4: defined at lines 253 and 296), which call
flash-attn 3's ``_flash_attn_forward`` / ``_flash_attn_backward`` with ``causal=False`` (lines 283
and 320) whatever they are given. So the diagonal blocks run unmasked: on a GPU each query also
attends to the later keys of its own chunks (wrong outputs and gradients), and the ring computes
1/R more attention than a causal one (R the ring degree). flash-attn 2 (``AttnType.FA``) and FA3's
``"fwd-bwd"`` stage (``yc-ulysses``, a ring of one) pass ``causal`` and are not affected. The
paper ran the authors' vendored yunchang (``long-context-attention/``, docs/paper.md "yunchang"),
whose two functions pass ``causal`` (and the window and softcap) to the kernel; with this module
the pip yunchang does the same, so ``yc-ring``/``yc-usp`` with ``attn_type="fa3"`` run what the
paper ran.

Mechanism. ``select_flash_attn_impl`` (``yunchang/kernels/__init__.py``, 0.6.4 lines 87-91)
returns the two functions by their names in the ``yunchang.kernels`` module, looked up at every
call. ``fa3_causal()`` binds those two names to ``fa3_forward`` / ``fa3_backward`` here, which make
yunchang's flash-attn 3 call (through the functions yunchang bound at import,
``yunchang.kernels.attention.flash_attn_forward_hopper`` / ``flash_attn_func_hopper_backward``,
so a simulated or real FA3 alike) with ``causal``, ``window_size`` and ``softcap`` (backward:
``deterministic`` too) as given, and binds yunchang's own back when the last scope ends. Nothing
in site-packages is edited and nothing else in yunchang changes.

Scope. ``run(fn, q, k, v)`` (what the wrappers call) holds the binding while ``fn`` runs and
again while its backward runs, which autograd runs later (``loss.backward()``, possibly on its
own thread): an identity autograd node on the output binds when the output's gradient arrives
(before yunchang's backward nodes) and one on the inputs unbinds once all of their gradients
are computed (after them). Scopes nest (a count under a lock), so several layers' forwards and
backwards interleave safely in one process; a backward that raises midway leaves the count
raised, so the binding stays for the rest of the process (harmless: it is the correct function).

Refusal. ``check()`` (called when a wrapper is built with ``attn_type="fa3"``, before any
communication) raises one line when yunchang's internals do not have the shape this was written
for (0.6.4): the two names missing, their parameters changed, ``select_flash_attn_impl`` not
returning them by name, or the bound flash-attn 3 functions missing.
"""
from __future__ import annotations

import inspect
import threading

import torch

FORWARD_PARAMS = ("q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                  "alibi_slopes", "return_softmax")
BACKWARD_PARAMS = ("dout", "q", "k", "v", "out", "softmax_lse", "block_dq_buffer", "block_dk_buffer",
                   "block_dv_buffer", "dropout_p", "softmax_scale", "bwd_causal", "window_size", "softcap",
                   "alibi_slopes", "deterministic", "rng_state")
# flash-attn 3's _flash_attn_forward arguments without defaults that yunchang's ring never uses
_FWD_UNUSED = ("k_new", "v_new", "qv", "out", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new", "seqused_q",
               "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k",
               "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale")
_BWD_UNUSED = ("cu_seqlens_q", "cu_seqlens_k", "sequed_q", "sequed_k", "max_seqlen_q", "max_seqlen_k")
NOTE = ("yunchang's FA3 ring stages called with the caller's causal flag (methods.core.yc_fa3: pip yunchang "
        "0.6.4 passes causal=False to flash-attn 3; the paper's vendored copy passes it)")

_lock = threading.Lock()
_depth = 0
_saved: tuple | None = None  # yunchang's own two functions while bound


def _modules():
    from yunchang import kernels
    from yunchang.kernels import attention

    return kernels, attention


def _refuse(what: str) -> RuntimeError:
    import yunchang

    version = getattr(yunchang, "__version__", "?")
    return RuntimeError(
        f"yunchang {version}'s FA3 ring stages are not as methods/core/yc_fa3.py expects (written for 0.6.4): "
        f"{what}; check whether this version passes causal to flash-attn 3 and update methods/core/yc_fa3.py")


def check() -> None:
    """Refuse (one line) when yunchang's FA3 stage functions are not where and what 0.6.4 has."""
    kernels, attention = _modules()
    for name, params in (("flash_attn3_func_forward", FORWARD_PARAMS), ("flash_attn3_func_backward", BACKWARD_PARAMS)):
        fn = getattr(kernels, name, None)
        if not callable(fn):
            raise _refuse(f"yunchang.kernels.{name} is missing")
        if fn in (fa3_forward, fa3_backward):
            continue  # bound by a scope now
        got = tuple(inspect.signature(fn).parameters)
        if got != params:
            raise _refuse(f"yunchang.kernels.{name} takes {got}, not {params}")
    for name in ("flash_attn_forward_hopper", "flash_attn_func_hopper_backward"):
        if not hasattr(attention, name):
            raise _refuse(f"yunchang.kernels.attention.{name} is missing")
    fa3 = getattr(getattr(kernels, "AttnType", None), "FA3", None)
    select = getattr(kernels, "select_flash_attn_impl", None)
    if fa3 is None or select is None:
        raise _refuse("yunchang.kernels has no AttnType.FA3 or select_flash_attn_impl")
    for stage, name in (("fwd-only", "flash_attn3_func_forward"), ("bwd-only", "flash_attn3_func_backward")):
        if select(fa3, stage=stage) is not getattr(kernels, name):
            raise _refuse(f"select_flash_attn_impl(AttnType.FA3, {stage!r}) does not return yunchang.kernels.{name}")


def _bind() -> None:
    global _depth, _saved
    with _lock:
        if _depth == 0:
            check()
            kernels, _ = _modules()
            _saved = (kernels.flash_attn3_func_forward, kernels.flash_attn3_func_backward)
            kernels.flash_attn3_func_forward, kernels.flash_attn3_func_backward = fa3_forward, fa3_backward
            if kernels.select_flash_attn_impl(kernels.AttnType.FA3, stage="fwd-only") is not fa3_forward:
                kernels.flash_attn3_func_forward, kernels.flash_attn3_func_backward = _saved
                _saved = None
                raise _refuse("select_flash_attn_impl does not look its FA3 stages up by name at each call")
        _depth += 1


def _unbind() -> None:
    global _depth, _saved
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0 and _saved is not None:
            kernels, _ = _modules()
            kernels.flash_attn3_func_forward, kernels.flash_attn3_func_backward = _saved
            _saved = None


class fa3_causal:  # noqa: N801 - used as a context manager, like contextlib's
    """The binding for the duration of a ``with`` block (forward only; ``run`` covers backward)."""

    def __enter__(self) -> fa3_causal:
        _bind()
        return self

    def __exit__(self, *exc) -> None:
        _unbind()


def is_bound() -> bool:
    return _depth > 0


def _check_supported(dropout_p, alibi_slopes) -> None:
    if dropout_p:
        raise ValueError(f"flash-attn 3 has no dropout (yunchang's FA3 ring stage got dropout_p={dropout_p})")
    if alibi_slopes is not None:
        raise ValueError("flash-attn 3 has no ALiBi (yunchang's FA3 ring stage got alibi_slopes)")


def _window(window_size) -> tuple[int, int]:
    return (-1, -1) if window_size is None else tuple(window_size)


def fa3_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    """``yunchang.kernels.attention.flash_attn3_func_forward`` with ``causal``, ``window_size`` and
    ``softcap`` passed to flash-attn 3: ``(out, softmax_lse)``."""
    from yunchang.kernels import attention

    _check_supported(dropout_p, alibi_slopes)
    if attention.flash_attn_forward_hopper is None:
        raise RuntimeError("yunchang found no flash-attn 3 (flash_attn_interface) when it was imported")
    out, softmax_lse, *_ = attention.flash_attn_forward_hopper(
        q=q, k=k, v=v, **dict.fromkeys(_FWD_UNUSED), softmax_scale=softmax_scale, causal=bool(causal),
        window_size=_window(window_size), attention_chunk=0, softcap=softcap or 0.0, rotary_interleaved=True,
        scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0)
    return out, softmax_lse


def fa3_backward(dout, q, k, v, out, softmax_lse, block_dq_buffer, block_dk_buffer, block_dv_buffer, dropout_p,
                 softmax_scale, bwd_causal, window_size, softcap, alibi_slopes, deterministic, rng_state):
    """``yunchang.kernels.attention.flash_attn3_func_backward`` with ``causal`` (``bwd_causal``),
    ``window_size``, ``softcap`` and ``deterministic`` passed to flash-attn 3: fills the buffers."""
    from yunchang.kernels import attention

    _check_supported(dropout_p, alibi_slopes)
    if attention.flash_attn_func_hopper_backward is None:
        raise RuntimeError("yunchang found no flash-attn 3 (flash_attn_interface) when it was imported")
    attention.flash_attn_func_hopper_backward(
        dout, q, k, v, out, softmax_lse, **dict.fromkeys(_BWD_UNUSED), dq=block_dq_buffer, dk=block_dk_buffer,
        dv=block_dv_buffer, softmax_scale=softmax_scale, causal=bool(bwd_causal), window_size=_window(window_size),
        softcap=softcap or 0.0, deterministic=bool(deterministic), sm_margin=0)


class _BindInBackward(torch.autograd.Function):
    """Identity on the output; its backward (before the library's) binds."""

    @staticmethod
    def forward(ctx, out):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        _bind()
        return grad


class _UnbindInBackward(torch.autograd.Function):
    """Identity on the inputs; its backward (after the library's, once all their gradients are in) unbinds."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        _unbind()
        return dq, dk, dv


def run(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``fn(q, k, v)`` (a yunchang call returning the attention output) with the causal FA3 stages
    bound while it runs and while its backward runs."""
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if tracked:
        q, k, v = _UnbindInBackward.apply(q, k, v)
    with fa3_causal():
        out = fn(q, k, v)
    return _BindInBackward.apply(out) if tracked and out.requires_grad else out
