"""Registry of compressors by name, with an entry-point group for plug-ins.

    @register("topk")
    class TopK(Compressor): ...

    get("topk", ratio=0.01)      # -> TopK(ratio=0.01)
    available()                  # sorted names, aliases included

Third-party packages add compressors through the ``hipress_like.compressors``
entry-point group (each entry point loads a factory taking keyword params).
An unknown name lists what exists.
"""
from __future__ import annotations

import difflib
import logging
from typing import Any, Callable, Dict, List

from .base import Compressor
from .params import ParamError

__all__ = ["register", "get", "available", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "hipress_like.compressors"
_log = logging.getLogger(__name__)
_REGISTRY: Dict[str, Callable[..., Compressor]] = {}
_entry_points_loaded = False


def register(name: str, *aliases: str) -> Callable:
    """Class/factory decorator registering ``name`` (and ``aliases``)."""

    def deco(factory: Callable[..., Compressor]) -> Callable[..., Compressor]:
        for n in (name, *aliases):
            if n in _REGISTRY and _REGISTRY[n] is not factory:
                raise ValueError(f"compressor name {n!r} is already registered")
        _check_algo_id(name, factory)
        for n in (name, *aliases):
            _REGISTRY[n] = factory
        return factory

    return deco


def _algo_id(factory: Any) -> int:
    """The payload algorithm id a registered class declares (0: none, e.g. a wrapper)."""
    if isinstance(factory, type) and issubclass(factory, Compressor):
        return int(factory.algo_id)
    return 0


def _check_algo_id(name: str, factory: Any) -> None:
    """Reject a class whose payload algorithm id another registered class already uses.

    The id in every payload header is how ``decode`` rejects a foreign
    payload; two compressors sharing one would decode each other's bytes.
    Id 0 means "no own payload format" (wrappers such as ``ef`` send their
    inner compressor's payload) and is not checked.
    """
    aid = _algo_id(factory)
    if aid == 0:
        return
    for other_name, other in _REGISTRY.items():
        if other is not factory and _algo_id(other) == aid:
            used = sorted(_algo_id(f) for f in set(_REGISTRY.values()) if _algo_id(f))
            raise ValueError(
                f"compressor {name!r} ({getattr(factory, '__qualname__', factory)}) declares "
                f"algorithm id {aid}, already used by {other_name!r} "
                f"({getattr(other, '__qualname__', other)}); give {name!r} its own algo_id "
                f"(ids in use: {used}; a subclass inherits its parent's id)")


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    try:
        from importlib.metadata import entry_points

        eps = entry_points()
        group = eps.select(group=ENTRY_POINT_GROUP) if hasattr(eps, "select") else eps.get(
            ENTRY_POINT_GROUP, [])
        for ep in group:
            if ep.name not in _REGISTRY:
                try:
                    factory = ep.load()
                    _check_algo_id(ep.name, factory)
                    _REGISTRY[ep.name] = factory
                except Exception as e:  # a broken plug-in must not break the library
                    _log.warning("could not load compressor plug-in %s: %s", ep.name, e)
    except Exception as e:  # pragma: no cover - importlib failures are environmental
        _log.warning("could not scan entry points %s: %s", ENTRY_POINT_GROUP, e)


def available() -> List[str]:
    """Sorted names (and aliases) of every registered compressor."""
    _load_entry_points()
    return sorted(_REGISTRY)


def get(name: Any, **params: Any) -> Compressor:
    """Instantiate a compressor by name.

    Args:
        name: registry name (case-insensitive), or a ``Compressor`` instance
            (returned as is; then ``params`` must be empty).
        **params: constructor parameters; unknown ones raise ``ValueError``.

    Raises:
        ValueError: unknown name (the message lists the known ones) or
            invalid parameters.
    """
    if isinstance(name, Compressor):
        if params:
            raise ValueError("parameters cannot be given with a compressor instance")
        return name
    if not isinstance(name, str):
        raise TypeError(f"compressor must be a name or a Compressor, found {type(name).__name__}")
    _load_entry_points()
    key = name.strip().lower()
    if key not in _REGISTRY:
        close = difflib.get_close_matches(key, _REGISTRY, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown compressor {name!r}{hint}; available: {', '.join(available())}"
        )
    try:
        return _REGISTRY[key](**params)
    except ParamError:
        raise  # already says expected/found/fix (and a ParamTypeError must stay a TypeError)
    except TypeError as e:
        raise ValueError(f"invalid parameters for compressor {key!r}: {e}") from e
