"""``import hipress_like.byteps.mxnet as bps``: BytePS's MXNet (Gluon) API over CaSync.

A script written for ``byteps.mxnet`` runs with its import line changed.
BytePS itself is not used (module docstring of ``hipress_like.byteps``);
its MXNet names are mapped onto what the project already has, so nothing
is written twice:

- ``DistributedTrainer(params, optimizer, optimizer_params, root_rank=0,
  compression_params=None)``: the MXNet face's Gluon trainer
  (``adapters.mxnet.trainer``) with BytePS's differences. Its
  ``compression_params`` are read as BytePS reads them (``params.py``);
  the gradients go through CaSync-PS and the aggregate is compressed again
  before it comes back, as BytePS's server does; BytePS's knobs
  (``BYTEPS_MIN_COMPRESS_BYTES``, ``BYTEPS_PARTITION_BYTES``) set the plan
  (with ``plan="adaptive"`` or ``Adaptive(...)``, the start: the online planner
  re-plans from it while training runs, ``adaptive.py``);
  and ``root_rank``'s weights are broadcast once every parameter is
  initialised (BytePS does it at the first ``step``), so a BytePS script
  never calls ``broadcast_parameters`` for Gluon.
- ``byteps_push_pull(tensor, version, priority, name, is_average)``: in
  place, as BytePS's; a name declared with compression attributes
  (``byteps_declare_tensor(name, byteps_compressor_type="onebit", ...)``)
  goes through the compressed PS path of ``ops.py``, both ways.
- ``DistributedOptimizer(optimizer)``: the Module API's optimizer
  (``model.fit(..., kvstore=None, optimizer=...)``): each gradient averaged
  (uncompressed, as BytePS's Module path) before the wrapped optimizer's update.
- ``init``, ``shutdown``, ``rank``, ``size``, ``local_rank``,
  ``local_size``, ``broadcast_parameters``.

BytePS's compression semantics, kept here (BytePS's ``tests/test_onebit.py``,
``test_topk.py``, ``test_randomk.py`` and ``test_dithering.py`` are the
references): without ``ef`` there is no error feedback (the engine's
default would add it to onebit and top-k); random-k sends the kept values
unscaled, as BytePS's does. The update is
``w -= lr * C_server(mean_r C_worker(g_r)) / batch_size``; BytePS scales
each gradient by ``1 / (batch_size * size)`` before compressing and sums,
which is the same for these positively homogeneous compressors
(``C(a x) = a C(x)`` for ``a > 0``) up to float rounding.

CaSync-PS's aggregators are the workers themselves; as every BytePS worker
compresses its push, the aggregating worker compresses its own gradient
before adding it (``EngineConfig.own_push``), so on 2 workers the update is
BytePS's ``C(C(g_a) + C(g_b))``. Differences from BytePS, stated rather than
hidden: this project's onebit
reconstructs with two means (Seide et al. 2014), where BytePS's sends
``sign`` or ``||x||_1 / n * sign`` (``scaling``); random-k and dithering
draw their randomness from this project's counter RNG, not BytePS's
xorshift128+, so the same ``seed`` gives other draws; ``momentum``
(BytePS's worker-side Nesterov) is refused with the fix
(``params.py``); ``suspend`` and ``resume`` (BytePS's elastic scaling) and
``BYTEPS_ENABLE_ASYNC`` (asynchronous training) are not provided.

Example (BytePS's ``train_gluon_mnist_byteps_gc.py``, one line changed)::

    import hipress_like.byteps.mxnet as bps      # was: import byteps.mxnet as bps
    bps.init()
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.01 * bps.size()},
                                     compression_params={"compressor": "onebit",
                                                         "ef": "vanilla"})
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from typing import Any, Dict, Mapping, Optional

import mxnet as mx

from ..adapters import runtime as _runtime
from ..adapters.compression import Compression, CompressionSpec
from ..adapters.mxnet.optimizer import DistributedOptimizer as _HorovodStyleOptimizer
from ..adapters.mxnet.parameters import broadcast_parameters as _broadcast_parameters
from ..adapters.mxnet.tensors import as_torch, check_dense
from ..adapters.mxnet.trainer import DistributedTrainer as _Trainer
from ..cost_model.plan import GradientPlan, Plan
from ..tuning.online import Adaptive
from . import adaptive as _adaptive
from . import ops as _ops
from .params import Mapped, map_compression_params
from .torch import Knobs, read_knobs

__all__ = [
    "init", "shutdown", "rank", "size", "local_rank", "local_size", "DistributedTrainer",
    "DistributedOptimizer", "broadcast_parameters", "byteps_declare_tensor", "byteps_push_pull",
    "Adaptive",
]

log = logging.getLogger(__name__)

_knobs = Knobs()
_declared: Dict[str, Mapped] = {}  # name -> compressor declared with byteps_declare_tensor


# -- start-up ------------------------------------------------------------------------
def init(lazy: bool = True) -> None:
    """Read the ``BYTEPS_*`` knobs and join the other workers (idempotent).

    Args:
        lazy: accepted for BytePS compatibility (start-up is never deferred).

    Raises:
        ValueError: a bad ``BYTEPS_*`` value (``hipress_like.byteps.torch.read_knobs``).
        LaunchError: an inconsistent launcher environment (the message names the fix).
    """
    global _knobs
    _knobs = read_knobs()
    _runtime.init()


def shutdown() -> None:
    """Close every engine and leave the group (BytePS's ``shutdown``)."""
    _ops.reset()
    _declared.clear()
    _runtime.shutdown()


# BytePS's rank queries are the runtime's own (one answer for every face)
rank, size = _runtime.rank, _runtime.size
local_rank, local_size = _runtime.local_rank, _runtime.local_size


# -- compression_params in the engine's terms ---------------------------------------------
def _as_byteps(spec: CompressionSpec) -> CompressionSpec:
    """BytePS's random-k keeps the chosen values as they are (no ``n / k`` scaling)."""
    if spec.name == "randomk" or (spec.name == "ef" and spec.params.get("inner") == "randomk"):
        return CompressionSpec(spec.name, dict(spec.params, unbiased=False))
    return spec


# -- the trainer --------------------------------------------------------------------------
class DistributedTrainer(_Trainer):
    """BytePS's Gluon ``DistributedTrainer``: gradients averaged by CaSync-PS.

    A collective call: every rank constructs it at the same point, with the
    same model. One ``step(batch_size)`` (``batch_size`` is this worker's)
    averages every gradient over the workers (compressed on the way to the
    aggregator and again on the way back) and applies Gluon's update to the
    average divided by ``batch_size``, as BytePS's does.

    Args:
        params: ``net.collect_params()`` (taken in sorted-name order, as
            BytePS does), a dict or a list of Parameters.
        optimizer: an optimizer name (``"sgd"``) or an ``mx.optimizer.Optimizer``.
        optimizer_params: the optimizer's arguments when it is a name.
        root_rank: the worker whose initial weights every worker takes.
        compression_params: BytePS's dict (``hipress_like.byteps.params``):
            every key accepted whatever the compressor, values validated.
        strategy: "ps" (default, BytePS's parameter servers) or "ring".
        nonfinite, timeout: as ``hipress_like.mxnet.DistributedTrainer``.
        plan: None (default): BytePS's knobs plan, fixed. "adaptive" or
            ``bps.Adaptive(...)``: that plan starts, and the online planner
            re-plans from it as ``hipress_like.mxnet.DistributedTrainer(plan=
            "adaptive")`` does, pricing the compressor ``compression_params``
            names (``byteps/adaptive.py``); ``trainer.online`` and
            ``save_states`` as there. Any other plan is refused.

    Raises:
        ValueError: bad ``compression_params`` (an unknown compressor names
            the known ones), ``root_rank`` out of range, ``momentum="nesterov"``,
            a ``plan`` other than None, "adaptive" or an ``Adaptive``, or
            ``plan="adaptive"`` with an integer ``k`` or a profile without the
            compressor's curves.
        TypeError: ``compression_params`` not a dict, or a non-str
            ``compressor``/``ef``/``momentum``.

    Example:
        >>> trainer = bps.DistributedTrainer(net.collect_params(), "sgd",
        ...                                  {"learning_rate": 0.01 * bps.size()},
        ...                                  compression_params={"compressor": "topk",
        ...                                                      "k": 0.01})
        >>> trainer.step(batch_size)
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: Any = None,
                 root_rank: int = 0, compression_params: Optional[Mapping[str, Any]] = None,
                 *, strategy: str = "ps", nonfinite: str = "propagate",
                 timeout: Optional[float] = None, plan: Any = None):
        settings = _adaptive.settings_of(plan, "hipress_like.byteps.mxnet.DistributedTrainer",
                                         "hipress_like.mxnet.DistributedTrainer(..., plan=...)")
        n = _runtime._require().size
        if not isinstance(root_rank, int) or not 0 <= root_rank < n:
            raise ValueError(f"root_rank must be a rank in [0, {n}), found {root_rank!r}")
        if compression_params and isinstance(compression_params, Mapping) and \
                compression_params.get("momentum") == "nesterov":
            raise ValueError("compression_params['momentum'] = 'nesterov' (BytePS's "
                             "worker-side momentum before compression) is not implemented by "
                             "hipress-like; leave 'momentum' out of compression_params and "
                             "keep it in the optimizer: optimizer_params={'momentum': 0.9, "
                             "...} with 'sgd', or the 'nag' optimizer for Nesterov")
        mapped = map_compression_params(compression_params) if compression_params else None
        spec = _as_byteps(mapped.spec) if mapped is not None else Compression.none
        if isinstance(params, mx.gluon.ParameterDict):
            params = [params[k] for k in sorted(params.keys())]  # BytePS's order
        self._bps_mapped = mapped
        self._bps_spec = spec
        # plan="adaptive": (settings, candidate label, given profile), checked here
        self._bps_adaptive = None if settings is None else (settings, *_adaptive.candidate_of(
            settings, spec, mapped.count if mapped is not None else None))
        self._bps_root = root_rank
        self._bps_rule = _knobs.rule()
        if spec.name == "fp16":  # BytePS casts every gradient (a wire type)
            self._bps_rule = replace(self._bps_rule, min_compress_bytes=0)
        super().__init__(params, optimizer, optimizer_params=optimizer_params,
                         compression=None if spec.name == "identity" else spec,
                         strategy=strategy, plan=None, nonfinite=nonfinite, timeout=timeout,
                         seed=(mapped.seed or 0) if mapped is not None else 0)

    def _bps_plan(self) -> Optional[Plan]:
        """BytePS's knobs as the engine's plan, plus a ratio per gradient when ``k``
        counts elements (known once the shapes are)."""
        spec = self._bps_spec
        if spec.name == "identity":
            return None  # every gradient takes the plain allreduce
        gradients: Dict[str, GradientPlan] = {}
        count = self._bps_mapped.count if self._bps_mapped is not None else None
        if count is not None:
            for i, p in enumerate(self._params):
                numel = int(math.prod(p.shape))
                gp = self._bps_rule.decide(numel * 4, self._hp_size)
                if gp.compress:
                    gradients[f"{self._hp_prefix}{i}"] = replace(
                        gp, compressor=spec.name,
                        params=dict(spec.params, ratio=min(1.0, count / numel)))
        return Plan(compressor=spec.name, params=dict(spec.params), strategy=self._hp_kwargs[
            "strategy"], rule=self._bps_rule, gradients=gradients)

    def _hp_build(self) -> None:
        """Broadcast ``root_rank``'s weights, then build the engine with BytePS's plan
        (collective; runs once every parameter is initialised)."""
        _broadcast_parameters(list(self._params), root_rank=self._bps_root)
        # BytePS adds error feedback only for ef="vanilla" (then the spec is the ef
        # wrapper already), never the engine's automatic one for biased compressors
        plan = self._bps_plan()
        if self._bps_adaptive is not None:  # the knobs' plan starts; the planner goes on
            plan = _adaptive.start(self._bps_adaptive[0], plan, *self._bps_adaptive[1:])
        # and, as a BytePS server sees every push compressed, so does the aggregator
        self._hp_kwargs.update(plan=plan, error_feedback=False, own_push=True)
        super()._hp_build()


# -- push_pull ------------------------------------------------------------------------------
_DECLARE_KEYS = {  # BytePS's tensor attributes (byteps_declare_tensor) -> compression_params
    "byteps_compressor_type": "compressor", "byteps_compressor_k": "k",
    "byteps_ef_type": "ef", "byteps_momentum_type": "momentum", "byteps_seed": "seed",
    "byteps_compressor_onebit_scaling": "scaling",
    "byteps_dithering_partition": "partition", "byteps_dithering_normalize": "normalize",
}
_CODES = {"partition": {"0": "linear", "1": "natural"}, "normalize": {"0": "max", "1": "l2"}}


def byteps_declare_tensor(name: str, **kwargs: Any) -> None:
    """Declare ``name`` before its first ``byteps_push_pull`` (BytePS's declaration).

    Every worker must declare (or first push_pull) the same names in the same
    order; the first use of each name checks it across workers (``ops.py``).

    Args:
        name: the tensor's key.
        **kwargs: BytePS's compression attributes of the tensor
            (``byteps_compressor_type``, ``byteps_compressor_k``, ``byteps_ef_type``,
            ``byteps_seed``, ``byteps_compressor_onebit_scaling``,
            ``byteps_dithering_partition`` "0"/"1", ``byteps_dithering_normalize``
            "0"/"1"); with a compressor, ``byteps_push_pull(name=name)`` is
            compressed both ways.

    Raises:
        TypeError: an attribute BytePS does not define (the known ones are listed).
        ValueError: a value ``compression_params`` would refuse.
    """
    unknown = sorted(set(kwargs) - set(_DECLARE_KEYS))
    if unknown:
        raise TypeError(f"byteps_declare_tensor({name!r}): unknown attributes {unknown}; "
                        f"known: {', '.join(sorted(_DECLARE_KEYS))}")
    params = {}
    for key, value in kwargs.items():
        k = _DECLARE_KEYS[key]
        params[k] = _CODES.get(k, {}).get(str(value), value)
    _ops.declare(name)
    if params:
        mapped = map_compression_params(params)
        _declared[name] = replace(mapped, spec=_as_byteps(mapped.spec))


def byteps_push_pull(tensor: Any, version: int = 0, priority: int = 0,
                     name: Optional[str] = None, is_average: bool = True) -> None:
    """Average (or sum) ``tensor`` over the workers, in place (BytePS's push_pull).

    A name declared with a compressor takes the compressed PS path from
    ``BYTEPS_MIN_COMPRESS_BYTES`` up; other calls are a plain allreduce. The
    result is in ``tensor`` when the call returns.

    Args:
        tensor: a dense ``mx.nd.NDArray`` (float for compression).
        version, priority: accepted (BytePS's scheduling hints).
        name: BytePS's key (required for a compressed call).
        is_average: average (True) or sum.

    Example (the digits example's accuracy average)::

        bps.byteps_declare_tensor("acc")
        bps.byteps_push_pull(acc, name="acc", is_average=False)
        acc /= bps.size()
    """
    check_dense(tensor, "byteps_push_pull")
    view = as_torch(tensor)
    _ops.start(view, view, bool(is_average), name, _declared.get(name) if name else None,
               _knobs.rule()).synchronize()


# -- the Module API -------------------------------------------------------------------------
class DistributedOptimizer(_HorovodStyleOptimizer):
    """BytePS's optimizer for MXNet's Module API: each gradient averaged over the workers,
    then the wrapped optimizer's update.

    Used as BytePS's ``example/mxnet/common/fit_byteps.py`` uses it::

        opt = bps.DistributedOptimizer(mx.optimizer.create("sgd", learning_rate=0.1))
        bps.broadcast_parameters(arg_params, root_rank=0)      # after init_params
        model.fit(train, kvstore=None, optimizer=opt, ...)

    The MXNet face's wrapper (``adapters.mxnet.optimizer``: attributes read
    and written through to the wrapped optimizer, one index or a list of
    them per call) with BytePS's averaging: each gradient in place under the
    name ``gradient_<index>`` (``byteps_push_pull``; BytePS's Module path
    takes no ``compression_params``, so this is a plain allreduce), the
    names' order checked across workers on first use.

    Args:
        optimizer: an ``mx.optimizer.Optimizer``.

    Raises:
        TypeError: ``optimizer`` is not one (a name: ``mx.optimizer.create(name, ...)``).
        ValueError: ``BYTEPS_ENABLE_ASYNC`` is set: BytePS's asynchronous training
            (workers push weight deltas without waiting) is not provided; every
            step here is synchronous.
    """

    def __init__(self, optimizer: Any) -> None:
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps an mx.optimizer.Optimizer, found "
                            f"{type(optimizer).__name__}; for a name, pass "
                            f"mx.optimizer.create({optimizer!r}, ...)")
        if os.environ.get("BYTEPS_ENABLE_ASYNC", "0").strip() not in ("", "0"):
            raise ValueError("BYTEPS_ENABLE_ASYNC is set: BytePS's asynchronous training is "
                             "not provided here (every step is synchronous); unset it")
        super().__init__(optimizer)

    def _hp_average(self, index: Any, grad: Any) -> None:
        pairs = zip(index, grad) if isinstance(index, (list, tuple)) else [(index, grad)]
        for i, g in pairs:
            name = f"gradient_{i}"
            byteps_declare_tensor(name)  # idempotent; the first use checks the order
            byteps_push_pull(g, name=name, is_average=True)


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Overwrite every worker's ``params`` (a dict of NDArrays, as BytePS takes; a
    ``ParameterDict`` or a list too) with ``root_rank``'s, in place (collective).

    Gluon users need not call it: ``DistributedTrainer`` broadcasts ``root_rank``'s
    weights itself, as BytePS's does.
    """
    _broadcast_parameters(params, root_rank=root_rank)
