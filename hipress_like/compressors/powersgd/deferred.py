"""Decodes an optimizer step applies itself: PowerSGD's ``P Q^T`` and SGD's update in one sweep.

Idea: in the usual loop (backward, then ``optimizer.step()``, which synchronizes),
nothing runs between the averaging of a gradient and the update that reads it.
PowerSGD's decode writes the averaged gradient ``P Q^T`` into ``p.grad`` and
``torch.optim.SGD`` then reads it back, with the momentum and the parameter:
the VGG-style model's 84 MB layer is written and read once more than the
update needs, and ``_single_tensor_sgd`` makes three passes of its own. So the
optimizer *arms* the gradients it is about to step itself (``arm``), a decode
whose output is an armed gradient leaves its factors here instead of writing
(``offer``, from ``PowerSGD.decode_rounds``), and the step applies each in one
sweep (``native.psgd_lowrank_sgd``). The decode's values still land in
``p.grad`` and the parameter and momentum get torch's bits, so what a user can
read is unchanged; only the memory traffic is.

Anything not taken is written as before: a decode that ran before the arming,
one into another buffer, a step that raised (``release`` writes what is left).
The registry is process-wide, keyed by the gradient's address: engines of
in-process ranks arm distinct buffers, so none sees another's entries.
"""
from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Tuple

import torch

from .._build import native as _native
from . import lowrank

__all__ = ["arm", "offer", "take", "release", "Factors"]

#: A deferred decode: P (rows, r), Q^T (r, cols) and the gradient it belongs in.
Factors = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]

_lock = threading.Lock()
_armed: Dict[int, int] = {}  # a gradient's address -> its element count
_pending: Dict[int, Factors] = {}


def arm(grads: Iterable[torch.Tensor]) -> List[int]:
    """Take the decodes into ``grads`` (contiguous float32 CPU tensors) until
    ``take``/``release``; returns their keys."""
    keys = []
    with _lock:
        for g in grads:
            k = g.data_ptr()
            _armed[k] = g.numel()
            keys.append(k)
    return keys


def offer(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor) -> bool:
    """Keep the decode ``out = P Q^T`` for the step when ``out`` is an armed gradient
    (and the native kernel takes the three); False: the caller writes it."""
    if not _native.usable(p, qt, out, dtypes=(torch.float32,)):
        return False
    k = out.data_ptr()
    with _lock:
        if _armed.get(k) != out.numel() or int(p.shape[1]) < 1:
            return False
        _pending[k] = (p, qt, out)
        return True


def take(keys: Iterable[int]) -> Dict[int, Factors]:
    """The deferred decodes among ``keys``, removed and disarmed (the caller now
    owes each its gradient: ``native.psgd_lowrank_sgd`` or ``write``)."""
    got = {}
    with _lock:
        for k in keys:
            _armed.pop(k, None)
            f = _pending.pop(k, None)
            if f is not None:
                got[k] = f
    return got


def write(factors: Factors) -> None:
    """The decode as ``PowerSGD.decode_rounds`` writes it (``lowrank.powersgd_lowrank``)."""
    p, qt, out = factors
    lowrank.powersgd_lowrank(p, qt, out.view(int(p.shape[0]), int(qt.shape[1])))


def release(keys: Iterable[int]) -> None:
    """Disarm ``keys``; a decode still deferred among them is written into its gradient."""
    for f in take(keys).values():
        write(f)
