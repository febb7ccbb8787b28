"""The frame of every bulk message the engine sends: a versioned header, a length, checksums.

A round's exchange (``rounds.py``) moves, on each link, the payloads of that
link's batch concatenated (each padded to 8 bytes). Compressed payloads carry
a header of their own (``compressors/payload.py``), but that header says
neither who sent the bytes nor whether they arrived intact: a flipped bit in
a payload's data decoded into a wrong gradient and training went on
(issue 46, item 6). So the engine frames each link's message (format
version ``WIRE_VERSION``; docs/reliability.md, "The bulk message frame")::

    offset  size  field
         0     4  magic b"HPWM"
         4     1  version (WIRE_VERSION)
         5     1  flags (bit 0: a checksum table follows the header)
         6     2  reserved, 0
         8     4  sender rank (int32)
        12     4  receiver rank (int32)
        16     8  step index (uint64)
        24     8  body length in bytes (uint64)
        32     4  payload count n (uint32)
        36     4  CRC-32 (zlib) of bytes 0..35 and of the checksum table
        40    8n  checksum table (only with flag bit 0): per payload, the sum
                  of its padded bytes read as little-endian 64-bit words,
                  modulo 2**64
    40[+8n]  ...  body: the n payloads, each padded to 8 bytes

The receiver knows from the round's plan (every rank plans alike) who sends
what: it checks the magic, the version, the header's CRC, every field
against what it expects, the length, and each payload's sum, and raises
``WireError`` naming the sender and the payload (its message key) on the
first difference.

Why a 64-bit word sum and not a CRC over the body: it runs at memory speed
(``torch.sum`` over an ``int64`` view, on the payload's own device), a
fraction of a copy of the same bytes, where zlib's CRC-32 costs several
copies (the measurements are in docs/reliability.md); it detects every
single-bit flip (a flip changes one word by +-2**k, never 0 modulo 2**64)
and any damage whose word changes do not cancel. The header is small, so it
gets the stronger CRC. ``EngineConfig.wire_check=False`` leaves the table
out (header, length, version and sender are still checked).
"""
from __future__ import annotations

import struct
import zlib
from typing import Callable, List, Optional, Sequence

import torch

from ..compressors.payload import pad8
from .errors import WireError

__all__ = ["WIRE_VERSION", "MAGIC", "HEADER_NBYTES", "frame_nbytes", "frame", "unframe"]

WIRE_VERSION = 1
MAGIC = b"HPWM"
_HEAD = struct.Struct("<4sBBHiiQQI")  # up to the header CRC
HEADER_NBYTES = _HEAD.size + 4
_CHECKSUMS = 1  # flag bit: a checksum table follows the header
assert HEADER_NBYTES == 40


def frame_nbytes(sizes: Sequence[int], check: bool = True) -> int:
    """Bytes on the wire for payloads of ``sizes`` bytes framed together.

    Example:
        >>> frame_nbytes([3, 8]), frame_nbytes([3, 8], check=False)
        (72, 56)
    """
    return HEADER_NBYTES + (8 * len(sizes) if check else 0) + sum(pad8(s) for s in sizes)


def _word_sums(parts: Sequence[torch.Tensor]) -> List[int]:
    """Each padded part's sum as 64-bit little-endian words, modulo 2**64 (unsigned)."""
    if not parts:
        return []
    sums = torch.stack([p.view(torch.int64).sum() for p in parts]).cpu().tolist()
    return [s & 0xFFFFFFFFFFFFFFFF for s in sums]


def _header(src: int, dst: int, step: int, body: int, n: int,
            sums: Optional[List[int]]) -> bytes:
    flags = _CHECKSUMS if sums is not None else 0
    head = _HEAD.pack(MAGIC, WIRE_VERSION, flags, 0, src, dst, step & 0xFFFFFFFFFFFFFFFF, body, n)
    table = struct.pack(f"<{n}Q", *sums) if sums is not None else b""
    return head + struct.pack("<I", zlib.crc32(table, zlib.crc32(head))) + table


