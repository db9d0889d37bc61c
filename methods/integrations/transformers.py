"""UPipe as a Transformers attention function, over a sequence-parallel group (docs/upipe-in-transformers.md).

    from methods.integrations import transformers as upipe_hf
    name = upipe_hf.register(sp_group, chunk_heads=None)          # "upipe" in AttentionInterface
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    batch = upipe_hf.shard_batch(input_ids, labels, sp_group)    # this rank's contiguous slice
    out = model(**batch)                                          # loss: this rank's share
    upipe_hf.loss_across_shards(out.loss, sp_group)               # the whole sequence's mean
    out.loss.backward(); upipe_hf.sum_gradients(model, sp_group)

What runs. A Transformers attention module (``LlamaAttention`` and its kin) projects its local
tokens, applies QK-norm and RoPE at the positions it is given, and calls the registered function
as ``fn(module, query, key, value, attention_mask, scaling=..., **kwargs)`` with
``[batch, heads, local seq, head_dim]``; the function returns ``[batch, local seq, heads,
head_dim]`` for the module's ``o_proj``. This one runs UPipe's head stages (``methods.upipe``:
``plan_stages``, its GQA-aware schedule, KV heads replicated when fewer than the ranks) with the
suite's all-to-alls (``methods.core.comm``) and attention kernel (``methods.core.kernels``): per
stage, U query heads (and, once per KV group, their KV heads) go sequence->head, the kernel
attends over the whole sequence, and the stage's output comes back head->sequence into its heads'
slots of one preallocated output. Backward walks the same stages, exchanging each stage's q, k, v,
output and output gradient again, so only one stage's head-layout tensors exist at a time.

What it saves, compared with UPipe inside the suite's own block (``methods.upipe``): the
projections are the model's, so the full local Q, K, V exist (as under any Transformers attention
function) and are what this function saves for backward, with its output and one LSE per stage;
the head-layout tensors, which Ulysses (DeepSpeed's ``UlyssesSPAttentionHF``) holds for all heads
at once, exist for U heads at a time.

Sequence sharding is ALST's (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``,
``UlyssesSPDataLoaderAdapter``): rank r holds the contiguous slice ``[r*S/C, (r+1)*S/C)`` of
every sequence, with its global ``position_ids`` (RoPE must rotate by the global position), and
the labels are shifted by one over the *whole* sequence before it is cut (``shift_labels``; the
last position gets -100), so the token that predicts the first token of the next rank's slice
keeps its label. Each rank's loss is its share of the sum over valid tokens divided by the whole
batch's count of them (``num_items_in_batch``), so the ranks' losses add up to the mean, and each
rank's weight gradients are its tokens' share: summing them over the group
(``sum_gradients``, or a data-parallel wrapper that reduces over it) gives the full gradient.

Refused, in one line before any communication: a head count or ``chunk_heads`` UPipe cannot split
at the group's size (``methods.upipe.UPipe.validate``), an attention mask (padding or packed
sequences: this function attends causally over the whole sequence), dropout, and a sequence
length the group cannot cut into equal slices.
"""
from __future__ import annotations

import atexit
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

import methods
from methods.core import comm
from methods.core.base import index_tensor
from methods.core.kernels import Kernel, get_kernel, softmax_scale
from methods.core.spec import AttnSpec
from methods.upipe import Stage, UPipe, UPipeOptions, plan_stages

NAME = "upipe"
IGNORE_INDEX = -100  # Transformers' and ALST's label for "no loss here"


@dataclass(frozen=True)
class Schedule:
    """UPipe's stages for one attention shape on one group, and the kernel that attends."""

    group: object
    kernel: Kernel
    stages: tuple[Stage, ...]
    causal: bool


def _slots(heads: list[int], device) -> torch.Tensor:
    return index_tensor(heads, device)


def _to_heads(t: torch.Tensor, heads: list[int], group) -> torch.Tensor:
    """``t[:, :, heads]`` (sequence layout) in head layout: this rank's share of those heads, all tokens."""
    return comm.seq_to_head_(t.index_select(2, _slots(heads, t.device)), group)


