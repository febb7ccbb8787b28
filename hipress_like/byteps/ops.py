"""BytePS's ``push_pull`` family, on the same compressed PS path as the optimizer.

BytePS pushes a tensor to its server, which sums the workers' tensors and
(with a compressor) compresses the sum again before the workers pull it:
compression both ways. Here a compressed ``push_pull`` goes through a CaSync
engine with the PS strategy, the engine ``DistributedOptimizer`` uses: each
worker encodes its partition for the aggregator, the aggregator decodes and
sums the payloads in rank order, encodes the sum again with the same
compressor (its own error-feedback state, as BytePS's server has) and sends
those bytes back; every rank decodes the same bytes, so all ranks hold
bitwise-identical results (``casync/workflows.py``, CaSync-PS).

One engine serves one tensor name (BytePS's key), built on the name's first
compressed ``push_pull`` (collective, like BytePS's declaration) and reused
for every later call of that name. Tensors under
``BYTEPS_MIN_COMPRESS_BYTES``, non-float tensors and calls without a
compressor take the plain allreduce, as BytePS leaves small tensors
uncompressed.

Names are BytePS's keys: every worker must use (declare) them in the same
order. The first use of a name checks that order across ranks, one small
allgather, and a mismatch is an error on every rank naming each rank's
name, instead of summing different tensors.

Handles: ``poll`` is true once the result is in place; ``synchronize``
returns it once, and a second ``synchronize`` of the same handle is an
error (BytePS frees the handle at its first ``synchronize``).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..adapters import collectives as _coll
from ..adapters import objects as _objects
from ..adapters import runtime as _runtime
from ..adapters.engine_builder import build_engine, close_engine
from ..cost_model.plan import Plan, SizeRule
from .params import Mapped

__all__ = ["PushPullHandle", "start", "poll", "synchronize", "declare", "declared", "reset"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_declared: List[str] = []  # names in this rank's declaration order
_checked: Dict[str, int] = {}  # names whose order was checked across ranks -> index
_engines: Dict[str, Tuple[Any, Tuple[Any, ...]]] = {}  # name -> (engine, its key)


class PushPullHandle:
    """One in-flight ``push_pull``; ``synchronize`` returns its tensor once.

    Args:
        name: the tensor's name (for messages).
        out: the tensor that receives the result.
        inner: the allreduce handle, or the engine's gradient handle.
        engine: the engine of a compressed call, else None.
        scale: multiplies the engine's average (``size`` for a sum).
    """

    def __init__(self, name: str, out: torch.Tensor, inner: Any, engine: Any = None,
                 scale: float = 1.0):
        self.name, self._out, self._inner, self._engine = name, out, inner, engine
        self._scale = scale
        self._synchronized = False

    def poll(self) -> bool:
        """True once ``synchronize`` will not wait: the result is in place, or the
        operation failed (``synchronize`` then raises the error). On an unfinished
        compressed call this looks at the engine for up to 50 ms."""
        if self._synchronized:
            return True
        if self._engine is None:
            return _coll.poll(self._inner)
        if self._inner.done():
            return True
        try:
            self._inner.wait(0.0)  # raises the engine's error, if it failed
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - failed: synchronize() raises it
            return True
        return True

    def synchronize(self) -> torch.Tensor:
        """Wait for the result and return it.

        Raises:
            ValueError: the handle was synchronized before.
            hipress_like.casync.transport.TransportError, EngineError: a peer
                failed, stalled past the timeout, or raised.
        """
        if self._synchronized:
            raise ValueError(f"push_pull handle for {self.name!r} was already synchronized; "
                             "synchronize(handle) returns the result once (keep the tensor "
                             "it returned)")
        self._synchronized = True
        if self._engine is None:
            return _coll.synchronize(self._inner)
        self._engine.synchronize()
        self._inner.wait()
        if self._scale != 1.0:
            with torch.no_grad():
                self._out.mul_(self._scale)
        return self._out


def declare(name: str) -> int:
    """Declare ``name`` (BytePS's ``declare``); return its index in this rank's order."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"declare() takes a non-empty name, found {name!r}")
    with _lock:
        if name not in _declared:
            _declared.append(name)
        return _declared.index(name)


def declared() -> List[str]:
    """This rank's declared names, in order."""
    with _lock:
        return list(_declared)


def _check_order(name: str) -> None:
    """On a name's first use, check that every rank uses the same name at the same
    declaration index (collective: every rank's first use of a name is in the
    same place of its program, as BytePS requires)."""
    if name in _checked:
        return
    idx = declare(name)
    got = _objects.allgather_object([idx, name], name=f"declare {name!r}")
    if any(g != got[0] for g in got):
        seen = "; ".join(f"rank {r}: #{g[0]} {g[1]!r}" for r, g in enumerate(got))
        raise ValueError(f"push_pull names differ across ranks at this call ({seen}); "
                         "BytePS matches tensors by declaration order: declare (or first "
                         "push_pull) the same names in the same order on every worker")
    _checked[name] = idx


def _plan(name: str, mapped: Mapped, rule: SizeRule, nbytes: int, numel: int) -> Plan:
    """The engine's plan for one tensor: BytePS's size rule, and ``k`` as a count."""
    spec = mapped.spec
    gradients = {}
    if mapped.count is not None:
        gp = rule.decide(nbytes, _runtime.size())
        ratio = min(1.0, mapped.count / numel)
        gradients[name] = replace(gp, compressor=spec.name,
                                  params=dict(spec.params, ratio=ratio))
    return Plan(compressor=spec.name, params=dict(spec.params), strategy="ps", rule=rule,
                gradients=gradients)


def _engine_for(name: str, t: torch.Tensor, mapped: Mapped, rule: SizeRule) -> Any:
    key = (tuple(t.shape), t.dtype, repr(mapped.spec), mapped.count, mapped.seed, rule)
    entry = _engines.get(name)
    if entry is not None:
        if entry[1] != key:
            raise ValueError(f"push_pull {name!r}: first used as {entry[1][:2]} with "
                             f"{entry[1][2]}, now {key[:2]} with {key[2]}; a name keeps its "
                             "shape, dtype and compression (use another name)")
        return entry[0]
    engine = build_engine([(name, tuple(t.shape), t.dtype)], compression=mapped.spec,
                          strategy="ps", plan=_plan(name, mapped, rule, t.numel() *
                                                    t.element_size(), t.numel()),
                          nonfinite="propagate", timeout=None, seed=mapped.seed or 0,
                          own_push=True)
    _engines[name] = (engine, key)
    log.debug("push_pull %r: engine built (%s)", name, mapped.spec)
    return engine


def start(tensor: torch.Tensor, out: torch.Tensor, average: bool, name: Optional[str],
          mapped: Optional[Mapped], rule: SizeRule) -> PushPullHandle:
    """Start a ``push_pull`` of ``tensor`` whose result lands in ``out``.

    Args:
        tensor: the input.
        out: ``tensor`` itself (in place) or a copy of it.
        average: average (True) or sum over workers.
        name: the BytePS name; required with a compressor (it keys the engine).
        mapped: the compressor (``map_compression_params``), or None.
        rule: BytePS's size rule (``Knobs.rule()``).

    Raises:
        ValueError: a compressed call without a name, a name reused with another
            shape or compression, or names in different orders across ranks.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"push_pull expects a torch.Tensor, found {type(tensor).__name__}")
    if name is not None:
        _check_order(name)
    compress = mapped is not None and mapped.compresses and out.dtype in (
        torch.float32, torch.float64) and rule.decide(
            out.numel() * out.element_size(), _runtime.size()).compress
    if mapped is not None and mapped.compresses and name is None:
        raise ValueError("push_pull with a compressor needs name= (BytePS's key: it keeps "
                         "the compressor's state between calls)")
    if not compress:
        wire = mapped.spec if mapped is not None and not mapped.compresses else None
        h = _coll.allreduce_async_(out, average=bool(average), name=name, compression=wire)
        return PushPullHandle(name or "", out, h)
    engine = _engine_for(name, out, mapped, rule)
    h = engine.submit(name, out)  # the engine works on a contiguous copy if it must
    return PushPullHandle(name, out, h, engine, 1.0 if average else float(_runtime.size()))


def poll(handle: PushPullHandle) -> bool:
    """True once ``handle``'s result is in place."""
    return _as_handle(handle).poll()


def synchronize(handle: PushPullHandle) -> torch.Tensor:
    """Wait for ``handle`` and return its tensor (once per handle)."""
    return _as_handle(handle).synchronize()


def _as_handle(handle: Any) -> PushPullHandle:
    if not isinstance(handle, PushPullHandle):
        raise TypeError(f"expected a handle from push_pull_async*, found "
                        f"{type(handle).__name__}")
    return handle


def reset() -> None:
    """Close the push_pull engines and forget the names (``shutdown``)."""
    with _lock:
        engines = [e for e, _ in _engines.values()]
        _engines.clear()
        _declared.clear()
        _checked.clear()
    for e in engines:
        try:
            close_engine(e)
        except Exception as err:  # noqa: BLE001 - shutting down: report, go on
            log.warning("closing a push_pull engine failed: %s", err)
