"""Two-level (nested) activation checkpointing: ``StepConfig.ac_group``.

The sqrt(n) scheme of Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"
(arXiv 1604.06174, section 4.1): the ``n`` blocks are cut into groups of ``K`` consecutive
blocks (the last group takes the remainder when ``K`` does not divide ``n``); each group runs
under an outer non-reentrant ``torch.utils.checkpoint`` and each block inside it keeps its own
per-block checkpoint (``bench.training.step.CheckpointedBlock``).

What is stored where (torch's nested-checkpoint rules, ``torch/utils/checkpoint.py``, note
"Nestable Checkpoint": an inner checkpoint's inputs are saved *to its parent checkpoint*):

* forward: only each group's input (with the positions and the RoPE table, the checkpoint's
  other arguments) is saved, through the offload policy of ``offload_keep`` applied to groups
  as it is applied to blocks at ``K=1``: ``n/K`` block inputs on the host instead of ``n``;
* backward of a group: the first inner recomputation re-runs the group's forward (its first
  ``K-1`` blocks, torch's early stop ends it at the last block's input), which re-creates the
  group's ``K`` block inputs; those are the outer checkpoint's recomputed tensors and go to
  the host (``_OffloadRecomputed``), then each block's backward recomputes that block as at
  ``K=1``. Host: about ``n/K + K`` block inputs; device: one block's working set plus the
  group input being recomputed from, as at ``K=1``.

Cost (for the step-time model): ``K-1`` more block forwards per group, i.e. up to one more
forward per block (``(K-1)/K``), and the host traffic of ``K`` more block inputs per group
(down and up once each).

The offload of the recomputed inputs cannot be a saved-tensor hook pushed by the inner block,
as at ``K=1``: such a hook would take the inner inputs away from the parent checkpoint (in the
forward too, storing all ``n`` inputs again). ``_OffloadRecomputed`` wraps the hook that the
outer checkpoint itself has on top of the stack (``context_fn``: one context for the forward,
one for the recomputation), so the outer checkpoint still manages the inputs and only the
tensor it stores moves to the host.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def group_bounds(n_layers: int, size: int) -> list[range]:
    """Consecutive groups of ``size`` blocks; the last one holds the remainder."""
    if not 1 <= size <= n_layers:
        raise ValueError(f"ac_group must be between 1 and n_layers={n_layers}, got {size}")
    return [range(start, min(n_layers, start + size)) for start in range(0, n_layers, size)]


class _OffloadRecomputed:
    """Saved-tensor hooks around the outer checkpoint's own hooks (whichever are on top when
    entered: ``_checkpoint_hook`` in the forward, ``_recomputation_hook`` in the
    recomputation; read with ``torch._C._autograd._top_saved_tensors_default_hooks``).

    ``recompute=False`` (forward): packs with the checkpoint's hook and remembers the device;
    unpacking returns the recomputed tensor, from the host, on that device.
    ``recompute=True``: hands the checkpoint a host copy (``offload.pack``) instead of the
    recomputed device tensor, so the ``K`` re-created block inputs wait on the host.
    """

    def __init__(self, offload, recompute: bool) -> None:
        self.offload, self.recompute = offload, recompute

    def __enter__(self) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            raise RuntimeError("ac_group: no checkpoint hook to wrap (entered outside torch.utils.checkpoint)")
        pack, unpack = top
        if self.recompute:
            def wrapped_pack(t):
                packed = self.offload.pack(t)
                return pack(packed[1] if isinstance(packed, tuple) else packed)

            wrapped_unpack = unpack
        else:
            def wrapped_pack(t):
                return t.device, pack(t)

            def wrapped_unpack(packed):
                device, inner = packed
                t = unpack(inner)
                return t if t.device == device else self.offload.unpack((device, t))
        torch._C._autograd._push_saved_tensors_default_hooks(wrapped_pack, wrapped_unpack)

    def __exit__(self, *exc) -> None:
        torch._C._autograd._pop_saved_tensors_default_hooks()


class CheckpointedGroup(nn.Module):
    """``K`` consecutive checkpointed blocks under one outer checkpoint (see the module).

    ``blocks`` are the model's own (FSDP-wrapped) ``CheckpointedBlock``s, held in a tuple so
    that parameter names and FSDP units stay those of ``model.layers``. ``outer``: the offload
    of the group's input (``None``: kept on the device); ``inner``: the offload of the block
    inputs re-created in backward (``None``: they stay on the device).
    """

    def __init__(self, blocks: tuple[nn.Module, ...], outer=None, inner=None) -> None:
        super().__init__()
        self.blocks = tuple(blocks)
        self.outer, self.inner = outer, inner

    def _run(self, x: torch.Tensor, positions: torch.Tensor, *rope_table: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, positions, *rope_table)
        return x

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return _OffloadRecomputed(self.inner, False), _OffloadRecomputed(self.inner, True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *rope_table: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._run(x, positions, *rope_table)
        ctx = self.outer() if self.outer is not None else contextlib.nullcontext()
        # torch's determinism check compares each recomputed tensor's device with the forward's:
        # the host copies differ there by design, so it is off when they are offloaded
        extra: dict[str, object] = ({"context_fn": self._contexts, "determinism_check": "none"}
                                    if self.inner is not None else {})
        with ctx:
            return checkpoint(self._run, x, positions, *rope_table, use_reentrant=False, **extra)
