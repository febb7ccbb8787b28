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

import math
import struct
from typing import Dict, Optional, Tuple

import torch

from .base import (
    Capabilities,
    Compressor,
    Header,
    PayloadError,
    State,
    check_body_nbytes,
    check_gradient,
    decode_output,
    header_nbytes,
    pack_payload,
    unpack_fields,
    view_as_dtype,
)
from .ops import extract, hash32, sample_positions, topk_abs
from .params import check_bool, check_real
from .registry import register

__all__ = [
    "Sparsifier",
    "TopK",
    "RandomK",
    "num_selected",
    "index_dtype",
    "sparse_payload_nbytes",
    "pack_sparse",
    "unpack_sparse",
    "sampled_threshold",
    "view_as_dtype",
]

_EXTRA = struct.Struct("<QQ")  # k, index item size
_INT32_LIMIT = 2**31  # indices are < n, so int32 holds them while n <= 2**31
# Threshold estimation never uses fewer samples than _MIN_SAMPLES, nor fewer
# than _MIN_HITS / density (so at least ~32 sampled entries lie above the
# threshold), or all entries when the tensor is smaller. With 0.1% density
# and 1% sampling a 200k-entry tensor would otherwise place its threshold at
# the 2nd largest of 2000 samples, and send anywhere from 5% to 300% of k.
_MIN_SAMPLES = 1024
_MIN_HITS = 32


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _check_ratio(name: str, ratio: float, param: str = "ratio") -> float:
    """A density in (0, 1]: 0.01 keeps 1% of the elements."""
    return check_real(name, param, ratio, low=0.0, high=1.0, low_open=True, example=0.01)


def num_selected(ratio: float, n: int) -> int:
    """``k = ceil(ratio * n)`` clamped to [1, n] (tolerant to float rounding of ``ratio*n``)."""
    return max(1, min(n, math.ceil(ratio * n - 1e-6)))


def index_dtype(n: int) -> torch.dtype:
    """Smallest signed index type for an ``n``-element tensor: int32, or int64 past 2**31."""
    return torch.int32 if n <= _INT32_LIMIT else torch.int64


def sparse_payload_nbytes(k: int, numel: int, ndim: int = 1, value_itemsize: int = 4) -> int:
    """Exact size of a sparse payload holding ``k`` of ``numel`` entries.

    ``header + pad8(k * index_size) + k * value_itemsize`` (see the module docstring).
    """
    isz = torch.empty((), dtype=index_dtype(numel)).element_size()
    return header_nbytes(ndim, _EXTRA.size) + _pad8(k * isz) + k * value_itemsize


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
    ipad = _pad8(k * isz)
    vsz = grad.element_size()
    payload, body = pack_payload(algo_id, grad.dtype, tuple(grad.shape), _EXTRA.pack(k, isz),
                                 ipad + k * vsz, grad.device)
    if k:
        body[: k * isz].view(idt).copy_(idx)
        body[ipad:].view(grad.dtype).copy_(vals)
    if ipad > k * isz:
        body[k * isz: ipad].zero_()
    return payload


def unpack_sparse(payload: torch.Tensor, algo_id: int) -> Tuple[Header, torch.Tensor, torch.Tensor]:
    """Parse and validate a sparse payload: (header, int64 indices, values).

    Raises:
        PayloadError: bad header, wrong fields, body size that does not match
            ``k``, an index outside [0, n), or indices not strictly increasing.
    """
    h, (k, isz) = unpack_fields(payload, algo_id, _EXTRA, "sparse")
    n = h.numel
    if k > n:
        raise PayloadError(f"sparse payload declares k={k} entries for a tensor of {n}")
    idt = index_dtype(n)
    if isz != torch.empty((), dtype=idt).element_size():
        raise PayloadError(f"sparse payload index size {isz} bytes, expected "
                           f"{torch.empty((), dtype=idt).element_size()} for n={n}")
    vsz = torch.empty((), dtype=h.dtype).element_size()
    ipad = _pad8(k * isz)
    check_body_nbytes(h, ipad + k * vsz, "sparse", f" with k={k}")
    idx = view_as_dtype(h.body[: k * isz], idt).to(torch.int64)
    vals = view_as_dtype(h.body[ipad:], h.dtype)
    if k:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n:
            raise PayloadError(f"sparse payload index out of range [0, {n}): min {lo}, max {hi}")
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise PayloadError("sparse payload indices are not strictly increasing "
                               "(duplicated or corrupted)")
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
    s = max(math.ceil(sample_ratio * n), math.ceil(_MIN_HITS / density), _MIN_SAMPLES)
    if s >= n:
        return torch.topk(x.abs(), num_selected(density, n), sorted=False).values.min()
    pos = sample_positions(s, n, seed, step * s, x.device)
    sample = extract(x, pos).abs_()
    return torch.topk(sample, num_selected(density, s), sorted=False).values.min()


