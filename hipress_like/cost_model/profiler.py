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
  transfers over a transport (every rank sends to its ring successor in one
  ``alltoallv``, so all links are busy at once, as in CaSync's bulk rounds).

Profiles are versioned JSON, validated on load:

    {"format": "hipress-like-profile", "version": 1,
     "link": {"latency": 5e-05, "bandwidth": 1.25e8, "samples": [[4096, 8.1e-05], ...]},
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
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

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
    "broadcast_bytes",
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

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ProfileError(f"compressor {self.name!r}: category must be one of "
                               f"{CATEGORIES}, found {self.category!r}")
        if not (isinstance(self.ratio, (int, float)) and 0 < self.ratio <= 4):
            raise ProfileError(f"compressor {self.name!r}: ratio must be in (0, 4], "
                               f"found {self.ratio!r}")
        if not isinstance(self.header_bytes, int) or self.header_bytes < 0:
            raise ProfileError(f"compressor {self.name!r}: header_bytes must be an integer "
                               f">= 0, found {self.header_bytes!r}")

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
                "encode": self.encode.to_dict(), "decode": self.decode.to_dict()}

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any]) -> "CompressorProfile":
        """Validate and build; raises ``ProfileError``."""
        optional = {"params", "aggregatable", "error_feedback"}
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
                       error_feedback=bool(d.get("error_feedback", False)), ratio=d["ratio"],
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
        link: T_send's alpha-beta fit.
        compressors: profiles by registry name.
        link_samples: the (bytes, seconds) transfers the link was fitted to
            (empty when the link was given).
        meta: provenance (host, transport, world size, date).
    """

    link: Link
    compressors: Mapping[str, CompressorProfile] = field(default_factory=dict)
    link_samples: Tuple[Tuple[int, float], ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

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
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "link": {"latency": self.link.latency, "bandwidth": self.link.bandwidth,
                     "samples": [list(s) for s in self.link_samples]},
            "compressors": {k: v.to_dict() for k, v in sorted(self.compressors.items())},
            "meta": dict(self.meta),
        }

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
        known = {"format", "version", "link", "compressors", "meta"}
        if set(d) - known:
            raise ProfileError(f"unknown profile keys: {sorted(set(d) - known)}; known: "
                               f"{sorted(known)}")
        link = d.get("link")
        if not isinstance(link, Mapping) or not {"latency", "bandwidth"} <= set(link):
            raise ProfileError("profile 'link' must be {'latency': s, 'bandwidth': B/s, ...}")
        comps = d.get("compressors", {})
        if not isinstance(comps, Mapping):
            raise ProfileError("profile 'compressors' must be an object keyed by name")
        try:
            samples = tuple((int(s), float(t)) for s, t in link.get("samples", []))
            lk = Link(latency=link["latency"], bandwidth=link["bandwidth"])
        except (TypeError, ValueError) as e:
            raise ProfileError(f"invalid profile link: {e}") from e
        return cls(link=lk,
                   compressors={str(k): CompressorProfile.from_dict(str(k), v)
                                for k, v in comps.items()},
                   link_samples=samples, meta=dict(d.get("meta", {})))

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
        state = c.init(grad)
        if barrier:
            barrier()
        enc_t.append(_time(lambda g=grad, s=state: c.encode(g, s), repeats, min_time))
        payload, _ = c.encode(grad, state)
        pay.append(int(payload.numel()))
        dec_t.append(_time(lambda p=payload: c.decode(p), repeats, min_time))
        del grad, payload
    ratio, header = _fit_payload(sizes, pay)
    return CompressorProfile(
        name=name, params=dict(params or {}), category=c.capabilities.category,
        aggregatable=c.capabilities.aggregatable, ratio=ratio, header_bytes=header,
        error_feedback=bool(error_feedback), encode=Curve(tuple(sizes), tuple(enc_t)),
        decode=_curve_by_payload(pay, dec_t))


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
) -> Tuple[Link, Tuple[Tuple[int, float], ...]]:
    """Fit ``T_send`` over a transport. Collective: every rank must call it.

    1. For each size, every rank sends ``size`` bytes to its ring successor
       and receives from its predecessor in one ``alltoallv`` (all links busy,
       as in CaSync's bulk rounds); the slowest rank's time counts.
    2. Medians over ``repeats`` are fitted to ``latency + bytes/bandwidth``.
    3. Rank 0's fit is broadcast, so every rank returns identical numbers.

    Args:
        transport: a ``Transport`` (rank, size, alltoallv, allreduce, broadcast).
        sizes: message sizes in bytes (default 4 KB .. 16 MB).
        repeats: timed exchanges per size.
        timeout: seconds for each collective.
        progress: ``progress(iterable, desc, total)`` wrapper (rank 0 only).

    Returns:
        (link, samples) where samples are (bytes, seconds) medians.

    Raises:
        ValueError: a single rank (no link to measure).
    """
    n, rank = transport.size, transport.rank
    if n < 2:
        raise ValueError("measuring a link needs at least 2 ranks; pass latency and "
                         "bandwidth instead")
    sizes = list(sizes or log_sizes(4 << 10, 16 << 20))
    dst, src = (rank + 1) % n, (rank - 1) % n
    samples: List[Tuple[int, float]] = []
    items = _iterate(sizes, progress if rank == 0 else None, "link")
    for nbytes in items:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        send: List[Optional[torch.Tensor]] = [None] * n
        recv = [0] * n
        send[dst], recv[src] = buf, nbytes
        ts = []
        for i in range(repeats + 1):
            transport.barrier(timeout)
            t0 = time.perf_counter()
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
) -> Profile:
    """A full profile on every rank of a transport. Collective.

    Every rank times the compressors at the same moments (so the timings see
    the CPU contention of ``size`` ranks on one host) and the link (unless
    ``link`` is given); rank 0's measurements are what every rank returns.

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

    Returns:
        The same ``Profile`` on every rank.
    """
    prog = progress if transport.rank == 0 else None
    samples: Tuple[Tuple[int, float], ...] = ()
    if link is None:
        link, samples = measure_link(transport, link_sizes, repeats=repeats, timeout=timeout,
                                     progress=prog)
    profs = {}
    for name, params in compressors.items():
        profs[name] = profile_compressor(name, params, sizes, repeats=repeats, progress=prog,
                                         barrier=lambda: transport.barrier(timeout),
                                         error_feedback=error_feedback)
    prof = Profile(link=link, compressors=profs, link_samples=samples,
                   meta={"ranks": transport.size, "transport": type(transport).__name__,
                         "link_source": "measured" if samples else "given",
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