class _StagedAttention(torch.autograd.Function):
    """Attention of ``q [B, n, H, d]`` over ``k, v [B, n, G, d]`` (sequence layout, ``n = S/C``) in
    UPipe's head stages; saves its inputs, output and the stages' LSEs."""

    @staticmethod
    def forward(ctx, q, k, v, schedule: Schedule, scale: float):
        group, kernel = schedule.group, schedule.kernel
        out = q.new_empty(q.shape)
        lses = []
        kh = vh = None
        for stage in schedule.stages:
            if stage.kv_heads is not None:
                kh = vh = None  # the previous group's K/V go before the next group's arrive
                kh, vh = _to_heads(k, stage.kv_heads, group), _to_heads(v, stage.kv_heads, group)
            qh = _to_heads(q, stage.q_heads, group)
            o, lse = kernel.forward(qh, kh, vh, schedule.causal, scale)
            del qh
            out.index_copy_(2, _slots(stage.q_heads, q.device), comm.head_to_seq_(o, group))
            del o
            lses.append(lse)
        ctx.schedule, ctx.scale = schedule, scale
        ctx.save_for_backward(q, k, v, out, *lses)
        return out

    @staticmethod
    def backward(ctx, dout):
        schedule, scale = ctx.schedule, ctx.scale
        group, kernel, stages = schedule.group, schedule.kernel, schedule.stages
        q, k, v, out, *lses = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for s, stage in enumerate(stages):
            if stage.kv_heads is not None:
                kv_heads = stage.kv_heads
                kh, vh = _to_heads(k, kv_heads, group), _to_heads(v, kv_heads, group)
                dkh, dvh = torch.zeros_like(kh), torch.zeros_like(vh)
            qh, oh, doh = (_to_heads(t, stage.q_heads, group) for t in (q, out, dout))
            dqh, dk_s, dv_s = kernel.backward(doh, qh, kh, vh, oh, lses[s], schedule.causal, scale)
            del qh, oh, doh
            dkh.add_(dk_s)
            dvh.add_(dv_s)
            del dk_s, dv_s
            dq.index_add_(2, _slots(stage.q_heads, q.device), comm.head_to_seq_(dqh, group))
            del dqh
            if s + 1 == len(stages) or stages[s + 1].kv_heads is not None:  # end of a KV group
                del kh, vh
                slots = _slots(kv_heads, k.device)  # replicated KV heads: their gradients add up
                dk.index_add_(2, slots, comm.head_to_seq_(dkh, group))
                dv.index_add_(2, slots, comm.head_to_seq_(dvh, group))
                del dkh, dvh
        return dq, dk, dv, None, None


