"""UPipe ("Untied Ulysses", arXiv 2602.21196): Ulysses processed in stages of U query heads.

Algorithm. The H query heads are processed in H/U stages of ``chunk_heads`` = U heads
(U a multiple of the world size C, so each rank attends U/C heads per stage; default U = C;
U = H is Ulysses). A stage projects only its U query heads from the block input, applies
RoPE, runs the sequence->head all-to-all, attends, and all-to-alls the result back into a
preallocated sequence-sharded output ``[B, S/C, H, d]`` at the heads' own slots. Stage
tensors are dropped before the next stage, so the caching allocator hands the same blocks
to the next stage: full-head Q/K/V/O never exist at once. One ``wo`` GEMM follows.

GQA-aware schedule (how the query heads are permuted). Let G_e be the KV heads after
replication (KV heads fewer than C are replicated C/G times; their weight gradients are
summed back through the gather in ``head_rows``), g_e = H/G_e, q_r = U/C query heads and
k_r KV heads per rank per stage (k_r = 1 when q_r <= g_e, else q_r/g_e). KV heads are taken
in *groups* of k_r*C consecutive heads; rank r receives heads ``m*k_r*C + r*k_r ...`` of
group m, projected and exchanged **once per group** and kept for the k_r*g_e/q_r stages
that use them. Stage t of group m sends, for each rank r, the q_r query heads
``(m*k_r*C + r*k_r)*g_e + t*q_r + i``. Those are exactly the query heads that the reference
(``query h uses KV head h // g``) pairs with rank r's KV heads, so the reference weights
are used unchanged: the permutation lives only in which rows of ``wq`` a stage reads and
which output slots it writes. Example H=16, G=4, C=4, U=4: stage 0 = Q0,Q4,Q8,Q12 with
K/V0-3 exchanged, stage 1 = Q1,Q5,Q9,Q13 with no K/V traffic, and so on.

Backward. A custom autograd function saves only the block input x, the pre-``wo``
output and one LSE per stage. Backward walks the same schedule: it recomputes a group's
K/V and each stage's Q (under autograd, so RoPE and QK-norm are differentiated
exactly), exchanges the saved output and its gradient for the stage's heads, runs the
kernel backward, accumulates dK/dV over the group's stages, returns dQ (and dK/dV at the
group's end) with the head->sequence all-to-all and back-propagates them into dx and
the weight rows.

Activation memory (per rank; bf16 b = 2 bytes; batch B, sequence S, C ranks, n = S/C
local tokens, head dim d, model dim D, G_e KV heads after replication). Counted: every
tensor the block allocates during forward+backward, at its peak; not counted: weights,
their gradients, the block input x, its output y and the incoming gradient dy (they
belong to the surrounding model). Unit u = b*B*S*d, one head of the full sequence, so a
rank's share of H heads in sequence layout, b*B*n*H*d, is (H/C)*u.

Ulysses peaks while exchanging dout: saved q, k, v and the attention output in head
layout (2H/C + 2G_e/C)*u, plus dout, its send buffer and receive buffer 3*(H/C)*u:

    M_ulysses = (5*H/C + 2*G_e/C) * u

UPipe peaks in a stage's kernel backward: the saved pre-wo output (H/C)*u, dx b*B*n*D,
and one stage: the group's k, v, their dK/dV sums and the kernel's dk, dv (6*k_r*u),
and the stage's q, o, do, dq (4*q_r*u), with fp32 LSEs of all stages (4*B*S*H/C bytes):

    M_upipe = (H/C)*u + b*B*n*D + (6*k_r + 4*q_r)*u + 4*B*S*H/C

With U = C (q_r = k_r = 1) the head-dependent part does not grow with H: only the
persistent output does. ``activation_bytes`` evaluates both; tests/methods/test_memory.py
checks them against the simulated peak (FakeTensorMode + fake process group + MemTracker).
The paper's per-stage reduction of attention intermediates is 1 - U/H: 75% for H = 32
and 87.5% for H = 64 at U = C = 8.

Packed documents (``docs=``): as in Ulysses, a stage's all-to-all gives every rank whole
documents for its heads; each stage's kernel calls (forward and backward) take the documents.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .core import comm
from .core.base import NORM_EPS, AttentionMethod, MethodOptions, head_rows, index_tensor
from .core.documents import Documents
from .core.kernels import mask_keywords
from .core.normtile import norm_backward_, norm_linear, norm_weight_grad
from .core.registry import MethodFacts, PaperRun, register
from .core.rope import apply_rope
from .core.spec import AttnSpec


@dataclass(frozen=True)
class UPipeOptions(MethodOptions):
    chunk_heads: int | None = None  # U, query heads per stage (multiple of C); None: U = C


@dataclass(frozen=True)
class Stage:
    q_heads: list[int]  # global query heads, rank-major (rank r's q_r heads, then rank r+1's)
    kv_heads: list[int] | None  # original KV heads to project and exchange, or None: reuse


def plan_stages(spec: AttnSpec, world_size: int, chunk_heads: int) -> list[Stage]:
    """The GQA-aware stage schedule described in the module docstring."""
    c, h, g = world_size, spec.n_heads, spec.n_kv_heads
    rep = c // g if g < c else 1
    g_eff = g * rep
    ge = h // g_eff
    qr = chunk_heads // c
    kr = 1 if qr <= ge else qr // ge
    per_group = kr * c
    stages: list[Stage] = []
    for m in range(g_eff // per_group):
        kv = [(m * per_group + i) // rep for i in range(per_group)]
        for t in range(kr * ge // qr):
            q_heads = [
                (m * per_group + r * kr) * ge + t * qr + i for r in range(c) for i in range(qr)
            ]
            stages.append(Stage(q_heads, kv if t == 0 else None))
    return stages


def _rows(heads: list[int], head_dim: int, device) -> torch.Tensor:
    """Weight-row indices of ``heads`` (for scattering stage weight gradients)."""
    idx = index_tensor(heads, device)[:, None] * head_dim + torch.arange(head_dim, device=device)
    return idx.reshape(-1)


def _linear(norm_weight: torch.Tensor | None, eps: float):
    """``x @ w.T``, or with the block's input norm folded in (``fused_attn_norm``),
    ``rms_norm(x) @ w.T`` tile by tile (``methods.core.normtile``)."""
    if norm_weight is None:
        return F.linear
    return lambda x, w: norm_linear(x, norm_weight, eps, w)


def _post(t: torch.Tensor, head_dim: int, norm_weight, cos, sin) -> torch.Tensor:
    """Everything ``project`` does after the GEMM (head split, QK-norm, RoPE)."""
    t = t.unflatten(-1, (-1, head_dim))
    if norm_weight is not None:
        t = F.rms_norm(t, (head_dim,), norm_weight, NORM_EPS)
    return apply_rope(t, cos, sin) if cos is not None else t


class _UPipeFunction(torch.autograd.Function):
    """Forward and backward of the whole block (projections, stages, ``wo``) in one function.

    Backward never holds a full-head gradient of the pre-``wo`` output: each stage derives
    its own slice ``dy @ wo[:, stage]``; dx is accumulated in place with ``addmm_``.
    """

    @staticmethod
    def forward(ctx, x, wq, wk, wv, wo, qn, kn, cos, sin, block, xn=None, eps=0.0, docs=None):
        spec, group, kernel = block.spec, block.group, block.kernel
        mask = mask_keywords(docs=docs)
        b, n, _ = x.shape
        d, h = spec.head_dim, spec.n_heads
        lin = _linear(xn, eps)

        def project(x, w, head_dim, norm=None, c=None, s=None):
            return _post(lin(x, w), head_dim, norm, c, s)

        out = x.new_empty(b, n, h * d)
        out_heads = out.view(b, n, h, d)
        lses = []
        k = v = None
        for stage in block.stages:
            if stage.kv_heads is not None:
                k = v = None  # release the previous group's K/V before projecting the next
                k = comm.seq_to_head_(project(x, head_rows(wk, stage.kv_heads, d), d, kn, cos, sin), group)
                v = comm.seq_to_head_(project(x, head_rows(wv, stage.kv_heads, d), d), group)
            q = comm.seq_to_head_(project(x, head_rows(wq, stage.q_heads, d), d, qn, cos, sin), group)
            o, lse = kernel.forward(q, k, v, spec.causal, block.scale, **mask)
            del q
            o = comm.head_to_seq_(o, group)
            out_heads.index_copy_(2, index_tensor(stage.q_heads, x.device), o)
            del o
            lses.append(lse)
        del k, v
        ctx.block, ctx.eps, ctx.fused, ctx.mask = block, eps, xn is not None, mask
        ctx.save_for_backward(x, out, wq, wk, wv, wo, qn, kn, cos, sin, xn, *lses)
        return F.linear(out, wo)

    @staticmethod
    def backward(ctx, dy):
        block = ctx.block
        spec, group, kernel = block.spec, block.group, block.kernel
        x, out, wq, wk, wv, wo, qn, kn, cos, sin, xn, *lses = ctx.saved_tensors
        xn = xn if ctx.fused else None
        lin = _linear(xn, ctx.eps)

        def project(x, w, head_dim, norm=None, c=None, s=None):
            return _post(lin(x, w), head_dim, norm, c, s)

        d = spec.head_dim
        b, n, dim = x.shape
        x2, dy2 = x.reshape(-1, dim), dy.reshape(-1, dim)
        out_heads = out.view(b, n, spec.n_heads, d)
        dx = torch.zeros_like(x)
        dx2 = dx.view(-1, dim)
        dwq, dwk, dwv = torch.zeros_like(wq), torch.zeros_like(wk), torch.zeros_like(wv)
        dwo = torch.mm(dy2.t(), out.reshape(-1, out.shape[-1]))
        dqn = torch.zeros_like(qn) if qn is not None else None
        dkn = torch.zeros_like(kn) if kn is not None else None

        def backprop(weight_rows, heads, dweight, norm, dnorm, rope, grad_pre):
            """Recompute ``post(x @ w.T)`` under autograd, push ``grad_pre`` through it, and
            accumulate the GEMM's gradients by hand (``addmm_`` into dx: no dx-sized temporary)."""
            t = lin(x, weight_rows).requires_grad_()
            norm_leaf = None if norm is None else norm.detach().requires_grad_()
            with torch.enable_grad():
                pre = _post(t, d, norm_leaf, *(rope if rope else (None, None)))
            grads = torch.autograd.grad(pre, [t] + ([norm_leaf] if norm_leaf is not None else []), grad_pre)
            dt = grads[0].reshape(-1, weight_rows.shape[0])
            dx2.addmm_(dt, weight_rows)
            wgrad = torch.mm(dt.t(), x2) if xn is None else norm_weight_grad(x, xn, ctx.eps, dt)
            dweight.index_add_(0, _rows(heads, d, x.device), wgrad)
            if dnorm is not None:
                dnorm.add_(grads[1])

        stages = block.stages
        for s, stage in enumerate(stages):
            if stage.kv_heads is not None:
                kv_heads = stage.kv_heads
                wk_rows, wv_rows = head_rows(wk, kv_heads, d), head_rows(wv, kv_heads, d)
                k = comm.seq_to_head_(project(x, wk_rows, d, kn, cos, sin), group)
                v = comm.seq_to_head_(project(x, wv_rows, d), group)
                dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            heads = index_tensor(stage.q_heads, x.device)
            wq_rows = head_rows(wq, stage.q_heads, d)
            q = comm.seq_to_head_(project(x, wq_rows, d, qn, cos, sin), group)
            o = comm.seq_to_head_(out_heads.index_select(2, heads), group)
            wo_cols = wo[:, _rows(stage.q_heads, d, x.device)]
            do = comm.seq_to_head_(torch.mm(dy2, wo_cols).view(b, n, -1, d), group)
            dq, dk_s, dv_s = kernel.backward(do, q, k, v, o, lses[s], spec.causal, block.scale, **ctx.mask)
            del q, o, do
            dk.add_(dk_s)
            dv.add_(dv_s)
            del dk_s, dv_s
            dq = comm.head_to_seq_(dq, group)  # rebinding drops the head-layout copy first
            backprop(wq_rows, stage.q_heads, dwq, qn, dqn, (cos, sin), dq)
            del dq
            if s + 1 == len(stages) or stages[s + 1].kv_heads is not None:  # end of a KV group
                del k, v
                dk = comm.head_to_seq_(dk, group)
                backprop(wk_rows, kv_heads, dwk, kn, dkn, (cos, sin), dk)
                del dk
                dv = comm.head_to_seq_(dv, group)
                backprop(wv_rows, kv_heads, dwv, None, None, None, dv)
                del dv
        dxn = norm_backward_(x, xn, ctx.eps, dx) if xn is not None else None  # dx: d(norm(x)) -> dx
        return dx, dwq, dwk, dwv, dwo, dqn, dkn, None, None, None, dxn, None, None


