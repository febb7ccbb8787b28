"""Steps that saw NaN/Inf: compressor state rolls back, and the outcome every rank shares.

The idea: a rank learns that *some* rank's gradient was non-finite only when
the step's coordination ends (the ``FLAG_NONFINITE`` bit of a report, or the
status word behind a replayed schedule), long after every rank has encoded
its gradients and moved its compressor state (error-feedback memory,
PowerSGD's Q and error, DGC's momentum). Holding every encode back until all
ranks have vouched for all their gradients would end the overlap of
compression with backward, so the engine lets the step run and undoes it:

1. ``submit`` scans each gradient (``all_finite``). A rank that finds
   NaN/Inf flags the step and zeroes what it hands to a compressor, so no
   compressor sees NaN (several refuse it) and the exchange stays finite.
   A compressor that finds NaN/Inf in its own first pass
   (``Capabilities.checks_finite``) spares that scan: its ``NonFiniteError``
   flags the step, and its input is zeroed and encoded with a new state
   (``workflows.CompressorCodec``).
2. ``StateUndo.save``: the first time a step touches a compressor state
   (``CompressorCodec.state``) the state as it was is kept. A compressor
   that double-buffers (``Compressor.detach_state``: PowerSGD) gets a state
   whose step writes into a second buffer, so the old state is kept by
   reference, at no cost; any other state is copied, into buffers reused
   from step to step. ``nonfinite="raise"`` and ``"ignore"`` keep nothing.
3. ``finish_step`` (at the end of ``Engine.synchronize``), when any rank
   flagged the step: every saved state is put back (states created during
   the step are dropped), so the step leaves no trace in any compressor;
   with ``nonfinite="propagate"`` every gradient that went through a
   compressor is set to NaN on every rank, while uncompressed gradients
   carry the exact sums, with their Inf and NaN, as DDP's and Horovod's
   allreduce do. ``torch.amp.GradScaler`` then finds the NaN, skips the
   optimizer step and lowers its scale on every rank alike. With
   ``nonfinite="skip"`` ``synchronize`` returns False instead (the
   gradients then hold no meaningful average; the front ends do not step).

A copy costs one pass over each copied state per step (about one memory
copy of the error-feedback memory, which is why PowerSGD keeps its old
state by reference instead);
``nonfinite="ignore"`` skips both the scan and the copies.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Iterable, Mapping, Optional

import torch

__all__ = ["MODES", "StateUndo", "snapshot", "finish_step"]

# What a step does when some rank's gradient holds NaN/Inf (EngineConfig.nonfinite).
MODES = ("propagate", "skip", "raise", "ignore")


def snapshot(state: Any, spare: Any = None) -> Any:
    """A deep copy of a compressor state (dicts, lists, tuples, tensors, scalars),
    written into ``spare``'s tensors where shapes and dtypes match.

    Example:
        >>> s = {"error": torch.ones(2), "step": 3}
        >>> c = snapshot(s); _ = s["error"].add_(1)
        >>> c["error"].tolist(), c["step"]
        ([1.0, 1.0], 3)
    """
    if isinstance(state, torch.Tensor):
        if (isinstance(spare, torch.Tensor) and spare is not state
                and spare.shape == state.shape and spare.dtype == state.dtype
                and spare.device == state.device and spare.is_contiguous()):
            return spare.copy_(state)
        return state.clone()
    if isinstance(state, dict):
        sp = spare if isinstance(spare, dict) else {}
        return {k: snapshot(v, sp.get(k)) for k, v in state.items()}
    if type(state) in (list, tuple):
        sp = spare if type(spare) is type(state) and len(spare) == len(state) else \
            [None] * len(state)
        return type(state)(snapshot(v, s) for v, s in zip(state, sp))  # noqa: B905
    return state  # ints, floats, strings, None: immutable


class StateUndo:
    """The compressor states one step found, kept until the step's outcome is known.

    ``save`` runs on the computing executor's threads (one key at a time per
    key: a partition's site is touched by its own chain of tasks); ``end_step``
    on the caller's thread once every task is done.
    """

    def __init__(self) -> None:
        self.saved: Dict[str, Any] = {}  # key -> copy of its state, or None: created this step
        self._spare: Dict[str, Any] = {}  # buffers of the last copies, reused by the next
        self._lock = threading.Lock()

    def save(self, key: str, state: Optional[Dict[str, Any]],
             comp: Any = None) -> Optional[Dict[str, Any]]:
        """Keep ``state`` (the state at ``key`` before this step touches it) once a
        step, and return the state the step is to use: ``comp.detach_state``'s
        (``state`` itself is then kept, by reference) or ``state`` (then copied).

        Example (PowerSGD double-buffers: nothing is copied):
            >>> from hipress_like.compressors import get
            >>> c = get("powersgd", rank=1); g = torch.ones(4, 4)
            >>> st = c.init(g, world_size=1); u = StateUndo()
            >>> use = u.save("g|ring", st, c)
            >>> u.saved["g|ring"] is st, "m_buffer" in use
            (True, True)
        """
        with self._lock:
            if key in self.saved:
                return state
            spare = self._spare.pop(key, None)
        use, keep = state, None
        if state is not None:
            detached = comp.detach_state(state, spare) if comp is not None else None
            if detached is None:
                keep = snapshot(state, spare)
            else:
                use, keep = detached, state
        with self._lock:
            self.saved[key] = keep
        return use

    def end_step(self, states: Dict[str, Any], restore: bool) -> None:
        """Put the saved states back into ``states`` (``restore``) or let them go;
        either way the copies' buffers serve the next step's copies."""
        with self._lock:
            saved, self.saved = self.saved, {}
        for key, old in saved.items():
            if restore:
                new = states.pop(key, None)
                if old is not None:
                    states[key] = old
                old = new  # the discarded state's buffers become spares
            if old is not None:
                self._spare[key] = old


def finish_step(undo: Optional[StateUndo], states: Dict[str, Any], flagged: bool,
                handles: Iterable[Any], grads: Mapping[str, Any], mode: str) -> bool:
    """End a step: roll compressor state back if some rank flagged NaN/Inf, and
    write the outcome into the compressed gradients (see the module docstring).

    Args:
        undo: the engine's ``StateUndo`` (None when ``mode`` keeps no copies).
        states: the engine's compressor states.
        flagged: some rank saw NaN/Inf this step (``StepState.skipped``).
        handles: the step's handles (``Handle.name`` and the caller's tensor).
        grads: the layout's gradients by name (``GradLayout.compressor``).
        mode: ``EngineConfig.nonfinite``.

    Returns:
        What ``synchronize`` returns: False only for a step skipped with
        ``nonfinite="skip"``.
    """
    if undo is not None:
        undo.end_step(states, restore=flagged)
    if not flagged:
        return True
    if mode == "propagate":
        for h in handles:
            if grads[h.name].compressor is not None:
                h.tensor.fill_(float("nan"))
        return True
    return False
