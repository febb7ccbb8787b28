"""Validation of compressor parameters: expected, found, and how to fix it.

Every compressor checks its constructor parameters with these helpers, so a
plan or a command line that passes ``ratio="0.1"`` (a string) fails at
construction, on every rank, before any data moves:

    >>> check_real("randomk", "ratio", 0.1, low=0.0, high=1.0, low_open=True)
    0.1
    >>> check_real("randomk", "ratio", "0.1")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    hipress_like.compressors.params.ParamTypeError: randomk: ratio must be a number

A wrong type raises ``ParamTypeError``, a wrong value ``ParamError``. Both
are ``ValueError`` (the registry's contract: invalid parameters raise
``ValueError``); ``ParamTypeError`` is also a ``TypeError``.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

from ..errors import HipressError

__all__ = ["ParamError", "ParamTypeError", "check_real", "check_int", "check_bool",
           "check_str"]


class ParamError(HipressError, ValueError):
    """A compressor parameter has a value out of its range."""


class ParamTypeError(ParamError, TypeError):
    """A compressor parameter has the wrong type (a string where a number goes)."""


def _found(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def check_real(owner: str, name: str, value: Any, *, low: Optional[float] = None,
               high: Optional[float] = None, low_open: bool = False, high_open: bool = False,
               example: Any = None) -> float:
    """``value`` as a float, checked to be a finite real number in the given range.

    Args:
        owner: the compressor's name, for the message.
        name: the parameter's name.
        value: what was passed (int or float; bool and strings are rejected).
        low, high: bounds (None: unbounded); ``low_open``/``high_open``
            exclude the bound itself.
        example: a valid value shown in the fix.

    Raises:
        ParamTypeError: not a real number.
        ParamError: NaN, infinite, or out of range.
    """
    eg = f", e.g. {name}={example!r}" if example is not None else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParamTypeError(f"{owner}: {name} must be a number, found {_found(value)}; "
                             f"pass a float{eg}")
    v = float(value)
    lo_ok = low is None or (v > low if low_open else v >= low)
    hi_ok = high is None or (v < high if high_open else v <= high)
    if not math.isfinite(v) or not (lo_ok and hi_ok):
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        left = "(" if low_open or low is None else "["
        right = ")" if high_open or high is None else "]"
        rng = f"{left}{lo}, {hi}{right}"
        fix = f"; pass one in range{eg}" if eg else ""
        raise ParamError(f"{owner}: {name} must be a finite number in {rng}, found {value!r}{fix}")
    return v


def check_int(owner: str, name: str, value: Any, *, low: Optional[int] = None,
              choices: Optional[Sequence[int]] = None, example: Any = None) -> int:
    """``value`` as an int, checked to be an integer >= ``low`` or one of ``choices``.

    Raises:
        ParamTypeError: not an integer (floats such as 2.5 or 2.0, bools, strings).
        ParamError: below ``low`` or not among ``choices``.
    """
    eg = f", e.g. {name}={example!r}" if example is not None else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ParamTypeError(f"{owner}: {name} must be an integer, found {_found(value)}; "
                             f"pass an int{eg}")
    v = int(value)
    if choices is not None and v not in choices:
        raise ParamError(f"{owner}: {name} must be one of {tuple(choices)}, found {value!r}")
    if low is not None and v < low:
        raise ParamError(f"{owner}: {name} must be an integer >= {low}, found {value!r}{eg}")
    return v


def check_bool(owner: str, name: str, value: Any) -> bool:
    """``value`` checked to be a bool (not 0/1, not the string "false").

    Raises:
        ParamTypeError: anything but True or False.
    """
    if not isinstance(value, bool):
        raise ParamTypeError(f"{owner}: {name} must be True or False, found {_found(value)}; "
                             f"pass {name}=True or {name}=False")
    return value


def check_str(owner: str, name: str, value: Any, *, choices: Sequence[str]) -> str:
    """``value`` checked to be one of the strings ``choices``.

    Example:
        >>> check_str("powersgd", "error_dtype", "bfloat16", choices=("bfloat16",))
        'bfloat16'

    Raises:
        ParamTypeError: not a string (e.g. ``torch.bfloat16`` itself).
        ParamError: not among ``choices``.
    """
    if not isinstance(value, str):
        raise ParamTypeError(f"{owner}: {name} must be a string, one of {tuple(choices)}; found "
                             f"{_found(value)}")
    if value not in choices:
        raise ParamError(f"{owner}: {name} must be one of {tuple(choices)}, found {value!r}")
    return value
