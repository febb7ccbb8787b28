"""Ranks agree on a collective's arguments before any of its bytes move.

A collective whose ranks pass different arguments does not fail by itself:
gloo moves bytes, so an allgather of an int32 tensor on one rank and a
float32 tensor on another returns the float's bits read as integers on the
first and the reverse on the second. Horovod's coordinator refuses that
("Mismatched data types"); this module gives the user-facing collectives
(``adapters/collectives.py``) the same check, for every face.

The idea: before a collective, every rank describes its call as a few small
fields (the collective, its name, dtype, the shape where it must match, the
op, the root rank), packs them with msgpack into one fixed-size byte record,
and the ranks allgather those records: one small allgather per call. Every
rank then compares the same list, so all of them raise, with the same text,
naming each field that differs and which ranks hold which value.

The records are msgpack (plain data only, never pickle). A record too long
for its slot (a very long name) is carried by its SHA-1 digest: equal
values still compare equal, and the message says the name was digested.
"""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional, Sequence

import msgpack

from ..errors import HipressError

__all__ = ["CollectiveMismatchError", "RECORD_BYTES", "pack_call", "unpack_call",
           "disagreement"]

# Room for the collective, a name of ~150 characters, a dtype, a shape of a few
# dims and an op; longer fields travel as digests (see pack_call).
RECORD_BYTES = 256
_LEN = 2  # bytes of the little-endian length prefix


class CollectiveMismatchError(HipressError, ValueError, RuntimeError):
    """Ranks called a collective with different arguments; raised on every rank.

    Also a RuntimeError, the class Horovod raises for the same mismatch (its
    scripts and tests catch that).

    Attributes:
        fields: the names of the fields that differ (``dtype``, ``shape``, ...).
        ranks: the ranks outside the majority value of some differing
            field (every rank holding that field when no value has a majority).
    """

    def __init__(self, message: str, fields: Sequence[str] = (), ranks: Sequence[int] = ()):
        super().__init__(message)
        self.fields = tuple(fields)
        self.ranks = tuple(ranks)


def _digest(value: Any) -> str:
    return "sha1:" + hashlib.sha1(repr(value).encode()).hexdigest()[:16]


def pack_call(fields: Dict[str, Any]) -> bytes:
    """Pack one rank's description of a call into a ``RECORD_BYTES`` record.

    Args:
        fields: plain values (str, int, float, None, lists of them), keyed by
            field name; the order does not matter.

    Returns:
        ``RECORD_BYTES`` bytes: a 2-byte length, the msgpack map, zero padding.

    Example:
        >>> rec = pack_call({"collective": "allgather", "dtype": "torch.int32"})
        >>> len(rec), unpack_call(rec)["dtype"]
        (256, 'torch.int32')
    """
    body = msgpack.packb(fields, use_bin_type=True)
    if len(body) + _LEN > RECORD_BYTES:  # digest the longest values until it fits
        short = dict(fields)
        for key in sorted(short, key=lambda k: -len(repr(short[k]))):
            short[key] = _digest(short[key])
            body = msgpack.packb(short, use_bin_type=True)
            if len(body) + _LEN <= RECORD_BYTES:
                break
    return len(body).to_bytes(_LEN, "little") + body + bytes(RECORD_BYTES - _LEN - len(body))


def unpack_call(record: bytes) -> Dict[str, Any]:
    """Read back a record made by ``pack_call`` (lists come back as lists).

    Raises:
        CollectiveMismatchError: the record is not one (a peer running another
            version of the library, or not in a collective check at all).
    """
    n = int.from_bytes(record[:_LEN], "little")
    try:
        if not 0 < n <= RECORD_BYTES - _LEN:
            raise ValueError(f"length {n}")
        out = msgpack.unpackb(record[_LEN:_LEN + n], raw=False, strict_map_key=True)
        if not isinstance(out, dict):
            raise ValueError(f"a {type(out).__name__}, not a map")
        return out
    except (ValueError, msgpack.UnpackException) as e:
        raise CollectiveMismatchError(
            f"a peer's collective description is unreadable ({e}); expected every rank to "
            "run the same hipress_like version and to call the same collective") from e


_FIX = ("Expected every rank to call the same collective with the same arguments, in the same "
        "order; make the differing argument the same on every rank (e.g. cast the tensor to "
        "one dtype)")


def disagreement(what: str, per_rank: List[Dict[str, Any]],
                 fix: str = _FIX) -> Optional[CollectiveMismatchError]:
    """The error to raise when ranks described their call differently, else None.

    Every rank computes this from the same list, so every rank raises the same text.

    Args:
        what: this rank's collective as it appears in errors (``allgather 'x'``).
        per_rank: each rank's fields, in rank order.
        fix: what was expected and how to fix it (the message's last sentence).

    Returns:
        None when all ranks agree, else a ``CollectiveMismatchError`` naming,
        for every field that differs, which ranks hold which value.

    Example:
        >>> e = disagreement("allgather", [{"dtype": "torch.int32"}, {"dtype": "torch.float32"}])
        >>> print(e)  # doctest: +NORMALIZE_WHITESPACE
        allgather: ranks called it with different arguments: dtype: 'torch.int32' on
        rank(s) [0]; 'torch.float32' on rank(s) [1]. Expected every rank to call the same
        collective with the same arguments, in the same order; make the differing
        argument the same on every rank (e.g. cast the tensor to one dtype)
    """
    keys = sorted({k for rec in per_rank for k in rec})
    if len({rec.get("collective") for rec in per_rank}) > 1:
        # different collectives take different arguments: compare only what they share
        keys = ["collective"] + [k for k in keys if k != "collective"
                                 and all(k in rec for rec in per_rank)]
    parts, fields, blamed = [], [], set()
    for key in keys:
        values = [rec.get(key) for rec in per_rank]
        if all(v == values[0] for v in values):
            continue
        groups: Dict[str, List[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(repr(v), []).append(r)
        fields.append(key)
        parts.append(f"{key}: " + "; ".join(f"{v} on rank(s) {rs}" for v, rs in groups.items()))
        sizes = sorted((len(rs) for rs in groups.values()), reverse=True)
        if sizes[0] > sizes[1]:  # a strict majority: blame the others
            blamed.update(r for rs in groups.values() if len(rs) < sizes[0] for r in rs)
        else:  # a tie: nobody is more wrong than anybody else
            blamed.update(range(len(per_rank)))
    if not parts:
        return None
    return CollectiveMismatchError(
        f"{what}: ranks called it with different arguments: " + ", ".join(parts)
        + ". " + fix, fields, sorted(blamed))
