"""The engine's errors: what every rank raises when a step cannot complete."""
from __future__ import annotations

from typing import Sequence

from ..errors import HipressError

__all__ = ["EngineError", "GradientMismatchError", "ConfigMismatchError"]


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
