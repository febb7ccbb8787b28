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
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

__all__ = ["HEADER_VERSION", "PayloadError", "Header", "pack_payload", "unpack_payload",
           "unpack_fields", "check_body_nbytes", "header_nbytes", "FLOAT_DTYPES"]

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

FLOAT_DTYPES = tuple(_DTYPES)


class PayloadError(ValueError):
    """A payload is malformed: truncated, foreign, another version, wrong size."""


def header_nbytes(ndim: int, extra_nbytes: int) -> int:
    """Bytes taken by the header for a tensor of ``ndim`` dims and ``extra_nbytes`` fields."""
    return _FIXED.size + 8 * ndim + _pad8(extra_nbytes)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def pack_payload(
    algo_id: int,
    grad_dtype: torch.dtype,
    shape: Sequence[int],
    extra: bytes,
    body_nbytes: int,
    device: Any = "cpu",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Allocate a payload with its header written; return (payload, body view).

    The caller writes the compressed data into the returned body view (a
    1-D uint8 view of the payload, no copy).
    """
    ndim = len(shape)
    extra = extra + b"\0" * (_pad8(len(extra)) - len(extra))  # keep the body 8-byte aligned
    hdr = _FIXED.pack(_MAGIC, HEADER_VERSION, algo_id, _DTYPES[grad_dtype], ndim, len(extra),
                      body_nbytes)
    hdr += struct.pack(f"<{ndim}q", *shape) + extra
    payload = torch.empty(len(hdr) + body_nbytes, dtype=torch.uint8, device=device)
    payload[: len(hdr)] = torch.frombuffer(bytearray(hdr), dtype=torch.uint8).to(device)
    return payload, payload[len(hdr):]


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