def frame(payloads: Sequence[torch.Tensor], src: int, dst: int, step: int,
          check: bool = True) -> torch.Tensor:
    """One bulk message: ``payloads`` (flattened ``uint8``) behind the header.

    Args:
        payloads: the link's payloads in the plan's order.
        src, dst: this rank and the receiver.
        step: the step index (the receiver expects its own).
        check: include the checksum table.

    Returns:
        A 1-D ``uint8`` tensor of ``frame_nbytes(sizes, check)`` bytes on the
        payloads' device.

    Example:
        >>> msg = frame([torch.arange(3, dtype=torch.uint8)], src=0, dst=1, step=7)
        >>> [p.tolist() for p in unframe(msg, [3], src=0, dst=1, step=7)]
        [[0, 1, 2]]
    """
    sizes = [p.numel() for p in payloads]
    n = len(payloads)
    table = 8 * n if check else 0
    device = payloads[0].device if payloads else torch.device("cpu")
    buf = torch.empty(frame_nbytes(sizes, check), dtype=torch.uint8, device=device)
    off = HEADER_NBYTES + table
    parts = []
    for p, s in zip(payloads, sizes):
        buf[off: off + s] = p.reshape(-1)
        buf[off + s: off + pad8(s)] = 0  # the sum covers the padding: make it defined
        parts.append(buf[off: off + pad8(s)])
        off += pad8(s)
    sums = _word_sums(parts) if check else None
    head = _header(src, dst, step, off - HEADER_NBYTES - table, n, sums)
    buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    return buf


def unframe(buf: torch.Tensor, sizes: Sequence[int], *, src: int, dst: int, step: int,
            label: Optional[Callable[[int], str]] = None) -> List[torch.Tensor]:
    """Check a received bulk message and return views of its payloads.

    Args:
        buf: the message as received (1-D ``uint8``).
        sizes: the payloads' sizes the round's plan expects, in order.
        src, dst, step: the sender, this rank and the step the plan expects.
        label: ``label(i)`` names payload ``i`` (its gradient and partition) in
            the error; default: its position.

    Returns:
        One view of ``buf`` per payload, ``sizes[i]`` bytes each.

    Raises:
        WireError: the message is not a frame of this version, its header is
            damaged, a field differs from what the plan expects, it is
            shorter or longer than its header says, or a payload's checksum
            differs (``payload`` names it).
    """
    got = buf.numel()

    def fail(what: str, payload: Optional[str] = None) -> WireError:
        return WireError(f"rank {dst}: the bulk message from rank {src} in step {step} "
                         f"({got} bytes) is rejected: {what}", sender=src, payload=payload)

    if got < HEADER_NBYTES:
        raise fail(f"expected at least the {HEADER_NBYTES}-byte frame header, found {got} "
                   "bytes (truncated)")
    head = bytes(buf[:HEADER_NBYTES].cpu().numpy())
    magic, version, flags, _, s, d, st, body, n = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise fail(f"expected the magic {MAGIC!r} of a hipress-like bulk message, found "
                   f"{magic!r} (corrupted in transit, or not sent by hipress-like)")
    if version != WIRE_VERSION:
        raise fail(f"expected wire format version {WIRE_VERSION}, found {version}: run the "
                   "same hipress-like version on every rank")
    table_n = 8 * n if flags & _CHECKSUMS else 0
    if got < HEADER_NBYTES + table_n:
        raise fail(f"expected a checksum table of {table_n} bytes after the header, found "
                   f"{got - HEADER_NBYTES} bytes (truncated)")
    table = bytes(buf[HEADER_NBYTES: HEADER_NBYTES + table_n].cpu().numpy())
    (crc,) = struct.unpack_from("<I", head, _HEAD.size)
    if zlib.crc32(table, zlib.crc32(head[:_HEAD.size])) != crc:
        raise fail("the frame header's CRC-32 does not match (the header was corrupted in "
                   "transit)")
    want_body = sum(pad8(x) for x in sizes)
    for name, found, want in (("sender", s, src), ("receiver", d, dst),
                              ("step", st, step & 0xFFFFFFFFFFFFFFFF),
                              ("payload count", n, len(sizes)), ("body length", body, want_body)):
        if found != want:
            raise fail(f"its header says {name} {found}, expected {want} (the ranks disagree "
                       "on the round's plan, or the message is not this round's)")
    total = HEADER_NBYTES + table_n + body
    if got != total:
        raise fail(f"expected {total} bytes as its header says, found {got} "
                   f"({'truncated' if got < total else 'extra bytes'})")
    off = HEADER_NBYTES + table_n
    views, parts = [], []
    for x in sizes:
        views.append(buf[off: off + x])
        parts.append(buf[off: off + pad8(x)])
        off += pad8(x)
    if table_n:
        sent = struct.unpack(f"<{n}Q", table)
        for i, (a, b) in enumerate(zip(_word_sums(parts), sent)):
            if a != b:
                what = label(i) if label is not None else f"payload {i}"
                raise fail(f"{what} ({i + 1} of {n}, {sizes[i]} bytes) fails its checksum: "
                           f"expected the 64-bit word sum {b:#018x}, found {a:#018x} (corrupted "
                           "in transit)", payload=what)
    return views
