"""The PyTorch front end, shaped like ``horovod.torch``.

Switching a Horovod script is one line::

    import hipress_like.torch as hvd      # was: import horovod.torch as hvd

What is here, by module:

- ``torch_runtime``: ``init`` (torchrun's env://, mpirun, or a single
  process), ``rank``, ``size``, ``local_rank``, ``shutdown``, ...
- ``torch_collectives``: ``allreduce``, ``allgather``, ``broadcast`` (plus
  in-place and async forms).
- ``torch_objects``: ``broadcast_object``, ``allgather_object``,
  ``broadcast_parameters``, ``broadcast_optimizer_state``.
- ``torch_compression``: the ``Compression`` namespace.
- ``torch_optimizer``: ``DistributedOptimizer`` (gradients go to the CaSync
  engine from backward hooks).
- ``torch_ddp``: ``CaSyncHookState`` + ``casync_hook`` for
  ``DistributedDataParallel.register_comm_hook``.
"""
from .torch_collectives import (
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
from .torch_compression import Compression, CompressionSpec
from .torch_ddp import CaSyncHookState, casync_hook
from .torch_objects import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .torch_optimizer import DistributedOptimizer, OrderingError
from .torch_runtime import (
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

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "grouped_allreduce", "poll", "synchronize",
    "Compression", "CompressionSpec", "CaSyncHookState", "casync_hook",
    "DistributedOptimizer", "OrderingError",
    "barrier", "cross_rank", "cross_size", "cuda_built", "gloo_built", "gloo_enabled", "init",
    "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size",
]
