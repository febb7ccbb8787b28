"""A DDP communication hook that synchronises gradients with CaSync.

DDP users keep their training loop and add two lines::

    state = hpt.CaSyncHookState(ddp_model, compression=hpt.Compression.onebit)
    ddp_model.register_comm_hook(state, hpt.casync_hook)

How it works:

1. ``CaSyncHookState`` registers every trainable parameter of the wrapped
   module with an engine, by name (collective, like building the DDP model).
2. DDP calls ``casync_hook(state, bucket)`` for each bucket, in bucket
   order, as backward fills them. ``bucket.gradients()`` are views into the
   bucket's flat buffer; each is submitted to the engine under its
   parameter's name, so plans apply per gradient regardless of how DDP
   groups (and, after the first iteration, regroups) its buckets.
3. Each call returns a future. The last bucket's call finishes the engine's
   step (the averaged values are already in the buffers) and completes every
   future of the iteration; DDP then copies the buffers into ``p.grad``.

A step skipped for NaN/Inf (``nonfinite="skip"``) yields zero gradients on
every rank (a DDP hook cannot cancel ``optimizer.step()``).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..engine_builder import (
    build_engine,
    close_engine,
    device_type_of,
    refuse_adaptive,
    specs_of,
    wire_dtype,
)
from ..runtime import _track

__all__ = ["CaSyncHookState", "casync_hook"]

log = logging.getLogger(__name__)


class CaSyncHookState:
    """State for ``casync_hook``: the engine and this iteration's pending futures.

    A collective call: every rank builds it at the same point, after the
    DDP model.

    Args:
        model: the ``DistributedDataParallel`` model (or its module).
        compression: ``hpt.Compression.<name>``, a registry name, a
            ``Compressor`` or None (no compression / the plan's compressor).
        strategy: "ps" or "ring".
        plan: "auto", a ``Plan``, a plan file path or None.
        nonfinite: "raise" or "skip" (skipped steps get zero gradients).
        timeout: seconds before a stalled or dead peer becomes an error.
        seed: the compressors' random seed (same on all ranks).
        compression_back: the master compressor of bidirectional compression
            (see ``DistributedOptimizer``); None: the aggregate goes back
            encoded by ``compression``.

    Example:
        >>> ddp = DistributedDataParallel(model)
        >>> ddp.register_comm_hook(hpt.CaSyncHookState(ddp, compression="onebit"),
        ...                        hpt.casync_hook)
    """

    def __init__(self, model: torch.nn.Module, compression: Any = None, strategy: str = "ps",
                 plan: Any = "auto", nonfinite: str = "raise", timeout: Optional[float] = None,
                 seed: int = 0, compression_back: Any = None):
        refuse_adaptive(plan, "hpt.CaSyncHookState (the DDP comm hook)")
        module = getattr(model, "module", model)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names: Dict[int, str] = {id(p): n for n, p in named}
        self._by_ptr: Dict[int, str] = {p.data_ptr(): n for n, p in named}
        self.engine = build_engine(specs_of(named), compression=compression, strategy=strategy,
                                   plan=plan, nonfinite=nonfinite, timeout=timeout, seed=seed,
                                   compression_back=compression_back,
                                   device_type=device_type_of([p for _, p in named]))
        # (future, buffer, [(view, wire copy)]) of the buckets submitted this iteration
        self._pending: List[Tuple[torch.futures.Future, torch.Tensor,
                                  List[Tuple[torch.Tensor, torch.Tensor]]]] = []
        self.skipped_steps = 0
        _track(self)

    def name_of(self, p: torch.Tensor) -> str:
        """The registered name of parameter ``p`` (by identity, then by storage)."""
        n = self.names.get(id(p)) or self._by_ptr.get(p.data_ptr())
        if n is None:
            raise ValueError(f"a DDP bucket holds a parameter of shape {tuple(p.shape)} that "
                             "was not trainable when CaSyncHookState was built; build the "
                             "state after freezing/unfreezing parameters")
        return n

    def state_dict(self) -> Dict[str, Any]:
        """This rank's compressor state (save one per rank for an exact resume)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned on this rank."""
        self.engine.load_state_dict(state)

    def close(self) -> None:
        """Close the engine (also done by ``hpt.shutdown()``)."""
        eng, self.engine = self.engine, None
        if eng is not None:
            close_engine(eng)


# No annotations on purpose: DDP rejects a hook whose annotations are not exactly
# dist.GradBucket / Future[Tensor] (strings under postponed evaluation never are).
def casync_hook(state, bucket):  # noqa: ANN001
    """DDP comm hook: average the bucket's gradients with CaSync.

    Args:
        state: a ``CaSyncHookState``.
        bucket: DDP's ``GradBucket``.

    Returns:
        A future resolving to the bucket's buffer holding averaged gradients.
    """
    if state.engine is None:
        raise RuntimeError("casync_hook: the CaSyncHookState was closed")
    buf = bucket.buffer()
    copies: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for p, g in zip(bucket.parameters(), bucket.gradients()):  # noqa: B905
        name = state.name_of(p)
        wd = wire_dtype(g.dtype, name)
        if wd != g.dtype or not g.is_contiguous():
            w = g.to(wd, memory_format=torch.contiguous_format)
            copies.append((g, w))
            g = w
        state.engine.submit(name, g)
    fut: torch.futures.Future = torch.futures.Future()
    state._pending.append((fut, buf, copies))
    if bucket.is_last():
        pending, state._pending = state._pending, []
        try:
            ok = state.engine.synchronize()
        except BaseException as e:
            for f, _, _ in pending:
                if not f.done():
                    f.set_exception(e)
            raise
        if not ok:
            state.skipped_steps += 1
            log.warning("CaSync skipped a step (NaN/Inf gradient): gradients set to zero")
        for f, b, cps in pending:
            with torch.no_grad():
                for view, w in cps:
                    view.copy_(w)
                if not ok:
                    b.zero_()
            f.set_result(b)
    return fut
