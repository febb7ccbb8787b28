"""Horovod's TensorFlow calls this project does not implement itself, over the shared ones.

``horovod.tensorflow`` has ``alltoall``, ``reducescatter``, the grouped forms,
process sets, ``broadcast_`` and the ``*_op`` queries beside the collectives
this project owns (``collectives``). Where each of them runs is decided once,
for every face, in ``adapters.horovod_calls``: Horovod's own op under
``horovodrun``, torch.distributed otherwise. This module hands TensorFlow's
tensors to those calls (DLPack, ``bridge``), eagerly or inside ``tf.function``
(``tf.py_function``, as ``collectives`` does), and returns TF tensors.
Process sets are the shared objects: ``add_process_set`` returns one, and
every collective of this face takes it as ``process_set=``.

Gradients: as this face's ``allreduce``/``allgather``, these calls carry the
gradients Horovod registers for its ops: an alltoall's is the alltoall of
the upstream gradient back along the received splits; a reducescatter's, the
allgather of the upstream gradient (times the set's size for ``Sum``, and the
pre- and postscale factors). Arguments they refuse raise ``TFCallError``: a
``ValueError`` as the PyTorch face raises, and a ``tf.errors.InvalidArgumentError``
(a ``RuntimeError`` too), which is what ``horovod.tensorflow``'s ops raise for
arguments they refuse. Inside a graph, TensorFlow turns any ``ValueError`` a
``tf.py_function`` raises into ``InvalidArgumentError`` itself, and any other
error into ``UnknownError``: it keeps no other error class, so a mismatch
between ranks, which Horovod's ops raise as ``FailedPreconditionError``, is
``InvalidArgumentError`` there.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import tensorflow as tf

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
from ..runtime import local_rank, local_size
from .bridge import as_tf, as_torch, to_torch_dtype
from .collectives import (
    _average_gradient,
    _differentiable,
    _eager_or_graph,
    _eagerly,
    _own_rows,
    _py_collective,
    allgather,
    broadcast,
)
from .native import handed

__all__ = [
    "TFCallError", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "ccl_built", "ddl_built", "start_timeline", "stop_timeline",
    "alltoall", "reducescatter", "grouped_reducescatter", "grouped_allgather", "broadcast_",
    "size_op", "rank_op", "local_size_op", "local_rank_op",
]



class TFCallError(HipressError, tf.errors.InvalidArgumentError, ValueError, RuntimeError):
    """A call of the TensorFlow face refused its arguments (see the module docstring)."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)
        self.args = (message,)




def _rows_unknown(tensor: tf.Tensor) -> tf.TensorShape:
    return (tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank
            else tensor.shape)


