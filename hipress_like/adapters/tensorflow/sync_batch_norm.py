"""``SyncBatchNormalization``: batch normalization whose statistics are the whole batch's,
across every rank (Horovod's ``hvd.SyncBatchNormalization``).

In training each rank normalizes with the mean and variance of the global
batch, not of its own shard: the layer computes its shard's mean ``m_r`` and
mean of squares ``m_r^2 + v_r``, averages both over the ranks with this face's
``allreduce`` (differentiable, so the gradient flows through the other
ranks' statistics as well), and takes ``Var[X] = E[X^2] - E[X]^2``: the
statistics of the concatenated batch when every rank's shard has the same
size (as Horovod's assumes). The moving averages then follow the global
batch on every rank. Inference uses the moving averages, with no collective.

Keras 2 and Keras 3 both compute a layer's moments in ``_moments`` (with
different arguments); this class overrides it and leaves the rest of
``BatchNormalization`` as it is. Keras 2's fused kernel skips ``_moments``,
so it is refused there, as Horovod refuses it.
"""
from __future__ import annotations

from typing import Any, Tuple

import keras
import tensorflow as tf

from ..runtime import size
from .collectives import Sum, allreduce

__all__ = ["SyncBatchNormalization"]

_KERAS2 = int(keras.__version__.split(".")[0]) < 3


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with the statistics of the batch over all ranks.

    Args:
        fused: must be False (Keras 2's fused kernel computes its moments
            itself; Keras 3 has no fused option).
        **kwargs: ``BatchNormalization``'s (``axis``, ``momentum``, ``epsilon``, ...).

    Raises:
        ValueError: ``fused`` is True or None.

    Example:
        >>> layer = hvd.SyncBatchNormalization(axis=-1)   # in place of BatchNormalization
    """

    def __init__(self, fused: Any = False, **kwargs: Any) -> None:
        if fused is None or fused:
            raise ValueError("SyncBatchNormalization does not support fused=True (the fused "
                             "kernel computes the moments itself, so they could not be "
                             "synchronized)")
        if _KERAS2:
            kwargs["fused"] = False
        super().__init__(**kwargs)

    def _moments(self, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
        mean, variance = super()._moments(*args, **kwargs)
        n = size()
        if n == 1:
            return mean, variance
        # Var[X] = E[X^2] - E[X]^2, with E over every rank's shard (equal shard sizes)
        both = allreduce(tf.stack([mean, variance + tf.square(mean)]), op=Sum) / n
        group_mean, group_mean_of_square = tf.unstack(both)
        return group_mean, group_mean_of_square - tf.square(group_mean)
