"""The compressor-state envelope every front end puts in its checkpoints.

Compressor state (error-feedback residuals, PowerSGD's Q, DGC's momentum)
belongs to one rank. The PyTorch optimizer's ``"hipress"`` entry, the
TensorFlow face's ``compressor_state()`` and the Gluon trainer's side file
all wrap ``Engine.state_dict()`` in the same envelope::

    {"format": FORMAT, "version": VERSION, "world_size": N,
     "rank": r, "engine": {...}}          # one rank's own state, or
     "engines": [{...}, ... N of them]}   # every rank's, gathered by a collective

and read it back by the same rules (``unpack``): another world size starts
the compressor state fresh, with a warning; another rank's state is refused,
since it would resume this rank with someone else's residuals.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

__all__ = ["FORMAT", "VERSION", "pack", "check_format", "unpack", "restore"]

FORMAT = "hipress-like-optimizer-state"
VERSION = 1


def pack(local: Dict[str, Any], rank: int, size: int,
         engines: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """The envelope of this rank's engine state ``local``, or of every rank's
    (``engines``, index = rank, from an ``allgather_object`` the caller ran)."""
    hip: Dict[str, Any] = {"format": FORMAT, "version": VERSION, "world_size": size}
    if engines is not None:
        hip["engines"] = engines
    else:
        hip.update(rank=rank, engine=local)
    return hip


def check_format(hip: Any, where: str) -> None:
    """Raise ValueError unless ``hip`` is an envelope of this ``FORMAT`` and ``VERSION``."""
    get = hip.get if isinstance(hip, dict) else (lambda _k: None)
    if get("format") != FORMAT or get("version") != VERSION:
        raise ValueError(f"{where} is not a compressor state this version reads: format "
                         f"{get('format')!r} version {get('version')!r}; expected {FORMAT!r} "
                         f"version {VERSION}")


def unpack(hip: Any, rank: int, size: int, *, where: str, fix: str,
           foreign_empty_ok: bool = False) -> Optional[Dict[str, Any]]:
    """This rank's engine state from an envelope, or None to start fresh.

    Args:
        hip: the envelope (``pack`` output).
        rank, size: this process's rank and world size.
        where: what held it, for messages ("this state dict", a file name).
        fix: the sentence telling the user how to save it right.
        foreign_empty_ok: accept another rank's state when it holds no
            compressor state (nothing rank-specific would be restored).

    Raises:
        ValueError: not an envelope of this version, or another rank's state.
    """
    check_format(hip, where)
    if hip.get("world_size") != size:
        warnings.warn(f"compressor state in {where} was saved with {hip.get('world_size')} "
                      f"ranks, this run has {size}; starting compressor state fresh",
                      stacklevel=3)
        return None
    if "engines" in hip:
        return hip["engines"][rank]
    saved = hip.get("engine") or {}
    if hip.get("rank") == rank or (foreign_empty_ok and not any(saved.get("states", {}).values())):
        return saved
    raise ValueError(f"the compressor state in {where} belongs to rank {hip.get('rank')}, not "
                     f"rank {rank}: loading it would resume rank {rank} with another rank's "
                     f"error-feedback residuals. {fix}")


def restore(engine: Any, state: Optional[Dict[str, Any]]) -> None:
    """Put what ``unpack`` returned into ``engine``: None (another world size)
    starts its compressor state fresh, a dict is loaded as this rank's."""
    if state is None:
        engine.reset_state()
    else:
        engine.load_state_dict(state)
