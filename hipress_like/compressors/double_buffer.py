"""Double buffering of compressor states (``Compressor.detach_state``).

Idea: the engine keeps the state each step starts from, so that it can undo
a step in which some rank saw NaN/Inf (``casync.nonfinite``). A compressor
whose step rewrites large arrays of its state (PowerSGD's error, DGC's two
accumulators) can write the new arrays into a second set of buffers instead,
with the same traffic, and leave the old state intact: the engine then keeps
the old state by reference instead of copying it every step. The arrays of
the state the engine lets go at the end of a step (its ``spare``) are the
next step's second buffers, so two sets of buffers alternate.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["free_buffer", "second_buffer"]


def free_buffer(buf: Any, like: torch.Tensor, state: Mapping[str, Any], skip: str = "") -> bool:
    """``buf`` can receive a new array in place of ``like``: the same shape, dtype
    and device, contiguous, and sharing memory with no tensor of ``state`` but
    ``state[skip]`` (the key ``buf`` came from, if any)."""
    if (not isinstance(buf, torch.Tensor) or buf.shape != like.shape or buf.dtype != like.dtype
            or buf.device != like.device or not buf.is_contiguous()):
        return False
    ptr = buf.untyped_storage().data_ptr()
    return all(k == skip or not isinstance(v, torch.Tensor)
               or v.untyped_storage().data_ptr() != ptr for k, v in state.items())


def second_buffer(spare: Any, key: str, like: torch.Tensor, state: Mapping[str, Any],
                  buffer_key: str) -> torch.Tensor:
    """The buffer a step writes ``state[key]``'s successor into: ``spare[key]`` (a
    discarded state's array) when it is free, else the state's own
    ``state[buffer_key]`` when it is, else a new one shaped like ``like``.

    Example:
        >>> st = {"u": torch.zeros(3)}; old = {"u": torch.ones(3)}
        >>> second_buffer(old, "u", st["u"], st, "u_buffer") is old["u"]
        True
    """
    buf = spare.get(key) if isinstance(spare, dict) else None
    if free_buffer(buf, like, state):
        return buf
    buf = state.get(buffer_key)
    if free_buffer(buf, like, state, buffer_key):
        return buf
    return torch.empty_like(like, memory_format=torch.contiguous_format)
