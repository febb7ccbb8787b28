"""``horovod.tensorflow.util``'s helper that Horovod's TensorFlow scripts and tests call.

``hvd._executing_eagerly()`` (and ``hvd.util._executing_eagerly()``) tell a
script written for both TensorFlow 1's graphs and TensorFlow 2's eager mode
which one it is in; the face exports them under Horovod's names.
"""
from __future__ import annotations

import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (False while building a graph or tracing a
    ``tf.function``): Horovod's ``util._executing_eagerly``."""
    return tf.executing_eagerly()
