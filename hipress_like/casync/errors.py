"""The engine's errors: what every rank raises when a step cannot complete."""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import HipressError

__all__ = ["EngineError", "GradientMismatchError", "ConfigMismatchError", "WireError",
           "PeerFailureError"]


class EngineError(HipressError, RuntimeError):
    """Synchronisation failed (on this rank or a peer); the engine is unusable after it.

    Attributes:
        ranks: the ranks the failure is blamed on, when known.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class GradientMismatchError(EngineError, ValueError):
    """Ranks registered or submitted different gradients."""


class ConfigMismatchError(EngineError, ValueError):
    """Ranks built their engines with different settings (compressor, parameters,
    strategy, plan, ...): found at ``register``, before any data moves."""


class WireError(EngineError):
    """A bulk message arrived damaged, truncated, or not as the round's plan expects
    (``casync/wire.py``): raised on the receiver, naming the sender.

    Attributes:
        sender: the rank that sent the message (also in ``ranks``).
        payload: the damaged payload (gradient and partition), when one is known.
    """

    def __init__(self, message: str, sender: int, payload: Optional[str] = None):
        super().__init__(message, ranks=[sender])
        self.sender = sender
        self.payload = payload


class PeerFailureError(EngineError):
    """A peer reported that it failed (its error flag in a metadata round); this rank
    only learned of it, so it does not tell its peers again."""