@register(
    "upipe",
    "UPipe / Untied Ulysses: Ulysses in stages of U heads, GQA-aware, recomputing per stage",
    facts=MethodFacts(column="upipe", reference=True, paper_code=True, simulates=(PaperRun("upipe", max_gpus=8),)),
)
class UPipe(AttentionMethod):
    Options = UPipeOptions
    honours_documents: ClassVar[bool] = True
    rank_symmetric_reason = ("each stage's all-to-all gives every rank the whole sequence on its heads of the "
                             "stage, so every rank allocates the same shapes in the same order")

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: UPipeOptions) -> None:
        super().validate(spec, world_size, options)
        rep = cls.check_head_split(spec, world_size, "upipe")
        u = cls.chunk_heads_for(spec, world_size, options)
        c, h = world_size, spec.n_heads
        if u % c:
            lower = max(c, u - u % c)
            raise ValueError(
                f"upipe: chunk_heads={u} is not a multiple of the world size {c}: every rank attends "
                f"U/C heads per stage; use chunk_heads={lower} or {lower + c}"
            )
        if u <= 0 or u > h or h % u:
            divisors = [k * c for k in range(1, h // c + 1) if h % (k * c) == 0]
            raise ValueError(
                f"upipe: chunk_heads={u} must divide n_heads={h} (stages of equal size); "
                f"valid values at world size {c}: {divisors}"
            )
        qr, ge = u // c, h // (spec.n_kv_heads * rep)
        if ge % qr and qr % ge:
            raise ValueError(
                f"upipe: chunk_heads/world_size={qr} query heads per rank and {ge} query heads per "
                f"KV head must divide one another for the GQA-aware schedule; pick chunk_heads "
                f"so that {qr} divides {ge} or is a multiple of it"
            )

    @staticmethod
    def chunk_heads_for(spec: AttnSpec, world_size: int, options: UPipeOptions) -> int:
        return world_size if options.chunk_heads is None else int(options.chunk_heads)

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        self.chunk_heads = self.chunk_heads_for(spec, self.world_size, self.options)
        self.stages = plan_stages(spec, self.world_size, self.chunk_heads)

    @classmethod
    def activation_bytes(
        cls, spec: AttnSpec, seq_len: int, world_size: int, options: UPipeOptions,
        batch: int = 1, dtype_bytes: int = 2,
    ) -> int:
        """``M_upipe`` of the module docstring (the memory model the simulation is checked against)."""
        c, h = world_size, spec.n_heads
        u = cls.chunk_heads_for(spec, c, options)
        ge = h // (spec.n_kv_heads * (c // spec.n_kv_heads if spec.n_kv_heads < c else 1))
        qr = u // c
        kr = 1 if qr <= ge else qr // ge
        unit = dtype_bytes * batch * seq_len * spec.head_dim
        local_x = dtype_bytes * batch * (seq_len // c) * spec.dim
        return (h // c) * unit + local_x + (6 * kr + 4 * qr) * unit + 4 * batch * seq_len * h // c

    accepts_input_norm = True  # forward(x, ..., input_norm=(weight, eps)): fused_attn_norm

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                input_norm: tuple[torch.Tensor, float] | None = None, docs: Documents | None = None) -> torch.Tensor:
        """``input_norm=(weight, eps)``: ``x`` is the block input before its RMSNorm, which runs
        inside the block tile by tile (``methods.core.normtile``): the normed input never exists."""
        cos, sin = self.rope_for(x, positions, docs)
        return upipe_block(self, x, cos, sin, self, input_norm, docs)


def upipe_block(params, x: torch.Tensor, cos, sin, schedule,
                input_norm: tuple[torch.Tensor, float] | None = None, docs: Documents | None = None) -> torch.Tensor:
    """The whole UPipe block with ``params``' weights. ``schedule`` supplies ``spec``, ``group``
    (the head all-to-all group), ``kernel`` (any ``kernels.Kernel``, e.g. a ring), ``scale``
    and ``stages``: a ``UPipe`` module is its own schedule; ``usp-upipe`` passes its own.
    ``input_norm``: ``(weight, eps)`` of an RMSNorm applied to ``x`` inside the block. ``docs``:
    the documents, handed to every kernel call (which then sees the whole sequence in order)."""
    norm_weight, eps = input_norm if input_norm is not None else (None, 0.0)
    return _UPipeFunction.apply(
        x, params.wq.weight, params.wk.weight, params.wv.weight, params.wo.weight,
        params.q_norm_weight, params.k_norm_weight, cos, sin, schedule, norm_weight, eps, docs,
    )
