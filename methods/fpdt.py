"""FPDT-style attention: Ulysses over a pipeline of sequence chunks with K/V in host memory.

After "Fully Pipelined Distributed Transformer" (FPDT, Yao et al. 2024). Ulysses gives each of
C ranks all S tokens of H/C heads; FPDT does the same, but one sequence chunk at a time, so
that only a chunk's Q/K/V/O are on the device at once and the rest wait in host memory.

Chunk count. K chunks per rank, either fixed (``num_chunks``) or set by a chunk size
(``chunk_tokens``: K = S / chunk_tokens, so that every segment below has ``chunk_tokens``
tokens). The second is DeepSpeed FPDT's own knob (``--ds-sequence-parallel-fpdt-chunk-size``;
``deepspeed/sequence/fpdt_layer.py``: ``num_chunk_per_gpu = global_seq_len // chunk_size``),
and the paper's FPDT runs set it to 65,536 (docs/paper.md, "FPDT"): 2 chunks per rank at
128K, 64 at 4M. The number of chunks decides how much of the sequence is on the device at once
and how many exchanges and host round trips a step makes.

Token layout (``shard``/``unshard``: FPDT's own, ``layouts.cyclic_shard``). The sequence is
cut into C*K chunks of ``S/(C*K)`` tokens (K chunks per rank, above); global chunk ``c`` lives on
rank ``c % C``, so rank r holds chunks ``r, r+C, ..., r+(K-1)C`` (K non-contiguous pieces, in
that order). The sequence->head all-to-all of every rank's local chunk i then yields the *contiguous* global
segment i (chunks ``iC .. iC+C-1``) for H/C heads. That is what makes the pipeline work:
segment i attends causally to itself and fully to segments < i, so it can be computed as
soon as segments 0..i are projected, and the K(K-1)/2 blocks above the diagonal are skipped.
(With Ulysses' contiguous layout the i-th local chunks of all ranks would form a scattered
set of tokens that needs every other segment under a token-level mask.) Work is balanced
as in Ulysses: after the all-to-all every rank attends all tokens of its H/C heads, and
each pipeline step is the same work on every rank.

Forward, per segment i (causal): project chunk i's K/V, exchange them and put them in the
store (host memory when ``offload``: pinned, copied on a side stream on CUDA); project and
exchange chunk i's Q; attend it to K/V segments 0..i (the older ones fetched back from the
store, the next one prefetched while the current one is used), merging the partial results
with online softmax in fp32 (``kernels.merge_partials``); exchange the output back. Without
causality every segment's K/V is produced first, then each Q segment attends to all.

Backward (custom autograd function). Saved: the block input, and in the store each
segment's Q, K, V, output, LSE and (at the start of backward) output gradient. For each
K/V segment j: reload it, and for every Q segment i that attended to it, reload
``q_i, o_i, do_i, lse_i``, run the kernel backward of the (i, j) block (the final ``o_i``
and ``lse_i`` make each block's partial gradients exact), accumulate dK/dV of segment j
in fp32 and dQ of segment i in an fp32 accumulator kept in the store. When segment j's
dK/dV (or segment i's dQ) is complete it is exchanged back and pushed through a
recomputed projection of that chunk only (so RoPE and QK-norm are differentiated exactly).
Attention is only ever materialised for one (i, j) block.

UPipe's head stages inside the pipeline (``chunk_heads`` = U > 0; issue 18's "UPipe stages that
also chunk the sequence"). The whole pipeline above runs once per stage of U query heads, with
UPipe's GQA-aware schedule (``upipe.plan_stages``: a stage projects and exchanges the K/V heads of
its group, or reuses the previous stage's; U a multiple of C), so a chunk on the device holds U/C
heads instead of H/C. Store keys carry the stage (Q/O/LSE/dO/dQ) or the K/V group (K/V); the
backward takes the K/V groups one at a time, accumulating a segment's dK/dV over the group's
stages before exchanging it back. U = 0 (default) is FPDT: one stage of every head.

The block's RMSNorm inside the method (``fused_attn_norm``; ``forward(..., input_norm=(w, eps))``,
as ``upipe``): the function saves the block input, and each chunk is normed as it is projected
(forward) or re-projected (backward, under autograd, so the norm weight's gradient comes out of
the same recomputation); the normed input never exists at full length, one chunk of it at most.

Packed documents (``docs=``). Segment i holds global positions ``[i*S/K, (i+1)*S/K)`` in order,
so a document may cross segment boundaries: every (i, j) block is one kernel call with the
documents, its keys at global position ``j*S/K`` and its queries ``(i - j)*S/K`` after them (the
kernels' masking rule); a query row with no key of its document in segment j gets an LSE of
``-inf`` there, which the merge keeps as an empty set. Blocks above the diagonal are still
skipped under a causal mask.

The store is ``chunkstore.ChunkStore``: on CPU, host memory is where tensors already live,
so offloading keeps them as they are and the side stream is a no-op; the code path (and the
store's bookkeeping, which the tests read) is the same.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .core import comm, events
from .core.base import AttentionMethod, MethodOptions, head_rows, index_tensor, project
from .core.chunkstore import ChunkStore
from .core.documents import Documents
from .core.kernels import mask_keywords, merge_partials
from .core.layouts import cyclic_shard, cyclic_unshard
from .core.registry import MethodFacts, PaperRun, register
from .core.spec import AttnSpec
from .core.tiling import counting_as, repeated
from .ulysses import replicated_kv_heads
from .upipe import Stage, UPipe, UPipeOptions, plan_stages


@dataclass(frozen=True)
class FPDTOptions(MethodOptions):
    num_chunks: int = 2  # K: chunks per rank (the pipeline's depth), when chunk_tokens is 0
    offload: bool = True  # keep Q/K/V/O/LSE chunks in host memory between uses
    chunk_tokens: int = 0  # > 0: K = S / chunk_tokens (DeepSpeed's FPDT chunk size; the paper: 65536)
    chunk_heads: int = 0  # U > 0: UPipe's head stages inside the pipeline (U query heads at a time); 0: all heads

    def chunks_per_rank(self, seq_len: int) -> int:
        """K at global length ``seq_len`` (``chunk_tokens`` when set, else ``num_chunks``)."""
        return chunks_per_rank(self, seq_len)


def chunks_per_rank(options: MethodOptions, seq_len: int) -> int:
    """K at global length ``seq_len``: ``FPDTOptions.chunks_per_rank``, or ``num_chunks`` for a subclass's
    options without ``chunk_tokens`` (``ds-fpdt``)."""
    tokens = getattr(options, "chunk_tokens", 0)
    return seq_len // tokens if tokens else options.num_chunks


def _no_store() -> None:
    return None


# ----------------------------------------------------------------------- autograd function
def _normed(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The projections' input for a chunk ``x`` of the block input: ``x`` itself, or with the
    block's RMSNorm folded in (``fused_attn_norm``) that norm of the chunk alone, so that the
    normed input never exists at full length (as ``bench.model.decoder``'s RMSNorm computes it)."""
    return x if norm_weight is None else F.rms_norm(x, (x.shape[-1],), norm_weight, eps)


