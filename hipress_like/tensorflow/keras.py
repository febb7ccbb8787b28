"""``import hipress_like.tensorflow.keras as hvd``: the face of ``horovod.tensorflow.keras``.

The same names as ``hipress_like.tensorflow`` (``init``, ``rank``, ``size``,
``DistributedOptimizer``, ``allreduce``, ``broadcast_variables``, ...) plus
``callbacks`` (``hvd.callbacks.BroadcastGlobalVariablesCallback(0)``,
``hvd.callbacks.MetricAverageCallback()``) and ``broadcast_global_variables``.
Example, the shape of Horovod's Keras examples::

    import hipress_like.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])
"""
from typing import Any

from ..adapters.tensorflow import *  # noqa: F401,F403
from ..adapters.tensorflow import __all__ as _all
from ..adapters.tensorflow import (
    _executing_eagerly,  # noqa: F401 (Horovod's name)
    callbacks,  # noqa: F401
)
from ..adapters.tensorflow import broadcast_variables as _broadcast_variables


def broadcast_global_variables(root_rank: int, model: Any = None) -> None:
    """Broadcast ``model``'s variables (and its optimizer's) from ``root_rank``.

    Horovod's TF1-era name; with Keras 3 there are no global variables, so
    the model is needed.

    Raises:
        ValueError: no ``model`` given.
    """
    if model is None:
        raise ValueError("Keras 3 has no global variables: pass the model, "
                         "broadcast_global_variables(0, model), or use "
                         "hvd.callbacks.BroadcastGlobalVariablesCallback(0) in fit")
    _broadcast_variables(model.variables, root_rank)
    opt = getattr(model, "optimizer", None)
    if opt is not None and getattr(opt, "built", False):
        _broadcast_variables(opt.variables, root_rank)


__all__ = [*_all, "broadcast_global_variables"]


def __getattr__(name: str):  # noqa: ANN202 (PEP 562)
    """Horovod's own names this face does not define (``BroadcastGlobalVariablesHook``,
    ``PartialDistributedOptimizer``, ...): ``horovod.tensorflow.keras``'s under horovodrun with
    Horovod's TensorFlow ops, else an ``AttributeError`` saying how to get them
    (``adapters/tensorflow/native.py``)."""
    from ..adapters.tensorflow.native import face_getattr

    return face_getattr(name, "horovod.tensorflow.keras")
