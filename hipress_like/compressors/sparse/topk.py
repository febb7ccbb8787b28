"""Sparsification: the shared sparse payload, ``topk`` and ``randomk``.

A sparsifier sends ``k`` of the ``n`` gradient entries as (index, value)
pairs; the receiver scatters them into zeros (Aji & Heafield 2017; the
thesis's Top-r / Random-r, Sec. 2.2.1). Every sparsifier here (and ``dgc``,
``graddrop``) uses one payload layout, so decoding and its validation are
written once:

    header extra: k (uint64), index item size in bytes (uint64)
    body:         k indices (int32, or int64 when n > 2**31), strictly
                  increasing, zero-padded to a multiple of 8 bytes;
                  then k values in the gradient's dtype

That is the layout of the ``plain`` codecs. The indices and the values may
instead travel through other codecs (``codecs.py``: a run-length
code, ``bloom.py``: a Bloom filter; ``curvefit.py``: a fitted curve),
chosen per sparsifier (``get("topk", ratio=0.01, index_codec="bloom",
eps=0.01)``, ``value_codec="curvefit"``); the second header word then also
carries the codec ids and the codecs' fields follow it
(``codecs.py`` has the layout). With both codecs plain the bytes
are exactly the layout above. ``decode`` reads the codecs from the
payload, so any sparsifier decodes any codec pair.

Indices are sorted at encode time: the receiver's scatter walks memory in
order, and ``decode`` can reject duplicated or out-of-order indices (a sign
of corruption) with one O(k) comparison, besides the range check. A payload
that fails any check raises ``PayloadError``; nothing reaches a native
scatter with a bad index.

Sparse payloads are not aggregatable: summing two of them is a union that
inflates ``k`` (HiPress Sec. 5.3). An aggregator decodes, sums and encodes
again; for the Ring workflow that re-encode "re-selects the top K" so every
step sends the same size. ``Sparsifier.reselect`` does that selection
without touching any worker state (DGC's momentum, GradDrop's residual
belong to the worker that produced the gradient, not to the aggregate).

``randomk`` draws its indices from the counter-based hash RNG of ``ops``:
the keys ``hash32(step * n + i, seed)`` are distinct for distinct ``i`` (the
murmur3 finaliser is a bijection on 32-bit words), so the ``k`` largest keys
are ``k`` distinct indices, a uniformly random subset as far as the hash is
random, reproducible from ``(seed, step)`` on every device.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch

from ..base import (
    Capabilities,
    Compressor,
    Header,
    PayloadError,
    State,
    check_body_nbytes,
    check_gradient,
    decode_output,
    header_nbytes,
    mix_seed,
    pack_payload,
    unpack_fields,
    view_as_dtype,
)
from ..kernels import Kernels
from ..ops import extract, hash32, sample_positions, topk_abs, topk_abs_finite
from ..params import ParamError, check_bool, check_int, check_real
from ..payload import pad8
from ..registry import register
from . import bloom, curvefit  # noqa: F401  (register the codecs before any decode)
from .codecs import (
    IndexCode,
    PlainIndex,
    PlainValues,
    ValueCode,
    index_codec_by_id,
    index_dtype,
    make_index_codec,
    make_value_codec,
    value_codec_by_id,
)

__all__ = [
    "Sparsifier",
    "TopK",
    "RandomK",
    "num_selected",
    "index_dtype",
    "sparse_payload_nbytes",
    "pack_sparse",
    "pack_coded",
    "unpack_sparse",
    "SparseCode",
    "sample_count",
    "sampled_threshold",
    "threshold_of_sample",
    "view_as_dtype",
]

_EXTRA = struct.Struct("<QQ")  # k, index item size | index codec id << 8 | value codec id << 16
# Threshold estimation never uses fewer samples than _MIN_SAMPLES, nor fewer
# than _MIN_HITS / density (so at least ~32 sampled entries lie above the
# threshold), or all entries when the tensor is smaller. With 0.1% density
# and 1% sampling a 200k-entry tensor would otherwise place its threshold at
# the 2nd largest of 2000 samples, and send anywhere from 5% to 300% of k.
_MIN_SAMPLES = 1024
_MIN_HITS = 32


def _check_ratio(name: str, ratio: float, param: str = "ratio") -> float:
    """A density in (0, 1]: 0.01 keeps 1% of the elements."""
    return check_real(name, param, ratio, low=0.0, high=1.0, low_open=True, example=0.01)


def num_selected(ratio: float, n: int) -> int:
    """``k = ceil(ratio * n)`` clamped to [1, n] (tolerant to float rounding of ``ratio*n``)."""
    return max(1, min(n, math.ceil(ratio * n - 1e-6)))


def sparse_payload_nbytes(k: int, numel: int, ndim: int = 1, value_itemsize: int = 4) -> int:
    """Exact size of a sparse payload holding ``k`` of ``numel`` entries.

    ``header + pad8(k * index_size) + k * value_itemsize`` (see the module docstring).
    """
    isz = torch.empty((), dtype=index_dtype(numel)).element_size()
    return header_nbytes(ndim, _EXTRA.size) + pad8(k * isz) + k * value_itemsize


def pack_sparse(algo_id: int, grad: torch.Tensor, idx: torch.Tensor,
                vals: torch.Tensor) -> torch.Tensor:
    """Write (sorted ``idx``, ``vals``) of a gradient shaped like ``grad`` into a payload.

    Args:
        algo_id: the producing compressor's id (checked by ``unpack_sparse``).
        grad: the original gradient (its shape, dtype and device go to the header).
        idx: 1-D int64 strictly increasing indices into ``grad.reshape(-1)``.
        vals: 1-D values, same length as ``idx``, cast to ``grad.dtype``.

    Returns:
        The 1-D uint8 payload.
    """
    n, k = grad.numel(), idx.numel()
    idt = index_dtype(n)
    isz = torch.empty((), dtype=idt).element_size()
    ipad = pad8(k * isz)
    vsz = grad.element_size()
    payload, body = pack_payload(algo_id, grad.dtype, tuple(grad.shape), _EXTRA.pack(k, isz),
                                 ipad + k * vsz, grad.device)
    if k:
        body[: k * isz].view(idt).copy_(idx)
        body[ipad:].view(grad.dtype).copy_(vals)
    if ipad > k * isz:
        body[k * isz: ipad].zero_()
    return payload


def pack_coded(algo_id: int, grad: torch.Tensor, k: int, icode: IndexCode, icodec_id: int,
               vcode: ValueCode, vcodec_id: int) -> torch.Tensor:
    """Write a sparse payload from codec outputs (``codecs.py`` has the layout).

    Args:
        algo_id: the producing compressor's id.
        grad: the original gradient (shape, dtype and device go to the header).
        k: number of values.
        icode, icodec_id: the index codec's output and id.
        vcode, vcodec_id: the value codec's output and id.

    Returns:
        The 1-D uint8 payload.
    """
    isz = torch.empty((), dtype=index_dtype(grad.numel())).element_size()
    word = isz | (icodec_id << 8) | (vcodec_id << 16)
    extra = (_EXTRA.pack(k, word) + icode.fields + bytes(-len(icode.fields) % 8)
             + vcode.fields + bytes(-len(vcode.fields) % 8))
    isec, vsec = icode.section.numel(), vcode.section.numel()
    payload, body = pack_payload(algo_id, grad.dtype, tuple(grad.shape), extra,
                                 pad8(isec) + vsec, grad.device)
    body[:isec].copy_(icode.section)
    body[isec: pad8(isec)].zero_()
    body[pad8(isec):].copy_(vcode.section)
    return payload


def unpack_sparse(payload: torch.Tensor, algo_id: int) -> Tuple[Header, torch.Tensor, torch.Tensor]:
    """Parse, validate and decode a sparse payload of any codec pair: (header, int64
    sorted indices, values).

    Raises:
        PayloadError: bad header, wrong fields, unknown codec ids, body size
            that does not match ``k`` and the codecs' fields, an index
            outside [0, n), indices not strictly increasing, or a codec
            section that does not decode (a truncated or corrupted filter,
            run-length code or fit).
    """
    h, (k, word) = unpack_fields(payload, algo_id, _EXTRA, "sparse")
    n = h.numel
    if k > n:
        raise PayloadError(f"sparse payload declares k={k} entries for a tensor of {n}")
    isz, iid, vid = word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF
    want = torch.empty((), dtype=index_dtype(n)).element_size()
    if isz != want or word >> 24:
        raise PayloadError(f"sparse payload index size {isz} bytes, expected {want} for n={n}"
                           + (f" (reserved bits set: {word:#x})" if word >> 24 else ""))
    icls, vcls = index_codec_by_id(iid), value_codec_by_id(vid)
    ilen, vlen = icls.fields.size, vcls.fields.size
    if len(h.extra) != _EXTRA.size + pad8(ilen) + pad8(vlen):
        raise PayloadError(f"sparse payload extra has {len(h.extra)} bytes, expected "
                           f"{_EXTRA.size + pad8(ilen) + pad8(vlen)} for codecs "
                           f"{icls.name}/{vcls.name}")
    ifields = icls.fields.unpack_from(h.extra, _EXTRA.size)
    vfields = vcls.fields.unpack_from(h.extra, _EXTRA.size + pad8(ilen))
    isec = icls.section_nbytes(ifields, n, k)
    vsec = vcls.section_nbytes(vfields, k, h.dtype)
    codecs = "" if iid == vid == 0 else f" ({icls.name} indices, {vcls.name} values)"
    check_body_nbytes(h, pad8(isec) + vsec, "sparse", f" with k={k}{codecs}")
    idx = icls.decode(ifields, h.body[:isec], n, k)
    if idx.numel() != k:
        raise PayloadError(f"sparse payload's {icls.name} indices decode to {idx.numel()} "
                           f"positions, expected {k}")
    vals = vcls.decode(vfields, h.body[pad8(isec):], k, h.dtype)
    return h, idx, vals


def _scatter(h: Header, idx: torch.Tensor, vals: torch.Tensor,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    res = decode_output(h, out, vals.device)
    flat = res.view(-1)
    flat.zero_()
    if idx.numel():
        flat.index_copy_(0, idx, vals)
    return res


def sampled_threshold(x: torch.Tensor, density: float, sample_ratio: float, seed: int,
                      step: int) -> torch.Tensor:
    """Estimate the magnitude threshold that keeps a ``density`` fraction of ``|x|``.

    DGC (Lin et al. 2018, Sec. 3 / Appendix) and GradDrop (Aji & Heafield
    2017, Sec. 2) both avoid a full sort:

    1. draw ``s = max(ceil(sample_ratio * n), ceil(32 / density), 1024)``
       positions from the counter RNG keyed by (seed, step) (large tensors:
       ``sample_ratio * n``; small ones sample enough to see ~32 entries
       above the threshold);
    2. take the ``ceil(density * s)``-th largest sampled magnitude.

    Only the sampled entries are read, so ``x`` may be signed (``|x|`` is
    never materialised). When ``s >= n`` the exact ``ceil(density * n)``-th
    largest magnitude is returned.

    Args:
        x: 1-D values (or magnitudes).
        density: the fraction to keep, in (0, 1].
        sample_ratio: fraction of entries sampled, in (0, 1].
        seed: RNG seed.
        step: the step counter (a fresh sample each step).

    Returns:
        A 0-d tensor threshold.
    """
    n = x.numel()
    if sample_count(n, density, sample_ratio) >= n:
        return torch.topk(x.abs(), num_selected(density, n), sorted=False).values.min()
    return threshold_of_sample(lambda pos: extract(x, pos), n, density, sample_ratio, seed,
                               step, x.device)


def sample_count(n: int, density: float, sample_ratio: float) -> int:
    """How many entries ``sampled_threshold`` samples from ``n`` (step 1); ``n`` or
    more: it takes the exact threshold instead."""
    return max(math.ceil(sample_ratio * n), math.ceil(_MIN_HITS / density), _MIN_SAMPLES)


def threshold_of_sample(at: Callable[[torch.Tensor], torch.Tensor], n: int, density: float,
                        sample_ratio: float, seed: int, step: int,
                        device: Any = None) -> torch.Tensor:
    """``sampled_threshold`` of a tensor of ``n`` entries that need not exist yet:
    ``at(positions)`` gives its values there (DGC's fused step samples the new
    accumulator from the old state before the pass that writes it). For
    ``sample_count(n, ...) < n``."""
    s = sample_count(n, density, sample_ratio)
    pos = sample_positions(s, n, seed, step * s, device)
    sample = at(pos).abs_()
    return torch.topk(sample, num_selected(density, s), sorted=False).values.min()


def _sorted(idx: torch.Tensor) -> torch.Tensor:
    return torch.sort(idx).values


class SparseCode(NamedTuple):
    """What a sparsifier's ``_pack`` sent.

    Attributes:
        payload: the payload.
        idx: sorted int64 positions whose values were sent (``S``, or for a
            false-positive-aware Bloom filter the positions the decoder draws).
        values: the values read at ``idx`` (the source's dtype, before coding).
        wire: what the decoder puts for them (the gradient's dtype): the
            values cast, or the value codec's approximation.
    """

    payload: torch.Tensor
    idx: torch.Tensor
    values: torch.Tensor
    wire: torch.Tensor


class _SparseKernels(Kernels):
    """Decode-add and decode-divide that touch only the payload's k entries.

    The defaults decode into a dense workspace (zero, scatter) and then add
    or divide the whole tensor: four dense passes per payload. Here:

    * ``decode_add_``: ``acc[idx] += vals``; the same bits as decode-then-add,
      except that a -0.0 of ``acc`` outside ``idx`` stays -0.0 (adding the
      decoded +0.0 makes it +0.0; equal as values);
    * ``decode_div_``: ``out = 0; out[idx] = vals / n``; the same bits;
    * ``subtract_decoded_`` (error feedback's residual): ``x[idx] -= vals``; the
      same bits (``x - 0.0`` is ``x``, and ``a + (-b)`` is ``a - b``).

    ``unpack_sparse`` returns strictly increasing indices (every index codec
    checks or constructs them so), which these rely on; a buffer that is not
    contiguous, or not of the payload's dtype and size, takes the default
    (docs/design.md, "Measurements behind the code", has its timing).
    """

    def _sparse(self, payload: torch.Tensor, buf: torch.Tensor) -> Optional[Tuple[Any, Any]]:
        h, idx, vals = unpack_sparse(payload, self.comp.algo_id)
        if not buf.is_contiguous() or buf.dtype != vals.dtype or buf.numel() != h.numel:
            return None
        return idx, vals

    def decode_add_(self, payload: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """``acc += decode(payload)`` at the payload's indices only (see the class)."""
        got = self._sparse(payload, acc)
        if got is None:
            return super().decode_add_(payload, acc)
        acc.view(-1).index_add_(0, got[0], got[1])
        return acc

    def decode_div_(self, payload: torch.Tensor, out: torch.Tensor, n: int) -> torch.Tensor:
        """``out = decode(payload) / n`` with one zeroing pass and k divisions."""
        got = self._sparse(payload, out)
        if got is None:
            return super().decode_div_(payload, out, n)
        flat = out.view(-1)
        flat.zero_()
        flat.index_copy_(0, got[0], got[1] / n)
        return out

    def subtract_decoded_(self, x: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """``x -= decode(payload)`` at the payload's indices only."""
        got = self._sparse(payload, x)
        if got is None:
            return super().subtract_decoded_(x, payload)
        x.view(-1).index_add_(0, got[0], got[1], alpha=-1)
        return x


class Sparsifier(Compressor):
    """Common decode, sizes, codecs and re-selection of the sparse payload.

    Subclasses call ``_init_codecs`` at the end of ``__init__`` with their
    ``index_codec``, ``value_codec`` and remaining keyword parameters, and
    pack through ``_pack``: any sparsifier then works with any codec pair.
    """

    kernels_class = _SparseKernels
    ratio: float = 0.01
    index_codec: Any = PlainIndex()
    value_codec: Any = PlainValues()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Unpickle. The capabilities an instance keeps (``_init_codecs``) were
        pickled with the fields of their time: a field added since (e.g.
        ``checks_finite``) takes the class's declaration, not its default."""
        self.__dict__.update(state)
        caps, declared = state.get("capabilities"), type(self).capabilities
        if isinstance(caps, Capabilities) and caps is not declared:
            missing = {f.name: getattr(declared, f.name) for f in dataclasses.fields(caps)
                       if f.name not in vars(caps)}
            if missing:
                self.capabilities = dataclasses.replace(caps, **missing)

    def _init_codecs(self, index_codec: Any = "plain", value_codec: Any = "plain",
                     **codec_params: Any) -> None:
        """Build the codecs (``codecs.py``) from their names and parameters.

        The capabilities follow: a data-dependent codec size clears
        ``fixed_size``, a lossy codec clears ``unbiased``.

        Raises:
            ParamError: unknown codec (the message lists the known ones), bad
                codec parameters, or parameters no chosen codec takes.
        """
        params = dict(codec_params)
        self.index_codec = make_index_codec(self.name, index_codec, params)
        self.value_codec = make_value_codec(self.name, value_codec, params)
        if params:
            raise ParamError(
                f"{self.name}: unexpected parameter(s) {sorted(params)} for index_codec="
                f"{self.index_codec.name!r} (takes {list(self.index_codec.param_names)}) and "
                f"value_codec={self.value_codec.name!r} (takes "
                f"{list(self.value_codec.param_names)})")
        caps = self.capabilities
        self.capabilities = dataclasses.replace(
            caps, fixed_size=caps.fixed_size and self.index_codec.fixed_size
            and self.value_codec.fixed_size,
            unbiased=caps.unbiased and self.index_codec.lossless and self.value_codec.lossless)

    @property
    def _plain(self) -> bool:
        return self.index_codec.codec_id == 0 and self.value_codec.codec_id == 0

    def _pack(self, grad: torch.Tensor, idx: torch.Tensor,
              values_at: Callable[[torch.Tensor], torch.Tensor], seed: int) -> SparseCode:
        """Encode the sorted selection ``idx`` of ``grad`` with this sparsifier's codecs.

        Args:
            grad: the gradient (its shape, dtype, device go to the header).
            idx: sorted int64 positions chosen by the sparsifier.
            values_at: the values to send at given positions (the index codec
                may choose other positions, Bloom's false-positive-aware mode).
            seed: per-payload seed for randomised codecs (``_codec_seed``).

        Returns:
            The payload and what it sent (``SparseCode``).
        """
        if self._plain:  # the payload bytes of before codecs existed
            vals = values_at(idx)
            wire = vals.to(grad.dtype)
            return SparseCode(pack_sparse(self.algo_id, grad, idx, wire), idx, vals, wire)
        icode = self.index_codec.encode(idx, grad.numel(), seed)
        vals = values_at(icode.sent)
        vcode = self.value_codec.encode(vals.to(grad.dtype))
        payload = pack_coded(self.algo_id, grad, icode.sent.numel(), icode,
                             self.index_codec.codec_id, vcode, self.value_codec.codec_id)
        return SparseCode(payload, icode.sent, vals, vcode.wire)

    def _codec_seed(self, seed: int, idx: torch.Tensor) -> int:
        """The seed of a randomised index codec: the state's seed mixed with the sum of
        the selection, so it changes every step without a step counter."""
        if not self.index_codec.randomised:
            return 0
        return mix_seed(int(seed), int(idx.sum()) if idx.numel() else 0)

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scatter the (index, value) pairs into zeros of the original shape and dtype.

        The payload's codecs are read from its header, so this decodes any
        codec pair, whatever this sparsifier encodes with.

        Args:
            payload: a sparse payload of this compressor.
            out: optional buffer to scatter into (see ``base.decode_output``).

        Raises:
            PayloadError: see ``unpack_sparse``.
        """
        h, idx, vals = unpack_sparse(payload, self.algo_id)
        return _scatter(h, idx, vals, out)

    def _max_density(self) -> float:
        """The largest fraction a payload may carry (an upper bound for sizes)."""
        return self.ratio

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Size for ``k = ceil(max_density * numel)`` float32 entries (exact for fixed sizes)."""
        k = num_selected(self._max_density(), numel)
        if self._plain:
            return sparse_payload_nbytes(k, numel, ndim, 4)
        ic, vc = self.index_codec, self.value_codec
        extra = _EXTRA.size + pad8(ic.fields.size) + pad8(vc.fields.size)
        return (header_nbytes(ndim, extra) + pad8(ic.max_section_nbytes(numel, k))
                + vc.max_section_nbytes(k, 4))

    def reselect(self, grad: torch.Tensor, k: Optional[int] = None) -> torch.Tensor:
        """Exact top-``k`` payload of a (merged) tensor, touching no worker state.

        HiPress Sec. 5.3: after a Ring aggregator sums decoded partitions, it
        "re-selects top K elements" so every step sends the same size. The
        payload uses this compressor's codecs and decodes with its ``decode``.

        Args:
            grad: the merged tensor.
            k: entries to keep; default ``ceil(ratio * n)``.

        Returns:
            A sparse payload of ``min(k, n)`` entries.
        """
        check_gradient(grad)
        x = grad.detach().reshape(-1)
        k = num_selected(self.ratio, x.numel()) if k is None else max(1, min(int(k), x.numel()))
        idx = _sorted(topk_abs(x, k)[0])
        return self._pack(grad, idx, lambda i: extract(x, i), self._codec_seed(0, idx)).payload

    def params(self) -> Dict[str, object]:
        """Constructor parameters (the codecs' only when they are not plain)."""
        return {"ratio": self.ratio, **self._codec_params()}

    def _codec_params(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.index_codec.codec_id != 0:
            out.update(index_codec=self.index_codec.name, **self.index_codec.params())
        if self.value_codec.codec_id != 0:
            out.update(value_codec=self.value_codec.name, **self.value_codec.params())
        return out


@register("topk")
class TopK(Sparsifier):
    """Keep the ``k = ceil(ratio * n)`` largest-magnitude entries.

    Top-r sparsification (thesis Sec. 2.2.1; Aji & Heafield 2017). The payload
    size depends only on ``n`` (``capabilities.fixed_size``). Biased: pair it
    with error feedback (``get("ef", inner="topk", ratio=...)``).

    Args:
        ratio: fraction of entries kept, in (0, 1]; default 0.01.
        index_codec: how the positions travel: "plain" (default), "rle" or
            "bloom" (``codecs.py``, ``bloom.py``).
        value_codec: how the values travel: "plain" (default) or "curvefit".
        **codec_params: the chosen codecs' parameters (bloom: ``eps``,
            ``policy``, ``fpaware``, ``second_eps``; rle: ``block_bits``;
            curvefit: ``fit``, ``segments``, ``degree``).

    Example:
        >>> c = TopK(ratio=0.01)
        >>> payload, st = c.encode(torch.randn(1000), c.init(torch.zeros(1000)))
        >>> b = TopK(ratio=0.01, index_codec="bloom", eps=0.01)  # fp-aware Bloom filter
    """

    name = "topk"
    algo_id = 20
    # the selection reads every value and tells NaN/Inf (ops.topk_abs_finite)
    capabilities = Capabilities("sparsification", aggregatable=False, fixed_size=True,
                                checks_finite=True)
    # when set (plan="adaptive"'s ratio search sets it on the instances it searches,
    # tuning/ratio_search.py), the state records AR-Topk's gain terms, as AR-Topk's do:
    # one more pass over the gradient, so it is off by default
    records_gain = False

    def __init__(self, ratio: float = 0.01, index_codec: str = "plain",
                 value_codec: str = "plain", **codec_params: Any) -> None:
        self.ratio = _check_ratio("topk", ratio)
        self._init_codecs(index_codec, value_codec, **codec_params)

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Select the top-k magnitudes (operator ``sort``), sort their indices, pack.

        Raises:
            TypeError, ValueError: bad gradient (see ``check_gradient``).
        """
        check_gradient(grad)
        x = grad.detach().reshape(-1)
        top, _, finite = topk_abs_finite(x, num_selected(self.ratio, x.numel()))
        if not finite:  # NaN/Inf seen, or a path that cannot tell: checks_finite scans
            check_gradient(grad, nonfinite="always")
        idx = _sorted(top)
        seed = self._codec_seed(int(state.get("seed", 0)), idx)
        payload = self._pack(grad, idx, lambda i: extract(x, i), seed).payload
        if self.records_gain:  # ||g_c||^2 and ||g_e||^2 (AR-Topk Sec. 3-E's gain terms)
            xf = x.float()
            state = {**state, "gain": (float(extract(xf, idx).square().sum()),
                                       float(xf.square().sum()))}
        return payload, state


@register("randomk")
class RandomK(Sparsifier):
    """Keep ``k = ceil(ratio * n)`` entries chosen at random by the counter RNG.

    Random-r sparsification (thesis Sec. 2.2.1; Stich et al. 2018). The index
    set of step ``t`` is the top-k of the keys ``hash32(t * n + i, seed)``,
    a pseudo-random k-subset reproducible from (seed, step); ``step``
    advances by one per ``encode``.

    With ``unbiased=True`` (default) the values are scaled by ``n / k``: each
    entry is kept with probability ``k / n``, so ``E[decode(encode(g))] = g``.
    With ``unbiased=False`` values are sent as they are (use with error
    feedback).

    With ``seed`` every state draws with that seed, whatever its rank or site,
    as BytePS seeds every worker's and the server's random-k alike
    (``byteps/common/compressor/impl/randomk.h``): at a step, every push and
    the aggregate's pull keep the same entries, so the pull loses none of
    what the pushes sent. None (default): each state's own seed (the
    engine's, per rank and site), so ranks draw independently.

    Args:
        ratio: fraction of entries kept, in (0, 1]; default 0.01.
        unbiased: scale by ``n / k``; default True (declared unbiased only
            with lossless codecs).
        seed: an int >= 0 every state draws with, or None (default).
        index_codec, value_codec, **codec_params: as for ``TopK``.
    """

    name = "randomk"
    algo_id = 21

    def __init__(self, ratio: float = 0.01, unbiased: bool = True,
                 seed: Optional[int] = None, index_codec: str = "plain",
                 value_codec: str = "plain", **codec_params: Any) -> None:
        self.ratio = _check_ratio("randomk", ratio)
        self.unbiased = check_bool("randomk", "unbiased", unbiased)
        self.seed = None if seed is None else check_int("randomk", "seed", seed, low=0)
        self.capabilities = Capabilities("sparsification", aggregatable=False, fixed_size=True,
                                         unbiased=self.unbiased, stateful=True)
        self._init_codecs(index_codec, value_codec, **codec_params)

    def indices(self, n: int, seed: int, step: int, device="cpu") -> torch.Tensor:
        """The sorted int64 indices that step ``step`` with ``seed`` selects out of ``n``."""
        c = torch.arange(n, dtype=torch.int64, device=device) + step * n
        keys = hash32(c, seed)
        return _sorted(torch.topk(keys, num_selected(self.ratio, n), sorted=False).indices)

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Pick the step's random subset, scale by n/k if unbiased, pack; advance ``step``.

        Raises:
            TypeError, ValueError: bad gradient (see ``check_gradient``).
        """
        check_gradient(grad)
        x = grad.detach().reshape(-1)
        n = x.numel()
        seed = int(state.get("seed", 0)) if self.seed is None else self.seed
        step = int(state.get("step", 0))
        idx = self.indices(n, seed, step, x.device)
        scale = n / idx.numel()

        def values_at(i: torch.Tensor) -> torch.Tensor:
            vals = extract(x, i)
            return vals * scale if self.unbiased else vals

        new_state = dict(state, seed=seed, step=step + 1)
        return self._pack(grad, idx, values_at, self._codec_seed(seed, idx)).payload, new_state

    def params(self) -> Dict[str, object]:
        """Constructor parameters (the codecs' only when they are not plain)."""
        seed = {} if self.seed is None else {"seed": self.seed}
        return {"ratio": self.ratio, "unbiased": self.unbiased, **seed, **self._codec_params()}

