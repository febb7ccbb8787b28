"""The payload wire format: a fixed little-endian header, then the body (HiPress Sec. 4.1).

Payloads are bytes only. Each starts with a fixed little-endian header that
carries everything ``decode`` needs (dtype, shape, algorithm id, the body
length), so a payload can be decoded by any rank without side channels and a
truncated, foreign or wrong-version payload is rejected with a clear error:

    offset size field
    0      2    magic b"HL"
    2      1    header version (HEADER_VERSION)
    3      1    algorithm id (see ``Compressor.algo_id``)
    4      1    dtype code (_DTYPES)
    5      1    ndim
    6      2    length of the algorithm's fixed fields ("extra"), bytes
    8      8    body length, bytes
    16     8*ndim   shape (int64 each)
    ...    extra    algorithm fixed fields (scales, k, seeds, ...), zero-padded
                    to a multiple of 8 so the body can be viewed as floats
    ...    body     the compressed data
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from ..errors import HipressError

__all__ = ["HEADER_VERSION", "PayloadError", "Header", "PayloadPool", "pack_payload",
           "unpack_payload", "unpack_fields", "check_body_nbytes", "header_nbytes",
           "FLOAT_DTYPES", "pad8", "write_extra_f64", "NO_FIELDS"]

HEADER_VERSION = 1
_MAGIC = b"HL"
_FIXED = struct.Struct("<2sBBBBHQ")  # magic, version, algo, dtype, ndim, extra_len, body_len

_DTYPES: Dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
}
_DTYPE_OF = {v: k for k, v in _DTYPES.items()}

NO_FIELDS = struct.Struct("<")  # the extra of an algorithm without fixed fields

FLOAT_DTYPES = tuple(_DTYPES)


class PayloadError(HipressError, ValueError):
    """A payload is malformed: truncated, foreign, another version, wrong size."""


def header_nbytes(ndim: int, extra_nbytes: int) -> int:
    """Bytes taken by the header for a tensor of ``ndim`` dims and ``extra_nbytes`` fields."""
    return _FIXED.size + 8 * ndim + pad8(extra_nbytes)


def pad8(n: int) -> int:
    """``n`` rounded up to a multiple of 8: header fields and payload sections
    keep what follows them 8-byte aligned (viewable as float64/int64)."""
    return (n + 7) & ~7


def pack_payload(
    algo_id: int,
    grad_dtype: torch.dtype,
    shape: Sequence[int],
    extra: bytes,
    body_nbytes: int,
    device: Any = "cpu",
    pool: Optional["PayloadPool"] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Allocate a payload with its header written; return (payload, body view).

    The caller writes the compressed data into the returned body view (a
    1-D uint8 view of the payload, no copy). ``pool``: take the bytes from
    a ``PayloadPool`` (a buffer no one references any more) instead of a
    fresh allocation.
    """
    ndim = len(shape)
    extra = extra + b"\0" * (pad8(len(extra)) - len(extra))  # keep the body 8-byte aligned
    hdr = _FIXED.pack(_MAGIC, HEADER_VERSION, algo_id, _DTYPES[grad_dtype], ndim, len(extra),
                      body_nbytes)
    hdr += struct.pack(f"<{ndim}q", *shape) + extra
    total = len(hdr) + body_nbytes
    payload = (pool.empty(total, device) if pool is not None
               else torch.empty(total, dtype=torch.uint8, device=device))
    payload[: len(hdr)] = torch.frombuffer(bytearray(hdr), dtype=torch.uint8).to(device)
    return payload, payload[len(hdr):]


