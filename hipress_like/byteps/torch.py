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
  partitions of ``BYTEPS_PARTITION_BYTES``, as BytePS does.
- ``push_pull``, ``push_pull_inplace``, ``push_pull_async`` and
  ``push_pull_async_inplace`` with ``poll``/``synchronize(handle)``;
  ``declare``; ``broadcast_parameters``, ``broadcast_optimizer_state``,
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
partition     dithering: ``linear`` (default) or ``natural`` (also 0 / 1)
normalize     dithering: ``max`` (default) or ``l2`` (also 0 / 1)
seed          the compressors' random seed (same on every rank)
============  =================================================================

An unknown key or value, or a key that does not apply to the compressor, is
an error naming what is accepted.

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

__all__ = [
    "init", "shutdown", "rank", "size", "local_rank", "local_size",
    "DistributedOptimizer", "Compression", "map_compression_params", "Knobs", "read_knobs",
    "push_pull", "push_pull_inplace", "push_pull_async", "push_pull_async_inplace",
    "poll", "synchronize", "declare", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object",
]

log = logging.getLogger(__name__)

KEYS = ("compressor", "ef", "momentum", "scaling", "k", "partition", "normalize", "seed")
COMPRESSORS = ("onebit", "topk", "randomk", "dithering")
_APPLIES = {"onebit": {"scaling"}, "topk": {"k"}, "randomk": {"k"},
            "dithering": {"k", "partition", "normalize"}}
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
_declared: List[str] = []


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
    _declared.clear()
    _runtime.shutdown()


def rank() -> int:
    """This worker's rank."""
    return _runtime.rank()


def size() -> int:
    """The number of workers."""
    return _runtime.size()


def local_rank() -> int:
    """This worker's rank on its machine."""
    return _runtime.local_rank()


def local_size() -> int:
    """The number of workers on this machine."""
    return _runtime.local_size()


# -- compression_params ----------------------------------------------------------------
@dataclass(frozen=True)
class Mapped:
    """``compression_params`` in this project's terms.

    Attributes:
        spec: the compressor (wrapped in error feedback for ``ef="vanilla"``).
        count: BytePS's ``k`` as a count of elements per gradient (topk,
            randomk), or None; the ratio is then set per gradient.
        seed: the compressors' seed, or None.
    """

    spec: CompressionSpec
    count: Optional[int] = None
    seed: Optional[int] = None


def _choice(key: str, value: Any, accepted: Dict[Any, str], bools: bool = False) -> str:
    v = value.lower() if isinstance(value, str) else value
    if v not in accepted or (isinstance(v, bool) and not bools):  # True == 1 as a key
        names = ", ".join(repr(a) for a in accepted)
        raise ValueError(f"compression_params[{key!r}] = {value!r} is not accepted; "
                         f"accepted: {names}")
    return accepted[v]