def _segment_mask(causal: bool, i: int, j: int, seg: int, docs: Documents | None) -> tuple[bool, dict]:
    """The causal flag and masking keywords of the kernel call of query segment i on K/V segment j
    (``seg`` tokens each): without documents only the diagonal block is causal; with them, the
    kernels' rule places both segments in the documents."""
    if docs is None:
        return causal and i == j, {}
    return causal, mask_keywords((i - j) * seg, docs, j * seg)


class _FPDTFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wk, wv, qn, kn, cos, sin, norm_weight, eps, block, docs=None):
        spec, group, kernel, scale = block.spec, block.group, block.kernel, block.scale
        b, n, _ = x.shape
        causal, chunks = spec.causal, block.chunks_for_local(n)
        d, cs = spec.head_dim, n // chunks
        seg = cs * block.world_size  # tokens of a segment after the all-to-all
        rows = [slice(i * cs, (i + 1) * cs) for i in range(chunks)]
        store = ChunkStore(x.device, block.options.offload)
        keep = any(ctx.needs_input_grad)
        out = x.new_empty(b, n, spec.n_heads, d)
        live: dict = {}  # the K/V segment just produced: used from the device, not re-fetched

        def produce_kv(g, i, wk_g, wv_g):
            sl = rows[i]
            xi = _normed(x[:, sl], norm_weight, eps)
            k = comm.seq_to_head_(project(xi, wk_g, d, kn, cos[sl], sin[sl]), group)
            v = comm.seq_to_head_(project(xi, wv_g, d), group)
            del xi
            store.put(("k", g, i), k)
            store.put(("v", g, i), v)
            live.clear()
            live[("k", g, i)], live[("v", g, i)] = k, v

        def fetch(key):
            return live[key] if key in live else store.get(key)

        def attend(s, g, i, kv_segments, wq_s, heads):
            sl = rows[i]
            q = comm.seq_to_head_(project(_normed(x[:, sl], norm_weight, eps), wq_s, d, qn, cos[sl], sin[sl]), group)
            acc = lse = None
            # the first segment starts the accumulator, the middle ones are alike, the last two differ (before
            # the diagonal nothing is prefetched, its K/V being live): what a compressing policy may skip
            run = repeated(len(kv_segments), tail=2)
            for r, (pos, weight) in enumerate(run):
                j = kv_segments[pos]
                if r + 1 < len(run):  # the next K/V segment travels while this one is used
                    following, following_weight = kv_segments[run[r + 1][0]], run[r + 1][1]
                    with counting_as(following_weight):
                        for name in ("k", "v"):
                            if (name, g, following) not in live:
                                store.prefetch((name, g, following))
                with counting_as(weight):
                    flag, mask = _segment_mask(causal, i, j, seg, docs)
                    o, lse_b = kernel.forward(q, fetch(("k", g, j)), fetch(("v", g, j)), flag, scale, **mask)
                    acc, lse = merge_partials(acc, lse, o, lse_b, may_be_empty=docs is not None)
                del o, lse_b
            o = acc.to(x.dtype)
            del acc
            if heads is None:
                out[:, sl] = comm.head_to_seq_(o, group)
            else:
                out[:, sl].index_copy_(2, heads, comm.head_to_seq_(o, group))
            if keep:
                store.put(("q", s, i), q)
                store.put(("o", s, i), o)
                store.put(("lse", s, i), lse)

        events.note(events.CHUNK_PASSES, chunks * len(block.stages))  # the step-time model's per-chunk cost
        g = -1
        for s, stage in enumerate(block.stages):
            new_group = stage.kv_heads is not None
            if new_group:
                g += 1
                wk_g, wv_g = head_rows(wk, stage.kv_heads, d), head_rows(wv, stage.kv_heads, d)
            wq_s = head_rows(wq, stage.q_heads, d)
            heads = None if block.single_stage else index_tensor(stage.q_heads, x.device)
            live.clear()
            if causal:
                for i in range(chunks):
                    if new_group:
                        produce_kv(g, i, wk_g, wv_g)
                    attend(s, g, i, list(range(i + 1)), wq_s, heads)
            else:
                if new_group:
                    for i in range(chunks):
                        produce_kv(g, i, wk_g, wv_g)
                live.clear()
                for i in range(chunks):
                    attend(s, g, i, list(range(chunks)), wq_s, heads)
        live.clear()

        block._last_store = weakref.ref(store)
        # the chunks go through save_for_backward, so that activation checkpointing frees them with the
        # block's other saved tensors (chunkstore.ChunkStore.hand_over); ctx keeps the emptied store
        ctx.store, ctx.block, ctx.eps, ctx.docs = store, block, eps, docs
        ctx.save_for_backward(x, wq, wk, wv, qn, kn, cos, sin, norm_weight, *store.hand_over())
        return out.flatten(2)

    @staticmethod
    def backward(ctx, dout):
        block, store, eps, docs = ctx.block, ctx.store, ctx.eps, ctx.docs
        spec, group, kernel, scale = block.spec, block.group, block.kernel, block.scale
        x, wq, wk, wv, qn, kn, cos, sin, norm_weight, *stored = ctx.saved_tensors
        store.take_back(stored)
        del stored
        b, n, _ = x.shape
        causal, chunks = spec.causal, block.chunks_for_local(n)
        d, cs = spec.head_dim, n // chunks
        seg = cs * block.world_size
        rows = [slice(i * cs, (i + 1) * cs) for i in range(chunks)]
        dout = dout.reshape(b, n, spec.n_heads, d)
        stages = block.stages
        events.note(events.CHUNK_PASSES, chunks * len(stages))
        for s, stage in enumerate(stages):
            heads = None if block.single_stage else index_tensor(stage.q_heads, x.device)
            for i in range(chunks):
                do = dout[:, rows[i]] if heads is None else dout[:, rows[i]].index_select(2, heads)
                store.put(("do", s, i), comm.seq_to_head_(do.contiguous(), group))
                del do
        del dout

        def leaf(t):
            return None if t is None else t.detach().requires_grad_()

        wq_l, wk_l, wv_l, qn_l, kn_l, nw_l = leaf(wq), leaf(wk), leaf(wv), leaf(qn), leaf(kn), leaf(norm_weight)
        dx = torch.zeros_like(x)
        grads = {name: torch.zeros_like(t, dtype=torch.float32) for name, t in
                 (("wq", wq), ("wk", wk), ("wv", wv), ("qn", qn), ("kn", kn), ("norm", norm_weight))
                 if t is not None}

        def through_projection(i, outputs, out_grads, leaves):
            """Push gradients of chunk i's projections (recomputed, with the folded norm if any)
            into dx and the weights."""
            sl = rows[i]
            x_l = x[:, sl].detach().requires_grad_()
            leaves = leaves + [("norm", nw_l)]
            with torch.enable_grad():
                xi = _normed(x_l, nw_l, eps)
                made = [f(xi, cos[sl], sin[sl]) for f in outputs]
            named = [(name, t) for name, t in leaves if t is not None]
            got = torch.autograd.grad(made, [x_l] + [t for _, t in named], out_grads)
            dx[:, sl] += got[0]
            for (name, _), g in zip(named, got[1:], strict=False):
                grads[name] += g

        # stages that share a K/V group, in order: the group's dK/dV gather over all of them
        groups: list[tuple[list[int], list[int]]] = []
        for s, stage in enumerate(stages):
            if stage.kv_heads is not None:
                groups.append((stage.kv_heads, []))
            groups[-1][1].append(s)

        for g, (kv_heads, members) in enumerate(groups):
            def k_proj(x_l, c, s_, kv_heads=kv_heads):
                return project(x_l, head_rows(wk_l, kv_heads, d), d, kn_l, c, s_)

            def v_proj(x_l, c, s_, kv_heads=kv_heads):
                return project(x_l, head_rows(wv_l, kv_heads, d), d)

            for j in range(chunks):
                k, v = store.get(("k", g, j)), store.get(("v", g, j))
                dk = torch.zeros_like(k, dtype=torch.float32)
                dv = torch.zeros_like(v, dtype=torch.float32)
                q_segments = list(range(j, chunks)) if causal else list(range(chunks))
                work = [(s, i) for s in members for i in q_segments]
                # the middle items (between the first and the last, after which nothing is prefetched) are alike
                # with one stage, past the first K/V segment (by then every segment's partial dQ is in the store),
                # where only the first item completes a dQ (causal: the diagonal; without a mask every item
                # completes one at the last segment): then a compressing policy may skip them
                alike = len(members) == 1 and j >= 1 and (causal or j < chunks - 1)
                run = repeated(len(work), tail=1, alike=alike)
                for r, (pos, weight) in enumerate(run):
                    s, i = work[pos]
                    if r + 1 < len(run):
                        with counting_as(run[r + 1][1]):
                            for name in ("q", "o", "do", "lse", "dq"):
                                store.prefetch((name, *work[run[r + 1][0]]))
                    with counting_as(weight):
                        q, o, do, lse = (store.get((name, s, i)) for name in ("q", "o", "do", "lse"))
                        flag, mask = _segment_mask(causal, i, j, seg, docs)
                        dq_ij, dk_ij, dv_ij = kernel.backward(do, q, k, v, o, lse, flag, scale, **mask)
                        del q, o, do, lse
                        dk += dk_ij
                        dv += dv_ij
                        dq = store.get(("dq", s, i)) + dq_ij if ("dq", s, i) in store else dq_ij.float()
                        del dk_ij, dv_ij, dq_ij
                        last_kv = i if causal else chunks - 1
                        if j == last_kv:  # segment i's dQ of stage s is complete: exchange it back and project
                            for name in ("q", "o", "do", "lse", "dq"):
                                store.pop((name, s, i))
                            dq = comm.head_to_seq_(dq.to(x.dtype), group)
                            q_heads = stages[s].q_heads

                            def q_proj(x_l, c, s_, q_heads=q_heads):
                                return project(x_l, head_rows(wq_l, q_heads, d), d, qn_l, c, s_)

                            through_projection(i, [q_proj], [dq], [("wq", wq_l), ("qn", qn_l)])
                        else:
                            store.put(("dq", s, i), dq)
                        del dq
                store.pop(("k", g, j))
                store.pop(("v", g, j))
                del k, v
                dk = comm.head_to_seq_(dk.to(x.dtype), group)
                dv = comm.head_to_seq_(dv.to(x.dtype), group)
                through_projection(j, [k_proj, v_proj], [dk, dv], [("wk", wk_l), ("wv", wv_l), ("kn", kn_l)])
                del dk, dv

        ctx.store = None

        def cast(name, like):
            return None if like is None else grads[name].to(like.dtype)

        return (dx, cast("wq", wq), cast("wk", wk), cast("wv", wv), cast("qn", qn), cast("kn", kn),
                None, None, cast("norm", norm_weight), None, None, None)


