"""DeepSpeed's ``UlyssesSPAttentionHF`` (Ulysses as the Hugging Face stack runs it) around our kernel.

DeepSpeed's Arctic Long Sequence Training (ALST) is how Transformers/Accelerate train with
Ulysses: ``UlyssesSPAttentionHF`` (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``) takes
the place of the model's attention function, receives Q/K/V in Transformers' layout
``[batch, heads, local seq, head_dim]``, exchanges them with its own dim-0 all-to-alls (after
moving the sequence first and making copies), all-gathers ``position_ids``, calls the wrapped
Transformers-style attention function on ``[batch, heads/C, seq, head_dim]``, and sends the
output ``[batch, seq, heads/C, head_dim]`` back with a third all-to-all. As with ``ds-ulysses``,
the projections, RoPE (at the contiguous layout's global positions), QK-norm and ``wo`` are ours
on the shared weights, and the wrapped function calls our kernel (``methods.core.kernels``):
only the wrapper's communication and layout differ from ``ulysses``. Layout: contiguous, as
the HF stack shards its batches.

What is checked, in ``validate`` before any communication: the constraints the library's
constructor raises on (C divides H; C divides G or G divides C, the library replicating each KV
head C/G times itself when G < C, and autograd summing the replicas' gradients back), and its
minimum transformers version. World size 1 and non-causal attention are the wrapped function's
business and run. The library fixes the batch size at construction, so one wrapper is built per
batch size seen (they hold no state but shapes); ``seq_length_is_variable`` lets the sequence
length change. deepspeed.comm is set up as for ``ds-ulysses`` (``init_deepspeed_comm``), and the
libraries are imported lazily, in ``__init__``, never when ``methods`` is imported.

Packed documents (``docs=``), as ALST takes them: ``position_ids`` that restart at 0 at every
document. The block hands the library the per-document positions of its tokens; the library
all-gathers them, and the wrapped attention function reads the documents back from the gathered
``position_ids`` (a new document wherever they restart at 0, Transformers' packed-sequence rule:
``documents_from_position_ids``) and gives them to our kernel.
"""
from __future__ import annotations

import importlib.metadata

import torch

from .core.base import AttentionMethod, MethodOptions
from .core.documents import Documents
from .core.kernels import attention
from .core.registry import MethodFacts, register
from .core.spec import AttnSpec
from .ds_ulysses import init_deepspeed_comm, require_group

NAME = "ds-ulysses-hf"
MIN_TRANSFORMERS = "4.51.3"  # UlyssesSPAttentionHF.__init__ raises below this version
HF_HINT = "pip install -e '.[deepspeed,hf]' (deepspeed and transformers; pin torch==<your version> in the same command)"


def documents_from_position_ids(position_ids: torch.Tensor) -> Documents | None:
    """The documents of packed ``position_ids`` ``[batch, seq]`` (every row alike): a new one wherever
    they restart at 0; None for one sequence (no restart after the first token, or no 0 first)."""
    pos = position_ids[0]
    starts = torch.nonzero(pos == 0).flatten().tolist()
    if len(starts) < 2 or starts[0] != 0:
        return None
    return Documents.from_lengths([b - a for a, b in zip(starts, [*starts[1:], pos.shape[0]], strict=True)])


