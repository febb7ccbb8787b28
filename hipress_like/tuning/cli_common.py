"""What ``hipress-profile``'s subcommands share: one-line errors, units, models.

Sizes take binary units as the paper does (``4KB`` = 4096 bytes, ``MB`` =
MiB); bandwidths take bits (``1gbit``, ``10gbps``) or bytes per second
(``125MB/s``), decimal as ``tc`` does; latencies take ``s``, ``ms``, ``us``.
``--model`` is a preset, a size list, a JSON file or ``package.module:attr``.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Tuple

from ..cost_model.presets import PRESETS, from_json, from_module, preset
from ..errors import HipressError

__all__ = ["CLIError", "parse_bytes", "parse_bandwidth", "parse_seconds", "format_bytes",
           "model_sizes"]


class CLIError(HipressError, ValueError):
    """Bad command-line input; printed as one line, exit code 2."""


# -- units ------------------------------------------------------------------
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_BYTES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_BW = {"": 1.0, "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9,
       "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
       "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8}
_SECONDS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _parse(text: str, units: Dict[str, float], what: str, example: str) -> float:
    m = re.fullmatch(_NUM + r"\s*([a-zµ/]*)", str(text).strip().lower())
    if not m or m.group(2) not in units:
        raise CLIError(f"cannot read {what} {text!r}; expected a number with a unit like "
                       f"{example}")
    return float(m.group(1)) * units[m.group(2)]


def parse_bytes(text: str) -> int:
    """``"4KB"`` -> 4096 (binary units, as HiPress writes sizes)."""
    v = _parse(text, _BYTES, "a size", "4KB, 16MB, 1.5GB")
    if v < 1:
        raise CLIError(f"a size must be at least 1 byte, found {text!r}")
    return int(round(v))


def parse_bandwidth(text: str) -> float:
    """``"1gbit"`` -> 1.25e8 bytes/s; ``"125MB/s"`` -> 1.25e8; a bare number is bytes/s."""
    v = _parse(text, _BW, "a bandwidth", "1gbit, 10gbps, 125MB/s")
    if v <= 0:
        raise CLIError(f"bandwidth must be > 0, found {text!r}")
    return v


def parse_seconds(text: str) -> float:
    """``"50us"`` -> 5e-05; a bare number is seconds."""
    return _parse(text, _SECONDS, "a latency", "50us, 1ms, 0.002s")


def format_bytes(n: float) -> str:
    """4096 -> '4 KB', 5.5 * 2**20 -> '5.5 MB'."""
    for unit, f in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= f:
            return f"{n / f:.4g} {unit}"
    return f"{int(n)} B"


def model_sizes(spec: str, scale: float) -> List[Tuple[str, int]]:
    """Resolve --model: a preset, a size list, a JSON file or ``module:attr``."""
    s = spec.strip()
    if s.lower() in PRESETS:
        return preset(s, scale)
    if os.path.isfile(s):
        sizes = from_json(s)
    elif re.fullmatch(r"[0-9.eE+\-a-zA-Z\s]+(,[0-9.eE+\-a-zA-Z\s]+)*", s) and s[0].isdigit():
        sizes = [(f"grad{i}", parse_bytes(t)) for i, t in enumerate(s.split(","))]
    elif ":" in s:
        sizes = from_module(s)
    else:
        raise CLIError(f"--model {spec!r} is not a preset ({', '.join(sorted(PRESETS))}), a "
                       "size list (e.g. 4MB,16MB), a JSON file, or package.module:attr")
    if scale != 1.0:
        sizes = [(n, max(4, int(round(b * scale / 4)) * 4)) for n, b in sizes]
    return sizes
