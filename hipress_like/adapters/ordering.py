"""``OrderingError``: the one error every face raises for calls in the wrong order.

Horovod raises on ``zero_grad()`` between ``backward()`` and ``step()``;
the faces here do the same for their own sequences (the torch optimizer's
extra backward passes, MXNet's ``save_states()`` between
``allreduce_grads()`` and ``update()``, ...). Horovod's error is an
``AssertionError``, so scripts that catch that keep working; it is a
``RuntimeError`` and a ``HipressError`` too.
"""
from __future__ import annotations

from ..errors import HipressError

__all__ = ["OrderingError"]


class OrderingError(HipressError, AssertionError, RuntimeError):
    """Calls in the wrong order (Horovod raises AssertionError; this is both)."""
