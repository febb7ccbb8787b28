"""Profiles: the measured inputs of the cost model, and how to measure them.

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

Profiles are versioned JSON, validated on load:

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

import dataclasses
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..compressors.base import assume_finite
from .collectives import ring_allreduce
from .model import CATEGORIES, Curve, Link, fit_link

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "ProfileError",
    "CompressorProfile",
    "Profile",
    "log_sizes",
    "memory_bound",
    "profile_compressor",
    "measure_link",
    "profile_transport",
    "measure_sync_overhead",
    "measure_engine_sync",
    "engine_points",
    "broadcast_bytes",
    "monotone",
]

_log = logging.getLogger(__name__)

PROFILE_FORMAT = "hipress-like-profile"
PROFILE_VERSION = 1

Progress = Optional[Callable[[Iterable[Any], str, int], Iterable[Any]]]


class ProfileError(ValueError):
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
            engine (``measure_engine_sync``), as ``(bytes, K, seconds)``; the
            planner fits the engine's cost beyond Eq. 2 to them
            (``planner.EngineTerm``). Empty: not measured.
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_samples",
                           _engine_samples(self.engine_samples, f"compressor {self.name!r}"))
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
                "engine_samples": [list(x) for x in self.engine_samples]}

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any]) -> "CompressorProfile":
        """Validate and build; raises ``ProfileError``."""
        optional = {"params", "aggregatable", "error_feedback", "sync_overhead",
                    "engine_samples"}
        known = optional | {"category", "ratio", "header_bytes", "encode", "decode"}
        if not isinstance(d, Mapping):
            raise ProfileError(f"compressor {name!r}: expected an object, found {d!r:.60}")
        missing, unknown = known - set(d) - optional, set(d) - known
        if missing or unknown:
            raise ProfileError(f"compressor {name!r}: missing keys {sorted(missing)}, "
                               f"unknown keys {sorted(unknown)}")
        try:
            return cls(name=name, params=dict(d.get("params", {})), category=d["category"],
                       aggregatable=bool(d.get("aggregatable", False)),
                       error_feedback=bool(d.get("error_feedback", False)),
                       sync_overhead=d.get("sync_overhead", 0.0),
                       engine_samples=d.get("engine_samples", ()), ratio=d["ratio"],
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
        compressors: profiles by registry name.
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

    def __post_init__(self) -> None:
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

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict with format and version tags."""
        d = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "link": _link_dict(self.link, self.link_samples),
            "compressors": {k: v.to_dict() for k, v in sorted(self.compressors.items())},
            "meta": dict(self.meta),
        }
        if self.link_one is not None:
            d["link_one"] = _link_dict(self.link_one, self.link_one_samples)
        if self.allreduce is not None:
            d["allreduce"] = _link_dict(self.allreduce, self.allreduce_samples)
        if self.lane is not None:
            d["lane"] = _link_dict(self.lane, self.lane_samples)
        if self.sync_overhead:
            d["sync_overhead"] = self.sync_overhead
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "Profile":
        """Validate and build a profile from a dict (as read from JSON).

        Raises:
            ProfileError: wrong format tag or version, unknown keys, bad values.
        """
        if not isinstance(d, Mapping):
            raise ProfileError(f"a profile must be a JSON object, found {type(d).__name__}")
        if d.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"not a profile file: format is {d.get('format')!r}, expected "
                               f"{PROFILE_FORMAT!r}")
        if d.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile version {d.get('version')!r} is not supported "
                               f"(expected {PROFILE_VERSION}); re-run hipress-profile profile")
        known = {"format", "version", "link", "link_one", "sync_overhead", "compressors", "meta",
                 "allreduce", "lane"}
        if set(d) - known:
            raise ProfileError(f"unknown profile keys: {sorted(set(d) - known)}; known: "
                               f"{sorted(known)}")
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
                   lane_samples=lane_samples)

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
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"cannot read profile {os.fspath(path)!r}: {e}") from e
        try:
            return cls.from_dict(d)
        except ProfileError as e:
            raise ProfileError(f"{os.fspath(path)}: {e}") from e


