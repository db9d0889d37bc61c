"""A Llama-style decoder whose attention is any registered context-parallel method.

Architecture (Llama 3): token embedding, ``n_layers`` pre-norm blocks
``h = x + attention(rms_norm(x)); y = h + w2(silu(w1 rms_norm(h)) * w3 rms_norm(h))``,
a final RMSNorm and an LM head, untied unless the config ties it to the embedding
(``tie_word_embeddings``: one parameter serves both, as in Transformers). The attention
block, with its GQA projections, optional QK-norm and RoPE, is built by
``methods.build(method, spec, group, **options)``, so RoPE uses the global positions of the
method's sequence layout. Weights are random (no download): the suite measures memory and speed, not quality.

The tiled MLP and the chunked loss can also run through DeepSpeed's ALST autograd functions
(``impl="deepspeed"``, see ``deepspeed_tiled``) around the same weights, so that our
implementations can be checked against, and measured beside, the ones the paper's stack uses.
"""
from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

import methods
from methods.core.documents import Documents
from methods.core.rope import rope_table
from methods.core.tiling import compressing, run_tiles, tile_bounds

from .config import ModelConfig
from .dstiled import TiledMLPStandIn

# --------------------------------------------------------------------------- layers


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def norm_mlp(x, norm_w, eps, w1, w2, w3):
    """``swiglu(rms_norm(x))``: the MLP half of a block without its residual."""
    return swiglu(F.rms_norm(x, (x.shape[-1],), norm_w, eps), w1, w2, w3)


def norm_mlp_fn(x, norm_w, w1, w2, w3, eps):
    return norm_mlp(x, norm_w, eps, w1, w2, w3)


class _Tiled(torch.autograd.Function):
    """``fn(x, *weights)`` (shape-preserving, token-wise) over sequence tiles, saving only inputs.

    Forward runs tile by tile without autograd; backward recomputes each tile under autograd,
    so the full-sequence intermediates of ``fn`` never exist (only one tile's at a time).
    Weight gradients are accumulated over tiles.
    """

    @staticmethod
    def forward(ctx, fn, tiles, x, *weights):
        out = torch.empty_like(x)
        bounds = tile_bounds(x.shape[1], tiles)
        for i in run_tiles([length for _, length in bounds]):
            start, length = bounds[i]
            out.narrow(1, start, length).copy_(fn(x.narrow(1, start, length), *weights))
        ctx.save_for_backward(x, *weights)
        ctx.fn, ctx.tiles = fn, tiles
        return out

    @staticmethod
    def backward(ctx, dout):
        x, *weights = ctx.saved_tensors
        dx = torch.empty_like(x)
        grads: list[torch.Tensor | None] = [None] * len(weights)
        bounds = tile_bounds(x.shape[1], ctx.tiles)
        for i in run_tiles([length for _, length in bounds]):
            start, length = bounds[i]
            leaf = x.narrow(1, start, length).detach().requires_grad_()
            wl = [w.detach().requires_grad_() for w in weights]
            with torch.enable_grad():
                y = ctx.fn(leaf, *wl)
            g = torch.autograd.grad(y, [leaf] + wl, dout.narrow(1, start, length))
            del y
            dx.narrow(1, start, length).copy_(g[0])
            for j, gj in enumerate(g[1:]):
                grads[j] = gj if grads[j] is None else grads[j].add_(gj)
            del g, gj, leaf, wl  # else the next tile's gradients coexist with this tile's
        return (None, None, dx, *grads)


def deepspeed_tiled():
    """DeepSpeed's ALST module (``TiledMLP``, ``TiledFusedLogitsLoss``), imported on first use.

    Lazily, because DeepSpeed is optional and slow to import; outside any FakeTensorMode,
    because simulation builds and runs the model under one and an import must not create its
    module-level tensors as fake ones. Neither function communicates, so ``deepspeed.comm``
    need not be initialised (and its CPU shared-memory op is never built). Its import-time log
    lines ("Setting accelerator to CPU") go to stderr: DeepSpeed's logger writes to the stdout
    of its import, and stdout is where ``python -m bench`` prints its table and JSON rows.
    """
    with unset_fake_temporarily(), contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.sequence_parallel import ulysses_sp
    return ulysses_sp


