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

Activation memory of the attention block (per rank, batch B, bytes per element b, local
tokens n = S/C, full sequence S, head dim d, dim D; fp32 LSE; what a caching allocator
holds at the peak of forward+backward, x and dy excluded). Ulysses keeps Q/K/V/O and the
all-to-all copies of all heads alive:

    M_ulysses ~ b*B*n*d*(2*H + 2*G_e)            saved: q, k, v (head layout), out
              + b*B*n*d*(H + 2*G_e) + ...         the seq-layout copies alive while exchanging
    (peak in backward: saved q, k, v, out + dout, dq, dk, dv in head layout + exchange buffers)

UPipe keeps the pre-``wo`` output (``b*B*n*H*d``) plus one stage's buffers:

    M_upipe  ~ b*B*n*H*d                                  out (saved, sequence layout)
             + b*B*S*d*(q_r + ... )                       one stage's q/o/do/dq, head layout
             + (b + 4)*B*S*k_r*d * 2                      the group's k/v and fp32 dk/dv sums

The exact per-term accounting used by the memory test is ``activation_bytes`` below;
the per-stage intermediate reduction of the paper is 1 - U/H (75% for H=32, 87.5% for
H=64 at U = C = 8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm
from .base import AttentionMethod, MethodOptions, head_rows, project
from .registry import register
from .spec import AttnSpec


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
    idx = torch.tensor(heads, device=device)[:, None] * head_dim + torch.arange(head_dim, device=device)
    return idx.reshape(-1)


class _UPipeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wk, wv, qn, kn, cos, sin, block):
        spec, group, kernel = block.spec, block.group, block.kernel
        b, n, _ = x.shape
        d, h = spec.head_dim, spec.n_heads
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
            o, lse = kernel.forward(q, k, v, spec.causal, block.scale)
            del q
            o = comm.head_to_seq_(o, group)
            out_heads.index_copy_(2, torch.tensor(stage.q_heads, device=x.device), o)
            del o
            lses.append(lse)
        del k, v
        ctx.block = block
        ctx.has_qn, ctx.has_kn = qn is not None, kn is not None
        ctx.save_for_backward(x, out, wq, wk, wv, qn, kn, cos, sin, *lses)
        return out

    @staticmethod
    def backward(ctx, dout):
        block = ctx.block
        spec, group, kernel = block.spec, block.group, block.kernel
        x, out, wq, wk, wv, qn, kn, cos, sin, *lses = ctx.saved_tensors
        d = spec.head_dim
        b, n, _ = x.shape
        out_heads = out.view(b, n, spec.n_heads, d)
        dout_heads = dout.reshape(b, n, spec.n_heads, d)
        dx = torch.zeros_like(x)
        dwq, dwk, dwv = torch.zeros_like(wq), torch.zeros_like(wk), torch.zeros_like(wv)
        dqn = torch.zeros_like(qn) if qn is not None else None
        dkn = torch.zeros_like(kn) if kn is not None else None

        def leaf(t):
            return None if t is None else t.detach().requires_grad_()

        def accumulate(outputs, grads, weight_leaf, heads, dweight, norm_leaf, dnorm):
            inputs = [x_leaf, weight_leaf] + ([norm_leaf] if norm_leaf is not None else [])
            got = torch.autograd.grad(outputs, inputs, grads)
            dx.add_(got[0])
            dweight.index_add_(0, _rows(heads, d, x.device), got[1])
            if norm_leaf is not None:
                dnorm.add_(got[2])

        stages = block.stages
        for s, stage in enumerate(stages):
            x_leaf = leaf(x) if stage.kv_heads is not None else x_leaf
            if stage.kv_heads is not None:
                kv_heads = stage.kv_heads
                wk_leaf, wv_leaf, kn_leaf = leaf(head_rows(wk, kv_heads, d)), leaf(head_rows(wv, kv_heads, d)), leaf(kn)
                with torch.enable_grad():
                    k_pre = project(x_leaf, wk_leaf, d, kn_leaf, cos, sin)
                    v_pre = project(x_leaf, wv_leaf, d)
                k = comm.seq_to_head_(k_pre.detach(), group)
                v = comm.seq_to_head_(v_pre.detach(), group)
                dk = torch.zeros_like(k, dtype=torch.float32)
                dv = torch.zeros_like(v, dtype=torch.float32)
            heads = torch.tensor(stage.q_heads, device=x.device)
            wq_leaf, qn_leaf = leaf(head_rows(wq, stage.q_heads, d)), leaf(qn)
            with torch.enable_grad():
                q_pre = project(x_leaf, wq_leaf, d, qn_leaf, cos, sin)
            q = comm.seq_to_head_(q_pre.detach(), group)
            o = comm.seq_to_head_(out_heads.index_select(2, heads), group)
            do = comm.seq_to_head_(dout_heads.index_select(2, heads), group)
            dq, dk_s, dv_s = kernel.backward(do, q, k, v, o, lses[s], spec.causal, block.scale)
            del q, o, do
            dk.add_(dk_s)
            dv.add_(dv_s)
            del dk_s, dv_s
            dq = comm.head_to_seq_(dq, group)
            accumulate(q_pre, dq, wq_leaf, stage.q_heads, dwq, qn_leaf, dqn)
            del dq, q_pre
            last_of_group = s + 1 == len(stages) or stages[s + 1].kv_heads is not None
            if last_of_group:
                dk_pre = comm.head_to_seq_(dk.to(k.dtype), group)
                dv_pre = comm.head_to_seq_(dv.to(v.dtype), group)
                del k, v, dk, dv
                accumulate(k_pre, dk_pre, wk_leaf, kv_heads, dwk, kn_leaf, dkn)
                accumulate(v_pre, dv_pre, wv_leaf, kv_heads, dwv, None, None)
                del dk_pre, dv_pre, k_pre, v_pre
        return dx, dwq, dwk, dwv, dqn, dkn, None, None, None


@register(
    "upipe",
    "UPipe / Untied Ulysses: Ulysses in stages of U heads, GQA-aware, recomputing per stage",
)
class UPipe(AttentionMethod):
    Options = UPipeOptions

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

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self.rope_for(x, positions)
        out = _UPipeFunction.apply(
            x, self.wq.weight, self.wk.weight, self.wv.weight,
            self.q_norm_weight, self.k_norm_weight, cos, sin, self,
        )
        return self.wo(out)
