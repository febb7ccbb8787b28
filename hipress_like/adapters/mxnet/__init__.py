"""The MXNet front end, shaped like ``horovod.mxnet`` (Gluon).

Switching a Horovod script is one line::

    import hipress_like.mxnet as hvd      # was: import horovod.mxnet as hvd

The engine, the compressors and the process group are the framework-neutral
ones (``adapters.runtime``, ``adapters.engine_builder``,
``adapters.compression``) and run on torch tensors; this package only
hands MXNet's arrays to them without copying (DLPack, ``tensors``):

- ``trainer``: ``DistributedTrainer``, a Gluon ``Trainer`` whose gradients
  are averaged by CaSync (compression, PS/Ring strategy, plans; with
  ``plan="adaptive"``, ``hvd.Adaptive``, re-planned while training runs), with
  the compressor state in ``save_states``/``load_states``.
- ``optimizer``: ``DistributedOptimizer``, Horovod's per-update allreduce
  around any ``mx.optimizer.Optimizer`` (no compression beyond fp16).
- ``parameters``: ``broadcast_parameters`` (deferred initialisation too).
- ``collectives``: ``allreduce``, ``allgather``, ``broadcast`` (and
  in-place forms), ``broadcast_object``, ``allgather_object``.
- ``horovod_calls``: the rest of ``horovod.mxnet`` (``alltoall``,
  ``reducescatter``, the grouped forms, process sets), over the PyTorch
  face's calls: Horovod's own ops under ``horovodrun``, torch.distributed
  otherwise.

``init()`` joins the ranks exactly as the PyTorch face does (torchrun's
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``, mpirun through
mpi4py, a bpslaunch-style environment, or a single process). MXNet needs
numpy 1.23.5, so it lives in its own environment: ``scripts/env_mxnet.sh``.
"""
from ...tuning.online import Adaptive
from ..basics import *  # noqa: F403 (init, rank, size, Compression, ...: every face's)
from ..basics import __all__ as _BASICS
from .collectives import (
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    broadcast,
    broadcast_,
    broadcast_object,
    grouped_allreduce,
    grouped_allreduce_,
)
from .horovod_calls import (
    MXNetCallError,
    ProcessSet,
    add_process_set,
    alltoall,
    ccl_built,
    ddl_built,
    global_process_set,
    grouped_allgather,
    grouped_reducescatter,
    reducescatter,
    remove_process_set,
    start_timeline,
    stop_timeline,
)
from .optimizer import DistributedOptimizer
from .parameters import broadcast_parameters
from .trainer import STATE_SUFFIX, DistributedTrainer, OrderingError

__all__ = [
    "allgather", "allgather_object", "allreduce", "allreduce_", "broadcast", "broadcast_",
    "broadcast_object", "grouped_allreduce", "grouped_allreduce_",
    "MXNetCallError", "ProcessSet", "add_process_set", "alltoall", "ccl_built", "ddl_built",
    "global_process_set", "grouped_allgather", "grouped_reducescatter", "reducescatter",
    "remove_process_set", "start_timeline", "stop_timeline",
    "Adaptive", "DistributedOptimizer", "DistributedTrainer",
    "OrderingError", "STATE_SUFFIX", "broadcast_parameters",
] + _BASICS
