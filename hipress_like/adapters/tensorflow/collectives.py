"""Horovod's functional collectives for TensorFlow tensors, over the neutral ones.

``allreduce``, ``allgather``, ``broadcast``, ``broadcast_variables``,
``broadcast_object`` and ``allgather_object`` take and return TF tensors
(or variables, or plain objects). Each is one call of the framework-neutral
collective in ``adapters.collectives`` / ``adapters.objects`` (the runtime's
wire: torch.distributed's default group, or Horovod): the TF tensor
crosses by a zero-copy DLPack view (the collectives never write into their
input) and the result comes back by DLPack. Eagerly the call is direct;
inside ``tf.function`` it is a ``tf.py_function``, so the same code runs in both.

A model's gradients do not go this way: they go through the CaSync engine
(``DistributedGradientTape``, ``DistributedOptimizer``). The collectives
themselves are differentiable, with the gradients Horovod registers for its
ops (horovod/tensorflow/mpi_ops.py): an allreduce's gradient is the same
allreduce of the upstream gradient; an allgather's, the average of the
upstream gradients cut back to this rank's rows; a broadcast's, that average
on the root and zero elsewhere (``_differentiable``, one ``tf.custom_gradient``
per call). Under ``horovodrun`` Horovod's own ops run instead, with those
same gradients (``native``).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from .. import collectives as _tc
from .. import horovod_calls as _hc
from .. import objects as _to
from ..agreement import CollectiveMismatchError
from .bridge import as_tf, as_torch, to_torch_dtype
from .native import handed

__all__ = ["TFMismatchError", "Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce",
           "allgather",
           "broadcast", "grouped_allreduce", "broadcast_variables", "broadcast_object",
           "allgather_object"]

Average, Sum, Adasum, Min, Max, Product = (_tc.Average, _tc.Sum, _tc.Adasum, _tc.Min, _tc.Max,
                                           _tc.Product)


class TFMismatchError(CollectiveMismatchError, tf.errors.FailedPreconditionError):
    """Ranks called one of this face's collectives with different arguments (eagerly):
    this project's ``CollectiveMismatchError`` (raised on every rank, naming the ranks
    and fields) and ``tf.errors.FailedPreconditionError``, the class
    ``horovod.tensorflow``'s ops raise for the same mismatch. Inside a graph
    TensorFlow keeps no error class of a ``tf.py_function``: there the mismatch is an
    ``InvalidArgumentError`` (its text is the same)."""

    def __init__(self, message: str, fields: Sequence[str] = (), ranks: Sequence[int] = ()):
        CollectiveMismatchError.__init__(self, message, fields, ranks)
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)


_LAST_IN_GRAPH: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _py_collective(body: Callable[..., Any], inputs: List[Any], tout: Any, name: str) -> Any:
    """``tf.py_function(body, inputs, tout)`` for a collective in a graph, run after the
    graph's previous collective.

    A graph runs independent ops on parallel threads in any order, and two
    collectives started in different orders on two ranks cross on the wire
    (gloo aborts); Horovod's ops avoid that by negotiating each by name. Here
    every collective of a graph waits for the one created before it: graphs
    are built alike on every rank, so every rank runs them in one order
    (``tf.function`` orders stateful ops so itself; a ``tf.compat.v1``
    session graph does not).
    """
    graph = tf.compat.v1.get_default_graph()
    prev = _LAST_IN_GRAPH.get(graph)
    with tf.control_dependencies([prev] if prev is not None else []):
        out = tf.py_function(body, inputs, Tout=tout, name=name)
    _LAST_IN_GRAPH[graph] = (out[0] if isinstance(out, (list, tuple)) else out).op
    return out


def _eagerly(body: Callable[..., Any], *args: Any) -> Any:
    """``body(*args)`` run eagerly, a mismatch between ranks raised as ``TFMismatchError``
    (the class ``horovod.tensorflow``'s eager ops raise for it)."""
    try:
        return body(*args)
    except TFMismatchError:
        raise
    except CollectiveMismatchError as e:
        raise TFMismatchError(str(e), e.fields, e.ranks) from e


def _eager_or_graph(fn: Any, tensor: tf.Tensor, out_shape: Any, name: str) -> tf.Tensor:
    """Run ``fn(eager tensor) -> torch tensor`` now, or as a ``tf.py_function`` in a graph
    (``_py_collective``)."""
    def body(t: tf.Tensor) -> tf.Tensor:
        out = as_tf(fn(as_torch(t)))
        return out if out.dtype == t.dtype else tf.cast(out, t.dtype)

    if tf.executing_eagerly():
        return _eagerly(body, tensor)
    out = _py_collective(body, [tensor], tensor.dtype, name)
    out.set_shape(out_shape)
    return out


def _differentiable(forward: Callable[[tf.Tensor], Any], backward: Callable[[tf.Tensor], Any],
                   tensor: tf.Tensor) -> Any:
    """``forward(tensor)``, with ``backward(upstream)`` as its gradient.

    Integer and boolean tensors have no gradient: ``forward`` runs as it is.
    ``forward`` may return a tuple whose first element is the differentiable
    output (alltoall's received splits are not); ``backward`` then gets that
    output's upstream gradient and the outputs, and returns the input's.
    """
    if not (tensor.dtype.is_floating or tensor.dtype.is_complex):
        return forward(tensor)

    @tf.custom_gradient
    def op(x: tf.Tensor) -> Any:
        out = forward(x)
        if isinstance(out, tuple):
            def grad_many(dy: tf.Tensor, *_: Any) -> tf.Tensor:
                return backward(dy, out)
            return out, grad_many
        return out, backward

    return op(tensor)


def _average_gradient(dy: tf.Tensor, process_set: Any) -> tf.Tensor:
    """The upstream gradient averaged over the set's ranks (Horovod's gradients of
    allgather and broadcast start with it)."""
    return allreduce(dy, op=Average, process_set=process_set)


def _own_rows(dy: tf.Tensor, x: tf.Tensor, process_set: Any) -> tf.Tensor:
    """This rank's rows of ``dy``, an allgather's gradient: every rank's row count is
    gathered and ``dy`` cut at them (Horovod's ``_allgather_grad``)."""
    n = _hc._set_size(process_set)
    rows = allgather(tf.reshape(tf.shape(x)[0], [1]), process_set=process_set)
    return tf.split(dy, tf.reshape(rows, [n]), axis=0)[_hc._set_rank(process_set)]


@tf.autograph.experimental.do_not_convert
@handed
def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = None, op: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: Optional[str] = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` over all ranks (default: average); eager or in ``tf.function``.

    ``tf.IndexedSlices`` are allgathered (values and indices), as Horovod
    does, and their values averaged unless ``op=Sum`` (other ops and pre- or
    postscaling are ``NotImplementedError``, as Horovod's). ``compression`` is
    ``Compression.none``/``fp16`` (the wire type) or a CompLL compressor, as
    in ``hipress_like.torch.allreduce``.

    Example:
        >>> hvd.allreduce(tf.constant([float(hvd.rank())]))   # 4 ranks
        <tf.Tensor: shape=(1,), dtype=float32, numpy=array([1.5], dtype=float32)>

    Raises:
        TypeError: a dtype with no torch counterpart (``tf.string``).
        ValueError: an unknown op, a multi-round compressor.
        NotImplementedError: ``tf.IndexedSlices`` with an op other than Sum or
            Average, or with a pre- or postscale factor.
    """
    if isinstance(tensor, tf.IndexedSlices):
        op = _tc._resolve_op(op, average)
        if op not in (Average, Sum):  # as horovod.tensorflow.allreduce refuses them
            raise NotImplementedError("Only Sum and Average ops are supported with "
                                      f"tf.IndexedSlices, found {op!r}")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError("Pre/postscale_factor are not supported with "
                                      "tf.IndexedSlices")
        values = allgather(tensor.values, name=name)
        indices = allgather(tensor.indices, name=name)
        if op == Average:
            values = values / tf.cast(_tc._dist().get_world_size(), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    tensor = tf.convert_to_tensor(tensor)
    to_torch_dtype(tensor.dtype, "allreduce's tensor")

    def forward(x: tf.Tensor) -> tf.Tensor:
        return _eager_or_graph(
            lambda t: _tc.allreduce(t, average=average, name=name, compression=compression,
                                    op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, process_set=process_set),
            x, x.shape, "hipress_allreduce")

    def backward(dy: tf.Tensor) -> tf.Tensor:  # the same reduction (Horovod's _allreduce_grad)
        return allreduce(dy, op=_tc._resolve_op(op, average), prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, process_set=process_set)

    return _differentiable(forward, backward, tensor)


@tf.autograph.experimental.do_not_convert
@handed
def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                      compression: Any = None, op: Optional[str] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: Optional[str] = None, process_set: Any = None) -> List[Any]:
    """``allreduce`` each tensor of a list; returns the list of results."""
    return [allreduce(t, average=average, compression=compression, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      name=name, process_set=process_set) for t in tensors]


@tf.autograph.experimental.do_not_convert
@handed
def allgather(tensor: Any, name: Optional[str] = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension (sizes may differ).

    Example:
        >>> hvd.allgather(tf.constant([hvd.rank()]))   # 4 ranks
        <tf.Tensor: shape=(4,), dtype=int32, numpy=array([0, 1, 2, 3], dtype=int32)>
    """
    tensor = tf.convert_to_tensor(tensor)
    to_torch_dtype(tensor.dtype, "allgather's tensor")
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:]) \
        if tensor.shape.rank else tensor.shape
    return _differentiable(
        lambda x: _eager_or_graph(lambda t: _tc.allgather(t, name=name, process_set=process_set),
                                  x, shape, "hipress_allgather"),
        lambda dy: _own_rows(_average_gradient(dy, process_set), tensor, process_set), tensor)


@tf.autograph.experimental.do_not_convert
@handed
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              process_set: Any = None, ignore_name_scope: bool = False) -> tf.Tensor:
    """``root_rank``'s value of ``tensor``, on every rank."""
    tensor = tf.convert_to_tensor(tensor)
    to_torch_dtype(tensor.dtype, "broadcast's tensor")

    def backward(dy: tf.Tensor) -> tf.Tensor:  # Horovod's _broadcast_grad: the global rank
        g = _average_gradient(dy, process_set)
        return g if _tc._dist().get_rank() == root_rank else g * 0

    return _differentiable(
        lambda x: _eager_or_graph(
            lambda t: _tc.broadcast(t, root_rank, name=name, process_set=process_set),
            x, x.shape, "hipress_broadcast"),
        backward, tensor)


@tf.autograph.experimental.do_not_convert
@handed
def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: Any = None) -> Any:
    """Assign ``root_rank``'s values to ``variables`` on every rank (eager or in a graph).

    Variables are packed by dtype into one flat buffer each (a few
    broadcasts per model, not one per variable), as ``broadcast_parameters``
    does for torch. Inside ``tf.function`` the returned op groups the
    assignments.

    Example:
        >>> hvd.broadcast_variables(model.variables, root_rank=0)
        >>> hvd.broadcast_variables(optimizer.variables, root_rank=0)
    """
    variables = list(variables)
    if not variables:
        return tf.no_op() if not tf.executing_eagerly() else None
    for v in variables:
        to_torch_dtype(v.dtype, f"variable {getattr(v, 'path', None) or v.name!r}")

    def body(*values: tf.Tensor) -> List[tf.Tensor]:
        ts = [as_torch(x).clone() for x in values]  # broadcast_parameters writes in place
        _to.broadcast_parameters([(str(i), t) for i, t in enumerate(ts)], root_rank,
                                 process_set)
        return [as_tf(t) for t in ts]

    values = [tf.convert_to_tensor(v) for v in variables]
    if tf.executing_eagerly():
        for v, x in zip(variables, body(*values)):
            v.assign(tf.cast(x, v.dtype) if x.dtype != v.dtype else x)
        return None
    outs = _py_collective(body, values, [x.dtype for x in values],
                          "hipress_broadcast_variables")
    ops = []
    for v, x, ref in zip(variables, outs, values):
        x.set_shape(ref.shape)
        ops.append(v.assign(x))
    return tf.group(*ops)


@tf.autograph.experimental.do_not_convert
@handed
def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = None) -> Any:
    """Send a plain-data object (numbers, strings, lists, dicts, torch tensors) from
    ``root_rank`` to every rank (``hipress_like.torch.broadcast_object``)."""
    return _to.broadcast_object(obj, root_rank, name, process_set)


@tf.autograph.experimental.do_not_convert
@handed
def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = None
                     ) -> List[Any]:
    """Gather a plain-data object from every rank; list index = rank."""
    return _to.allgather_object(obj, name, process_set)

