"""BytePS's ``compression_params``, read the way BytePS reads them.

BytePS (``byteps/mxnet/__init__.py``, ``DistributedTrainer._register_compressor``)
does not check the dict as a whole: it reads the keys it knows and validates
their *values* only. Its examples rely on that and pass every key whatever the
compressor (``k`` and ``scaling`` with onebit, ``partition`` and ``normalize``
with top-k). This module does the same, key by key:

============  ==========================================================  =========
key           BytePS's rule (a falsy value counts as absent)              here
============  ==========================================================  =========
compressor    a str; absent: a warning and no compression                 onebit,
                                                                          topk,
                                                                          randomk,
                                                                          dithering
ef            a str (``vanilla``)                                         error
                                                                          feedback
momentum      a str (``nesterov``), applied on the worker                 refused
scaling       onebit only; other compressors ignore it                    accepted
k             required by topk, randomk, dithering; ignored by onebit     ratio,
                                                                          count,
                                                                          levels
partition     ``linear`` or ``natural``, whatever the compressor          dithering
normalize     ``max`` or ``l2``, whatever the compressor                  dithering
seed          an integer (``is not None``)                                seed;
                                                                          randomk's
                                                                          for every
                                                                          rank
fp16          truthy: fp16 on the wire when no compressor is chosen       fp16
============  ==========================================================  =========

A key that does not apply to the chosen compressor, or one BytePS does not
read at all, is accepted as BytePS accepts it and logged once, at debug
level. A value BytePS would refuse is an error saying what is accepted; an
unknown compressor is an error naming the known ones.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Set, Tuple

from ..adapters.compression import Compression, CompressionSpec

__all__ = ["KEYS", "COMPRESSORS", "Mapped", "map_compression_params"]

log = logging.getLogger(__name__)

KEYS = ("compressor", "ef", "momentum", "scaling", "k", "partition", "normalize", "seed",
        "fp16")
COMPRESSORS = ("onebit", "topk", "randomk", "dithering")
_APPLIES = {"onebit": {"scaling"}, "topk": {"k"}, "randomk": {"k"},
            "dithering": {"k", "partition", "normalize"}}
_logged: Set[Tuple[str, Tuple[str, ...]]] = set()


@dataclass(frozen=True)
class Mapped:
    """``compression_params`` in this project's terms.

    Attributes:
        spec: the compressor (wrapped in error feedback for ``ef="vanilla"``),
            or ``Compression.none`` / ``.fp16`` when no compressor is chosen.
        count: BytePS's ``k`` as a count of elements per gradient (topk,
            randomk), or None; the ratio is then set per gradient.
        seed: the compressors' seed, or None.
    """

    spec: CompressionSpec
    count: Optional[int] = None
    seed: Optional[int] = None

    @property
    def compresses(self) -> bool:
        """True when a compressor (not none/fp16) was chosen."""
        return self.spec.name not in ("identity", "fp16")


def _given(p: Mapping[str, Any], key: str) -> bool:
    """BytePS's ``if compression_params.get(key):``."""
    return bool(p.get(key))


def _string(p: Mapping[str, Any], key: str) -> Optional[str]:
    """``compressor``, ``ef`` and ``momentum``: BytePS raises TypeError unless a str."""
    if not _given(p, key):
        return None
    v = p[key]
    if not isinstance(v, str):
        raise TypeError(f"compression_params[{key!r}] must be a str (as in BytePS), "
                        f"found {type(v).__name__} {v!r}")
    return v


def _choice(key: str, value: Any, accepted: Tuple[str, ...]) -> str:
    if value not in accepted:
        raise ValueError(f"compression_params[{key!r}] = {value!r} is not accepted; "
                         f"accepted: {', '.join(repr(a) for a in accepted)}")
    return value