class UPipeAttention:
    """The attention function (``AttentionInterface`` entry) for one sequence-parallel group.

    ``chunk_heads``: U, the query heads per stage (a multiple of the group's size dividing the
    head count; None: U = C, the least memory). ``kernel``: a ``methods.core.kernels`` name
    (None: the process default). The schedule is planned, and UPipe's constraints checked, on the
    first call for each attention shape (or ahead of it, by ``check``)."""

    def __init__(self, group, chunk_heads: int | None = None, kernel: str | None = None) -> None:
        self.group = group
        self.world_size = comm.world(group)[0]
        self.chunk_heads, self.kernel_name = chunk_heads, kernel
        self._schedules: dict[tuple[int, int, int, bool], Schedule] = {}
        self.released = False

    def release(self) -> None:
        """Drop this function's references to its group (and the schedules holding it).

        ``register`` calls it at interpreter exit (``atexit``, while Python is still whole). A
        gloo group destroyed by ``dist.destroy_process_group`` but still referenced here would
        outlive the interpreter's finalization; its worker thread, still releasing the last
        collective's tensors, then takes the GIL of a finalizing interpreter and the process
        aborts ("terminate called without an active exception"; pytorch/pytorch#190489). Once no
        one holds the group, its destructor joins those threads first."""
        self.group, self.released = None, True
        self._schedules.clear()

    def check(self, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        """UPipe's constraints for this shape at the group's size (``ValueError``: one line)."""
        spec = AttnSpec(dim=n_heads * head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
        methods.validate(NAME, spec, self.world_size, **self._options())

    def _options(self) -> dict:
        return {k: v for k, v in (("chunk_heads", self.chunk_heads), ("kernel", self.kernel_name)) if v is not None}

    def schedule(self, n_heads: int, n_kv_heads: int, head_dim: int, causal: bool) -> Schedule:
        key = (n_heads, n_kv_heads, head_dim, causal)
        if key not in self._schedules:
            self.check(n_heads, n_kv_heads, head_dim)
            spec = AttnSpec(dim=n_heads * head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
            u = UPipe.chunk_heads_for(spec, self.world_size, UPipeOptions(**self._options()))
            self._schedules[key] = Schedule(self.group, get_kernel(self.kernel_name),
                                            tuple(plan_stages(spec, self.world_size, u)), causal)
        return self._schedules[key]

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
        if self.released:
            raise RuntimeError(f"{NAME} attention was released at interpreter exit (its group with it); "
                               f"call upipe_hf.register again for a new group")
        if attention_mask is not None:
            raise ValueError(f"{NAME} attention takes no attention mask (it attends causally over the whole "
                             f"sequence): pass no attention_mask, and no padded or packed sequences")
        if dropout:
            raise ValueError(f"{NAME} attention has no attention dropout; set the config's attention_dropout to 0")
        b, h, n, d = query.shape
        schedule = self.schedule(h, key.shape[1], d, bool(getattr(module, "is_causal", True)))
        scale = softmax_scale(d) if scaling is None else scaling
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [batch, local seq, heads, head_dim]
        return _StagedAttention.apply(q, k, v, schedule, scale), None


def register(group, chunk_heads: int | None = None, kernel: str | None = None, config=None,
             name: str = NAME) -> str:
    """Register UPipe over ``group`` in Transformers' ``AttentionInterface`` as ``name`` and return
    it (for ``attn_implementation=`` or ``model.set_attn_implementation``). With a Transformers
    ``config``, UPipe's constraints for its heads are checked now, before a model exists."""
    from transformers import AttentionInterface

    fn = UPipeAttention(group, chunk_heads, kernel)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        fn.check(heads, getattr(text, "num_key_value_heads", None) or heads,
                 getattr(text, "head_dim", None) or text.hidden_size // heads)
    AttentionInterface.register(name, fn)
    atexit.register(_release, weakref.ref(fn))  # the registry is global: it would hold the group to the end
    return name


def _release(fn: weakref.ref) -> None:
    """``UPipeAttention.release`` at exit for a function still alive (a replaced one was freed with its group)."""
    alive = fn()
    if alive is not None:
        alive.release()


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor, group,
                ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """This rank's slice of a ``[batch, seq]`` batch as ALST cuts it (module docstring):
    ``input_ids``, ``position_ids`` (global), ``shift_labels`` (shifted before the cut, so no
    label is lost at a slice boundary), ``labels`` (the same tensor: Transformers computes a loss
    only when ``labels`` is given, and uses ``shift_labels`` as they are) and
    ``num_items_in_batch`` (the whole batch's valid labels, so the ranks' losses sum to the mean)."""
    size, rank = comm.world(group)
    if input_ids.shape != labels.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids and labels must both be [batch, seq], got {tuple(input_ids.shape)} and "
                         f"{tuple(labels.shape)}")
    seq = input_ids.shape[1]
    if seq % size:
        raise ValueError(f"sequence length {seq} is not divisible by the {size} ranks of the sequence-parallel "
                         f"group; pad the batch to a multiple of {size} (labels {ignore_index} on the padding)")
    shifted = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    n = seq // size
    cut = slice(rank * n, (rank + 1) * n)
    positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    mine = shifted[:, cut].contiguous()
    return dict(input_ids=input_ids[:, cut].contiguous(), position_ids=positions[:, cut].contiguous(),
                labels=mine, shift_labels=mine, num_items_in_batch=(shifted != ignore_index).sum())


def loss_across_shards(loss: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence's loss from the ranks' shares (a sum; no autograd: for logging)."""
    total = loss.detach().clone()
    if comm.world(group)[0] > 1:
        dist.all_reduce(total, group=group)
    return total


def sum_gradients(model: torch.nn.Module, group) -> None:
    """Sum every parameter's gradient over the group: each rank's holds its own tokens' share."""
    if comm.world(group)[0] == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
