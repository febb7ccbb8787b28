"""Horovod's basic calls, the same in every face: one list, re-exported by each.

``init``, ``rank``, ``size``, ``local_rank``, ... come from ``runtime`` (the
process group every engine's transport joins), ``Compression`` from
``compression`` and the reduction ops (``Average``, ``Sum``, ...) from
``collectives``; ``hipress_like.torch``, ``.tensorflow`` and ``.mxnet``
each re-export this module's ``__all__``, so a name added here reaches
every face at once and no face's list drifts from the others.
"""
from .collectives import Adasum, Average, Max, Min, Product, Sum
from .compression import Compression, CompressionSpec
from .runtime import (
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
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "Compression", "CompressionSpec",
    "barrier", "cross_rank", "cross_size", "cuda_built", "gloo_built", "gloo_enabled", "init",
    "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size",
]
