"""Keras callbacks of ``horovod.tensorflow.keras.callbacks``, for ``model.fit``.

- ``BroadcastGlobalVariablesCallback(root_rank)``: every rank starts from
  ``root_rank``'s model and optimizer variables. Keras 3 builds the model and
  the optimizer before ``on_train_begin``, so the broadcast happens there,
  before the first step (Horovod has to wait for the end of the first
  batch); a model built only by its first batch is broadcast after it.
- ``MetricAverageCallback()``: at the end of every epoch the metrics in
  ``logs`` are averaged over ranks (one float64 allreduce), so every rank
  reports, and callbacks such as ``ReduceLROnPlateau`` act on, the same values.
- ``LearningRateWarmupCallback(initial_lr, warmup_epochs)``: Goyal et al.'s
  gradual warm-up, as Horovod schedules it: the learning rate grows per
  batch from ``initial_lr / size()`` to ``initial_lr`` over the warm-up epochs.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import keras
import torch

from .. import collectives as _tc
from ..runtime import size
from .collectives import broadcast_variables
from .sync import var_key

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateWarmupCallback", "LearningRateScheduleCallback"]

log = logging.getLogger(__name__)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank``.

    Args:
        root_rank: the rank whose values every rank starts from.
        device: accepted for Horovod compatibility.
        local_variables: variables (or one) each rank keeps as they are, as
            Horovod's: not broadcast (model-parallel layers).

    Example:
        >>> model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None
                 ) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        if local_variables is not None and not isinstance(local_variables, (list, tuple)):
            local_variables = [local_variables]
        self._local = {var_key(v) for v in local_variables or []}

    def _broadcast(self) -> None:
        def shared(vs: Any) -> list:
            return [v for v in vs if var_key(v) not in self._local]

        broadcast_variables(shared(self.model.variables), root_rank=self.root_rank)
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and getattr(opt, "built", False):
            broadcast_variables(shared(opt.variables), root_rank=self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        """Broadcast now if the model is built (Keras 3 builds it before fit starts)."""
        if not self.broadcast_done and getattr(self.model, "built", False):
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Broadcast after the first batch if ``on_train_begin`` could not."""
        if not self.broadcast_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics over ranks (place it before callbacks that read them).

    Example:
        >>> callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        ...              hvd.callbacks.MetricAverageCallback()]
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Replace every numeric entry of ``logs`` by its average over ranks."""
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        if not keys:
            return
        values = torch.tensor([float(logs[k]) for k in keys], dtype=torch.float64)
        avg = _tc.allreduce(values, name=f"metrics of epoch {epoch}")
        for k, v in zip(keys, avg.tolist()):
            logs[k] = v


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Warm the learning rate up from ``initial_lr / size()`` to ``initial_lr``.

    The multiplier of epoch ``e`` (fractional: ``epoch + batch / steps``) is
    ``(e * (size - 1) / warmup_epochs + 1) / size`` (Horovod's schedule).

    Args:
        initial_lr: the learning rate after the warm-up (usually scaled by
            ``size()``).
        warmup_epochs: epochs of warm-up.
        momentum_correction: accepted for Horovod compatibility (not applied).
        steps_per_epoch: batches per epoch (default: what ``fit`` reports).
        verbose: log the end of the warm-up (at INFO).
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0) -> None:
        super().__init__()
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0

    def _lr(self, epoch: float) -> float:
        n = size()
        return self.initial_lr * (epoch * (n - 1) / self.warmup_epochs + 1) / n

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Remember the epoch (batches are counted within it)."""
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Set this batch's warm-up learning rate."""
        if self._epoch >= self.warmup_epochs:
            return
        steps = self.steps_per_epoch or (self.params or {}).get("steps") or 1
        self.model.optimizer.learning_rate = self._lr(self._epoch + batch / steps)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Land exactly on ``initial_lr`` when the warm-up ends."""
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate = self.initial_lr
            if self.verbose:
                log.info("epoch %d: finished gradual learning rate warm-up to %g",
                         epoch + 1, self.initial_lr)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` (Horovod's schedule).

    Between ``start_epoch`` and ``end_epoch`` (exclusive; None: to the end), at
    the first batch of each epoch (``staircase``) or at every batch with the
    fractional epoch ``epoch + batch / steps_per_epoch``.

    Args:
        initial_lr: the learning rate the multiplier scales (required).
        multiplier: a function of the epoch, or a number ``m`` for
            ``m ** (epoch - start_epoch)`` (exponential decay).
        start_epoch, end_epoch: the epochs it acts in.
        staircase: once per epoch (True) or every batch.
        momentum_correction: accepted for Horovod compatibility (not applied).
        steps_per_epoch: batches per epoch (default: what ``fit`` reports).

    Raises:
        ValueError: no ``initial_lr``.
    """

    def __init__(self, initial_lr: float, multiplier: Any, start_epoch: int = 0,
                 end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None
                 ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("LearningRateScheduleCallback needs initial_lr")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (
            lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Remember the epoch (batches are counted within it)."""
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Set this batch's learning rate when the schedule acts on it."""
        if self._epoch < self.start_epoch or (self.end_epoch is not None
                                              and self._epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(
                    self._epoch)
            return
        steps = self.steps_per_epoch or (self.params or {}).get("steps") or 1
        self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(
            self._epoch + batch / steps)


def _is_number(v: Any) -> bool:
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False