class _KernelAttentionInterface:
    """Our kernel as a Transformers attention function (an ``ALL_ATTENTION_FUNCTIONS`` entry).

    Called as ``fn(module, query, key, value, attention_mask, **kwargs)`` on
    ``[batch, heads, seq, head_dim]`` (query heads a multiple of KV heads); returns
    ``(out [batch, seq, heads, head_dim], attn_weights)``. The block passes no mask (causality
    is the spec's) and no dropout, and ``scaling`` as Transformers' attention modules do; the
    documents come from the gathered ``position_ids`` (``documents_from_position_ids``).
    """

    def __init__(self, causal: bool, kernel, scale: float) -> None:
        self.causal, self.kernel, self.scale = causal, kernel, scale
        # set by the block for each call: only a call with documents reads them from position_ids
        # (reading them needs the positions' values, which a call without documents never asks for)
        self.packed = False

    def __call__(self, module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        if attention_mask is not None or dropout:
            raise ValueError(f"{NAME}: the kernel interface takes no attention mask and no dropout")
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # -> [batch, seq, heads, head_dim]
        position_ids = kwargs.get("position_ids")
        docs = documents_from_position_ids(position_ids) if self.packed and position_ids is not None else None
        out = attention(q, k, v, self.causal, self.kernel, self.scale if scaling is None else scaling, docs=docs)
        return out, None


@register(
    NAME,
    "DeepSpeed's UlyssesSPAttentionHF (ALST, Ulysses under Transformers/Accelerate) around our attention kernel",
    requires=("deepspeed", "transformers"),
    install_hint=HF_HINT,
    # the Hugging Face stack's Ulysses (ALST), not TorchTitan's model code
    facts=MethodFacts(column="ulysses", library="DeepSpeed", torchtitan=False),
)
class DeepSpeedUlyssesHF(AttentionMethod):
    rank_symmetric_reason = ("DeepSpeed's all-to-all gives every rank the whole sequence on H/C heads, so every "
                             "rank allocates the same shapes in the same order")
    honours_documents = True  # through position_ids that restart at every document, as ALST takes them

    @classmethod
    def validate(cls, spec: AttnSpec, world_size: int, options: MethodOptions) -> None:
        super().validate(spec, world_size, options)
        cls.check_head_split(spec, world_size, NAME)
        try:
            have = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            return  # the registry reports the missing library
        from packaging.version import Version

        if Version(have) < Version(MIN_TRANSFORMERS):
            raise ValueError(
                f"{NAME}: UlyssesSPAttentionHF needs transformers>={MIN_TRANSFORMERS}, found {have}; "
                f"pip install -U 'transformers>={MIN_TRANSFORMERS}'"
            )

    def __init__(self, spec: AttnSpec, group=None, **options) -> None:
        super().__init__(spec, group, **options)
        require_group(group, NAME, "DeepSpeed's UlyssesSPAttentionHF")
        init_deepspeed_comm()
        self.attention_interface = _KernelAttentionInterface(spec.causal, self.kernel, self.scale)
        self._wrappers: dict[int, torch.nn.Module] = {}  # batch size -> UlyssesSPAttentionHF

    def sp_attention(self, batch: int) -> torch.nn.Module:
        """The library's wrapper for this batch size (it fixes the batch at construction)."""
        if batch not in self._wrappers:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            self._wrappers[batch] = UlyssesSPAttentionHF(
                self.attention_interface,
                batch_size=batch,
                attn_head_count=self.spec.n_heads,
                attn_head_size=self.spec.head_dim,
                kv_head_count=self.spec.n_kv_heads,
                num_hidden_layers=1,
                process_group=self.group,
                seq_length_is_variable=True,
            )
        return self._wrappers[batch]

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        if positions is None:
            positions = self.default_positions(x.shape[1], x.device, docs)
        cos, sin = self.rope_for(x, positions)
        q, k, v = self.project_qkv(x, cos, sin)  # all H query and G KV heads of the local tokens
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # Transformers' [batch, heads, seq, head_dim]
        # the library's position_ids (all-gathered as is) carry the documents: per-document positions
        ids = positions if docs is None else self.default_positions(x.shape[1], x.device, docs)
        position_ids = ids.unsqueeze(0).expand(x.shape[0], -1).contiguous()
        # `self` stands for the Transformers attention module: the library reads its `training`
        # and, when it replicates KV heads, sets its `num_key_value_groups`
        self.attention_interface.packed = docs is not None
        out, _ = self.sp_attention(x.shape[0])(self, q, k, v, None, scaling=self.scale, position_ids=position_ids)
        return self.wo(out)  # out: [batch, local seq, H * head_dim]
