"""``broadcast_parameters`` for Gluon: every rank starts from ``root_rank``'s weights.

Accepts what Horovod's MXNet face accepts: a Gluon ``ParameterDict``
(``net.collect_params()``), a dict of Parameters or NDArrays (the Module
API's ``arg_params``), or a list of them. Initialised arrays are viewed as
torch tensors (DLPack) and broadcast packed by dtype
(``adapters.objects.broadcast_parameters``: a few broadcasts, not one
per parameter).

Gluon initialises a layer whose input size is not given (``Dense(10)``)
only at its first forward pass (deferred initialisation). Such a parameter
is broadcast right after it is initialised: its ``_init_impl`` is wrapped
on that one instance, so the first forward pass, which every rank runs,
finishes with the broadcast.
"""
from __future__ import annotations

import types
from typing import Any, List, Tuple

import torch

from .. import collectives as _tc
from .. import objects as _to
from ..runtime import _require
from .tensors import as_torch, check_dense

__all__ = ["broadcast_parameters"]


def _items(params: Any) -> List[Tuple[str, Any]]:
    import mxnet as mx

    if isinstance(params, mx.gluon.ParameterDict):
        return list(params.items())  # insertion order: the model's, the same on every rank
    if isinstance(params, dict):
        return sorted(((str(k), v) for k, v in params.items()), key=lambda kv: kv[0])
    if isinstance(params, (list, tuple)):
        return [(getattr(p, "name", str(i)), p) for i, p in enumerate(params)]
    raise ValueError(f"invalid params of type {type(params).__name__}: expected "
                     "net.collect_params() (a ParameterDict), a dict of Parameters or "
                     "NDArrays, or a list of them")


def _broadcast_after_init(param: Any, root_rank: int) -> None:
    """Make ``param``'s deferred initialisation end with a broadcast from ``root_rank``."""
    original = param._init_impl

    def init_then_broadcast(self: Any, *args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        del self._init_impl  # back to the class's method: broadcast once
        _broadcast_arrays([(self.name, a) for a in self.list_data()], root_rank)

    param._init_impl = types.MethodType(init_then_broadcast, param)


def _broadcast_arrays(named: List[Tuple[str, Any]], root_rank: int) -> None:
    views = [(name, as_torch(a)) for name, a in named]
    with torch.no_grad():
        _to.broadcast_parameters(views, root_rank=root_rank)


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: Any = None,
                         process_set: Any = None) -> None:
    """Overwrite every rank's parameters in place with ``root_rank``'s (collective).

    Args:
        params: ``net.collect_params()``, a dict of Parameters or NDArrays,
            or a list of them (the same structure on every rank).
        root_rank: the rank whose values win.
        prefix: accepted for Horovod compatibility (it names Horovod's
            broadcasts); unused.
        process_set: only ``None`` (all ranks).

    Raises:
        ValueError: ``params`` is of another type, or ``root_rank`` is out of range.
        TypeError: an entry is a sparse array or not an array at all.

    Example:
        >>> net.initialize(mx.init.Xavier())
        >>> hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    """
    import mxnet as mx

    rt = _require()
    _tc._no_process_set(process_set)
    if not 0 <= root_rank < rt.size:
        raise ValueError(f"root_rank must be in [0, {rt.size}), found {root_rank}")
    arrays: List[Tuple[str, Any]] = []
    for name, p in _items(params):
        if isinstance(p, mx.gluon.Parameter):
            try:
                data = p.list_data()
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(p, root_rank)
                continue
            arrays.extend((name, a) for a in data)
        else:
            check_dense(p, f"broadcast_parameters entry {name!r}")
            arrays.append((name, p))
    if arrays:
        _broadcast_arrays(arrays, root_rank)