def auto_tiles(local_len: int, dim: int) -> int:
    """The paper's (ALST) tile count: ``ceil(local tokens / dim)``."""
    return max(1, math.ceil(local_len / dim))


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that can run tiled over the sequence (``tiles``: None/1 plain, 0 auto).

    Tiling matters beyond memory savings: on CPU (and so under simulation) ``F.rms_norm``
    is a composite whose backward holds several fp32 copies of its input, where CUDA runs
    one fused kernel; tiled, those temporaries are one tile's.
    """

    tiles: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = 1 if self.tiles is None else (auto_tiles(x.shape[1], x.shape[-1]) if self.tiles == 0
                                          else min(self.tiles, x.shape[1]))
        if n <= 1 or x.dim() != 3 or not torch.is_grad_enabled():
            return super().forward(x)
        return _Tiled.apply(partial(_rms, eps=self.eps), n, x, self.weight)


def _rms(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class FeedForward(nn.Module):
    """SwiGLU MLP with its pre-norm; ``tiles`` > 1: tiled over the sequence (recomputing).

    ``impl`` says whose tiling runs: ``ours`` (``_Tiled``, weights passed as inputs and their
    gradients returned) or ``deepspeed`` (``TiledMLP``, which calls ``plain(self, tile)`` and
    lets autograd accumulate into the weights' ``.grad`` tile by tile). DeepSpeed cuts tiles
    with ``torch.chunk`` (sizes ``ceil(n / tiles)``, possibly fewer of them) where ours cuts
    ``tensor_split``'s near-equal ones; the function is token-wise, so the result is the same.
    A simulation (``compressing``) runs DeepSpeed's tiles through ``dstiled.TiledMLPStandIn``, which
    replays its identical middle tiles to the same figures.
    """

    def __init__(self, dim: int, ffn_dim: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=eps)  # applied inside the (tiled) MLP
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.eps = eps
        self.tiles: int | None = None  # None/1: plain autograd; 0: auto (ceil(local tokens / dim))
        self.impl = "ours"  # whose tiling: ours | deepspeed

    def n_tiles(self, local_len: int) -> int:
        if self.tiles is None:
            return 1
        if self.tiles == 0:
            return auto_tiles(local_len, self.w1.in_features)
        return max(1, min(self.tiles, local_len))

    def weights(self) -> list[torch.Tensor]:
        return [self.norm.weight, self.w1.weight, self.w2.weight, self.w3.weight]

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The untiled MLP half; also DeepSpeed's ``fn(self, tile)``."""
        return norm_mlp(x, self.norm.weight, self.eps, self.w1.weight, self.w2.weight, self.w3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles = self.n_tiles(x.shape[1])
        if tiles == 1 or not torch.is_grad_enabled():
            return self.plain(x)
        if self.impl == "deepspeed":
            # weights are read from the module at call time (FSDP's unsharded ones in both passes); a
            # simulation runs DeepSpeed's tiles through a stand-in that replays its identical middle tiles
            tiled = deepspeed_tiled().TiledMLP
            if compressing():
                tiled = TiledMLPStandIn
            return tiled.apply(type(self).plain, self, x, tiles, self.weights())
        return _Tiled.apply(partial(norm_mlp_fn, eps=self.eps), tiles, x, *self.weights())


class _HoldForBackward(torch.autograd.Function):
    """Identity on ``x`` that keeps ``held`` alive until the block's backward reaches it.

    With a RoPE table (``Decoder.set_rope_table``) TorchTitan's attention keeps the table it
    was given for its own backward: the Llama attention's ``xq_ * freqs_cis`` saves a view of
    it, UPipe's custom op ``ctx.save_for_backward(..., freqs_cis, ...)`` the whole tensor. The
    table is an argument of the checkpointed block, so under checkpoint offload
    (``save_on_cpu``) the recomputation gets a *fresh device copy* of it, which those saves
    keep until the attention's backward is done. Saving it here, on the block's first op,
    keeps the same copy for the block's backward (a little longer: through the attention
    norm's backward too, after the attention's peak)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(held)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class Block(nn.Module):
    """One pre-norm decoder block: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``.

    ``rope_table``: the model's RoPE table (``Decoder.set_rope_table``), an argument as in
    TorchTitan, so that activation checkpointing saves (and offloads) it with the input.
    ``fused_norm`` (``StepConfig.fused_attn_norm``): the attention's RMSNorm runs inside the
    attention method, tile by tile (``methods.core.normtile``), so the normed input, which the
    method would save for its backward, never exists as a full-length tensor."""

    def __init__(self, cfg: ModelConfig, attention: nn.Module) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = attention
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, cfg.norm_eps)
        self.fused_norm = False
        self.docs: Documents | None = None  # packed documents of the sequence (Decoder.set_documents)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope_table: torch.Tensor | None = None) -> torch.Tensor:
        if rope_table is not None:
            x = _HoldForBackward.apply(x, rope_table)
            self.attention.rope_table = rope_table  # the angles are looked up in this (possibly unpacked) copy
        try:
            h = x + self._attend(x, positions)
        finally:
            if rope_table is not None:
                self.attention.rope_table = None
        return h + self.feed_forward(h)

    def _attend(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # documents reach the method only when there are some (a method that refuses them takes no docs=)
        docs = {"docs": self.docs} if self.docs is not None else {}
        if self.fused_norm:
            norm = (self.attention_norm.weight, self.attention_norm.eps)
            return self.attention(x, positions=positions, input_norm=norm, **docs)
        return self.attention(self.attention_norm(x), positions=positions, **docs)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Logits and the softmax in fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_starts(n: int, chunk: int) -> Iterator[int]:
    starts = list(range(0, n, chunk))
    for i in run_tiles([min(chunk, n - s) for s in starts]):
        yield starts[i]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ w.T`` against ``labels`` in chunks of tokens.

    Forward keeps one chunk's fp32 logits at a time and saves only the per-token
    log-sum-exp; backward recomputes each chunk's logits, forms ``softmax - onehot`` and
    accumulates ``dh`` (per chunk) and ``dw`` (``addmm_``). The full ``[tokens, vocab]``
    logits never exist. Labels equal to ``ignore_index`` contribute nothing. The chunks are
    iterated by ``methods.core.tiling.run_tiles`` (all of them, unless a simulation compresses
    the identical ones).
    """

    @staticmethod
    def forward(ctx, h, w, labels, chunk, ignore_index):
        n = h.shape[0]
        acc = _acc_dtype(h)
        lse = torch.empty(n, dtype=acc, device=h.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0)
        for start in _chunk_starts(n, chunk):
            sl = slice(start, min(n, start + chunk))
            logits = F.linear(h[sl], w).to(acc)
            lse[sl] = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, safe[sl, None]).squeeze(1)
            total += ((lse[sl] - target) * valid[sl]).sum()
            del logits
        count = valid.sum().clamp_min(1).to(acc)
        ctx.save_for_backward(h, w, safe, valid, lse, count)
        ctx.chunk = chunk
        return total / count

    @staticmethod
    def backward(ctx, dloss):
        h, w, safe, valid, lse, count = ctx.saved_tensors
        acc = lse.dtype
        scale = (dloss / count).to(acc)
        dh = torch.empty_like(h)
        dw = torch.zeros_like(w)
        n = h.shape[0]
        for start in _chunk_starts(n, ctx.chunk):
            sl = slice(start, min(n, start + ctx.chunk))
            logits = F.linear(h[sl], w).to(acc)
            grad = logits.sub_(lse[sl, None]).exp_()  # softmax, in place
            grad.scatter_add_(1, safe[sl, None], -torch.ones_like(lse[sl, None]))
            grad.mul_((scale * valid[sl])[:, None])
            grad = grad.to(h.dtype)
            torch.mm(grad, w, out=dh[sl])
            dw.addmm_(grad.t(), h[sl])
            del grad, logits
        return dh, dw, None, None, None


def chunked_cross_entropy(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                          chunk: int = 2048, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``h @ w.T`` (``h``: ``[..., dim]``) without full logits."""
    return _ChunkedCrossEntropy.apply(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1), chunk, ignore_index)


def _shard_cross_entropy(head: LMHead, h: torch.Tensor, labels: torch.Tensor,
                         count: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """DeepSpeed's ``fn(self, x, y)`` for one shard: its summed cross-entropy over ``count``.

    ``TiledFusedLogitsLoss`` reduces the shards' outputs by mean (of the shard means: unequal
    shards or ignored labels weigh wrong) or sum; dividing each shard's sum by the rank's
    valid-token count and summing gives exactly our mean over valid tokens.
    """
    logits = F.linear(h, head.output.weight).to(_acc_dtype(h))
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum") / count


def deepspeed_cross_entropy(head: LMHead, h: torch.Tensor, labels: torch.Tensor, chunk: int,
                            ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy through DeepSpeed's ``TiledFusedLogitsLoss``: as many shards as our
    chunks of ``chunk`` tokens (``torch.chunk`` sizes, so at most ``chunk`` each). It runs each
    shard's backward inside forward: ``head.output.weight.grad`` is filled then, and backward
    only hands back the saved ``dh``."""
    count = (labels != ignore_index).sum().clamp_min(1).to(_acc_dtype(h))
    shards = math.ceil(labels.numel() / chunk)
    fn = partial(_shard_cross_entropy, count=count, ignore_index=ignore_index)
    return deepspeed_tiled().TiledFusedLogitsLoss.apply(fn, head, h, labels, None, shards,
                                                        [head.output.weight], "sum")


def liger_chunk(tokens: int, dim: int, vocab: int) -> int:
    """Tokens per chunk of Liger's fused linear cross-entropy for ``tokens`` rows of width ``dim``
    and a ``vocab``-sized head: ``next_power_of_2(ceil(tokens / ceil(vocab / dim)))``, so that a
    chunk's logits hold about as much as the hidden states (Liger-Kernel
    ``liger_kernel/ops/fused_linear_cross_entropy.py``, ``fused_linear_cross_entropy_forward``)."""
    rows = max(1, -(-tokens // -(-vocab // dim)))
    return 1 << (rows - 1).bit_length()


def full_cross_entropy(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor,
                       ignore_index: int = -100) -> torch.Tensor:
    """The plain version: materialises ``[tokens, vocab]`` logits (fp32 for the softmax)."""
    logits = F.linear(h.reshape(-1, h.shape[-1]), w).to(_acc_dtype(h))
    return F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index)


class LMHead(nn.Module):
    """Final RMSNorm, output projection and the loss (chunked or full). The projection's weight is
    the embedding's when the config ties them (``Decoder``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.loss_chunk: int | None = None  # tokens per chunk; 0: Liger's rule (liger_chunk); None: full logits
        self.loss_impl = "ours"  # whose chunking: ours | deepspeed (deepspeed_cross_entropy)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        chunk = self.loss_chunk or (liger_chunk(labels.numel(), *self.output.weight.shape[::-1])
                                    if self.loss_chunk == 0 else None)
        if chunk and self.loss_impl == "deepspeed" and torch.is_grad_enabled():
            return deepspeed_cross_entropy(self, h, labels, chunk)
        if chunk:
            return chunked_cross_entropy(h, self.output.weight, labels, chunk)
        return full_cross_entropy(h, self.output.weight, labels)


class Decoder(nn.Module):
    """Llama-style decoder on this rank's part of the sequence.

    ``forward(tokens, positions, labels)`` takes this rank's tokens ``[B, S/C]`` in the
    attention method's layout (``model.shard``), their global positions, and next-token
    labels in the same layout; it returns the mean loss over the local tokens (with equal
    token counts per rank, averaging gradients over ranks, as FSDP does, gives the
    gradient of the global mean). With packed documents (``set_documents``) every attention keeps
    within each document and ``positions`` are the tokens' positions inside their documents.

    ``bench.training.step`` may replace each block by a wrapper (activation checkpointing) and
    may run them in groups (``set_layer_groups``, two-level checkpointing); by default each
    block is called directly.
    """

    def __init__(self, cfg: ModelConfig, method: str, group=None, **method_options) -> None:
        super().__init__()
        self.cfg = cfg
        self.method = method
        spec = cfg.attn_spec(causal=True)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(
            Block(cfg, methods.build(method, spec, group=group, **method_options)) for _ in range(cfg.n_layers)
        )
        self.head = LMHead(cfg)
        if cfg.tie_word_embeddings:  # one parameter: FSDP shards it once, both uses add to its gradient
            self.head.output.weight = self.tok_embeddings.weight

    def blocks(self) -> list[Block]:
        """Every decoder block, through any wrapper around it (activation checkpointing)."""
        out = []
        for layer in self.layers:
            while not isinstance(layer, Block):
                layer = layer.block
            out.append(layer)
        return out

    def attention_module(self) -> nn.Module:
        """The first block's attention method (through any wrapper around the block)."""
        return self.blocks()[0].attention

    def set_documents(self, docs: Documents | None) -> None:
        """Packed documents (``methods.Documents`` of the global sequence; None: one sequence): every
        block's attention gets them as ``docs=``, so attention stays within each document. A setting
        of the model, not a forward argument, so that checkpoint wrappers and groups pass nothing new;
        the batch's positions are then the per-document ones (``bench.training.step.make_batch``)."""
        self.attention_module().check_documents(docs)
        for block in self.blocks():
            block.docs = docs

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of a full-sequence tensor in the attention method's layout."""
        return self.attention_module().shard(x, dim)

    def set_mlp_tiles(self, tiles: int | None, impl: str = "ours") -> None:
        """None: plain MLP; 0: the paper's auto rule ceil(local tokens / dim); n: n tiles.
        ``impl``: whose tiling (``ours`` | ``deepspeed``; imported now, so that a missing or
        broken DeepSpeed fails at build time)."""
        if impl == "deepspeed":
            deepspeed_tiled()
        for layer in self.layers:
            layer.feed_forward.tiles = tiles
            layer.feed_forward.impl = impl

    def set_norm_tiles(self, tiles: int | None) -> None:
        """Tiling of the attention norms and the final norm (None: plain; 0: auto)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.tiles = tiles

    def set_fused_attn_norm(self, on: bool) -> None:
        """Fold each block's attention RMSNorm into its attention method (``Block.fused_norm``);
        only methods that declare ``accepts_input_norm`` can."""
        if on and not getattr(self.attention_module(), "accepts_input_norm", False):
            raise ValueError(f"fused_attn_norm: method {self.method!r} cannot run the block's RMSNorm inside "
                             f"its projections (only upipe and fpdt can); drop fused_attn_norm")
        for block in self.blocks():
            block.fused_norm = on

    def set_loss_chunk(self, chunk: int | None, impl: str = "ours") -> None:
        """None: full logits; n: chunks of n tokens (0: Liger's rule, :func:`liger_chunk`), by ``impl``
        (``ours`` | ``deepspeed``)."""
        if impl == "deepspeed":
            deepspeed_tiled()
        self.head.loss_chunk = chunk
        self.head.loss_impl = impl

    def set_rope_table(self, seq_len: int | None) -> None:
        """Keep a precomputed RoPE table of ``seq_len`` positions (TorchTitan's ``freqs_cis``
        buffer: ``complex64 [seq_len, head_dim / 2]``, the whole training sequence on every
        rank, never sharded) and make every block's attention look its angles up there;
        None: angles computed for the local positions only (no table). Each block receives
        the table as an argument (``Block``)."""
        table = None
        if seq_len is not None:
            device = self.tok_embeddings.weight.device
            table = rope_table(seq_len, self.cfg.head_dim, self.cfg.rope_theta, device=device)
        self.register_buffer("rope_table", table, persistent=False)

    def set_layer_groups(self, groups: list[nn.Module] | None) -> None:
        """Run these instead of ``self.layers``: callables like a block (``x, positions, *rope_table``)
        that together run every block once, in order (``bench.training.nested``). Held in a plain
        list, not registered: the blocks' parameters stay where they are (``self.layers``)."""
        self.__dict__["layer_groups"] = list(groups) if groups else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        table = getattr(self, "rope_table", None)
        for layer in self.__dict__.get("layer_groups") or self.layers:
            x = layer(x, positions) if table is None else layer(x, positions, table)
        return self.head(x, labels)
