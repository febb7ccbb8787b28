"""Reading the cost model's versioned JSON files (plans, profiles); errors name the file."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Type, TypeVar, Union

T = TypeVar("T")


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
