"""Profiles: the measured inputs of the cost model (the schema; measuring is in tuning/).

HiPress fits its cost curves from measurements (Sec. 3.3: "we launch the GPU
kernels and peer-to-peer communication tasks with respect to different
gradient sizes to fit the compression and network cost curves"). A
``Profile`` holds exactly that and nothing hard-coded:

- per compressor: its category, its payload size (``header + ratio * m``,
  the ``r`` of Eq. 2) and two ``Curve``s, ``T_enc`` by input bytes and
  ``T_dec`` by payload bytes, timed over log-spaced sizes (4 KB .. 256 MB by
  default, bounded by free memory);
- the link: ``Link(latency, bandwidth)``, either given or fitted to timed
  bulk rounds over a transport: every rank sends to its ring successor in
  one ``alltoallv`` (all links busy at once), optionally preceded by the
  small ``allgather`` of metadata CaSync's coordinator runs before each
  round. A second fit, ``link_one``, times one busy link (rank 0 to 1): when
  the links share a bottleneck (the CPU on loopback, a switch) one link
  alone is faster than N at once, and the planner uses the fit matching the
  number of links a synchronisation keeps busy (``model.concurrent_link``).

``hipress_like.tuning.profiler`` measures them; this module only holds,
validates, saves and loads them, so the pure cost model never imports the
engine. Profiles are versioned JSON, validated on load:

    {"format": "hipress-like-profile", "version": 1,
     "link": {"latency": 5e-05, "bandwidth": 1.25e8, "samples": [[4096, 8.1e-05], ...]},
     "link_one": {"latency": 4e-05, "bandwidth": 1.2e8, "samples": [...]},   (optional)
     "compressors": {"onebit": {"params": {}, "category": "quantization",
                                "aggregatable": false, "ratio": 0.03125,
                                "header_bytes": 32,
                                "encode": {"sizes": [...], "times": [...]},
                                "decode": {"sizes": [...], "times": [...]}}},
     "meta": {...}}
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import HipressError
from ._files import check_envelope, load_json
from .collectives import ring_allreduce
from .model import CATEGORIES, Curve, Link
from .plan import STRATEGIES as ENGINE_STRATEGIES

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "ProfileError",
    "CompressorProfile",
    "Profile",
    "Progress",
    "log_sizes",
]

_log = logging.getLogger(__name__)

PROFILE_FORMAT = "hipress-like-profile"
PROFILE_VERSION = 1

Progress = Optional[Callable[[Iterable[Any], str, int], Iterable[Any]]]


class ProfileError(HipressError, ValueError):
    """A profile file or object is invalid."""


@dataclass(frozen=True)
class CompressorProfile:
    """Measured costs of one compressor.

    Attributes:
        name: registry name.
        params: constructor parameters it was profiled with.
        category: "quantization", "sparsification", "lowrank" or "none"
            (selects alpha/beta/gamma, HiPress Table 3).
        aggregatable: payloads merge without decoding.
        ratio: payload bytes per input byte, header excluded.
        header_bytes: fixed bytes per payload.
        encode: T_enc by input bytes.
        decode: T_dec by payload bytes.
        error_feedback: the timings include the error-feedback wrapper the
            engine puts around biased compressors.
        sync_overhead: seconds a compressed synchronisation costs beyond
            Eq. 2 in the engine (``measure_sync_overhead``); 0: not measured
            (the profile-wide ``sync_overhead`` applies).
        engine_samples: whole compressed synchronisations timed through the
            engine (``measure_engine_sync``) with strategy ``engine_strategy``,
            as ``(bytes, K, seconds)``; the planner fits the engine's cost
            beyond Eq. 2 to them (``planner.EngineTerm``). Empty: not measured.
        engine_strategy: the strategy ``engine_samples`` were timed with
            ("ps" for profiles written before it was recorded: the CLI's
            default then).
        engine_samples_by: the samples of further strategies, by strategy
            (``samples_for`` reads both): PS and Ring pay differently beyond
            Eq. 2 (Ring's hops decode, merge and re-encode in turn), so a
            Ring planner must not fit PS timings.
        engine_cpu_by: per strategy, the CPU seconds one rank spends on the
            same synchronisations (every thread of its process), as
            ``(bytes, K, cpu_seconds)``: the work a rank's cores must find
            room for, which the advisor adds up when ranks outnumber cores
            (``step_model.predict_step``). Empty: not measured.
    """

    name: str
    category: str
    ratio: float
    header_bytes: int
    encode: Curve
    decode: Curve
    params: Mapping[str, Any] = field(default_factory=dict)
    aggregatable: bool = False
    error_feedback: bool = False
    sync_overhead: float = 0.0
    engine_samples: Tuple[Tuple[int, int, float], ...] = ()
    engine_strategy: str = "ps"
    engine_samples_by: Mapping[str, Tuple[Tuple[int, int, float], ...]] = field(
        default_factory=dict)
    engine_cpu_by: Mapping[str, Tuple[Tuple[int, int, float], ...]] = field(
        default_factory=dict)

    def __post_init__(self) -> None:
        where = f"compressor {self.name!r}"
        object.__setattr__(self, "engine_samples", _engine_samples(self.engine_samples, where))
        if self.engine_strategy not in ENGINE_STRATEGIES:
            raise ProfileError(f"{where}: engine_strategy must be one of {ENGINE_STRATEGIES}, "
                               f"found {self.engine_strategy!r}")
        by = self.engine_samples_by
        if not isinstance(by, Mapping) or any(k not in ENGINE_STRATEGIES for k in by):
            raise ProfileError(f"{where}: engine_samples_by must map strategies "
                               f"{ENGINE_STRATEGIES} to samples, found {by!r:.80}")
        object.__setattr__(self, "engine_samples_by", {
            k: _engine_samples(v, f"{where}, {k}") for k, v in by.items()})
        cpu = self.engine_cpu_by
        if not isinstance(cpu, Mapping) or any(k not in ENGINE_STRATEGIES for k in cpu):
            raise ProfileError(f"{where}: engine_cpu_by must map strategies "
                               f"{ENGINE_STRATEGIES} to samples, found {cpu!r:.80}")
        object.__setattr__(self, "engine_cpu_by", {
            k: _engine_samples(v, f"{where}, CPU {k}", cpu=True) for k, v in cpu.items()})
        if self.category not in CATEGORIES:
            raise ProfileError(f"compressor {self.name!r}: category must be one of "
                               f"{CATEGORIES}, found {self.category!r}")
        if not (isinstance(self.ratio, (int, float)) and 0 < self.ratio <= 4):
            raise ProfileError(f"compressor {self.name!r}: ratio must be in (0, 4], "
                               f"found {self.ratio!r}")
        if not isinstance(self.header_bytes, int) or self.header_bytes < 0:
            raise ProfileError(f"compressor {self.name!r}: header_bytes must be an integer "
                               f">= 0, found {self.header_bytes!r}")
        if not (isinstance(self.sync_overhead, (int, float)) and self.sync_overhead >= 0):
            raise ProfileError(f"compressor {self.name!r}: sync_overhead must be >= 0 seconds, "
                               f"found {self.sync_overhead!r}")

    def samples_for(self, strategy: str) -> Tuple[Tuple[int, int, float], ...]:
        """The engine timings taken with ``strategy`` (empty when none were)."""
        if strategy == self.engine_strategy:
            return self.engine_samples
        return self.engine_samples_by.get(strategy, ())

    def payload_bytes(self, nbytes: float) -> float:
        """Payload size for an ``nbytes`` input (``r * m`` of Eq. 2, plus the header)."""
        return self.header_bytes + self.ratio * nbytes

    def rate(self, nbytes: float) -> float:
        """Effective compression rate ``r`` at ``nbytes`` (the header counts)."""
        return self.payload_bytes(nbytes) / nbytes

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form (without the name, which is the key)."""
        return {"params": dict(self.params), "category": self.category,
                "aggregatable": self.aggregatable, "ratio": self.ratio,
                "header_bytes": self.header_bytes, "error_feedback": self.error_feedback,
                "sync_overhead": self.sync_overhead, "encode": self.encode.to_dict(),
                "decode": self.decode.to_dict(),
                "engine_samples": [list(x) for x in self.engine_samples],
                "engine_strategy": self.engine_strategy,
                "engine_samples_by": {k: [list(x) for x in v]
                                      for k, v in self.engine_samples_by.items()},
                **({"engine_cpu_by": {k: [list(x) for x in v]
                                      for k, v in self.engine_cpu_by.items()}}
                   if self.engine_cpu_by else {})}

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any]) -> "CompressorProfile":
        """Validate and build; raises ``ProfileError``."""
        optional = {"params", "aggregatable", "error_feedback", "sync_overhead",
                    "engine_samples", "compressor", "engine_strategy", "engine_samples_by",
                    "engine_cpu_by"}
        known = optional | {"category", "ratio", "header_bytes", "encode", "decode"}
        if not isinstance(d, Mapping):
            raise ProfileError(f"compressor {name!r}: expected an object, found {d!r:.60}")
        missing, unknown = known - set(d) - optional, set(d) - known
        if missing or unknown:
            raise ProfileError(f"compressor {name!r}: missing keys {sorted(missing)}, "
                               f"unknown keys {sorted(unknown)}")
        try:
            # a labelled candidate ("topk-bloom") names its registry compressor
            return cls(name=str(d.get("compressor", name)), params=dict(d.get("params", {})),
                       category=d["category"],
                       aggregatable=bool(d.get("aggregatable", False)),
                       error_feedback=bool(d.get("error_feedback", False)),
                       sync_overhead=d.get("sync_overhead", 0.0),
                       engine_samples=d.get("engine_samples", ()),
                       engine_strategy=d.get("engine_strategy", "ps"),
                       engine_samples_by=d.get("engine_samples_by", {}),
                       engine_cpu_by=d.get("engine_cpu_by", {}), ratio=d["ratio"],
                       header_bytes=d["header_bytes"], encode=Curve.from_dict(d["encode"]),
                       decode=Curve.from_dict(d["decode"]))
        except ProfileError:
            raise
        except (TypeError, ValueError) as e:
            raise ProfileError(f"compressor {name!r}: {e}") from e


