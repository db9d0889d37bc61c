"""A barrier after every ring step, as the paper's ring code does (``StepConfig.ring_barrier``).

Why. The paper's runs did not use a plain ring. Both ring implementations the paper measured end
every ring step's wait with a barrier over the ring's process group:

* the authors' vendored yunchang (``long-context-attention/yunchang/ring/utils.py`` in
  ``ghadiaravi13/untied-ulysses``, ``RingComm.wait``: ``dist.barrier(group=self._process_group)``
  after the requests' ``wait()``, commented "clear ring buffers to free up memory"), which ran
  Ring (1 x C) and the ring half of USP (Ulysses 8 x 2 on 16 GPUs);
* UPipe's own ring (``untied_ulysses/flash_attn_utils.py``, ``RingComm.wait``, the same call),
  which ran UPipe 8 x 2.

pip yunchang (0.6.4) and our ``comm.RingComm`` have no barrier. Under NCCL a barrier is a
one-element all-reduce on the group's communicator whose wait blocks the host until the device
has finished it, so each ring step costs a collective's latency and a drained launch queue on
top of its transfers: many small synchronisations, which matter where a step is short (Ring on
two nodes at 128K-256K, ``bench.stackmodel.steptime``). The numerics do not change.

Mechanism. While :func:`ring_step_barriers` is entered (the training step enters it for the whole
step when ``StepConfig.ring_barrier`` is set, so the backward, which autograd may run on its own
thread, is covered too), :func:`enabled` is true: ``comm.RingComm.wait`` (our ``ring``, ``usp``,
``usp-upipe``) then calls ``dist.barrier(group)`` after its requests complete, and pip yunchang's
``yunchang.ring.utils.RingComm.wait`` (``yc-ring``, ``yc-usp``) is bound to a wrapper that does
the same, as the vendored copy does (when yunchang is imported: its wrappers import it when they
are built, before the step). Scopes nest (a count under a lock); yunchang's own method is
bound back when the last one ends. Nothing in site-packages is edited. The barriers pass through
the dispatcher as ``c10d::barrier``, so the benchmark's ``CommCounter`` counts them
(``comm.barrier.*``) and the step-time model charges each on the critical path at its own fitted
cost (``barrier_s``, ``bench.stackmodel.steptime``).

The paper stack turns it on for the methods that stand for the paper's ring code
(``bench.stackmodel.stack``, term 9).
"""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import torch.distributed as dist

_lock = threading.Lock()
_depth = 0
_yunchang_wait = None  # yunchang's own RingComm.wait while bound to ours


def enabled() -> bool:
    """Whether a ring step's wait ends with a barrier now."""
    return _depth > 0


def barrier(group) -> None:
    """The vendored ``RingComm.wait``'s barrier over the ring's ``group``."""
    dist.barrier(group=group)


def _yunchang_ring_comm():
    """yunchang's ``RingComm`` if yunchang is imported (its wrappers import it when built, before
    a step runs). Never imported from here: yunchang records at import whether flash-attn is
    present, so an import before the simulation installs its fake would spoil it for the process
    (``bench.stackmodel.fake_flash_attn.check_fresh``)."""
    utils = sys.modules.get("yunchang.ring.utils")
    return getattr(utils, "RingComm", None)


def _bind_yunchang() -> None:
    global _yunchang_wait
    cls = _yunchang_ring_comm()
    if cls is None or _yunchang_wait is not None:
        return
    own = cls.wait

    def wait(self) -> None:
        own(self)
        barrier(self._process_group)

    _yunchang_wait = own
    cls.wait = wait


def _unbind_yunchang() -> None:
    global _yunchang_wait
    cls = _yunchang_ring_comm()
    if cls is not None and _yunchang_wait is not None:
        cls.wait = _yunchang_wait
    _yunchang_wait = None


@contextlib.contextmanager
def ring_step_barriers() -> Iterator[None]:
    """Every ring step's wait ends with a barrier over the ring's group while this is entered."""
    global _depth
    with _lock:
        if _depth == 0:
            _bind_yunchang()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _unbind_yunchang()