def map_compression_params(params: Mapping[str, Any]) -> Mapped:
    """Map BytePS's ``compression_params`` onto this project's compressors.

    Raises:
        ValueError: an unknown key or value, a missing ``compressor`` or ``k``,
            a key that does not apply to the compressor, or ``momentum``.

    Example:
        >>> map_compression_params({"compressor": "topk", "k": 0.01, "ef": "vanilla"}).spec
        Compression.ef(inner='topk', ratio=0.01)
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"compression_params must be a dict, found {type(params).__name__}")
    unknown = sorted(str(k) for k in params if k not in KEYS)
    if unknown:
        raise ValueError(f"unknown compression_params key(s) {unknown}; accepted: "
                         f"{', '.join(KEYS)}")
    p = {k: v for k, v in params.items() if v is not None and v != ""}
    if "compressor" not in p:
        raise ValueError("compression_params needs 'compressor' (one of "
                         f"{', '.join(COMPRESSORS)})")
    name = _choice("compressor", p["compressor"], {c: c for c in COMPRESSORS})
    stray = sorted(k for k in ("scaling", "k", "partition", "normalize")
                   if k in p and k not in _APPLIES[name])
    if stray:
        raise ValueError(f"compression_params {stray} do not apply to compressor {name!r}; "
                         f"it takes {sorted(_APPLIES[name]) or 'none of k, scaling, ...'}")
    if "momentum" in p:
        _choice("momentum", p["momentum"], {"nesterov": "nesterov"})
        raise ValueError("compression_params['momentum'] = 'nesterov' (BytePS's worker-side "
                         "momentum before compression) is not implemented by hipress-like; "
                         "put the momentum in the optimizer instead: torch.optim.SGD(..., "
                         "momentum=0.9, nesterov=True)")
    kw: Dict[str, Any] = {}
    count = None
    if name in ("topk", "randomk", "dithering") and "k" not in p:
        raise ValueError(f"compression_params needs 'k' with compressor {name!r} (a ratio in "
                         "(0, 1) or a count for topk/randomk, the number of levels for "
                         "dithering)")
    if name == "onebit" and "scaling" in p:
        _choice("scaling", p["scaling"], {True: "", False: "", "true": "", "false": "",
                                           "1": "", "0": ""}, bools=True)
    elif name in ("topk", "randomk"):
        k = _number("k", p["k"])
        if 0 < k < 1:
            kw["ratio"] = k
        elif k >= 1 and k == int(k):
            count = int(k)
        else:
            raise ValueError(f"compression_params['k'] = {p['k']!r}: expected a ratio in "
                             "(0, 1) or a whole count >= 1")
    elif name == "dithering":
        k = _number("k", p["k"])
        if k < 1 or k != int(k):
            raise ValueError(f"compression_params['k'] = {p['k']!r}: dithering takes a whole "
                             "number of levels >= 1")
        kw["s"] = int(k)
        if "partition" in p:
            name = _choice("partition", p["partition"], {
                "linear": "dithering", 0: "dithering", "0": "dithering",
                "natural": "natural_dithering", 1: "natural_dithering",
                "1": "natural_dithering"})
        if "normalize" in p:
            kw["normalize"] = _choice("normalize", p["normalize"], {
                "max": "max", 0: "max", "0": "max", "l2": "l2", 1: "l2", "1": "l2"})
    spec = CompressionSpec(name, kw)
    if "ef" in p:
        _choice("ef", p["ef"], {"vanilla": "vanilla"})
        spec = CompressionSpec("ef", {"inner": name, **kw})
    seed = None
    if "seed" in p:
        s = _number("seed", p["seed"])
        if s < 0 or s != int(s):
            raise ValueError(f"compression_params['seed'] = {p['seed']!r}: expected a whole "
                             "number >= 0")
        seed = int(s)
    return Mapped(spec, count, seed)


def _number(key: str, value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if isinstance(value, bool) or not math.isfinite(x):
        raise ValueError(f"compression_params[{key!r}] must be a number, found {value!r}")
    return x


def _plan(mapped: Optional[Mapped], spec: CompressionSpec, strategy: str,
          named: List[Any], optimizer: torch.optim.Optimizer) -> Optional[Plan]:
    """The engine's plan: BytePS's size rule (``Knobs``), plus a ratio per gradient
    when ``k`` counts elements."""
    if spec.name == "identity":
        return None  # nothing to compress: every gradient takes the allreduce lane
    rule = _knobs.rule()
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
                         timeout: Optional[float] = None) -> torch.optim.Optimizer:
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

    Raises:
        ValueError: bad ``compression_params``, ``staleness``, or scale factors.
    """
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
        spec, seed = mapped.spec, mapped.seed or 0
        if compression not in (None, Compression.none):
            log.info("compression=%r is ignored: compression_params chooses %r",
                     compression, spec)
    else:
        spec = compression if isinstance(compression, CompressionSpec) else \
            _coll._spec(compression)
    plan = _plan(mapped, spec, strategy, named, optimizer)
    opt = _DistributedOptimizer(optimizer, named_parameters=named or None, compression=spec,
                                backward_passes_per_step=backward_passes_per_step,
                                strategy=strategy, plan=plan, nonfinite=nonfinite,
                                timeout=timeout, seed=seed)
    opt._hp_scale = factor
    return opt


# -- push_pull ------------------------------------------------------------------------------
def declare(name: str) -> None:
    """Declare a tensor name before its first ``push_pull`` (BytePS needs every
    worker to declare the same names in the same order; here it only checks the
    name, since collectives match by call order)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"declare() takes a non-empty name, found {name!r}")
    if name not in _declared:
        _declared.append(name)


def push_pull_async(tensor: torch.Tensor, average: bool = True, name: Optional[str] = None,
                    version: int = 0, priority: int = 0) -> Any:
    """Start averaging (or summing) ``tensor`` over workers into a new tensor;
    ``synchronize(handle)`` returns it. ``version`` and ``priority`` are accepted."""
    return _coll.allreduce_async(tensor, average=bool(average), name=name)


def push_pull_async_inplace(tensor: torch.Tensor, average: bool = True,
                            name: Optional[str] = None, version: int = 0,
                            priority: int = 0) -> Any:
    """Start averaging (or summing) ``tensor`` in place; ``synchronize(handle)``
    returns it."""
    return _coll.allreduce_async_(tensor, average=bool(average), name=name)


def push_pull(tensor: torch.Tensor, average: bool = True, name: Optional[str] = None,
              version: int = 0, priority: int = 0,
              compression: Any = Compression.none) -> torch.Tensor:
    """The average (or sum) of ``tensor`` over workers, as a new tensor."""
    return _coll.allreduce(tensor, average=bool(average), name=name, compression=compression)


def push_pull_inplace(tensor: torch.Tensor, average: bool = True, name: Optional[str] = None,
                      version: int = 0, priority: int = 0) -> torch.Tensor:
    """Average (or sum) ``tensor`` over workers in place; returns it.

    Example (BytePS's metric averaging)::

        bps.declare("val_loss")
        bps.push_pull_inplace(loss_sum, average=False, name="val_loss")
    """
    return _coll.allreduce_(tensor, average=bool(average), name=name)


def poll(handle: Any) -> bool:
    """True when an ``*_async`` operation has finished."""
    return _coll.poll(handle)


def synchronize(handle: Any) -> torch.Tensor:
    """Wait for an ``*_async`` operation; return its output tensor."""
    return _coll.synchronize(handle)


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
