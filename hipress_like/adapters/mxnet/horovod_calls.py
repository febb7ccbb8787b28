"""Horovod's MXNet calls this project does not implement itself, over the PyTorch face's.

``horovod.mxnet`` has ``alltoall``, ``reducescatter`` and the grouped forms,
process sets and the build queries beside the collectives this project owns
(``collectives``). The PyTorch face already decides, per call, where each of
them runs (``adapters.torch.horovod_calls``): handed to Horovod's own op under
``horovodrun``, over torch.distributed otherwise. This module hands MXNet's
arrays to those calls without a copy (DLPack, ``tensors.as_torch``) and the
results back as new NDArrays on the input's context, so both faces share one
implementation, one set of checks and one set of error messages. Process sets
are the PyTorch face's objects: ``add_process_set`` returns one, and every
collective of this face takes it as ``process_set=``.

``priority`` (Horovod's hint to MXNet's engine) is accepted and ignored: each
call blocks until its result is ready, as Horovod's MXNet ops do on return.
Arguments the calls refuse raise ``MXNetCallError``: a ``ValueError`` as the
PyTorch face raises, and a ``RuntimeError`` as ``horovod.mxnet``'s
``MXNetError`` is, so a Horovod script's handler catches it.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ...errors import HipressError
from .. import collectives as _tc
from .. import horovod_calls as _hc
from ..horovod_calls import (
    ProcessSet,
    add_process_set,
    ccl_built,
    ddl_built,
    global_process_set,
    refused_as,
    remove_process_set,
    start_timeline,
    stop_timeline,
)
from .tensors import as_torch, check_dense, to_mxnet

__all__ = [
    "MXNetCallError", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "ccl_built", "ddl_built", "start_timeline", "stop_timeline",
    "alltoall", "reducescatter", "grouped_reducescatter", "grouped_allgather",
]



class MXNetCallError(HipressError, ValueError, RuntimeError):
    """A call of the MXNet face refused its arguments (see the module docstring)."""




def _splits(splits: Any) -> Any:
    """Horovod's MXNet ``splits``: an NDArray, a list, or None, as an int tensor."""
    if splits is None:
        return None
    import mxnet as mx
    import torch

    if isinstance(splits, mx.nd.NDArray):
        return as_torch(splits, write=False)
    return torch.tensor(list(splits), dtype=torch.int32)


def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None, priority: int = 0,
             process_set: Any = None) -> Any:
    """Send ``splits[r]`` rows of ``tensor`` to rank ``r``; gather what each rank sends.

    Args:
        tensor: a dense NDArray, at least 1-D.
        splits: rows per destination rank (int32 NDArray or a list); None: equal.
        name: label for error messages.
        priority: accepted for Horovod compatibility; ignored.
        process_set: a set from ``add_process_set``; default: every rank.

    Returns:
        The received rows (rank order); with ``splits`` given, also an int32
        NDArray of the rows received from each rank, as ``horovod.mxnet`` returns.
    """
    check_dense(tensor, "alltoall")
    with refused_as(MXNetCallError, "alltoall"):
        out = _hc.alltoall(as_torch(tensor, write=False), _splits(splits), name, process_set)
    if splits is None:
        return to_mxnet(out, tensor)
    import mxnet as mx

    data, received = out
    return to_mxnet(data, tensor), mx.nd.array(received.numpy(), dtype="int32")


def reducescatter(tensor: Any, op: Optional[str] = _tc.Average, name: Optional[str] = None,
                  priority: int = 0, process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce ``tensor`` over the ranks and keep this rank's rows (Horovod's split: the
    first ``rows % size`` ranks get one row more); a new NDArray.

    Args:
        tensor: a dense NDArray, at least 1-D.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        name: label for error messages.
        priority: accepted for Horovod compatibility; ignored.
        process_set: a set from ``add_process_set``; default: every rank.
        prescale_factor, postscale_factor: multiply before / after reducing.
    """
    check_dense(tensor, "reducescatter")
    with refused_as(MXNetCallError, "reducescatter"):
        out = _hc.reducescatter(as_torch(tensor, write=False), name=name, op=op,
                                process_set=process_set, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor)
    return to_mxnet(out, tensor)


def grouped_reducescatter(tensors: Sequence[Any], op: Optional[str] = _tc.Average,
                          name: Optional[str] = None, priority: int = 0,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[Any]:
    """``reducescatter`` of every array in the list (all in flight together)."""
    for t in tensors:
        check_dense(t, "grouped_reducescatter")
    with refused_as(MXNetCallError, "grouped_reducescatter"):
        outs = _hc.grouped_reducescatter([as_torch(t, write=False) for t in tensors],
                                         name=name, op=op, process_set=process_set,
                                         prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor)
    return [to_mxnet(o, t) for o, t in zip(outs, tensors)]


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None, priority: int = 0,
                      process_set: Any = None) -> List[Any]:
    """``allgather`` of every array in the list: each rank's rows concatenated."""
    for t in tensors:
        check_dense(t, "grouped_allgather")
    with refused_as(MXNetCallError, "grouped_allgather"):
        outs = _hc.grouped_allgather([as_torch(t, write=False) for t in tensors], name=name,
                                     process_set=process_set)
    return [to_mxnet(o, t) for o, t in zip(outs, tensors)]
