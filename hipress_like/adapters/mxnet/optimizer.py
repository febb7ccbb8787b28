"""``DistributedOptimizer``: an ``mx.optimizer.Optimizer`` that averages each gradient
before updating, like ``horovod.mxnet.DistributedOptimizer``.

It wraps any MXNet optimizer: each ``update(index, weight, grad, state)``
(or ``update_multi_precision``, with one index or a list of them, as
Gluon's ``Updater`` aggregates them) first averages ``grad`` over the ranks
in place, then lets the wrapped optimizer update. That is Horovod's design:
one blocking allreduce per update call through the default group, for
scripts that hand an optimizer to ``gluon.Trainer(..., kvstore=None)`` or
to the Module API.

Only ``Compression.none`` and ``Compression.fp16`` apply here, because an
update call sees a few gradients at a time and CaSync pipelines a whole
step; ``DistributedTrainer`` is the CaSync path (compression, PS/Ring,
plans).
"""
from __future__ import annotations

from typing import Any, Dict

import mxnet as mx

from .. import collectives as _tc
from .tensors import as_torch

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Average every gradient over the ranks, then update with the wrapped optimizer.

    Attributes not set here (``lr``, ``wd``, ``rescale_grad``,
    ``param_dict``, ...) are read from and written to the wrapped optimizer,
    so ``gluon.Trainer`` and learning-rate schedulers configure it as usual.

    Args:
        optimizer: the ``mx.optimizer.Optimizer`` to wrap.
        gradient_predivide_factor: Horovod option; averaging is exact here,
            so it does not change the result.
        num_groups: Horovod's fusion option; accepted and ignored.
        process_set: average over this set only (``add_process_set``); a rank
            outside it updates with its own gradient, as Horovod's does.
        compression: ``Compression.none`` (default) or ``Compression.fp16``.

    Raises:
        TypeError: ``optimizer`` is not an MXNet optimizer.
        ValueError: another compressor (use ``DistributedTrainer``).

    Example:
        >>> opt = mx.optimizer.create("sgd", learning_rate=0.05 * hvd.size())
        >>> opt = hvd.DistributedOptimizer(opt)
        >>> trainer = mx.gluon.Trainer(net.collect_params(), opt, kvstore=None)
    """

    def __init__(self, optimizer: Any, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: Any = None, compression: Any = None):
        # The wrapped optimizer holds every setting and counter; this object holds
        # only the wrapper's own fields, so Optimizer.__init__ is not called.
        if not isinstance(optimizer, mx.optimizer.Optimizer) or \
                isinstance(optimizer, DistributedOptimizer):
            raise TypeError(f"expected an mx.optimizer.Optimizer, found "
                            f"{type(optimizer).__name__}")
        spec = _tc._spec(compression)
        if spec.name not in ("identity", "fp16"):
            raise ValueError(f"DistributedOptimizer supports Compression.none and "
                             f"Compression.fp16, found {spec!r}; for CaSync compression use "
                             "hvd.DistributedTrainer(params, optimizer, compression=...)")
        object.__setattr__(self, "_hp_inner", optimizer)
        object.__setattr__(self, "_hp_compression", spec)
        object.__setattr__(self, "_hp_process_set", process_set)

    def unwrap(self) -> mx.optimizer.Optimizer:
        """The wrapped optimizer."""
        return self._hp_inner

    # -- forwarding ---------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_hp") or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        return getattr(self._hp_inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_hp"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._hp_inner, name, value)

    def __getstate__(self) -> Dict[str, Any]:
        return {"_hp_inner": self._hp_inner, "_hp_compression": self._hp_compression}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)

    @property
    def learning_rate(self) -> float:
        """The wrapped optimizer's current learning rate."""
        return self._hp_inner.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Set the wrapped optimizer's learning rate."""
        self._hp_inner.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: Dict[Any, float]) -> None:
        """Forwarded to the wrapped optimizer."""
        self._hp_inner.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: Dict[Any, float]) -> None:
        """Forwarded to the wrapped optimizer."""
        self._hp_inner.set_wd_mult(args_wd_mult)

    def create_state(self, index: Any, weight: Any) -> Any:
        """The wrapped optimizer's state for one weight."""
        return self._hp_inner.create_state(index, weight)

    def create_state_multi_precision(self, index: Any, weight: Any) -> Any:
        """The wrapped optimizer's state for one weight (with an fp32 master copy)."""
        return self._hp_inner.create_state_multi_precision(index, weight)

    # -- the update -----------------------------------------------------------------------
    def _hp_average(self, index: Any, grad: Any) -> None:
        ps = self._hp_process_set
        if ps is not None and (not ps.included() or ps.size() == 1):
            return  # Horovod's rule: outside the set (or alone in it), no averaging
        if isinstance(index, (list, tuple)):
            handles = [_tc.allreduce_async_(as_torch(g), name=f"grad.{i}", process_set=ps,
                                            compression=self._hp_compression)
                       for i, g in zip(index, grad)]
        else:
            handles = [_tc.allreduce_async_(as_torch(grad), name=f"grad.{index}",
                                            process_set=ps, compression=self._hp_compression)]
        for h in handles:
            h.wait()

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Average ``grad`` (one array or a list) over the ranks, then update ``weight``."""
        self._hp_average(index, grad)
        self._hp_inner.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        """Like ``update``, for optimizers keeping an fp32 master copy of fp16 weights."""
        self._hp_average(index, grad)
        self._hp_inner.update_multi_precision(index, weight, grad, state)
