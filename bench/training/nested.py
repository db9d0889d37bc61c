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
  ``K=1``. The first of them is the group's own input, which the outer checkpoint already
  keeps until the group's backward ends: it is stored as that kept copy, not copied again
  (``CheckpointedGroup.held_copy``). Host: about ``n/K + K - 1`` block inputs; device: one
  block's working set plus the group input being recomputed from, as at ``K=1``.

Cost (for the step-time model): ``K-1`` more block forwards per group, i.e. up to one more
forward per block (``(K-1)/K``), and the host traffic of ``K-1`` more block inputs down and
``K`` up per group.

The offload of the recomputed inputs cannot be a saved-tensor hook pushed by the inner block,
as at ``K=1``: such a hook would take the inner inputs away from the parent checkpoint (in the
forward too, storing all ``n`` inputs again). ``_OffloadRecomputed`` wraps the hook that the
outer checkpoint itself has on top of the stack (``context_fn``: one context for the forward,
one for the recomputation), so the outer checkpoint still manages the inputs and only the
tensor it stores moves to the host.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint


def group_bounds(n_layers: int, size: int) -> list[range]:
    """Consecutive groups of ``size`` blocks; the last one holds the remainder."""
    if not 1 <= size <= n_layers:
        raise ValueError(f"ac_group must be between 1 and n_layers={n_layers}, got {size}")
    return [range(start, min(n_layers, start + size)) for start in range(0, n_layers, size)]


def data_key(t: torch.Tensor) -> tuple:
    """What makes two tensors the same data: their storage and the view of it. A tensor reaches an
    inner checkpoint as a new tensor object over the same storage: torch's saved tensors unpack as
    new variables, and FSDP2's pre-forward passes a block's inputs that need gradients through an
    autograd function."""
    return t.untyped_storage()._cdata, t.dtype, tuple(t.shape), t.stride(), t.storage_offset()


class FetchedCopies:
    """Device tensors that an offload's ``unpack`` made -> the host tensors they were copied from.

    Held weakly on both sides, so nothing here keeps memory alive: the device side by its
    storage (``StorageWeakRef``: the tensor object itself is dropped at once, when torch wraps the
    unpacked data in a new variable; a storage that died cannot be mistaken for a new one at the
    same address while the weak reference holds its control block), the host side by the tensor
    object, which the checkpoint's saved tensor holds as long as it is needed.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[StorageWeakRef, tuple, weakref.ref]] = []

    def _live(self) -> list[tuple[StorageWeakRef, tuple, weakref.ref]]:
        self._entries = [e for e in self._entries if not e[0].expired() and e[2]() is not None]
        return self._entries

    def add(self, device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> None:
        self._live().append((StorageWeakRef(device_tensor.untyped_storage()), data_key(device_tensor),
                             weakref.ref(host_tensor)))

    def get(self, t: torch.Tensor) -> torch.Tensor | None:
        key = data_key(t)
        return next((host() for _, k, host in self._live() if k == key), None)


class _OffloadRecomputed:
    """Saved-tensor hooks around the outer checkpoint's own hooks (whichever are on top when
    entered: ``_checkpoint_hook`` in the forward, ``_recomputation_hook`` in the
    recomputation; read with ``torch._C._autograd._top_saved_tensors_default_hooks``).

    ``recompute=False`` (forward): packs with the checkpoint's hook and remembers the device;
    unpacking returns the recomputed tensor, from the host, on that device.
    ``recompute=True``: hands the checkpoint a host copy (``offload.pack``) instead of the
    recomputed device tensor, so the ``K`` re-created block inputs wait on the host.
    """

    def __init__(self, offload, recompute: bool, group: CheckpointedGroup | None = None) -> None:
        self.offload, self.recompute, self.group = offload, recompute, group

    def __enter__(self) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            raise RuntimeError("ac_group: no checkpoint hook to wrap (entered outside torch.utils.checkpoint)")
        pack, unpack = top
        if self.recompute:
            def wrapped_pack(t):
                held = self.group.held_copy(t) if self.group is not None else None
                if held is not None:  # the group's own input: stored as the copy already kept
                    return pack(held)
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
        # the arguments of this run (the forward's, then the recomputation's): see held_copy
        self._args = [weakref.ref(a) for a in (x, positions, *rope_table)]
        for block in self.blocks:
            x = block(x, positions, *rope_table)
        return x

    def held_copy(self, t: torch.Tensor) -> torch.Tensor | None:
        """What the outer checkpoint already keeps of ``t``, if ``t`` is an argument of the
        group's recomputation (the group's input, positions, RoPE table), else ``None``.

        The first block of the group saves the group's input again. Offloaded as a new copy, that
        would be a second host copy of a tensor whose first copy the outer checkpoint holds until
        the group's backward ends (one block input of host memory, and its device-to-host copy, per
        group). So it is stored as that same copy: the host tensor it was unpacked from
        (``HostOffload.host_copy``), or, when the outer keeps the group's input on the device,
        the device tensor itself, which the outer's saved input already holds.
        """
        key = data_key(t)
        arg = next((a for a in (ref() for ref in getattr(self, "_args", ())) if a is not None and data_key(a) == key),
                   None)
        if arg is None:
            return None
        if self.outer is None:
            return t
        return self.outer.host_copy(arg)

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return _OffloadRecomputed(self.inner, False), _OffloadRecomputed(self.inner, True, self)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *rope_table: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._run(x, positions, *rope_table)
        # the outer's hooks remember what they unpack (HostOffload.host_copy, read by held_copy)
        ctx = self.outer(remember=True) if self.outer is not None else contextlib.nullcontext()
        # torch's determinism check compares each recomputed tensor's device with the forward's:
        # the host copies differ there by design, so it is off when they are offloaded
        extra: dict[str, object] = ({"context_fn": self._contexts, "determinism_check": "none"}
                                    if self.inner is not None else {})
        with ctx:
            return checkpoint(self._run, x, positions, *rope_table, use_reentrant=False, **extra)