def _engine_samples(samples: Any, where: str) -> Tuple[Tuple[int, int, float], ...]:
    """Validate ``(bytes, K, seconds)`` triples; raises ``ProfileError``."""
    out = []
    try:
        for row in samples:
            m, k, t = row
            if not (int(m) == m and m > 0 and int(k) == k and k >= 1 and float(t) > 0
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


def _available_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_bound(sizes: Sequence[int], copies: int = 4, fraction: float = 0.5) -> List[int]:
    """Drop sizes whose ``copies`` buffers would not fit in ``fraction`` of free memory."""
    avail = _available_memory()
    if avail is None:
        return list(sizes)
    kept = [s for s in sizes if s * copies <= fraction * avail]
    if len(kept) < len(sizes):
        _log.warning("skipping sizes above %d bytes: not enough free memory (%d bytes)",
                     kept[-1] if kept else 0, avail)
    return kept


def _time(fn: Callable[[], Any], repeats: int, min_time: float) -> float:
    """Median seconds of ``fn`` over at least ``repeats`` calls and ``min_time`` seconds."""
    fn()  # warm up (allocator, lazy init, compilation)
    ts: List[float] = []
    start = time.perf_counter()
    while len(ts) < repeats or (time.perf_counter() - start < min_time and len(ts) < 50):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return max(statistics.median(ts), 1e-9)


def _iterate(items: Sequence[Any], progress: Progress, desc: str) -> Iterable[Any]:
    return progress(items, desc, len(items)) if progress else items


def profile_compressor(
    name: str,
    params: Optional[Mapping[str, Any]] = None,
    sizes: Optional[Sequence[int]] = None,
    *,
    repeats: int = 5,
    min_time: float = 0.05,
    progress: Progress = None,
    barrier: Optional[Callable[[], None]] = None,
    error_feedback: Union[bool, str] = False,
) -> CompressorProfile:
    """Time encode and decode of a compressor over sizes (HiPress Sec. 3.3).

    1. For each size, a float32 gradient of that many bytes (standard normal,
       fixed seed) is encoded once to warm up, then timed (median).
    2. The payload is decoded and timed the same way.
    3. ``ratio`` and ``header_bytes`` are fitted to the payload sizes.

    Args:
        name: registry name of the compressor.
        params: its constructor parameters.
        sizes: bytes per gradient (default 4 KB .. 256 MB, bounded by memory).
        repeats: timed calls per size (at least).
        min_time: keep timing small sizes until this many seconds passed.
        progress: ``progress(iterable, desc, total)`` wrapper (e.g. tqdm).
        barrier: called before each size (all ranks time together, so a
            multi-rank profile sees the CPU contention of real training).
        error_feedback: time the compressor inside the error-feedback
            wrapper (True), bare (False), or as the engine runs it ("auto":
            wrapped when biased, stateless and single-round).

    Returns:
        The compressor's profile.

    Raises:
        ValueError: unknown compressor (the message lists the known ones).
    """
    from .. import compressors

    c = compressors.get(name, **dict(params or {}))
    if error_feedback == "auto":
        caps = c.capabilities
        error_feedback = (caps.category != "none" and not caps.unbiased and not caps.stateful
                          and caps.rounds == 1)
    if error_feedback:
        c = compressors.get("ef", inner=c)
    sizes = memory_bound(sorted(set(sizes or log_sizes(4 << 10, 256 << 20))))
    if not sizes:
        raise ValueError("no size to profile fits in memory")
    gen = torch.Generator().manual_seed(0)
    enc_t, dec_t, pay = [], [], []
    for nbytes in _iterate(sizes, progress, f"{name} encode/decode"):
        grad = torch.randn(max(1, nbytes // 4), generator=gen)
        out = torch.empty_like(grad)
        state = c.init(grad)
        if barrier:
            barrier()
        # as the engine runs them: it has scanned the gradient for NaN/Inf already
        # (assume_finite), and it decodes into existing buffers (out=), never into a
        # fresh tensor, whose page faults cost several memory copies here
        with assume_finite():
            enc_t.append(_time(lambda g=grad, s=state: c.encode(g, s), repeats, min_time))
            payload, _ = c.encode(grad, state)
        pay.append(int(payload.numel()))
        dec_t.append(_time(lambda p=payload, o=out: c.decode(p, out=o), repeats, min_time))
        del grad, payload, out
    ratio, header = _fit_payload(sizes, pay)
    enc_t, dec_t = monotone(enc_t), monotone(dec_t)
    return CompressorProfile(
        name=name, params=dict(params or {}), category=c.capabilities.category,
        aggregatable=c.capabilities.aggregatable, ratio=ratio, header_bytes=header,
        error_feedback=bool(error_feedback), encode=Curve(tuple(sizes), tuple(enc_t)),
        decode=_curve_by_payload(pay, dec_t))


def monotone(times: Sequence[float]) -> List[float]:
    """The closest non-decreasing sequence (least squares in log time; pool adjacent violators).

    Encoding more bytes never takes less time, so a sample below a smaller
    size's is noise (a descheduled run, a warm cache); pooling keeps one
    stray sample from bending the curve and the planner's K with it.

    Example:
        >>> [round(t, 6) for t in monotone([1.0, 4.0, 1.0, 8.0])]
        [1.0, 2.0, 2.0, 8.0]
    """
    blocks: List[List[float]] = []  # [sum of log times, count]
    for t in times:
        blocks.append([math.log(t), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out: List[float] = []
    for s, c in blocks:
        out += [math.exp(s / c)] * int(c)
    return out


def _fit_payload(sizes: Sequence[int], payloads: Sequence[int]) -> Tuple[float, int]:
    """payload = header + ratio * size, from the two largest sizes (headers are fixed)."""
    if len(sizes) == 1:
        return payloads[0] / sizes[0], 0
    (s0, p0), (s1, p1) = (sizes[-2], payloads[-2]), (sizes[-1], payloads[-1])
    ratio = (p1 - p0) / (s1 - s0)
    if ratio <= 0:
        return payloads[-1] / sizes[-1], 0
    return ratio, max(0, int(round(p1 - ratio * s1)))


def _curve_by_payload(payloads: Sequence[int], times: Sequence[float]) -> Curve:
    # Tiny inputs can give equal payload sizes; keep one sample per size.
    pts: Dict[int, float] = {}
    for i, p in enumerate(payloads):
        pts[p] = max(pts.get(p, 0.0), times[i])
    xs = sorted(pts)
    return Curve(tuple(xs), tuple(pts[x] for x in xs))


def measure_link(
    transport: Any,
    sizes: Optional[Sequence[int]] = None,
    *,
    repeats: int = 5,
    timeout: float = 300.0,
    progress: Progress = None,
    pattern: str = "all",
    round_meta_bytes: int = 0,
) -> Tuple[Link, Tuple[Tuple[int, float], ...]]:
    """Fit ``T_send`` over a transport. Collective: every rank must call it.

    1. For each size, one bulk round: an ``allgather`` of ``round_meta_bytes``
       (CaSync's coordinator reports; 0 skips it), then one ``alltoallv`` in
       which every rank sends ``size`` bytes to its ring successor
       (``pattern="all"``, every link busy) or only rank 0 sends to rank 1
       (``pattern="one"``); ``pattern="allreduce"`` times the transport's
       allreduce of ``size`` bytes instead (what the engine's collective lane
       runs), so its fit is Table I's Ring-AR ``2(N-1) alpha + 2(N-1)/N m
       beta`` with the constants measured as a whole. The slowest rank's
       time counts.
    2. Medians over ``repeats`` are fitted to ``latency + bytes/bandwidth``.
    3. Rank 0's fit is broadcast, so every rank returns identical numbers.

    Args:
        transport: a ``Transport`` (rank, size, alltoallv, allgather, allreduce,
            broadcast, barrier).
        sizes: message sizes in bytes (default 4 KB .. 16 MB).
        repeats: timed rounds per size.
        timeout: seconds for each collective.
        progress: ``progress(iterable, desc, total)`` wrapper (rank 0 only).
        pattern: "all" or "one" busy link(s), or "allreduce".
        round_meta_bytes: metadata allgathered before each round.

    Returns:
        (link, samples) where samples are (bytes, seconds) medians.

    Raises:
        ValueError: a single rank (no link to measure) or an unknown pattern.
    """
    n, rank = transport.size, transport.rank
    if n < 2:
        raise ValueError("measuring a link needs at least 2 ranks; pass latency and "
                         "bandwidth instead")
    if pattern not in ("all", "one", "allreduce"):
        raise ValueError(f"pattern must be 'all', 'one' or 'allreduce', found {pattern!r}")
    sizes = list(sizes or log_sizes(4 << 10, 16 << 20))
    dst, src = (rank + 1) % n, (rank - 1) % n
    if pattern == "one":
        dst, src = (1 if rank == 0 else -1), (0 if rank == 1 else -1)
    meta = torch.zeros(max(1, round_meta_bytes // 8), dtype=torch.int64)
    samples: List[Tuple[int, float]] = []
    for nbytes in _iterate(sizes, progress if rank == 0 else None, f"link ({pattern})"):
        send: List[Optional[torch.Tensor]] = [None] * n
        recv = [0] * n
        values = None
        if pattern == "allreduce":
            values = torch.zeros(max(1, nbytes // 4))
        else:
            if dst >= 0:
                send[dst] = torch.zeros(nbytes, dtype=torch.uint8)
            if src >= 0:
                recv[src] = nbytes
        ts = []
        for i in range(repeats + 1):
            transport.barrier(timeout)
            t0 = time.perf_counter()
            if round_meta_bytes:
                transport.allgather(meta, timeout)
            if values is not None:
                transport.allreduce(values, "sum", timeout)
            else:
                transport.alltoallv(send, recv, timeout)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            transport.allreduce(dt, "max", timeout)
            if i:  # the first exchange warms up connections and buffers
                ts.append(float(dt.item()))
        samples.append((nbytes, statistics.median(ts)))
    link = fit_link([s for s, _ in samples], [t for _, t in samples])
    agreed = torch.tensor([link.latency, link.bandwidth], dtype=torch.float64)
    transport.broadcast(agreed, 0, timeout)
    return Link(latency=float(agreed[0]), bandwidth=float(agreed[1])), tuple(samples)


def measure_engine_sync(transport: Any, strategy: str = "ps",
                        points: Sequence[Tuple[int, int]] = ((4, 1),), *,
                        compressor: Optional[CompressorProfile] = None, repeats: int = 5,
                        timeout: float = 300.0,
                        engine_config: Optional[Mapping[str, Any]] = None,
                        progress: Progress = None) -> Tuple[Tuple[int, int, float], ...]:
    """Time whole synchronisations of one gradient through the CaSync engine. Collective.

    For each ``(bytes, K)`` point, an engine with a one-gradient plan
    (compressed with ``compressor`` into K partitions, or uncompressed when
    ``compressor`` is None) synchronises a float32 gradient of that size
    ``repeats`` times after one warm-up step; a sample is the median of the
    slowest rank's ``submit``-to-``synchronize`` time. This is what the
    cost model predicts, measured as a whole, so the planner can charge
    the engine's work that HiPress Eq. 1/2 leave out (coordination rounds,
    per-partition tasks, the aggregator's re-encode; see
    ``planner.EngineTerm``).

    Args:
        transport: the transport every rank uses.
        strategy: the engine's strategy.
        points: ``(bytes, K)`` pairs (bytes rounded down to whole floats).
        compressor: the profiled compressor, or None for the uncompressed path.
        repeats: timed synchronisations per point.
        timeout: seconds for each collective.
        engine_config: extra ``EngineConfig`` fields (as the engine will run).
        progress: ``progress(iterable, desc, total)`` wrapper (rank 0 only).

    Returns:
        ``(bytes, K, seconds)`` per point, rank 0's numbers on every rank.
    """
    from ..casync.engine import Engine, EngineConfig
    from .plan import GradientPlan, Plan

    name = compressor.name if compressor else "identity"
    params = dict(compressor.params) if compressor else {}
    out: List[Tuple[int, int, float]] = []
    desc = f"engine sync ({name if compressor else 'uncompressed'})"
    for nbytes, k in _iterate(list(points), progress if transport.rank == 0 else None, desc):
        numel = max(1, int(nbytes) // 4)
        plan = Plan(compressor=name, params=params, strategy=strategy,
                    gradients={"_probe": GradientPlan(compress=compressor is not None,
                                                      partitions=int(k))})
        cfg = dict(engine_config or {})
        cfg.update(plan=plan, strategy=strategy, timeline=False, timeout=timeout,
                   compressor=name, params=params)
        eng = Engine(transport, EngineConfig(**cfg))
        try:
            eng.register([("_probe", (numel,), torch.float32)])
            gen = torch.Generator().manual_seed(transport.rank)
            src = torch.randn(numel, generator=gen)
            grad = src.clone()
            ts = []
            for i in range(repeats + 1):
                grad.copy_(src)
                transport.barrier(timeout)
                t0 = time.perf_counter()
                eng.submit("_probe", grad)
                eng.synchronize()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                transport.allreduce(dt, "max", timeout)
                if i:  # the first step warms up buffers, threads and compressor state
                    ts.append(float(dt.item()))
        finally:
            eng.close()
        out.append((4 * numel, int(k), statistics.median(ts)))
    agreed = torch.tensor([t for _, _, t in out], dtype=torch.float64)
    transport.broadcast(agreed, 0, timeout)
    return tuple((m, k, float(t)) for (m, k, _), t in zip(out, agreed.tolist()))


def engine_points(max_bytes: int, n: int, lo: int = 64 << 10) -> List[Tuple[int, int]]:
    """The (bytes, K) grid ``profile_transport`` times compressed syncs at.

    Four sizes spaced by 8x from ``lo`` up to ``max_bytes`` (fewer when the
    range is short), each with K = 1, 2, N and 3N: enough to fit the
    engine's fixed, per-partition and per-byte costs (``planner.EngineTerm``).
    K = 2 is there because syncs over a few partitions often measure
    fastest, and a fit sampled only at 1, N and 3N misses them.
    """
    sizes = [s for s in (lo << (3 * i) for i in range(4)) if s <= max_bytes] or [max_bytes]
    return [(s, k) for s in sizes for k in sorted({1, min(2, n), n, 3 * n})]


def measure_sync_overhead(transport: Any, link: Link, strategy: str = "ps", *,
                          compressor: Optional[CompressorProfile] = None, repeats: int = 10,
                          timeout: float = 300.0,
                          engine_config: Optional[Mapping[str, Any]] = None,
                          allreduce: Optional[Link] = None) -> float:
    """The engine's fixed cost per synchronisation, beyond Eq. 1 (or Eq. 2). Collective.

    HiPress's Eq. 1/2 count the rounds that move gradient bytes and the
    encode/decode operators. The CaSync engine also runs coordination rounds
    that carry no bytes: a step opens and closes with a round of reports, and
    each compute stage of a compressed workflow (encode, aggregate, decode)
    leaves rounds waiting for it. This synchronises a tiny gradient (1 float
    uncompressed; 1024 floats through ``compressor``) through the engine
    ``repeats`` times (``measure_engine_sync``) and returns the slowest
    rank's median time minus the equation's prediction for it (>= 0).

    Args:
        transport: the transport every rank uses.
        link: the fitted link (T_send).
        strategy: the engine's strategy.
        compressor: measure the compressed path of this profiled compressor
            (Eq. 2); None measures the uncompressed path (Eq. 1).
        repeats: timed synchronisations.
        timeout: seconds for each collective.
        engine_config: extra ``EngineConfig`` fields (as the engine will run).
        allreduce: the allreduce fit; with the engine's collective lane
            (``raw_collective``, default on) the uncompressed model is that
            allreduce (or Table I's Ring-AR on ``link``), not Eq. 1.
    """
    from .model import sync_params, t_sync_cpr, t_sync_orig
    from .planner import ENGINE_TO_MODEL

    m = 4096 if compressor else 4
    ((m, _, t),) = measure_engine_sync(transport, strategy, [(m, 1)], compressor=compressor,
                                       repeats=repeats, timeout=timeout,
                                       engine_config=engine_config)
    n = transport.size
    cfg = dict(engine_config or {})
    if compressor is None and cfg.get("raw_collective", True):
        model = Profile(link=link, allreduce=allreduce).allreduce_time(m, n)
    elif compressor is None:
        model = t_sync_orig(m, 1, n, link, sync_params(ENGINE_TO_MODEL[strategy], "none"))
    else:
        model = t_sync_cpr(m, 1, n, compressor.rate(m), link, compressor.encode,
                           compressor.decode,
                           sync_params(ENGINE_TO_MODEL[strategy], compressor.category))
    return max(0.0, t - model)


def profile_transport(
    transport: Any,
    compressors: Mapping[str, Mapping[str, Any]],
    *,
    sizes: Optional[Sequence[int]] = None,
    link_sizes: Optional[Sequence[int]] = None,
    link: Optional[Link] = None,
    repeats: int = 5,
    timeout: float = 300.0,
    progress: Progress = None,
    error_feedback: Union[bool, str] = "auto",
    round_meta_bytes: int = 0,
    engine_overhead: Optional[str] = None,
    raw_collective: bool = True,
    engine_grid: Optional[Sequence[Tuple[int, int]]] = None,
) -> Profile:
    """A full profile on every rank of a transport. Collective.

    Every rank times the compressors at the same moments (so the timings see
    the CPU contention of ``size`` ranks on one host) and the link with all
    links and with one link busy (unless ``link`` is given); rank 0's
    measurements are what every rank returns.

    Args:
        transport: the transport every rank uses.
        compressors: {name: params} to profile.
        sizes: gradient sizes for the compressor curves.
        link_sizes: message sizes for the link fit.
        link: a given link (skips the link measurement).
        repeats: timed calls per size.
        timeout: seconds for each collective.
        progress: ``progress(iterable, desc, total)`` wrapper (rank 0 only).
        error_feedback: see ``profile_compressor`` (default: as the engine runs it).
        round_meta_bytes: see ``measure_link``.
        engine_overhead: a strategy ("ps", "ring") to also time whole
            synchronisations through the engine: its fixed cost per
            synchronisation (``measure_sync_overhead``), the uncompressed
            lane over ``link_sizes`` (``Profile.lane``, with
            ``raw_collective``) and each compressor over ``engine_grid``
            (``CompressorProfile.engine_samples``). None measures none of
            them (HiPress's Eq. 1/2 as published).
        raw_collective: the engine's setting (uncompressed gradients by
            allreduce); with a measured link, the allreduce is measured too.
        engine_grid: ``(bytes, K)`` points of the compressed engine timings
            (default ``engine_points`` up to the largest profiled size).

    Returns:
        The same ``Profile`` on every rank.
    """
    prog = progress if transport.rank == 0 else None
    samples: Tuple[Tuple[int, float], ...] = ()
    one, one_samples = None, ()
    if link is None:
        link, samples = measure_link(transport, link_sizes, repeats=repeats, timeout=timeout,
                                     progress=prog, round_meta_bytes=round_meta_bytes)
        one, one_samples = measure_link(transport, link_sizes, repeats=repeats,
                                        timeout=timeout, progress=prog, pattern="one",
                                        round_meta_bytes=round_meta_bytes)
    ar, ar_samples = None, ()
    if samples and raw_collective:
        ar, ar_samples = measure_link(transport, link_sizes, repeats=repeats, timeout=timeout,
                                      progress=prog, pattern="allreduce",
                                      round_meta_bytes=round_meta_bytes)
    overhead = 0.0
    lane, lane_samples = None, ()
    measure = bool(engine_overhead) and transport.size > 1
    ecfg = {"raw_collective": raw_collective}
    if measure:
        overhead = measure_sync_overhead(transport, one or link, engine_overhead,
                                         repeats=2 * repeats, timeout=timeout,
                                         engine_config=ecfg, allreduce=ar)
        if raw_collective:
            lsizes = list(link_sizes or log_sizes(4 << 10, 16 << 20))
            timed = measure_engine_sync(transport, engine_overhead, [(s, 1) for s in lsizes],
                                        repeats=repeats, timeout=timeout, engine_config=ecfg,
                                        progress=prog)
            lane_samples = tuple((m, t) for m, _, t in timed)
            lane = fit_link([m for m, _ in lane_samples], [t for _, t in lane_samples])
    profs = {}
    for name, params in compressors.items():
        cp = profile_compressor(name, params, sizes, repeats=repeats, progress=prog,
                                barrier=lambda: transport.barrier(timeout),
                                error_feedback=error_feedback)
        if measure:
            grid = engine_grid or engine_points(int(cp.encode.sizes[-1]), transport.size)
            cp = dataclasses.replace(
                cp, sync_overhead=measure_sync_overhead(
                    transport, one or link, engine_overhead, compressor=cp,
                    repeats=2 * repeats, timeout=timeout, engine_config=ecfg),
                engine_samples=measure_engine_sync(
                    transport, engine_overhead, grid, compressor=cp, repeats=repeats,
                    timeout=timeout, engine_config=ecfg, progress=prog))
        profs[name] = cp
    prof = Profile(link=link, compressors=profs, link_samples=samples, link_one=one,
                   link_one_samples=one_samples, sync_overhead=overhead, allreduce=ar,
                   allreduce_samples=ar_samples, lane=lane, lane_samples=lane_samples,
                   meta={"ranks": transport.size, "transport": type(transport).__name__,
                         "link_source": "measured" if samples else "given",
                         "round_meta_bytes": round_meta_bytes,
                         "created": time.strftime("%Y-%m-%dT%H:%M:%S")})
    data = json.dumps(prof.to_dict()).encode() if transport.rank == 0 else b""
    return Profile.from_dict(json.loads(broadcast_bytes(transport, data, timeout)))


def broadcast_bytes(transport: Any, data: bytes, timeout: float = 300.0) -> bytes:
    """Broadcast rank 0's bytes to every rank (length first, then the data)."""
    n = torch.tensor([len(data)], dtype=torch.int64)
    transport.broadcast(n, 0, timeout)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    if transport.rank == 0 and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    transport.broadcast(buf, 0, timeout)
    return buf.numpy().tobytes()
