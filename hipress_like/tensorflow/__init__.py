"""``import hipress_like.tensorflow as hvd``: the TensorFlow face (like ``horovod.tensorflow``).

A thin re-export of ``hipress_like.adapters.tensorflow``; see that package
for what each name does and how gradients cross into the engine (DLPack
views, a staging buffer per gradient, ``tf.py_function`` inside
``tf.function``). ``hipress_like.tensorflow.keras`` is the
``horovod.tensorflow.keras`` face. Example::

    import hipress_like.tensorflow as hvd
    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.onebit)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))

Needs TensorFlow (``pip install hipress-like[tensorflow]``, or
``scripts/env_tensorflow.sh`` for a ready environment).
"""
from ..adapters.tensorflow import *  # noqa: F401,F403
from ..adapters.tensorflow import (
    __all__,  # noqa: F401
    _executing_eagerly,  # noqa: F401 (Horovod's name)
)


def __getattr__(name: str):  # noqa: ANN202 (PEP 562)
    """Horovod's own names this face does not define (``BroadcastGlobalVariablesHook``,
    ``PartialDistributedOptimizer``, ...): ``horovod.tensorflow``'s under horovodrun with
    Horovod's TensorFlow ops, else an ``AttributeError`` saying how to get them
    (``adapters/tensorflow/native.py``)."""
    from ..adapters.tensorflow.native import face_getattr

    return face_getattr(name, "horovod.tensorflow")