def _use_count(t: torch.Tensor) -> Optional[int]:
    """How many tensors (and other holders) share ``t``'s storage, or None when this
    torch does not say (a private API: ``torch.multiprocessing`` uses it)."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return None
    return int(fn(t.untyped_storage()._cdata))


class PayloadPool:
    """Payload buffers a compressor reuses once nothing references them any more.

    A fresh CPU payload of tens of MB costs a page fault per 4 KB on first
    touch: on this project's host an 18 MB C_nat payload spent ~10 ms
    faulting against ~14 ms of encoding (glibc's heap handed out fresh
    pages on most calls). The pool keeps up to ``keep`` buffers per size
    and hands out a *view* of one whose storage nothing else holds (the
    storage's use count is back to what it was when the buffer was made),
    so a payload still being sent, decoded or held by the caller is never
    overwritten. CPU only (other devices have caching allocators); where
    torch does not expose the use count, every call allocates.
    """

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._bufs: Dict[Tuple[int, str], list] = {}
        self._lock = threading.Lock()

    def empty(self, nbytes: int, device: Any = "cpu") -> torch.Tensor:
        """A 1-D uint8 tensor of ``nbytes`` bytes (uninitialised) on ``device``."""
        dev = torch.device(device)
        if dev.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=dev)
        with self._lock:
            bufs = self._bufs.setdefault((nbytes, str(dev)), [])
            for buf, idle in bufs:
                if _use_count(buf) == idle:
                    return buf.view(-1)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            idle = _use_count(buf)
            if idle is not None and len(bufs) < self.keep:
                bufs.append((buf, idle))
            return buf.view(-1)

    def __getstate__(self) -> Dict[str, Any]:  # compressors are copied and pickled
        return {"keep": self.keep}

    def __setstate__(self, d: Dict[str, Any]) -> None:
        self.__init__(d["keep"])


@dataclass(frozen=True)
class Header:
    """A parsed payload header."""

    algo_id: int
    dtype: torch.dtype
    shape: Tuple[int, ...]
    extra: bytes
    body: torch.Tensor  # 1-D uint8 view into the payload

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.detach().cpu().numpy().tobytes()


def unpack_payload(payload: torch.Tensor, algo_id: Optional[int] = None) -> Header:
    """Parse and validate a payload's header.

    Raises:
        PayloadError: not a 1-D uint8 tensor, truncated, wrong magic/version,
            another algorithm's payload, or a body length that does not match.
    """
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise PayloadError(
            f"payload must be a 1-D torch.uint8 tensor, found "
            f"{getattr(payload, 'dtype', type(payload).__name__)} "
            f"with shape {tuple(getattr(payload, 'shape', ()))}"
        )
    n = payload.numel()
    if n < _FIXED.size:
        raise PayloadError(f"payload truncated: {n} bytes, the header alone needs {_FIXED.size}")
    head = _bytes_of(payload[: _FIXED.size])
    magic, version, aid, dcode, ndim, extra_len, body_len = _FIXED.unpack(head)
    if magic != _MAGIC:
        raise PayloadError(f"not a hipress-like payload (magic {magic!r}, expected {_MAGIC!r})")
    if version != HEADER_VERSION:
        raise PayloadError(
            f"payload header version {version} is not supported (this build reads "
            f"version {HEADER_VERSION}); all ranks must run the same hipress-like version"
        )
    if algo_id is not None and aid != algo_id:
        raise PayloadError(f"payload was produced by algorithm id {aid}, expected {algo_id}")
    if dcode not in _DTYPE_OF:
        raise PayloadError(f"payload has unknown dtype code {dcode}")
    hlen = _FIXED.size + 8 * ndim + extra_len
    if n < hlen:
        raise PayloadError(f"payload truncated: {n} bytes, header declares {hlen}")
    if n != hlen + body_len:
        raise PayloadError(
            f"payload size mismatch: {n} bytes, header declares {hlen} + body {body_len} = "
            f"{hlen + body_len} (truncated or padded in transit)"
        )
    rest = _bytes_of(payload[_FIXED.size: hlen])
    shape = struct.unpack(f"<{ndim}q", rest[: 8 * ndim])
    if any(s < 0 for s in shape):
        raise PayloadError(f"payload declares a negative shape {shape}")
    return Header(aid, _DTYPE_OF[dcode], tuple(shape), rest[8 * ndim:], payload[hlen:])


def unpack_fields(payload: torch.Tensor, algo_id: int, fields: struct.Struct,
                  name: str) -> Tuple[Header, Tuple[Any, ...]]:
    """Parse a payload whose header extra starts with fixed ``fields``.

    Returns:
        The header and the unpacked fields.

    Raises:
        PayloadError: malformed header, or an extra shorter than ``fields``.
    """
    h = unpack_payload(payload, algo_id)
    if len(h.extra) < fields.size:
        raise PayloadError(f"{name} payload extra has {len(h.extra)} bytes, "
                           f"expected {fields.size}")
    return h, fields.unpack_from(h.extra)


def check_body_nbytes(h: Header, expected: int, name: str, detail: str = "") -> None:
    """Raise ``PayloadError`` unless the body has exactly ``expected`` bytes."""
    if h.body.numel() != expected:
        raise PayloadError(f"{name} body has {h.body.numel()} bytes, expected {expected} "
                           f"for {h.numel} elements{detail}")


def write_extra_f64(payload: torch.Tensor, ndim: int, offset: int,
                    values: Tuple[torch.Tensor, ...]) -> None:
    """Store 0-d tensors as float64 into the header's extra field, on the device.

    The extra field starts at ``header_nbytes(ndim, 0)`` (the layout above) and
    is 8-byte aligned, so it can be viewed as float64 without a host round trip.
    """
    start = header_nbytes(ndim, 0) + offset
    dst = payload[start: start + 8 * len(values)].view(torch.float64)
    dst.copy_(torch.stack([v.to(torch.float64) for v in values]))
