"""The TensorFlow front end, shaped like ``horovod.tensorflow`` / ``horovod.tensorflow.keras``.

Switching a Horovod TensorFlow 2 script is one line::

    import hipress_like.tensorflow as hvd          # was: import horovod.tensorflow as hvd
    import hipress_like.tensorflow.keras as hvd    # was: import horovod.tensorflow.keras as hvd

The engine works on torch tensors; this package only moves TensorFlow's
tensors to it and back, and hooks into TensorFlow's and Keras's training
loops. By module:

- ``bridge``: DLPack views (zero-copy both ways) and the staging buffers
  the engine writes its averages into (TF tensors are immutable).
- ``sync``: ``GradientSync``, a gradient list in, averages out, eagerly or
  inside ``tf.function`` (through ``tf.py_function``).
- ``tape``: ``DistributedGradientTape``, ``PartialDistributedGradientTape``
  and the tape engines' checkpoint state (``compressor_state``,
  ``load_compressor_state``).
- ``optimizer`` (Keras 3) and ``optimizer_keras2`` (Keras 2): ``DistributedOptimizer`` for
  ``model.fit``.
- ``callbacks``: ``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
  ``LearningRateWarmupCallback``.
- ``collectives``: ``allreduce``, ``allgather``, ``broadcast``,
  ``broadcast_variables``, ``broadcast_object``, ``allgather_object``.
- ``horovod_calls``: the rest of ``horovod.tensorflow`` (``alltoall``,
  ``reducescatter``, the grouped forms, process sets, ``broadcast_``, the
  ``*_op`` queries), over the calls every face shares
  (``adapters.horovod_calls``).
- ``elastic``: ``TensorFlowState``, ``TensorFlowKerasState`` (``KerasState``)
  and ``run`` over the shared ``adapters.elastic``.
- ``sync_batch_norm``: ``SyncBatchNormalization`` (statistics over every rank).
- ``util``: Horovod's ``_executing_eagerly``.

Framework-neutral, shared with the other faces: ``adapters.runtime``
(``init``, ``rank``, ``size``, launchers), ``adapters.engine_builder`` and
``adapters.compression`` (the ``Compression`` namespace), and
``tuning.online.Adaptive``, the settings of ``plan="adaptive"`` (exported as
``hvd.Adaptive``, as ``hpt.Adaptive`` is by the PyTorch face).

``DistributedOptimizer`` is Keras 3's wrapper (``optimizer.py``) under
TensorFlow 2.16+, and under the Keras 2 of TensorFlow 2.15 and older (the
TensorFlows Horovod's own ops build against) a run-time subclass of the
user's optimizer class, as Horovod's (``optimizer_keras2.py``).
"""
import keras

from ...tuning.online import Adaptive
from ..basics import *  # noqa: F403 (init, rank, size, Compression, ...: every face's)
from ..basics import __all__ as _BASICS
from . import callbacks
from .callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from .collectives import (
    TFMismatchError,
    allgather,
    allgather_object,
    allreduce,
    broadcast,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
)
from .horovod_calls import (
    ProcessSet,
    TFCallError,
    add_process_set,
    alltoall,
    broadcast_,
    ccl_built,
    ddl_built,
    global_process_set,
    grouped_allgather,
    grouped_reducescatter,
    local_rank_op,
    local_size_op,
    rank_op,
    reducescatter,
    remove_process_set,
    size_op,
    start_timeline,
    stop_timeline,
)

if int(keras.__version__.split(".")[0]) >= 3:  # TensorFlow 2.16+
    from .optimizer import DistributedOptimizer
else:  # Keras 2 (TensorFlow 2.15 and older, what Horovod's TF ops build against)
    from .optimizer_keras2 import DistributedOptimizer  # type: ignore[assignment]
from . import elastic, util
from .sync import GradientSync
from .sync_batch_norm import SyncBatchNormalization
from .tape import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
    compressor_state,
    load_compressor_state,
)
from .util import _executing_eagerly  # noqa: F401 (Horovod's name; its tests call it)

__all__ = [
    "allgather", "allgather_object", "allreduce", "broadcast", "broadcast_object",
    "broadcast_variables", "grouped_allreduce",
    "Adaptive", "DistributedGradientTape", "DistributedOptimizer",
    "PartialDistributedGradientTape", "SyncBatchNormalization", "elastic", "util",
    "GradientSync", "BroadcastGlobalVariablesCallback", "LearningRateWarmupCallback",
    "MetricAverageCallback", "callbacks",
    "compressor_state", "load_compressor_state",
    "ProcessSet", "TFCallError", "TFMismatchError", "add_process_set", "alltoall", "broadcast_",
    "ccl_built",
    "ddl_built", "global_process_set", "grouped_allgather", "grouped_reducescatter",
    "local_rank_op", "local_size_op", "rank_op", "reducescatter", "remove_process_set",
    "size_op", "start_timeline", "stop_timeline",
] + _BASICS