def _number(key: str, value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if isinstance(value, bool) or not math.isfinite(x):
        raise ValueError(f"compression_params[{key!r}] must be a number, found {value!r}")
    return x


def _log_unused(name: str, keys: Tuple[str, ...]) -> None:
    """Say once per process (debug level) which keys the compressor does not use."""
    if keys and (name, keys) not in _logged:
        _logged.add((name, keys))
        log.debug("compression_params %s do not apply to compressor %r; accepted and "
                  "ignored, as BytePS does", list(keys), name)


def map_compression_params(params: Mapping[str, Any]) -> Mapped:
    """Map BytePS's ``compression_params`` onto this project's compressors.

    Args:
        params: BytePS's dict (module docstring).

    Returns:
        The compressor spec, the per-gradient count of ``k`` and the seed.

    Raises:
        TypeError: ``params`` is not a dict, or ``compressor``/``ef``/``momentum``
            is not a str.
        ValueError: an unknown compressor, ``ef`` or ``momentum`` value, a
            ``partition`` other than linear/natural, a ``normalize`` other than
            max/l2, a missing or bad ``k``, a bad ``seed``, or
            ``momentum="nesterov"`` (not implemented here; the message says
            what to do instead).

    Example:
        >>> map_compression_params({"compressor": "topk", "k": 0.01, "ef": "vanilla"}).spec
        Compression.ef(inner='topk', ratio=0.01)
        >>> map_compression_params({"compressor": "onebit", "k": 0.01,
        ...                         "partition": "linear", "normalize": "max"}).spec
        Compression.onebit
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"compression_params must be a dict, found {type(params).__name__}")
    p = dict(params)
    compressor = _string(p, "compressor")
    ef = _string(p, "ef")
    momentum = _string(p, "momentum")
    # validated whatever the compressor, as BytePS does
    partition = _choice("partition", p["partition"], ("linear", "natural")) \
        if _given(p, "partition") else None
    normalize = _choice("normalize", p["normalize"], ("max", "l2")) \
        if _given(p, "normalize") else None
    seed = None
    if p.get("seed") is not None:
        s = _number("seed", p["seed"])
        if s < 0 or s != int(s):
            raise ValueError(f"compression_params['seed'] = {p['seed']!r}: expected a whole "
                             "number >= 0")
        seed = int(s)
    if compressor is None:
        spec = Compression.fp16 if _given(p, "fp16") else Compression.none
        if ef or momentum:
            log.warning("compression_params without 'compressor': no compression (as "
                        "BytePS: 'Compressor is not defined'); 'ef'/'momentum' unused")
        else:
            log.debug("compression_params without 'compressor': %s", spec)
        return Mapped(spec, None, seed)
    name = compressor.lower()
    if name not in COMPRESSORS:
        raise ValueError(f"compression_params['compressor'] = {compressor!r} is not a "
                         f"BytePS compressor; known: {', '.join(COMPRESSORS)}")
    if ef is not None:
        _choice("ef", ef, ("vanilla",))
    if momentum is not None:
        _choice("momentum", momentum, ("nesterov",))
        raise ValueError("compression_params['momentum'] = 'nesterov' (BytePS's worker-side "
                         "momentum before compression) is not implemented by hipress-like; "
                         "put the momentum in the optimizer instead: torch.optim.SGD(..., "
                         "momentum=0.9, nesterov=True), and leave 'momentum' out")
    unused = tuple(sorted(k for k in p if k not in ("compressor", "ef", "momentum", "seed")
                          and k not in _APPLIES[name] and p[k] not in (None, False, "")))
    _log_unused(name, unused)
    kw: Dict[str, Any] = {}
    count = None
    if name in ("topk", "randomk", "dithering") and p.get("k") is None:
        raise ValueError(f"compression_params needs 'k' with compressor {name!r} (a ratio in "
                         "(0, 1) or a count for topk/randomk, the number of levels for "
                         "dithering)")
    if name == "randomk" and seed is not None:
        # BytePS seeds every worker's and the server's random-k alike: the same
        # entries at a step on every rank and in the pull (RandomK's ``seed``)
        kw["seed"] = seed
    if name in ("topk", "randomk"):
        k = _number("k", p["k"])
        if 0 < k < 1:
            kw["ratio"] = k
        elif k >= 1 and k == int(k):
            count = int(k)
        else:
            raise ValueError(f"compression_params['k'] = {p['k']!r}: expected a ratio in "
                             "(0, 1) or a whole count >= 1")
    elif name == "dithering":
        k = _number("k", p["k"])
        if k < 1 or k != int(k):
            raise ValueError(f"compression_params['k'] = {p['k']!r}: dithering takes a whole "
                             "number of levels >= 1")
        kw["s"] = int(k)
        if partition == "natural":
            name = "natural_dithering"
        if normalize is not None:
            kw["normalize"] = normalize
    spec = CompressionSpec(name, kw)
    if ef is not None:
        spec = CompressionSpec("ef", {"inner": name, **kw})
    return Mapped(spec, count, seed)
