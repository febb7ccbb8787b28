"""Index and value codecs of the sparse payload: the interface, ``plain`` and ``rle``.

A sparsifier (top-k, random-k, DGC, GradDrop) chooses a set ``S`` of ``r``
of the ``d`` gradient positions and sends ``(i, g[i])`` for ``i in S`` (the
thesis "Sparse communication for deep learning", Sec. 2.2.1 and 3). How the
set ``S`` and the values travel is a separate choice: an *index codec*
writes ``S`` (plain int32 positions, a run-length code of the bitmap, a
Bloom filter), a *value codec* writes the values (plain floats, a fitted
curve). ``topk.py`` puts both into one payload, so any sparsifier
combines with any codec pair and the header names the pair:

    header extra  k (uint64), then one uint64 word:
                    bits 0-7   index item size (4, or 8 when d > 2**31)
                    bits 8-15  index codec id  (0 plain, 1 rle, 2 bloom)
                    bits 16-23 value codec id  (0 plain, 1 curvefit)
                    bits 24-63 zero
                  then the index codec's fields, zero-padded to 8 bytes,
                  then the value codec's fields, zero-padded to 8 bytes
    body          the index section, zero-padded to 8 bytes,
                  then the value section

With both codecs plain the ids are 0 and there are no fields, so the bytes
are exactly those of the sparse payload before codecs existed (``k``, the
index size, the int32 indices padded to 8, the values). A reader that
predates codecs sees an index size that is not 4 or 8 in any other
payload and rejects it.

An index codec's ``encode`` returns the indices whose values are to be
sent (``IndexCode.sent``): the set itself for lossless codecs; for a Bloom
filter with false-positive-aware compression (thesis Sec. 3.7), the set the
decoder will select. ``decode`` reads only the payload (fields and
section), never the codec object's own settings, so any rank decodes any
codec. Codecs register by name and id; an unknown name or id raises with
the list of known ones.

Run-length code (thesis Sec. 2.3.1, Fig. 1, "counting only the zeros"):
the bitmap ``b`` of ``S`` is written as the lengths of the zero runs that
precede each one bit, in code blocks of ``w`` bits. A run of ``L`` zeros
is ``floor(L / M)`` escape blocks of value ``M = 2**w - 1`` ("``M`` zeros,
no one yet") then one block ``L mod M`` ("that many zeros, then a one");
zeros after the last one are implied by ``d``. ``w`` is given, or chosen
per payload as the width with the fewest bits. The code is lossless.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Mapping, Tuple, Type

import torch

from ..base import view_as_dtype
from ..params import ParamError, check_int
from ..payload import PayloadError, pad8  # noqa: F401  (sparse_codecs.pad8 was public)

__all__ = [
    "IndexCode",
    "ValueCode",
    "IndexCodec",
    "ValueCodec",
    "PlainIndex",
    "PlainValues",
    "RunLength",
    "register_index_codec",
    "register_value_codec",
    "index_codec_names",
    "value_codec_names",
    "make_index_codec",
    "make_value_codec",
    "index_codec_by_id",
    "value_codec_by_id",
    "index_dtype",
    "pack_uint",
    "unpack_uint",
    "rle_nbits",
]

_INT32_LIMIT = 2**31  # indices are < n, so int32 holds them while n <= 2**31


def index_dtype(n: int) -> torch.dtype:
    """Smallest signed index type for an ``n``-element tensor: int32, or int64 past 2**31."""
    return torch.int32 if n <= _INT32_LIMIT else torch.int64


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# -- bit packing of w-bit unsigned codes ------------------------------------------------

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_uint(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integers of ``bits`` bits (1..32) into a little-endian bit stream.

    Code ``i`` takes bits ``[i*bits, (i+1)*bits)`` of the stream, least
    significant first; stream bit ``b`` is bit ``b % 8`` of byte ``b // 8``.
    Vectorised (one bit matrix), no loop per element.

    Args:
        codes: 1-D integer tensor with values in ``[0, 2**bits)``.
        bits: code width.

    Returns:
        1-D uint8 tensor of ``ceil(len(codes) * bits / 8)`` bytes.
    """
    c = codes.reshape(-1).to(torch.int64)
    if bits == 8:
        return c.to(torch.uint8)
    if bits in (16, 32):  # two's complement words of the same bits
        top = 1 << (bits - 1)
        c = ((c + top) & ((1 << bits) - 1)) - top
        return c.to(torch.int32 if bits == 32 else torch.int16).view(torch.uint8).clone()
    shifts = torch.arange(bits, dtype=torch.int32, device=c.device)
    # the bit matrix in int32 then uint8: a quarter of the memory traffic of int64
    stream = ((c.to(torch.int32).unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = -stream.numel() % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    w = _BIT_WEIGHTS.to(c.device)
    return (stream.view(-1, 8) * w).sum(1, dtype=torch.int32).to(torch.uint8)


def unpack_uint(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_uint``: the first ``count`` codes of ``bits`` bits, as int64.

    Raises:
        PayloadError: ``data`` holds fewer than ``ceil(count * bits / 8)`` bytes.
    """
    need = (count * bits + 7) // 8
    if data.numel() < need:
        raise PayloadError(f"bit stream of {data.numel()} bytes, {count} codes of {bits} bits "
                           f"need {need}")
    d = data[:need]
    if bits == 8:
        return d.to(torch.int64)
    if bits == 16:
        return d.clone().view(torch.int16).to(torch.int64) & 0xFFFF
    if bits == 32:
        return d.clone().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, dtype=torch.uint8, device=d.device)
    stream = ((d.unsqueeze(1) >> shifts) & 1).reshape(-1)[: count * bits].to(torch.int32)
    weights = torch.ones(bits, dtype=torch.int32, device=d.device) << torch.arange(
        bits, dtype=torch.int32, device=d.device)
    return (stream.view(count, bits) * weights).sum(1, dtype=torch.int64)  # bits <= 31 here


# -- the codec interface ------------------------------------------------------------------

@dataclass(frozen=True)
class IndexCode:
    """An encoded index set: the codec's fields, its section and the indices sent.

    Attributes:
        fields: the codec's fixed header fields (``codec.fields`` packed).
        section: 1-D uint8 body section (unpadded; the payload pads it to 8).
        sent: sorted int64 positions whose values the payload carries, in
            order (the encoded set, or for false-positive-aware Bloom
            filters the set the decoder will select).
    """

    fields: bytes
    section: torch.Tensor
    sent: torch.Tensor


@dataclass(frozen=True)
class ValueCode:
    """Encoded values: fields, section, and the values the decoder will produce."""

    fields: bytes
    section: torch.Tensor
    wire: torch.Tensor


class _Codec:
    """What index and value codecs declare alike.

    Subclasses set ``name``, ``codec_id`` (a byte, unique among codecs of
    their kind), ``fields`` (a ``struct.Struct`` of the fixed header fields),
    ``param_names`` (the constructor parameters, as accepted by the
    sparsifiers), and the declarations ``lossless`` (``decode`` returns
    exactly what was encoded) and ``fixed_size`` (the section size depends
    only on the counts). A codec without parameters keeps this constructor;
    ``owner`` names the sparsifier in error messages.
    """

    name: ClassVar[str] = "?"
    codec_id: ClassVar[int] = -1
    fields: ClassVar[struct.Struct] = struct.Struct("<")
    param_names: ClassVar[Tuple[str, ...]] = ()
    lossless: ClassVar[bool] = True
    fixed_size: ClassVar[bool] = True

    def __init__(self, owner: str = "sparse") -> None:
        pass

    def params(self) -> Dict[str, Any]:
        """Constructor parameters."""
        return {}


class IndexCodec(_Codec):
    """How the sorted positions of a sparse payload are written.

    The declarations of ``_Codec`` (``fixed_size``: the section size
    depends only on ``n`` and ``k``), and ``randomised`` (``encode`` uses
    its ``seed``).
    """

    randomised: ClassVar[bool] = False

    def encode(self, idx: torch.Tensor, n: int, seed: int) -> IndexCode:
        """Encode the sorted int64 positions ``idx`` out of ``n`` (``seed``: per payload)."""
        raise NotImplementedError

    @classmethod
    def section_nbytes(cls, fields: Tuple[Any, ...], n: int, k: int) -> int:
        """Exact section size declared by ``fields`` (for validation).

        Raises:
            PayloadError: fields that declare no valid size.
        """
        raise NotImplementedError

    @classmethod
    def decode(cls, fields: Tuple[Any, ...], section: torch.Tensor, n: int,
               k: int) -> torch.Tensor:
        """The ``k`` sorted int64 positions a payload places its values at.

        Raises:
            PayloadError: fields or section inconsistent, a position out of range.
        """
        raise NotImplementedError

    def max_section_nbytes(self, n: int, k: int) -> int:
        """An upper bound of the section size for ``k`` of ``n`` positions."""
        raise NotImplementedError


class ValueCodec(_Codec):
    """How the values of a sparse payload are written (the declarations of ``_Codec``)."""

    def encode(self, vals: torch.Tensor) -> ValueCode:
        """Encode 1-D values (the gradient's dtype, in the order of the indices sent)."""
        raise NotImplementedError

    @classmethod
    def section_nbytes(cls, fields: Tuple[Any, ...], k: int, dtype: torch.dtype) -> int:
        """Exact section size declared by ``fields`` for ``k`` values of ``dtype``."""
        raise NotImplementedError

    @classmethod
    def decode(cls, fields: Tuple[Any, ...], section: torch.Tensor, k: int,
               dtype: torch.dtype) -> torch.Tensor:
        """The ``k`` values, in ``dtype``.

        Raises:
            PayloadError: fields or section inconsistent.
        """
        raise NotImplementedError

    def max_section_nbytes(self, k: int, itemsize: int) -> int:
        """An upper bound of the section size for ``k`` values of ``itemsize`` bytes."""
        raise NotImplementedError


_INDEX: Dict[str, Type[IndexCodec]] = {}
_VALUE: Dict[str, Type[ValueCodec]] = {}


def _register(table: Dict[str, Any], kind: str, cls: Any) -> Any:
    for other in table.values():
        if other is not cls and (other.name == cls.name or other.codec_id == cls.codec_id):
            raise ValueError(f"{kind} codec {cls.name!r} (id {cls.codec_id}) clashes with "
                             f"{other.name!r} (id {other.codec_id})")
    if not 0 <= cls.codec_id <= 255:
        raise ValueError(f"{kind} codec id must be a byte, found {cls.codec_id}")
    table[cls.name] = cls
    return cls


def register_index_codec(cls: Type[IndexCodec]) -> Type[IndexCodec]:
    """Class decorator: make ``cls`` selectable as ``index_codec=cls.name``."""
    return _register(_INDEX, "index", cls)


def register_value_codec(cls: Type[ValueCodec]) -> Type[ValueCodec]:
    """Class decorator: make ``cls`` selectable as ``value_codec=cls.name``."""
    return _register(_VALUE, "value", cls)


def index_codec_names() -> Tuple[str, ...]:
    """Registered index codec names, sorted."""
    return tuple(sorted(_INDEX))


def value_codec_names() -> Tuple[str, ...]:
    """Registered value codec names, sorted."""
    return tuple(sorted(_VALUE))


def _known(table: Mapping[str, Any]) -> str:
    return ", ".join(f"{c.codec_id} ({c.name})" for c in sorted(table.values(),
                                                                key=lambda c: c.codec_id))


def _by_id(table: Mapping[str, Any], kind: str, codec_id: int) -> Any:
    for c in table.values():
        if c.codec_id == codec_id:
            return c
    raise PayloadError(f"sparse payload names {kind} codec id {codec_id}, unknown here "
                       f"(known: {_known(table)}); all ranks must run the same version")


def index_codec_by_id(codec_id: int) -> Type[IndexCodec]:
    """The index codec class of a payload's id.

    Raises:
        PayloadError: no registered codec has that id.
    """
    return _by_id(_INDEX, "index", codec_id)


def value_codec_by_id(codec_id: int) -> Type[ValueCodec]:
    """The value codec class of a payload's id.

    Raises:
        PayloadError: no registered codec has that id.
    """
    return _by_id(_VALUE, "value", codec_id)


def _make(table: Mapping[str, Any], kind: str, owner: str, name: Any,
          params: Dict[str, Any]) -> Any:
    if not isinstance(name, str) or name.strip().lower() not in table:
        raise ParamError(f"{owner}: unknown {kind}_codec {name!r}; available: "
                         f"{', '.join(sorted(table))}")
    cls = table[name.strip().lower()]
    mine = {k: params.pop(k) for k in list(params) if k in cls.param_names}
    return cls(owner=owner, **mine)


def make_index_codec(owner: str, name: Any, params: Dict[str, Any]) -> IndexCodec:
    """Build the index codec ``name``, taking its parameters out of ``params`` (in place).

    Raises:
        ParamError: unknown name (the message lists the known ones) or bad parameters.
    """
    return _make(_INDEX, "index", owner, name, params)


def make_value_codec(owner: str, name: Any, params: Dict[str, Any]) -> ValueCodec:
    """Build the value codec ``name``, taking its parameters out of ``params`` (in place).

    Raises:
        ParamError: unknown name (the message lists the known ones) or bad parameters.
    """
    return _make(_VALUE, "value", owner, name, params)


# -- plain ------------------------------------------------------------------------------

@register_index_codec
class PlainIndex(IndexCodec):
    """The positions as int32 (int64 past 2**31 elements), strictly increasing."""

    name = "plain"
    codec_id = 0

    def encode(self, idx: torch.Tensor, n: int, seed: int) -> IndexCode:
        """The positions' bytes in the index dtype of ``n``."""
        return IndexCode(b"", idx.to(index_dtype(n)).view(torch.uint8), idx)

    @classmethod
    def section_nbytes(cls, fields: Tuple[Any, ...], n: int, k: int) -> int:
        """``k`` index items."""
        return k * _itemsize(index_dtype(n))

    @classmethod
    def decode(cls, fields: Tuple[Any, ...], section: torch.Tensor, n: int,
               k: int) -> torch.Tensor:
        """View the positions; check their range and strict order."""
        idx = view_as_dtype(section[: k * _itemsize(index_dtype(n))],
                            index_dtype(n)).to(torch.int64)
        check_positions(idx, n, "sparse")
        return idx

    def max_section_nbytes(self, n: int, k: int) -> int:
        """Exact: ``k`` index items."""
        return k * _itemsize(index_dtype(n))


def check_positions(idx: torch.Tensor, n: int, what: str) -> None:
    """Raise ``PayloadError`` unless ``idx`` lies in [0, n) and strictly increases."""
    if not idx.numel():
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= n:
        raise PayloadError(f"{what} payload index out of range [0, {n}): min {lo}, max {hi}")
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise PayloadError(f"{what} payload indices are not strictly increasing "
                           "(duplicated or corrupted)")


@register_value_codec
class PlainValues(ValueCodec):
    """The values in the gradient's dtype."""

    name = "plain"
    codec_id = 0

    def encode(self, vals: torch.Tensor) -> ValueCode:
        """The values' bytes."""
        v = vals.contiguous()
        return ValueCode(b"", v.view(torch.uint8), v)

    @classmethod
    def section_nbytes(cls, fields: Tuple[Any, ...], k: int, dtype: torch.dtype) -> int:
        """``k`` items of ``dtype``."""
        return k * _itemsize(dtype)

    @classmethod
    def decode(cls, fields: Tuple[Any, ...], section: torch.Tensor, k: int,
               dtype: torch.dtype) -> torch.Tensor:
        """View the values."""
        return view_as_dtype(section[: k * _itemsize(dtype)], dtype)

    def max_section_nbytes(self, k: int, itemsize: int) -> int:
        """Exact: ``k`` items."""
        return k * itemsize


# -- run-length code of the bitmap ---------------------------------------------------------

def rle_nbits(gaps: torch.Tensor, bits: int) -> int:
    """Bits of the run-length code of zero runs ``gaps`` in blocks of ``bits`` bits.

    Each run ``L`` takes ``floor(L / M) + 1`` blocks, ``M = 2**bits - 1``
    (thesis Sec. 2.3.1, counting zeros).
    """
    full = (1 << bits) - 1
    return bits * int((torch.div(gaps, full, rounding_mode="floor") + 1).sum())


def _gaps(idx: torch.Tensor) -> torch.Tensor:
    """Zero-run lengths before each one bit of the bitmap of sorted ``idx``."""
    prev = torch.cat([idx.new_full((1,), -1), idx[:-1]])
    return idx - prev - 1


@register_index_codec
class RunLength(IndexCodec):
    """Run-length code of the index bitmap (lossless baseline; module docstring).

    Args:
        block_bits: code-block width ``w`` in 1..32, or 0 (default) to pick,
            per payload, the width that gives the fewest bits.
    """

    name = "rle"
    codec_id = 1
    fields = struct.Struct("<B7xQ")  # block width w, number of code blocks T
    param_names = ("block_bits",)
    fixed_size = False

    def __init__(self, owner: str = "sparse", block_bits: int = 0) -> None:
        self.block_bits = check_int(owner, "block_bits", block_bits, low=0, example=8)
        if self.block_bits > 32:
            raise ParamError(f"{owner}: block_bits must be in 1..32 (0: choose per payload), "
                             f"found {block_bits!r}")

    def params(self) -> Dict[str, Any]:
        """Constructor parameters."""
        return {"block_bits": self.block_bits}

    def encode(self, idx: torch.Tensor, n: int, seed: int) -> IndexCode:
        """Zero runs, split at ``M = 2**w - 1``, packed in ``w``-bit blocks."""
        gaps = _gaps(idx)
        # past the width that holds the longest run every run takes one block, and wider
        # blocks only cost more: the best width is at most that one
        top = min(32, int(gaps.max()).bit_length() + 1) if idx.numel() else 1
        w = self.block_bits or min(range(1, top + 1), key=lambda b: (rle_nbits(gaps, b), b))
        full = (1 << w) - 1
        q = torch.div(gaps, full, rounding_mode="floor")
        ends = torch.cumsum(q + 1, 0) - 1
        count = int(ends[-1]) + 1 if idx.numel() else 0
        codes = torch.full((count,), full, dtype=torch.int64, device=idx.device)
        codes[ends] = gaps - q * full
        return IndexCode(self.fields.pack(w, count), pack_uint(codes, w), idx)

    @classmethod
    def section_nbytes(cls, fields: Tuple[Any, ...], n: int, k: int) -> int:
        """``ceil(T * w / 8)``."""
        w, count = fields
        return (count * w + 7) // 8

    @classmethod
    def decode(cls, fields: Tuple[Any, ...], section: torch.Tensor, n: int,
               k: int) -> torch.Tensor:
        """Positions from the run lengths: a one after each terminating block."""
        w, count = fields
        if not 1 <= w <= 32:
            raise PayloadError(f"rle payload declares a block width of {w} bits, expected 1..32")
        if count < k or count > k + n // max(1, (1 << w) - 1) + 1:
            raise PayloadError(f"rle payload declares {count} code blocks for {k} of {n} "
                               "positions")
        codes = unpack_uint(section, w, count)
        full = (1 << w) - 1
        ends = codes < full
        if int(ends.sum()) != k or (count and not bool(ends[-1])):
            raise PayloadError(f"rle payload's {count} blocks end {int(ends.sum())} runs, "
                               f"expected {k} ending with the last block (corrupted)")
        pos = torch.cumsum(torch.where(ends, codes + 1, codes), 0)[ends] - 1
        if k and int(pos[-1]) >= n:
            raise PayloadError(f"rle payload runs past the tensor: position {int(pos[-1])} "
                               f"of {n}")
        return pos

    def max_section_nbytes(self, n: int, k: int) -> int:
        """``T <= k + floor((n - k) / M)`` blocks (the sum of floors is at most the floor
        of the sum); with a chosen width, the best bound over widths."""
        widths = [self.block_bits] if self.block_bits else range(1, 33)
        return min((w * (k + (n - k) // ((1 << w) - 1)) + 7) // 8 for w in widths)


def ceil_log2(k: int) -> int:
    """Bits that hold ``0 .. k-1`` (at least 1)."""
    return max(1, (k - 1).bit_length())