@register(
    "fpdt",
    "FPDT-style: Ulysses over a pipeline of sequence chunks, online softmax, K/V in host memory",
    # the paper's FPDT ran in Megatron-DeepSpeed (DeepSpeed's, ds-fpdt), whose offload path cannot be
    # simulated: ours stands for it, at the paper's chunk (--ds-sequence-parallel-fpdt-chunk-size 65536)
    facts=MethodFacts(column="fpdt", reference=True, torchtitan=False,
                      simulates=(PaperRun("fpdt", {"chunk_tokens": 65536}),)),
)
class FPDT(AttentionMethod):
    Options = FPDTOptions
    honours_documents: ClassVar[bool] = True
    rank_symmetric_reason = ("each chunk's all-to-all gives every rank that chunk of the whole sequence on H/C "
                             "heads, chunk after chunk, so every rank allocates the same shapes in the same order")

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: FPDTOptions) -> None:
        super().validate(spec, world_size, options)
        cls.check_head_split(spec, world_size, cls.method_name)
        cls.check_num_chunks(options.num_chunks)
        cls.check_chunk_tokens(options, world_size)
        cls.check_chunk_heads(spec, world_size, options)

    @classmethod
    def check_chunk_heads(cls, spec: AttnSpec, world_size: int, options: FPDTOptions) -> None:
        """U = 0 (FPDT's one stage), or a stage size UPipe itself accepts (its checks, as usp-upipe runs them)."""
        u = getattr(options, "chunk_heads", 0)
        if isinstance(u, bool) or not isinstance(u, int) or u < 0:
            raise ValueError(
                f"{cls.method_name}: chunk_heads={u!r} must be 0 (all heads at once) or UPipe's stage size U "
                f"(a multiple of the world size {world_size} that divides n_heads={spec.n_heads})"
            )
        if u:
            try:
                UPipe.validate(spec, world_size, UPipeOptions(chunk_heads=u))
            except ValueError as err:
                raise ValueError(f"{cls.method_name}: chunk_heads runs UPipe's head stages; {err}") from None

    @classmethod
    def check_chunk_tokens(cls, options: FPDTOptions, world_size: int) -> None:
        t = options.chunk_tokens
        if t < 0 or (t and t % world_size):
            raise ValueError(
                f"{cls.method_name}: chunk_tokens={t} must be 0 (use num_chunks) or a positive multiple of the "
                f"world size {world_size} (each rank holds chunk_tokens / {world_size} tokens of a chunk)"
            )
        if t and options.num_chunks != FPDTOptions.num_chunks:
            raise ValueError(
                f"{cls.method_name}: give num_chunks or chunk_tokens, not both (chunk_tokens={t} sets the chunks "
                f"per rank to seq_len / {t}; num_chunks={options.num_chunks} fixes them)"
            )

    @classmethod
    def check_num_chunks(cls, k) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"{cls.method_name}: num_chunks={k!r} must be an int >= 1 (chunks per rank; "
                "1 is plain Ulysses, more chunks keep less of the sequence on the device)"
            )

    @classmethod
    def seq_multiple(cls, world_size: int, options: FPDTOptions) -> int:
        return getattr(options, "chunk_tokens", 0) or world_size * options.num_chunks

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        self.kv_heads = replicated_kv_heads(spec, self.check_head_split(spec, self.world_size, self.method_name))
        u = getattr(self.options, "chunk_heads", 0)
        # one stage of every head (FPDT), or UPipe's GQA-aware stages of U heads
        self.stages = plan_stages(spec, self.world_size, u) if u else [Stage(list(range(spec.n_heads)), self.kv_heads)]
        self.single_stage = not u
        self._last_store = _no_store

    # -- layout: global chunk c on rank c % C (cyclic)
    def shard(self, x: torch.Tensor, dim: int, docs: Documents | None = None) -> torch.Tensor:
        self.check_documents(docs, x.shape[dim])
        self.check_seq_len(x.shape[dim], self.world_size, self.options)
        return cyclic_shard(x, dim, self.rank, self.world_size, chunks_per_rank(self.options, x.shape[dim]))

    def unshard(self, x: torch.Tensor, dim: int, docs: Documents | None = None) -> torch.Tensor:
        self.check_documents(docs, x.shape[dim] * self.world_size)
        return cyclic_unshard(x, dim, self.group, self.chunks_for_local(x.shape[dim]))

    def chunks_for_local(self, n: int) -> int:
        """K for a local sequence of ``n`` tokens (the global length is ``n`` times the world size)."""
        return chunks_per_rank(self.options, n * self.world_size)

    @property
    def last_store(self) -> ChunkStore | None:
        """The chunk store of the latest forward while its autograd graph is alive (for tests)."""
        return self._last_store()

    def check_local_len(self, n: int) -> None:
        k = self.chunks_for_local(n)
        tokens = getattr(self.options, "chunk_tokens", 0)
        if k < 1 or n % k or (tokens and n * self.world_size % tokens):  # chunks of exactly chunk_tokens
            what = f"chunk_tokens={tokens} ({k} chunks per rank)" if tokens else f"num_chunks={k}"
            raise ValueError(
                f"{self.method_name}: local sequence length {n} cannot be cut into {what}; shard a sequence "
                f"whose length is a multiple of {self.seq_multiple(self.world_size, self.options)}"
            )

    accepts_input_norm = True  # forward(x, ..., input_norm=(weight, eps)): fused_attn_norm

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                input_norm: tuple[torch.Tensor, float] | None = None, docs: Documents | None = None) -> torch.Tensor:
        """``input_norm=(weight, eps)``: ``x`` is the block input before its RMSNorm, which runs on
        each chunk as the chunk is projected (forward) or re-projected (backward), so the normed
        input never exists at full length (``fused_attn_norm``)."""
        self.check_local_len(x.shape[1])
        cos, sin = self.rope_for(x, positions, docs)
        norm_weight, eps = input_norm if input_norm is not None else (None, 0.0)
        out = _FPDTFunction.apply(
            x, self.wq.weight, self.wk.weight, self.wv.weight,
            self.q_norm_weight, self.k_norm_weight, cos, sin, norm_weight, eps, self, docs,
        )
        return self.wo(out)
