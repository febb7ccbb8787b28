"""Reading the cost model's versioned JSON files (plans, profiles); errors name the file."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Collection, Mapping, Type, TypeVar, Union

T = TypeVar("T")


def check_envelope(d: Any, what: str, fmt: str, versions: Collection[Any],
                   known: Collection[str], error: Type[ValueError], hint: str) -> Any:
    """Check what every versioned file shares: a JSON object, its format tag, a
    version this library reads, no unknown top-level keys; return the version.

    Args:
        d: the parsed JSON.
        what: the kind of file, for messages ("plan", "profile").
        fmt: the expected ``format`` tag.
        versions: the ``version`` values this library reads.
        known: the top-level keys allowed.
        error: the exception type raised.
        hint: how to fix an unsupported version (appended to its message).

    Raises:
        error: any of these checks fails.
    """
    if not isinstance(d, Mapping):
        raise error(f"a {what} must be a JSON object, found {type(d).__name__}")
    if d.get("format") != fmt:
        raise error(f"not a {what} file: format is {d.get('format')!r}, expected {fmt!r}")
    version = d.get("version")
    if version not in versions:
        raise error(f"{what} version {version!r} is not supported (this library reads "
                    f"versions {tuple(versions)}); {hint}")
    unknown = set(d) - set(known)
    if unknown:
        raise error(f"unknown {what} keys: {sorted(unknown)}; known: {sorted(known)}")
    return version


def load_json(path: Union[str, os.PathLike], from_dict: Callable[[Any], T],
              error: Type[ValueError], what: str) -> T:
    """``from_dict(json of path)``; any failure is an ``error`` naming the file.

    Raises:
        error: the file cannot be read, is not JSON, or ``from_dict`` refused it.
    """
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"cannot read {what} {os.fspath(path)!r}: {e}") from e
    try:
        return from_dict(d)
    except error as e:
        raise error(f"{os.fspath(path)}: {e}") from e
