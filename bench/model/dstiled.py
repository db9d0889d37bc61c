"""DeepSpeed's ``TiledMLP`` as a simulation runs it: its identical middle tiles run once, replayed for the rest.

The paper stack's tiled MLP is DeepSpeed's ALST ``TiledMLP``
(deepspeed/runtime/sequence_parallel/ulysses_sp.py): forward, every tile under ``no_grad``, each
tile's output kept until one ``cat`` joins them; backward, every tile recomputed under autograd and
back-propagated on its own (``torch.autograd.backward``), its input gradient landing in a slice of
one zero-filled buffer and the weights' gradients accumulating in their ``.grad``. A simulated
step runs it three times per layer (forward, checkpoint recompute, backward) over
``ceil(local tokens / dim)`` tiles, which made it most of a paper-stack simulation's time.

``TiledMLPStandIn`` is an autograd function with the same arguments, the same saved tensor and the
same operators in the same order (what the memory tracker, the allocation trace and the step's
counters see), written for the simulation only (``FeedForward`` uses it while
``methods.core.tiling.compressing`` is on; real and emulated runs call DeepSpeed's). Its tiles go
through ``run_tiles``: the first runs, the second runs standing for every tile of its size up to
the last (``counting_as``: the counters count it that many times), and the last runs when its size
differs. What the skipped tiles would have done to the memory tracker is replayed from the second's
record (``bench.measure.tape``): every allocation, free and peak check in order, so that the peaks,
their categories and the allocation trace (its every event, so the caching allocator's replay and
its reserved peak) are those of running all of them. The outputs the forward keeps are stand-ins
until the ``cat`` (which reads the second tile's output in their place: only shapes matter) and are
freed in the order Python frees a list, last first; in the backward each tile's output is freed
when the next tile's replaces it, as there.

DeepSpeed's ZeRO flags (``ds_grad_is_ready`` on the compute parameters) are not set: nothing in
this suite reads them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from bench.measure import tape
from methods.core.tiling import compressing, run_tiles, tile_items


def _release(held: list) -> None:
    """Free what ``held`` holds, last first: real tensors (their last reference dropped) and stand-ins."""
    while held:
        item = held.pop()
        if isinstance(item, tape.Storage):
            item.free()
        del item


def _compressed(sizes: list[int]) -> dict[int, int]:
    """Each tile that runs and how many tiles it stands for (``methods.core.tiling.tile_items`` under the
    policy: without ``compressing``, every tile, each standing for itself, as DeepSpeed runs them)."""
    return dict(tile_items(sizes, compressing()))


def _check_periodic(rec: tape.Tape, frees: int) -> None:
    """A replayed tile must free ``frees`` storages of the tile before it (none without a tracker) and,
    when it frees any, leave as many of its own for the next one."""
    if rec.external not in (0, frees) or (rec.external and rec.escapes != frees):
        raise RuntimeError(f"a TiledMLP tile freed {rec.external} storages of the tile before it (expected {frees}) "
                           f"and left {rec.escapes} alive: its tiles do not repeat, so they cannot be replayed")


class TiledMLPStandIn(torch.autograd.Function):
    """``TiledMLP.apply(fn, module, x, shards, compute_params)`` with the middle tiles compressed."""

    @staticmethod
    def forward(ctx, fn: Callable, module, x: torch.Tensor, shards: int, compute_params) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.compute_params = [p for p in compute_params if p.requires_grad]
        ctx.save_for_backward(x)
        pieces = list(torch.chunk(x, chunks=shards, dim=-2))
        sizes = [p.shape[-2] for p in pieces]
        weights = _compressed(sizes)
        kept: list = []  # every tile's output in tile order: real tensors and lists of stand-ins
        standing = None  # the recorded tile's output, which the cat reads for the replayed ones (only shapes matter)
        with torch.no_grad():
            for i in run_tiles(sizes):
                if weights[i] == 1:
                    kept.append(fn(module, pieces[i]))
                    continue
                with tape.recording() as rec:
                    kept.append(fn(module, pieces[i]))
                _check_periodic(rec, 0)
                standing = kept[-1]
                kept.extend(rec.replay() for _ in range(weights[i] - 1))
        joined = torch.cat([t if isinstance(t, torch.Tensor) else standing for t in kept], dim=-2)
        del standing
        for i in reversed(range(len(kept))):  # the outputs' list dies, last item first
            item, kept[i] = kept[i], None
            _release(item if isinstance(item, list) else [item])
            del item
        return joined

    @staticmethod
    def backward(ctx, *grads):
        (x,) = ctx.saved_tensors
        fn, module, shards = ctx.fn, ctx.module, ctx.shards
        wants_grad = x.requires_grad
        x = x.detach()
        x.requires_grad_(wants_grad)
        dim, shape = x.shape[-1], x.shape
        x = x.reshape(-1, dim)
        incoming = grads[0].reshape(-1, dim)
        x_grad = torch.zeros_like(x)
        pieces = list(torch.chunk(x, chunks=shards, dim=0))
        sizes = [p.shape[0] for p in pieces]
        weights = _compressed(sizes)
        held: list = []  # the previous tile's output (or its stand-ins): freed once the next tile's exists
        for i in run_tiles(sizes):
            if weights[i] == 1:
                _backward_tile(fn, module, pieces, i, wants_grad, x_grad, incoming, held)
                continue
            with tape.recording() as rec:
                _backward_tile(fn, module, pieces, i, wants_grad, x_grad, incoming, held)
            _check_periodic(rec, 1)
            for _ in range(weights[i] - 1):
                held.extend(rec.replay([lambda: _release(held)] if rec.external else []))
        x_grad = x_grad.view(shape)
        del incoming
        _release(held)
        return (None, None, x_grad, None, None)


def _backward_tile(fn: Callable, module, pieces: list[torch.Tensor], i: int, wants_grad: bool,
                   x_grad: torch.Tensor, incoming: torch.Tensor, held: list) -> None:
    """Tile ``i`` of the backward: its input gradient's slice set as the tile's ``.grad``, the tile
    recomputed under autograd (the previous tile's output freed once this one's exists, as a
    rebound variable frees it) and back-propagated; its output is left in ``held``."""
    piece = pieces[i]
    piece.requires_grad_(wants_grad)
    step, offset = pieces[i].shape[0], i * pieces[0].shape[0]
    piece.grad = x_grad.narrow(0, offset, step).view_as(piece)
    grad_piece = incoming.narrow(0, offset, step).view_as(piece)
    with torch.enable_grad():
        out = fn(module, piece)
        _release(held)
    held.append(out)
    torch.autograd.backward(out, grad_piece)
