"""``import hipress_like.byteps.torch as bps``: BytePS's PyTorch API over CaSync.

A BytePS training script runs with its import line changed. BytePS itself
is not used (BytePS 0.2.5 cannot be built on torch 2.x, nor without CUDA and
NCCL); its API is mapped onto this project's framework-neutral core
(``adapters.runtime``, ``adapters.engine_builder``, ``adapters.compression``)
and the PyTorch face's ``DistributedOptimizer``, so nothing is written twice:

- ``init``, ``shutdown``, ``rank``, ``size``, ``local_rank``, ``local_size``:
  the launcher is torchrun, mpirun, horovodrun or, on one machine, a
  bpslaunch-style environment (``DMLC_WORKER_ID``, ``DMLC_NUM_WORKER``; the
  ranks meet at ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``, where BytePS's
  scheduler would listen).
- ``DistributedOptimizer(optimizer, named_parameters, compression,
  backward_passes_per_step, compression_params=..., pre_scale_factor=...,
  post_scale_factor=...)``: CaSync-PS by default (BytePS is a parameter
  server; here every worker is also the aggregator of a byte-balanced share).
  Gradients from ``BYTEPS_MIN_COMPRESS_BYTES`` up are compressed, in
  partitions of ``BYTEPS_PARTITION_BYTES``, as BytePS does. With
  ``plan="adaptive"`` (or ``Adaptive(...)``) that plan is the start, and the
  online planner re-plans from it while training runs (``adaptive.py``).
- ``push_pull``, ``push_pull_inplace``, ``push_pull_async`` and
  ``push_pull_async_inplace`` with ``poll``/``synchronize(handle)``;
  ``declare``: with a compressor, over the same compressed PS path as the
  optimizer, compressed both ways as BytePS's server does
  (``hipress_like.byteps.ops``); ``broadcast_parameters``, ``broadcast_optimizer_state``,
  ``broadcast_object``; ``Compression`` (``none``, ``fp16`` and this project's
  compressors).

``compression_params`` (BytePS's keys, ``map_compression_params``):

============  =================================================================
compressor    ``onebit``, ``topk``, ``randomk``, ``dithering`` (this project's
              compressors of the same names; ``dithering`` with
              ``partition="natural"`` is ``natural_dithering``)
k             topk/randomk: a fraction in (0, 1) is the kept ratio; an integer
              >= 1 keeps k elements of each gradient (a per-gradient ratio
              k/numel); dithering: the number of levels s
ef            ``vanilla``: error feedback around the compressor; absent: the
              engine's default (biased, memoryless compressors such as onebit
              and top-k get error feedback anyway)
momentum      ``nesterov`` is refused: BytePS applies it on the worker before
              compression; use ``torch.optim.SGD(momentum=..., nesterov=True)``
scaling       onebit: accepted; this project's onebit always scales (two
              reconstruction values, Seide et al. 2014)
partition     dithering: ``linear`` (default) or ``natural``
normalize     dithering: ``max`` (default) or ``l2``
seed          the compressors' random seed (same on every rank)
fp16          without a compressor: fp16 on the wire
============  =================================================================

They are read as BytePS reads them (``hipress_like.byteps.params``): a key
that does not apply to the compressor is accepted and logged once at debug
level, values are validated whatever the compressor, and an unknown
compressor is an error naming the known ones.

``BYTEPS_*`` variables, read by ``init``:

==============================  ================================================
BYTEPS_PARTITION_BYTES          used: bytes per partition of a compressed
                                gradient (default 4096000, as BytePS)
BYTEPS_MIN_COMPRESS_BYTES       used: smaller gradients are not compressed
                                (default 65536, as BytePS)
BYTEPS_ENABLE_ASYNC             refused when 1: training here is synchronous
BYTEPS_LOCAL_RANK, _LOCAL_SIZE  ignored: the launcher's own variables say it
BYTEPS_SERVER_ENABLE_SCHEDULE,  ignored: CaSync's coordinator orders and
BYTEPS_SCHEDULING_CREDIT        batches the messages
BYTEPS_PCIE_SWITCH_SIZE,        ignored: GPU and server topology; there are no
BYTEPS_NCCL_GROUP_SIZE,         separate servers (aggregators are co-located
BYTEPS_REDUCE_ROOTS,            and balanced by bytes)
BYTEPS_ENABLE_MIXED_MODE,
BYTEPS_MIXED_MODE_BOUND,
BYTEPS_KEY_HASH_FN
BYTEPS_THREADPOOL_SIZE,         ignored: the engine's executors do the
BYTEPS_OMP_THREAD_PER_GPU       compression work
BYTEPS_TRACE_ON, BYTEPS_TRACE_* ignored: use ``optimizer.engine.timeline``
BYTEPS_LOG_LEVEL                ignored: use Python's ``logging``
==============================  ================================================

Example (BytePS's MNIST example, one line changed)::

    import hipress_like.byteps.torch as bps      # was: import byteps.torch as bps
    bps.init()
    optimizer = bps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression_params={"compressor": "onebit",
                                                             "ef": "vanilla"})
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional

import torch

from ..adapters import collectives as _coll
from ..adapters import objects as _objects
from ..adapters import runtime as _runtime
from ..adapters.compression import Compression, CompressionSpec
from ..adapters.torch.gradients import resolve_names
from ..adapters.torch.objects import broadcast_optimizer_state as _broadcast_optimizer_state
from ..adapters.torch.optimizer import DistributedOptimizer as _DistributedOptimizer
from ..cost_model.plan import GradientPlan, Plan, SizeRule
from ..tuning.online import Adaptive
from . import adaptive as _adaptive
from . import ops as _ops
from .params import Mapped, map_compression_params

__all__ = [
    "init", "shutdown", "rank", "size", "local_rank", "local_size",
    "DistributedOptimizer", "Compression", "map_compression_params", "Knobs", "read_knobs",
    "push_pull", "push_pull_inplace", "push_pull_async", "push_pull_async_inplace",
    "poll", "synchronize", "declare", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object", "Adaptive",
]

log = logging.getLogger(__name__)

_IGNORED = ("BYTEPS_LOCAL_RANK", "BYTEPS_LOCAL_SIZE", "BYTEPS_SERVER_ENABLE_SCHEDULE",
            "BYTEPS_SCHEDULING_CREDIT", "BYTEPS_PCIE_SWITCH_SIZE", "BYTEPS_NCCL_GROUP_SIZE",
            "BYTEPS_REDUCE_ROOTS", "BYTEPS_ENABLE_MIXED_MODE", "BYTEPS_MIXED_MODE_BOUND",
            "BYTEPS_KEY_HASH_FN", "BYTEPS_THREADPOOL_SIZE", "BYTEPS_OMP_THREAD_PER_GPU",
            "BYTEPS_TRACE_ON", "BYTEPS_LOG_LEVEL")


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """The ``BYTEPS_*`` settings that mean something here (module docstring)."""

    partition_bytes: int = 4096000  # BytePS's default
    min_compress_bytes: int = 1 << 16  # BytePS's default

    def rule(self) -> SizeRule:
        """The engine's size rule: compress from ``min_compress_bytes``, partitions
        of ``partition_bytes``."""
        return SizeRule(min_compress_bytes=self.min_compress_bytes,
                        bytes_per_partition=self.partition_bytes)


_knobs = Knobs()


def read_knobs(env: Optional[Mapping[str, str]] = None) -> Knobs:
    """Read the ``BYTEPS_*`` variables (``os.environ`` by default).

    Raises:
        ValueError: a used variable is not a positive integer (0 allowed for
            ``BYTEPS_MIN_COMPRESS_BYTES``), or ``BYTEPS_ENABLE_ASYNC=1``.
    """
    env = os.environ if env is None else env
    vals: Dict[str, int] = {}
    for var, field, low in (("BYTEPS_PARTITION_BYTES", "partition_bytes", 1),
                            ("BYTEPS_MIN_COMPRESS_BYTES", "min_compress_bytes", 0)):
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        try:
            vals[field] = int(raw)
        except ValueError:
            vals[field] = -1
        if vals[field] < low:
            raise ValueError(f"{var} must be an integer >= {low} (bytes), found {raw!r}")
    if env.get("BYTEPS_ENABLE_ASYNC", "0") not in ("", "0"):
        raise ValueError("BYTEPS_ENABLE_ASYNC=1 asks for asynchronous training, which "
                         "hipress-like does not do (every step is synchronous); unset it")
    ignored = [v for v in env if v in _IGNORED or v.startswith("BYTEPS_TRACE_")]
    if ignored:
        log.info("BytePS settings without a meaning here, ignored: %s", ", ".join(ignored))
    return replace(Knobs(), **vals)


# -- start-up ------------------------------------------------------------------------
def init(lazy: bool = True) -> None:
    """Read the ``BYTEPS_*`` knobs and join the other workers (idempotent).

    Args:
        lazy: accepted for BytePS compatibility (start-up is never deferred).

    Raises:
        LaunchError: a bpslaunch-style environment without its scheduler's
            address, a server or scheduler role, or an inconsistent launcher
            environment (the message names the fix).
    """
    global _knobs
    _knobs = read_knobs()
    _runtime.init()  # torchrun, mpirun, horovodrun or bpslaunch-style (DMLC_*) variables


def shutdown() -> None:
    """Close every engine and leave the group (BytePS's ``shutdown``)."""
    _ops.reset()
    _runtime.shutdown()


# BytePS's rank queries are the runtime's own (one answer for every face)
rank, size = _runtime.rank, _runtime.size
local_rank, local_size = _runtime.local_rank, _runtime.local_size


# -- compression_params: params.py -------------------------------------------------------
def _plan(mapped: Optional[Mapped], spec: CompressionSpec, strategy: str,
          named: List[Any], optimizer: torch.optim.Optimizer) -> Optional[Plan]:
    """The engine's plan: BytePS's size rule (``Knobs``), plus a ratio per gradient
    when ``k`` counts elements."""
    if spec.name == "identity":
        return None  # nothing to compress: every gradient takes the allreduce lane
    rule = _knobs.rule()
    if spec.name == "fp16":  # BytePS casts every gradient (a wire type, not a compressor)
        rule = replace(rule, min_compress_bytes=0)
    gradients: Dict[str, GradientPlan] = {}
    if mapped is not None and mapped.count is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        names = resolve_names(params, named or None, optimizer.param_groups)
        n = _runtime.size()
        for p in {id(p): p for p in params}.values():
            if not (p.requires_grad or p.is_floating_point()):
                continue  # not synchronised (DistributedOptimizer's rule)
            gp = rule.decide(p.numel() * 4, n)
            if gp.compress:
                ratio = min(1.0, mapped.count / p.numel())
                ps = dict(spec.params, ratio=ratio)
                gradients[names[id(p)]] = replace(gp, compressor=spec.name, params=ps)
    return Plan(compressor=spec.name, params=dict(spec.params), strategy=strategy, rule=rule,
                gradients=gradients)


# -- the optimizer -----------------------------------------------------------------------
def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = Compression.none,
                         backward_passes_per_step: int = 1, staleness: int = 0, *,
                         compression_params: Optional[Mapping[str, Any]] = None,
                         pre_scale_factor: float = 1.0, post_scale_factor: float = 1.0,
                         strategy: str = "ps", nonfinite: str = "propagate",
                         timeout: Optional[float] = None, plan: Any = None
                         ) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged by CaSync.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()`` (names key the plan).
        compression: ``bps.Compression.none`` (default) or ``.fp16``, used when
            ``compression_params`` is not given.
        backward_passes_per_step: backward passes accumulated before averaging.
        staleness: only 0 (BytePS's pipelined SGD is not implemented).
        compression_params: BytePS's dict (module docstring); it takes
            precedence over ``compression``.
        pre_scale_factor, post_scale_factor: BytePS multiplies gradients by
            the first before compression and by the second after averaging;
            every compressor here is positively homogeneous (C(a x) = a C(x)),
            so both are applied as one factor after averaging, with the same
            result.
        strategy: "ps" (default, BytePS's parameter servers) or "ring".
        nonfinite: "propagate" (default, as BytePS and DDP), "skip" or "raise";
            see ``hipress_like.torch.DistributedOptimizer``.
        timeout: seconds before a stalled or dead peer becomes an error.
        plan: None (default): BytePS's knobs plan (the size rule, ``Knobs``),
            fixed. "adaptive" or ``bps.Adaptive(...)``: the job starts on
            that plan and re-plans at step boundaries as
            ``hipress_like.torch.DistributedOptimizer(plan="adaptive")`` does,
            pricing the compressor ``compression_params`` names (``byteps/
            adaptive.py``: its profile is ``Adaptive(profile=...)``'s, or
            taken at start as ``plan="auto"`` takes one); ``opt.online``
            and ``state_dict()`` as there. Any other plan is refused.

    Raises:
        ValueError: bad ``compression_params``, ``staleness``, or scale factors,
            a ``plan`` other than None, "adaptive" or an ``Adaptive``, or
            ``plan="adaptive"`` with an integer ``k`` or a profile without
            the compressor's curves (``byteps/adaptive.py``).
    """
    settings = _adaptive.settings_of(plan, "hipress_like.byteps.torch.DistributedOptimizer",
                                     "hipress_like.torch.DistributedOptimizer(..., plan=...)")
    if staleness != 0:
        raise ValueError(f"staleness={staleness!r}: BytePS's pipelined SGD is not implemented "
                         "by hipress-like; pass staleness=0")
    factor = float(pre_scale_factor) * float(post_scale_factor)
    if not math.isfinite(factor) or factor == 0:
        raise ValueError(f"pre_scale_factor * post_scale_factor must be finite and nonzero, "
                         f"found {pre_scale_factor!r} * {post_scale_factor!r}")
    named = list(named_parameters) if named_parameters is not None else []
    mapped = None
    seed = 0
    if compression_params:
        mapped = map_compression_params(compression_params)
        seed = mapped.seed or 0
    if mapped is not None and mapped.spec.name != "identity":
        spec = mapped.spec
        if compression not in (None, Compression.none):
            log.info("compression=%r is ignored: compression_params chooses %r",
                     compression, spec)
    else:  # no compressor in compression_params (BytePS: none): compression= holds
        spec = compression if isinstance(compression, CompressionSpec) else \
            _coll._spec(compression)
    if settings is not None:  # checked before the knobs' plan is made (a count of k)
        label, profile = _adaptive.candidate_of(settings, spec,
                                                mapped.count if mapped is not None else None)
    plan = _plan(mapped, spec, strategy, named, optimizer)
    if settings is not None:  # the knobs' plan starts; the online planner takes it from there
        plan = _adaptive.start(settings, plan, label, profile)
    opt = _DistributedOptimizer(optimizer, named_parameters=named or None, compression=spec,
                                backward_passes_per_step=backward_passes_per_step,
                                strategy=strategy, plan=plan, nonfinite=nonfinite,
                                timeout=timeout, seed=seed, own_push=True)
    opt._hp_scale = factor
    return opt


# -- push_pull: ops.py ------------------------------------------------------------------------
def _mapped(compression: Any, compression_params: Optional[Mapping[str, Any]]
            ) -> Optional[Mapped]:
    if compression_params:
        mapped = map_compression_params(compression_params)
        if mapped.spec.name != "identity":
            return mapped
    spec = _coll._spec(compression)
    return None if spec.name == "identity" else Mapped(spec)


def declare(name: str) -> None:
    """Declare a tensor name before its first ``push_pull``. Every worker must
    declare (or first push_pull) the same names in the same order, as in
    BytePS; the first use of each name checks it across ranks (``ops.py``)."""
    _ops.declare(name)


def push_pull_async(tensor: torch.Tensor, average: bool = True, name: Optional[str] = None,
                    version: int = 0, priority: int = 0, compression: Any = Compression.none,
                    *, compression_params: Optional[Mapping[str, Any]] = None) -> Any:
    """Start averaging (or summing) ``tensor`` over workers into a new tensor;
    ``synchronize(handle)`` returns it.

    Args:
        tensor: the input (left unchanged).
        average: average (True) or sum.
        name: BytePS's key; required with a compressor.
        version, priority: accepted (BytePS's scheduling hints).
        compression: ``Compression.none``/``.fp16`` (the wire type) or one of
            this project's compressors (``Compression.onebit``, ...).
        compression_params: BytePS's dict (``params.py``); takes precedence.
            A compressor sends the tensor over the compressed PS path, both
            ways (``ops.py``), from ``BYTEPS_MIN_COMPRESS_BYTES`` up.
    """
    return _ops.start(tensor, tensor.detach().clone(), average, name,
                      _mapped(compression, compression_params), _knobs.rule())


def push_pull_async_inplace(tensor: torch.Tensor, average: bool = True,
                            name: Optional[str] = None, version: int = 0,
                            priority: int = 0, compression: Any = Compression.none, *,
                            compression_params: Optional[Mapping[str, Any]] = None) -> Any:
    """Start averaging (or summing) ``tensor`` in place; ``synchronize(handle)``
    returns it. Arguments as ``push_pull_async``."""
    with torch.no_grad():
        return _ops.start(tensor, tensor, average, name,
                          _mapped(compression, compression_params), _knobs.rule())


def push_pull(tensor: torch.Tensor, average: bool = True, name: Optional[str] = None,
              version: int = 0, priority: int = 0, compression: Any = Compression.none, *,
              compression_params: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """The average (or sum) of ``tensor`` over workers, as a new tensor.

    Example (BytePS's metric averaging, and a compressed push_pull)::

        avg = bps.push_pull(torch.tensor(loss), name="avg_loss")
        g = bps.push_pull(grad, name="g0", compression_params={"compressor": "onebit"})
    """
    return synchronize(push_pull_async(tensor, average, name, version, priority, compression,
                                       compression_params=compression_params))


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: Optional[str] = None,
                      version: int = 0, priority: int = 0, compression: Any = Compression.none,
                      *, compression_params: Optional[Mapping[str, Any]] = None
                      ) -> torch.Tensor:
    """Average (or sum) ``tensor`` over workers in place; returns it.

    Example (BytePS's metric averaging)::

        bps.declare("val_loss")
        bps.push_pull_inplace(loss_sum, average=False, name="val_loss")
    """
    return synchronize(push_pull_async_inplace(tensor, average, name, version, priority,
                                               compression,
                                               compression_params=compression_params))


def poll(handle: Any) -> bool:
    """True when a ``push_pull_async*`` operation has finished."""
    return _ops.poll(handle)


def synchronize(handle: Any) -> torch.Tensor:
    """Wait for a ``push_pull_async*`` operation; return its output tensor.

    Raises:
        ValueError: ``handle`` was synchronized before.
    """
    return _ops.synchronize(handle)


# -- broadcasts -------------------------------------------------------------------------------
def broadcast_parameters(params: Any, root_rank: int, prefix: str = "Parameter.") -> None:
    """Overwrite every worker's parameters (a state dict or named parameters) with
    ``root_rank``'s. ``prefix`` (BytePS's tensor-name prefix) is accepted."""
    _objects.broadcast_parameters(params, root_rank=root_rank)


def broadcast_optimizer_state(optimizer: Any, root_rank: int,
                              prefix: str = "Parameter.") -> None:
    """Overwrite every worker's optimizer state with ``root_rank``'s."""
    _broadcast_optimizer_state(optimizer, root_rank=root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None) -> Any:
    """``root_rank``'s ``obj`` on every worker (msgpack, never pickle)."""
    return _objects.broadcast_object(obj, root_rank=root_rank, name=name)
