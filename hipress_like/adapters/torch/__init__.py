"""The PyTorch front end, shaped like ``horovod.torch``.

Switching a Horovod script is one line::

    import hipress_like.torch as hvd      # was: import horovod.torch as hvd

What is here, by module. Framework-neutral, shared with the other faces:

- ``adapters.launcher``: which launcher started the job (torchrun, mpirun,
  horovodrun, a bpslaunch-style environment or a single process).
- ``adapters.runtime``: ``init``, ``rank``, ``size``, ``local_rank``,
  ``shutdown``, ... (the process group every engine's transport joins).
- ``adapters.engine_builder``: ``compression=``/``strategy=``/``plan=`` to an
  engine over a transport of its own.
- ``adapters.compression``: the ``Compression`` namespace.
- ``adapters.collectives``: ``allreduce``, ``allgather``, ``broadcast``
  (plus in-place and async forms), over torch tensors, as this face
  re-exports them.
- ``adapters.objects``: ``broadcast_object``, ``allgather_object``,
  ``broadcast_parameters``.
- ``adapters.ordering``: ``OrderingError``.

PyTorch's own (autograd hooks, optimizers), in this package:

- ``objects``: ``broadcast_optimizer_state`` (``torch.optim`` state).
- ``optimizer``: ``DistributedOptimizer`` (gradients go to the CaSync
  engine from backward hooks).
- ``quorum``: ``DistributedOptimizer(stragglers=Quorum(...))``, partial
  aggregation over ``hipress_like.partial``'s lane.
- ``ddp``: ``CaSyncHookState`` + ``casync_hook`` for
  ``DistributedDataParallel.register_comm_hook``.
- ``horovod_calls``: the rest of ``horovod.torch``'s surface (reducescatter,
  alltoall, grouped forms, join, process sets, barrier, SyncBatchNorm, the
  timeline, sparse allreduce): handed to Horovod under horovodrun, run over
  torch.distributed where simple otherwise, else an error naming how to get it.
  Its ``synchronize``/``poll`` take either kind of handle.
"""
from ...partial import Quorum
from ...tuning.online import Adaptive
from ..basics import *  # noqa: F403 (init, rank, size, Compression, ...: every face's)
from ..basics import __all__ as _BASICS
from ..collectives import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce,
)
from ..horovod_calls import *  # noqa: F403 (reducescatter, alltoall, join, process sets, ...)
from ..horovod_calls import __all__ as _HOROVOD_CALLS
from ..objects import allgather_object, broadcast_object, broadcast_parameters
from ..ordering import OrderingError
from .ddp import CaSyncHookState, casync_hook
from .objects import broadcast_optimizer_state
from .optimizer import DistributedOptimizer

__all__ = [
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "grouped_allreduce",
    "CaSyncHookState", "casync_hook",
    "DistributedOptimizer", "OrderingError", "Quorum", "Adaptive",
] + _BASICS + _HOROVOD_CALLS  # "barrier" is in both: horovod_calls' (imported last) is the one