@dataclass(frozen=True)
class Profile:
    """Everything the cost model measures: link and compressor curves.

    Attributes:
        link: T_send's alpha-beta fit with every link busy.
        compressors: profiles by registry name, or by a candidate label whose
            entry names its compressor (``"compressor"`` in the JSON).
        link_samples: the (bytes, seconds) rounds the link was fitted to
            (empty when the link was given).
        link_one: T_send with a single busy link (None: same as ``link``).
        link_one_samples: its samples.
        sync_overhead: seconds every synchronisation costs beyond Eq. 1/2 (the
            engine's coordination rounds that carry no gradient bytes),
            measured by ``measure_sync_overhead``; 0 is the paper's model.
        allreduce: the transport's allreduce time fitted to ``alpha + m beta``
            (``measure_link(pattern="allreduce")``): the engine's collective
            lane for uncompressed gradients. None: derived from ``link``
            with Table I's Ring-AR formula.
        allreduce_samples: its samples.
        lane: the engine's whole uncompressed synchronisation (its collective
            lane: copy into the bucket, NaN/Inf scan, allreduce, mean written
            back, and the coordinator's round), timed through the engine
            (``measure_engine_sync``) and fitted to ``alpha + m beta``. When
            present it is what "no compression" costs with ``raw_collective``.
        lane_samples: its samples.
        lane_cpu: the CPU seconds one rank spends on each of those
            synchronisations, as ``(bytes, cpu_seconds)`` (see
            ``CompressorProfile.engine_cpu_by``). Empty: not measured.
        meta: provenance (host, transport, world size, date).
    """

    link: Link
    compressors: Mapping[str, CompressorProfile] = field(default_factory=dict)
    link_samples: Tuple[Tuple[int, float], ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    link_one: Optional[Link] = None
    link_one_samples: Tuple[Tuple[int, float], ...] = ()
    sync_overhead: float = 0.0
    allreduce: Optional[Link] = None
    allreduce_samples: Tuple[Tuple[int, float], ...] = ()
    lane: Optional[Link] = None
    lane_samples: Tuple[Tuple[int, float], ...] = ()
    lane_cpu: Tuple[Tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        try:
            pairs = tuple((int(m), float(c)) for m, c in self.lane_cpu)
            if any(not (m > 0 and c >= 0 and math.isfinite(c)) for m, c in pairs):
                raise ValueError(f"{self.lane_cpu!r:.80}")
        except (TypeError, ValueError) as e:
            raise ProfileError(f"lane_cpu must be [bytes > 0, cpu_seconds >= 0] pairs, "
                               f"found {e}") from None
        object.__setattr__(self, "lane_cpu", pairs)
        if not (isinstance(self.sync_overhead, (int, float)) and self.sync_overhead >= 0):
            raise ProfileError(f"sync_overhead must be a number >= 0 seconds, found "
                               f"{self.sync_overhead!r}")

    def allreduce_time(self, m: float, n: int) -> float:
        """Seconds for an allreduce of ``m`` bytes over ``n`` ranks (the collective lane).

        The measured ``allreduce`` fit when the profile has one, else Table I's
        Ring-AR ``2(N-1) alpha + 2(N-1)/N m beta`` on the all-links fit.
        """
        if self.allreduce is not None:
            return self.allreduce(m)
        return ring_allreduce(m, n, self.link.alpha, self.link.beta)

    def compressor(self, name: str) -> CompressorProfile:
        """The profile of compressor ``name``.

        Raises:
            ProfileError: the profile has no such compressor (lists those it has).
        """
        if name not in self.compressors:
            have = ", ".join(sorted(self.compressors)) or "none"
            raise ProfileError(f"the profile has no compressor {name!r} (it has: {have}); "
                               f"profile it with: hipress-profile profile --compressors {name}")
        return self.compressors[name]

    def with_link(self, link: Link) -> "Profile":
        """This profile priced on another link: its link fits are replaced by ``link``.

        What was timed on the profiled network goes: the one-link and
        allreduce fits, the timed lane and the compressors' whole-engine
        timings (the planner then uses Table I's Ring-AR and Eq. 2 plus the
        measured constant overheads, which are CPU work). Compressor curves
        and the CPU figures stay.
        """
        comps = {k: replace(v, engine_samples=(), engine_samples_by={})
                 for k, v in self.compressors.items()}
        return replace(self, link=link, link_samples=(), link_one=None, link_one_samples=(),
                       allreduce=None, allreduce_samples=(), lane=None, lane_samples=(),
                       compressors=comps, meta={**self.meta, "link_source": "given"})

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict with format and version tags."""
        d = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "link": _link_dict(self.link, self.link_samples),
            "compressors": {k: {**v.to_dict(), **({"compressor": v.name} if v.name != k else {})}
                            for k, v in sorted(self.compressors.items())},
            "meta": dict(self.meta),
        }
        if self.link_one is not None:
            d["link_one"] = _link_dict(self.link_one, self.link_one_samples)
        if self.allreduce is not None:
            d["allreduce"] = _link_dict(self.allreduce, self.allreduce_samples)
        if self.lane is not None:
            d["lane"] = _link_dict(self.lane, self.lane_samples)
        if self.lane_cpu:
            d["lane_cpu"] = [list(x) for x in self.lane_cpu]
        if self.sync_overhead:
            d["sync_overhead"] = self.sync_overhead
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Profile":
        """Validate and build a profile from a dict (as read from JSON).

        Raises:
            ProfileError: wrong format tag or version, unknown keys, bad values.
        """
        check_envelope(d, "profile", PROFILE_FORMAT, (PROFILE_VERSION,),
                       {"format", "version", "link", "link_one", "sync_overhead", "compressors",
                        "meta", "allreduce", "lane", "lane_cpu"},
                       ProfileError, "re-run hipress-profile profile")
        comps = d.get("compressors", {})
        if not isinstance(comps, Mapping):
            raise ProfileError("profile 'compressors' must be an object keyed by name")
        lk, samples = _link_from(d.get("link"), "link")
        one, one_samples = (_link_from(d["link_one"], "link_one") if "link_one" in d
                            else (None, ()))
        ar, ar_samples = (_link_from(d["allreduce"], "allreduce") if "allreduce" in d
                          else (None, ()))
        lane, lane_samples = _link_from(d["lane"], "lane") if "lane" in d else (None, ())
        return cls(link=lk,
                   compressors={str(k): CompressorProfile.from_dict(str(k), v)
                                for k, v in comps.items()},
                   link_samples=samples, meta=dict(d.get("meta", {})), link_one=one,
                   link_one_samples=one_samples, sync_overhead=d.get("sync_overhead", 0.0),
                   allreduce=ar, allreduce_samples=ar_samples, lane=lane,
                   lane_samples=lane_samples, lane_cpu=d.get("lane_cpu", ()))

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the profile as indented JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Profile":
        """Read and validate a profile file.

        Raises:
            ProfileError: unreadable file, bad JSON or an invalid profile (names the file).
        """
        return load_json(path, cls.from_dict, ProfileError, "profile")


def _engine_samples(samples: Any, where: str, cpu: bool = False
                    ) -> Tuple[Tuple[int, int, float], ...]:
    """Validate ``(bytes, K, seconds)`` triples (seconds > 0; >= 0 for ``cpu``
    seconds, which a tiny synchronisation may not register); raises ``ProfileError``."""
    out = []
    least = 0.0 if cpu else 1e-300
    try:
        for row in samples:
            m, k, t = row
            if not (int(m) == m and m > 0 and int(k) == k and k >= 1 and float(t) >= least
                    and math.isfinite(float(t))):
                raise ValueError(f"{row!r}")
            out.append((int(m), int(k), float(t)))
    except (TypeError, ValueError) as e:
        raise ProfileError(f"{where}: engine_samples must be [bytes > 0, K >= 1, seconds > 0] "
                           f"triples, found {e}") from None
    return tuple(out)


def _link_dict(link: Link, samples: Sequence[Tuple[int, float]]) -> Dict[str, Any]:
    return {"latency": link.latency, "bandwidth": link.bandwidth,
            "samples": [list(x) for x in samples]}


def _link_from(d: Any, key: str) -> Tuple[Link, Tuple[Tuple[int, float], ...]]:
    if not isinstance(d, Mapping) or not {"latency", "bandwidth"} <= set(d):
        raise ProfileError(f"profile {key!r} must be {{'latency': s, 'bandwidth': B/s, ...}}")
    try:
        samples = tuple((int(s), float(t)) for s, t in d.get("samples", []))
        return Link(latency=d["latency"], bandwidth=d["bandwidth"]), samples
    except (TypeError, ValueError) as e:
        raise ProfileError(f"invalid profile {key}: {e}") from e


# -- measuring ---------------------------------------------------------------

def log_sizes(lo: int, hi: int, per_octave: float = 0.5) -> List[int]:
    """Log-spaced sizes from ``lo`` to ``hi`` bytes, multiples of 4 (float32).

    Args:
        lo: smallest size in bytes (>= 4).
        hi: largest size in bytes (>= lo).
        per_octave: points per doubling (0.5: every factor of 4).

    Example:
        >>> log_sizes(4096, 65536)
        [4096, 16384, 65536]
    """
    if lo < 4 or hi < lo:
        raise ValueError(f"need 4 <= lo <= hi, found lo={lo}, hi={hi}")
    steps = max(1, round(math.log2(hi / lo) * per_octave)) if hi > lo else 0
    out = []
    for i in range(steps + 1):
        s = lo * (hi / lo) ** (i / steps) if steps else lo
        s = max(4, int(round(s / 4)) * 4)
        if not out or s > out[-1]:
            out.append(s)
    return out
