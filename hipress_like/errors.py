"""The one base class of every error hipress-like raises.

``except hipress_like.HipressError`` catches anything the library raises on
purpose, and nothing else (a bug's ``KeyError`` still surfaces as itself).
Each error keeps the built-in base it always had as well (``PlanError`` is
still a ``ValueError``, ``EngineError`` still a ``RuntimeError``), so code
written against those keeps working; the base adds no behaviour and no
message format: every error's text says what was expected, what was found
and how to fix it, where it is raised.

This module sits below every layer (tests/unit/test_layers.py) and imports
nothing, so the lowest module can derive from it.
"""
from __future__ import annotations

__all__ = ["HipressError"]


class HipressError(Exception):
    """Base of every exception class defined in hipress_like.

    Example:
        >>> from hipress_like.cost_model.plan import PlanError
        >>> issubclass(PlanError, HipressError) and issubclass(PlanError, ValueError)
        True
    """