@tf.autograph.experimental.do_not_convert
@handed
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             ignore_name_scope: bool = False, process_set: Any = None) -> Any:
    """Send ``splits[r]`` rows of ``tensor`` to rank ``r``; gather what each rank sends.

    Eager or inside ``tf.function`` (one ``tf.py_function`` with both outputs).

    Args:
        tensor: at least 1-D.
        splits: rows per destination rank (an int32 tensor or a list); None: an
            equal split (the rows must divide by the number of ranks).
        name: label for error messages.
        ignore_name_scope: accepted for Horovod compatibility.
        process_set: a set from ``add_process_set``; default: every rank.

    Returns:
        the received rows; with ``splits`` given, ``(received rows, rows received
        from each rank)`` (the second an int32 tensor), as ``horovod.tensorflow``
        returns them.
    """
    import torch

    tensor = tf.convert_to_tensor(tensor)
    to_torch_dtype(tensor.dtype, "alltoall's tensor")
    given = splits is not None
    split_in = (tf.reshape(tf.cast(tf.convert_to_tensor(splits), tf.int32), [-1]) if given
                else tf.zeros([0], tf.int32))

    def body(t: tf.Tensor, sp: tf.Tensor) -> List[tf.Tensor]:
        x = as_torch(t)
        n = _hc._set_size(process_set)
        s = torch.tensor(sp.numpy(), dtype=torch.int32) if given else None
        if s is None and x.dim() and x.shape[0] % n == 0:
            s = torch.full((n,), x.shape[0] // n, dtype=torch.int32)  # the equal split
        with refused_as(TFCallError, "alltoall"):
            out = _hc.alltoall(x, s, name, process_set)  # s None: refused, with the reason
        data, recv = out
        res = as_tf(data)
        return [res if res.dtype == t.dtype else tf.cast(res, t.dtype),
                tf.constant(recv.numpy(), dtype=tf.int32)]

    def forward(x: tf.Tensor) -> Any:
        if tf.executing_eagerly():
            data, recv = _eagerly(body, x, split_in)
            return data, recv
        data, recv = _py_collective(body, [x, split_in], [x.dtype, tf.int32],
                                    "hipress_alltoall")
        data.set_shape(_rows_unknown(x))
        recv.set_shape([None])
        return data, recv

    def backward(dy: tf.Tensor, out: Any) -> tf.Tensor:  # Horovod's _alltoall_grad
        return alltoall(dy, splits=out[1], process_set=process_set)[0]

    data, recv = _differentiable(forward, backward, tensor)
    return (data, recv) if given else data  # horovod.tensorflow's: the splits only if given


@tf.autograph.experimental.do_not_convert
@handed
def reducescatter(tensor: Any, op: Optional[str] = _tc.Average, name: Optional[str] = None,
                  ignore_name_scope: bool = False, process_set: Any = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` over the ranks and keep this rank's rows (Horovod's split: the
    first ``rows % size`` ranks get one row more).

    Args:
        tensor: at least 1-D.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
        name: label for error messages.
        ignore_name_scope: accepted for Horovod compatibility.
        process_set: a set from ``add_process_set``; default: every rank.
        prescale_factor, postscale_factor: multiply before / after reducing.
    """
    tensor = tf.convert_to_tensor(tensor)
    to_torch_dtype(tensor.dtype, "reducescatter's tensor")

    def run(t: Any) -> Any:
        with refused_as(TFCallError, "reducescatter"):
            return _hc.reducescatter(t, name=name, op=op, process_set=process_set,
                                     prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor)

    def backward(dy: tf.Tensor) -> tf.Tensor:  # Horovod's _reducescatter_grad
        if _tc._resolve_op(op, None) == _tc.Sum:
            dy = dy * _hc._set_size(process_set)
        if prescale_factor * postscale_factor != 1.0:
            dy = dy * prescale_factor * postscale_factor
        return allgather(dy, process_set=process_set)

    return _differentiable(
        lambda x: _eager_or_graph(run, x, _rows_unknown(x), "hipress_reducescatter"),
        backward, tensor)


@handed
def grouped_reducescatter(tensors: Sequence[Any], op: Optional[str] = _tc.Average,
                          name: Optional[str] = None, process_set: Any = None,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[tf.Tensor]:
    """``reducescatter`` of every tensor in the list."""
    return [reducescatter(t, op=op, name=f"{name}.{i}" if name else None,
                          process_set=process_set, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for i, t in enumerate(tensors)]


@tf.autograph.experimental.do_not_convert
@handed
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      process_set: Any = None) -> List[tf.Tensor]:
    """``allgather`` of every tensor in the list: each rank's rows concatenated."""
    out = []
    for i, t in enumerate(tensors):
        t = tf.convert_to_tensor(t)
        to_torch_dtype(t.dtype, "grouped_allgather's tensor")
        label = f"{name}.{i}" if name else None
        out.append(_differentiable(
            lambda x, label=label: _eager_or_graph(
                lambda y: _tc.allgather(y, name=label, process_set=process_set),
                x, _rows_unknown(x), "hipress_grouped_allgather"),
            lambda dy, t=t: _own_rows(_average_gradient(dy, process_set), t, process_set), t))
    return out


@handed
def broadcast_(variables: Sequence[Any], root_rank: int, name: Optional[str] = None,
               process_set: Any = None) -> Any:
    """Assign ``root_rank``'s values to each variable, in place (Horovod's in-place
    broadcast of a list of ``tf.Variable``); returns the variables (in a graph: their
    assigned values)."""
    single = isinstance(variables, tf.Variable)
    vs = [variables] if single else list(variables)
    for i, v in enumerate(vs):
        if not isinstance(v, tf.Variable):
            raise TypeError(f"broadcast_ assigns into tf.Variable objects, found "
                            f"{type(v).__name__} at position {i}; use broadcast() for tensors")
    # eagerly each assign returns its variable; in a graph, the value once assigned
    # (running it runs the broadcast and the assignment), as Horovod's op returns
    out = [v.assign(broadcast(v, root_rank, name=f"{name}.{i}" if name else None,
                              process_set=process_set)) for i, v in enumerate(vs)]
    return out[0] if single else out


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks, as an int32 tensor (Horovod's graph-mode query)."""
    return tf.constant(_hc._set_size(_set_by_id(process_set_id)), dtype=tf.int32, name=name)


def rank_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """This rank (within the set), as an int32 tensor."""
    return tf.constant(_hc._set_rank(_set_by_id(process_set_id)), dtype=tf.int32, name=name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this host, as an int32 tensor."""
    return tf.constant(local_size(), dtype=tf.int32, name=name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This rank's index on its host, as an int32 tensor."""
    return tf.constant(local_rank(), dtype=tf.int32, name=name)


def _set_by_id(process_set_id: int) -> Any:
    if process_set_id == 0:
        return None
    found = _hc._SETS.get(process_set_id)
    if found is None:
        raise TFCallError(f"no process set with id {process_set_id} (add_process_set "
                          "returns the sets and their ids)")
    return found

