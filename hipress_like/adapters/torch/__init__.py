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

PyTorch's own (autograd hooks, optimizers, torch tensors), in this package:

- ``collectives``: ``allreduce``, ``allgather``, ``broadcast`` (plus
  in-place and async forms).
- ``objects``: ``broadcast_object``, ``allgather_object``,
  ``broadcast_parameters``, ``broadcast_optimizer_state``.
- ``optimizer``: ``DistributedOptimizer`` (gradients go to the CaSync
  engine from backward hooks).
- ``quorum``: ``DistributedOptimizer(stragglers=Quorum(...))``, partial
  aggregation over ``casync.quorum``'s lane.
- ``ddp``: ``CaSyncHookState`` + ``casync_hook`` for
  ``DistributedDataParallel.register_comm_hook``.
"""
from ...casync.quorum import Quorum
from ..compression import Compression, CompressionSpec
from ..runtime import (
    barrier,
    cross_rank,
    cross_size,
    cuda_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from .collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
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
    poll,
    synchronize,
)
from .ddp import CaSyncHookState, casync_hook
from .objects import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .optimizer import DistributedOptimizer, OrderingError

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "grouped_allreduce", "poll", "synchronize",
    "Compression", "CompressionSpec", "CaSyncHookState", "casync_hook",
    "DistributedOptimizer", "OrderingError", "Quorum",
    "barrier", "cross_rank", "cross_size", "cuda_built", "gloo_built", "gloo_enabled", "init",
    "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size",
]
