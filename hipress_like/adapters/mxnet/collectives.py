"""Horovod's MXNet collectives (``allreduce``, ``allgather``, ``broadcast``, objects).

Each takes and returns ``mx.nd.NDArray`` and runs the framework-neutral
collective (``adapters.collectives``, over the runtime's wire:
torch.distributed's default group, or Horovod) on a DLPack view of the
array, so the reductions, the dtype handling (int16 and unsigned types
Horovod accepts) and the error messages are written once. In-place forms
(``allreduce_``, ``broadcast_``) write into the array's own memory; the
others return a new NDArray on the input's context.

``priority`` (Horovod's scheduling hint to MXNet's engine) is accepted and
ignored: each call is blocking here. Gradients go through the CaSync engine
(``DistributedTrainer``), not through these.
"""
from __future__ import annotations

from typing import Any, List, Optional

from .. import collectives as _tc
from .. import objects as _to
from .tensors import as_torch, check_dense, to_mxnet

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
    "broadcast", "broadcast_", "broadcast_object", "allgather_object",
]

Average, Sum, Adasum, Min, Max, Product = (_tc.Average, _tc.Sum, _tc.Adasum, _tc.Min, _tc.Max,
                                          _tc.Product)


def allreduce(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None, op: Optional[str] = None, *,
              compression: Any = None) -> Any:
    """Reduce ``tensor`` over all ranks into a new NDArray (default: the average).

    Args:
        tensor: a dense NDArray, the same shape and dtype on every rank.
        average: Horovod's deprecated flag (True: Average, False: Sum).
        name: label used in error messages.
        priority: accepted for Horovod compatibility; ignored.
        prescale_factor, postscale_factor: multiply before / after reducing.
        process_set: only ``None`` (all ranks).
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        compression: ``Compression.none``/``fp16``, or a single-round CompLL
            compressor (every rank decodes every payload in rank order, so
            the results are bitwise identical).

    Example:
        >>> hvd.allreduce(mx.nd.array([hvd.rank()]))   # 4 ranks
        [1.5]
    """
    check_dense(tensor, "allreduce")
    out = _tc.allreduce(as_torch(tensor, write=False), average, name, compression, op,
                        prescale_factor, postscale_factor, process_set)
    return to_mxnet(out, tensor)


def allreduce_(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
               priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None, op: Optional[str] = None) -> Any:
    """In-place ``allreduce`` (``Compression.none``); returns ``tensor``."""
    check_dense(tensor, "allreduce_")
    _tc.allreduce_(as_torch(tensor), average, name, op, prescale_factor, postscale_factor,
                   process_set)
    return tensor


def grouped_allreduce(tensors: List[Any], average: Optional[bool] = None,
                      name: Optional[str] = None, priority: int = 0,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = None, op: Optional[str] = None) -> List[Any]:
    """``allreduce`` of every tensor in the list (all in flight together); new NDArrays."""
    for t in tensors:
        check_dense(t, "grouped_allreduce")
    outs = _tc.grouped_allreduce([as_torch(t, write=False) for t in tensors], average, name,
                                 None, op, prescale_factor, postscale_factor, process_set)
    return [to_mxnet(o, t) for o, t in zip(outs, tensors)]


def grouped_allreduce_(tensors: List[Any], average: Optional[bool] = None,
                       name: Optional[str] = None, priority: int = 0,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = None, op: Optional[str] = None) -> List[Any]:
    """In-place ``grouped_allreduce``; returns ``tensors``."""
    for t in tensors:
        check_dense(t, "grouped_allreduce_")
    handles = [_tc.allreduce_async_(as_torch(t), average, name, op, prescale_factor,
                                    postscale_factor, process_set) for t in tensors]
    for h in handles:
        h.wait()
    return tensors


def allgather(tensor: Any, name: Optional[str] = None, priority: int = 0,
              process_set: Any = None) -> Any:
    """Concatenate every rank's ``tensor`` along axis 0 (first dimensions may differ)."""
    check_dense(tensor, "allgather")
    return to_mxnet(_tc.allgather(as_torch(tensor, write=False), name, process_set), tensor)


def broadcast_(tensor: Any, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set: Any = None) -> Any:
    """Overwrite ``tensor`` with ``root_rank``'s value, in place; returns it."""
    check_dense(tensor, "broadcast_")
    _tc.broadcast_(as_torch(tensor), root_rank, name, process_set)
    return tensor


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, priority: int = 0,
              process_set: Any = None) -> Any:
    """A new NDArray holding ``root_rank``'s value of ``tensor``."""
    check_dense(tensor, "broadcast")
    return to_mxnet(_tc.broadcast(as_torch(tensor, write=False), root_rank, name, process_set),
                    tensor)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = None) -> Any:
    """Send plain data (numbers, strings, lists, dicts, torch tensors) from ``root_rank``.

    NDArrays do not travel inside objects (nothing received is unpickled):
    convert them with ``.asnumpy().tolist()`` or broadcast them with
    ``broadcast_``.
    """
    return _to.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = None) -> List[Any]:
    """Gather plain data from every rank; list index = rank."""
    return _to.allgather_object(obj, name, process_set)
