"""Optimizer state across ranks: the one object collective that is PyTorch's own.

``broadcast_optimizer_state`` reads and loads a ``torch.optim`` state dict;
it travels through the framework-neutral ``broadcast_object``
(``adapters/objects.py``, with ``allgather_object`` and
``broadcast_parameters``, which every face shares).
"""
from __future__ import annotations

from typing import Any

import torch

from ..collectives import _dist, _no_process_set
from ..objects import broadcast_object
from ..runtime import _require

__all__ = ["broadcast_optimizer_state"]


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0, model: Any = None,
                              process_set: Any = None) -> None:
    """Make every rank's optimizer state (and hyper-parameters) equal ``root_rank``'s.

    Works on a plain ``torch.optim`` optimizer or a ``DistributedOptimizer``;
    the wrapped optimizer's ``state_dict`` travels through
    ``broadcast_object``. Per-rank compressor state (error-feedback
    residuals) is not broadcast: it is each rank's own.

    On an optimizer that has not stepped yet, parameters that require a
    gradient and have none get a zero ``.grad``, as after Horovod's call
    (scripts read or broadcast ``p.grad`` right after it). Unlike Horovod,
    no optimizer step is taken to create the state: an empty state is
    already equal everywhere, and a zero step would move parameters under
    weight decay and start Adam's step count at 1.

    Example:
        >>> hpt.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    from torch.optim import Optimizer

    _dist()
    _no_process_set(process_set)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, found {type(optimizer).__name__}")
    is_root = _require().rank == root_rank
    if not optimizer.state:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    sd = Optimizer.state_dict(optimizer) if is_root else None
    sd = broadcast_object(sd, root_rank, "broadcast_optimizer_state")
    if not is_root:
        Optimizer.load_state_dict(optimizer, sd)