def _sorted(idx: torch.Tensor) -> torch.Tensor:
    return torch.sort(idx).values


class Sparsifier(Compressor):
    """Common decode, sizes and re-selection of the sparse payload."""

    ratio: float = 0.01

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Scatter the (index, value) pairs into zeros of the original shape and dtype.

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
        return sparse_payload_nbytes(num_selected(self._max_density(), numel), numel, ndim, 4)

    def reselect(self, grad: torch.Tensor, k: Optional[int] = None) -> torch.Tensor:
        """Exact top-``k`` payload of a (merged) tensor, touching no worker state.

        HiPress Sec. 5.3: after a Ring aggregator sums decoded partitions, it
        "re-selects top K elements" so every step sends the same size. The
        payload decodes with this compressor's ``decode``.

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
        return pack_sparse(self.algo_id, grad, idx, extract(x, idx))

    def params(self) -> Dict[str, object]:
        """Constructor parameters."""
        return {"ratio": self.ratio}


@register("topk")
class TopK(Sparsifier):
    """Keep the ``k = ceil(ratio * n)`` largest-magnitude entries.

    Top-r sparsification (thesis Sec. 2.2.1; Aji & Heafield 2017). The payload
    size depends only on ``n`` (``capabilities.fixed_size``). Biased: pair it
    with error feedback (``get("ef", inner="topk", ratio=...)``).

    Args:
        ratio: fraction of entries kept, in (0, 1]; default 0.01.

    Example:
        >>> c = TopK(ratio=0.01)
        >>> payload, st = c.encode(torch.randn(1000), c.init(torch.zeros(1000)))
    """

    name = "topk"
    algo_id = 20
    capabilities = Capabilities("sparsification", aggregatable=False, fixed_size=True)

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = _check_ratio("topk", ratio)

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Select the top-k magnitudes (operator ``sort``), sort their indices, pack.

        Raises:
            TypeError, ValueError: bad gradient (see ``check_gradient``).
        """
        check_gradient(grad)
        x = grad.detach().reshape(-1)
        idx = _sorted(topk_abs(x, num_selected(self.ratio, x.numel()))[0])
        return pack_sparse(self.algo_id, grad, idx, extract(x, idx)), state


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

    Args:
        ratio: fraction of entries kept, in (0, 1]; default 0.01.
        unbiased: scale by ``n / k``; default True.
    """

    name = "randomk"
    algo_id = 21

    def __init__(self, ratio: float = 0.01, unbiased: bool = True) -> None:
        self.ratio = _check_ratio("randomk", ratio)
        self.unbiased = check_bool("randomk", "unbiased", unbiased)
        self.capabilities = Capabilities("sparsification", aggregatable=False, fixed_size=True,
                                         unbiased=self.unbiased, stateful=True)

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
        seed, step = int(state.get("seed", 0)), int(state.get("step", 0))
        idx = self.indices(n, seed, step, x.device)
        vals = extract(x, idx)
        if self.unbiased:
            vals = vals * (n / idx.numel())
        new_state = dict(state, seed=seed, step=step + 1)
        return pack_sparse(self.algo_id, grad, idx, vals), new_state

    def params(self) -> Dict[str, object]:
        """Constructor parameters."""
        return {"ratio": self.ratio, "unbiased": self.unbiased}

