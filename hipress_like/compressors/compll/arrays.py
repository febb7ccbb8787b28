"""CompLL's sparsification operators: state arrays, filter, topk, threshold, gather, scatter.

HiPress Table 4 lists ``filter`` and ``sort`` among the common operators; DGC
and GradDrop (Table 5) need them, plus per-gradient state and payloads whose
size depends on the data. Their meaning, which the interpreter below, the C
(``render_seq``) and the CUDA (``render_cuda_seq``) forms all implement:

- **State arrays**: a global ``float* u;`` is per-gradient state, as long as
  the gradient, zero at ``init`` and kept between encodes (DGC's velocity and
  accumulation, GradDrop's residual); encode updates it with
  ``u = map(u, gradient, f)`` (``f`` of one element of each array) and
  ``scatter(u, idx, value)``.
- ``filter(x, pred)``: the ascending int32 indices i where ``pred(x[i])``
  holds (stream compaction).
- ``topk(x, candidates, k)``: the ``k`` candidates of largest ``|x|``, in
  ascending index order (all of them when there are ``k`` or fewer); among
  equal magnitudes the lower index wins. The exact second stage of DGC's
  selection (Lin et al. 2018, Appendix).
- ``threshold(x, density, sample_ratio)``: the magnitude threshold that keeps
  about a ``density`` fraction of ``|x|``, estimated from a sample as DGC and
  GradDrop (Aji & Heafield 2017, Sec. 2) do: ``s = max(ceil(sample_ratio n),
  ceil(32 / density), 1024)`` positions ``(hash32(step s + j, seed) n) >> 32``
  (``ops.sample_positions``, keyed by the compressor state's seed and step),
  and the ``ceil(density s)``-th largest sampled magnitude; when ``s >= n``
  the exact ``ceil(density n)``-th largest of all ``|x|``.
- ``gather(x, idx)``: ``x[idx]``.
- ``scatter(idx, vals)`` (decode): zeros of the gradient's length with
  ``vals`` at ``idx``; the indices must lie in [0, n) and increase strictly,
  else the payload is rejected.
- **Variable-size payloads**: ``concat(count, ..., idx, vals)`` writes the
  arrays' own lengths; each array after the first starts at a multiple of 8
  bytes (the sparse payload of ``sparse.py``); decode reads them back with
  ``extract(compressed, k, ..., idx[k], vals[k])``.
- ``fma(a, b, c)``: ``a * b + c`` rounded once (torch's ``add(alpha=)`` is
  fused on CPUs, so DGC's ``u = m u + g`` needs it to match bytes).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

import torch

from ..ops import sample_positions
from .checker import is_sparse

__all__ = ["assemble_body", "fma", "is_sparse", "num_selected", "sample_size", "interp_filter",
           "interp_topk", "interp_threshold", "interp_gather", "interp_scatter",
           "interp_extract_array"]

_MIN_SAMPLES, _MIN_HITS = 1024, 32
_DT = {"float": torch.float32, "int32": torch.int32, "int64": torch.int64,
       "double": torch.float64}


def assemble_body(arrays: List[torch.Tensor]) -> torch.Tensor:
    """The body bytes: each array (uint8 view) after the first at a multiple of 8 bytes."""
    parts: List[torch.Tensor] = []
    pos = 0
    for j, a in enumerate(arrays):
        a = a.reshape(-1)
        if j and pos % 8:
            parts.append(torch.zeros((pos + 7) // 8 * 8 - pos, dtype=torch.uint8,
                                     device=a.device))
            pos = (pos + 7) // 8 * 8
        parts.append(a)
        pos += a.numel()
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def num_selected(ratio: float, n: int) -> int:
    """``ceil(ratio * n)`` clamped to [1, n] (as the hand-written sparsifiers count)."""
    return max(1, min(n, math.ceil(ratio * n - 1e-6)))


def sample_size(n: int, density: float, sample_ratio: float) -> int:
    """How many positions ``threshold`` samples (module docstring)."""
    return max(math.ceil(sample_ratio * n), math.ceil(_MIN_HITS / density), _MIN_SAMPLES)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` with one rounding (C's fmaf) for float32 tensors.

    The float64 product of two float32 values is exact; their sum with ``c``
    is rounded to odd in float64 (TwoSum's error term picks the odd
    neighbour), and a round-to-odd result with 53 >= 24 + 2 bits rounds to
    float32 exactly as the fused operation (Boldo & Melquiond 2008, Thm. 4).
    Other dtypes: ``a * b + c``.
    """
    if not (a.dtype == b.dtype == c.dtype == torch.float32):
        return a * b + c
    p = a.double() * b.double()
    cd = c.double()
    p, cd = torch.broadcast_tensors(p, cd)
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    odd = (s.contiguous().view(torch.int64) & 1) == 1
    inf = torch.full_like(s, math.inf)
    toward = torch.nextafter(s, torch.where(err > 0, inf, -inf))
    return torch.where((err != 0) & ~odd & torch.isfinite(s), toward, s).float()


def _ev(it: Any, a: Any, scopes: List[Dict[str, Any]]) -> Any:
    return it._eval(a, scopes)


def interp_filter(it: Any, e: Any, args: List[Any], scopes: List[Dict[str, Any]]
                  ) -> torch.Tensor:
    """``filter(x, pred)``: ascending int32 indices where the predicate holds."""
    x = _ev(it, args[0], scopes)
    f = it.c.funcs[args[1].args[0]]
    keep = it._call_user(f, [x], torch.arange(x.numel(), dtype=torch.int64))
    keep = keep.expand(x.shape) if keep.dim() == 0 else keep
    return torch.nonzero(keep != 0).reshape(-1).to(torch.int32)


def interp_topk(it: Any, e: Any, args: List[Any], scopes: List[Dict[str, Any]]
                ) -> torch.Tensor:
    """``topk(x, candidates, k)``: the k candidates of largest |x|, ascending."""
    x = _ev(it, args[0], scopes)
    cand = _ev(it, args[1], scopes)
    k = int(_ev(it, args[2], scopes))
    if cand.numel() <= k:
        return cand
    mag = x.index_select(0, cand.long()).abs()
    order = torch.sort(-mag, stable=True).indices[:max(k, 0)]  # ties: the lower index
    return torch.sort(cand.index_select(0, order)).values


def interp_threshold(it: Any, e: Any, args: List[Any], scopes: List[Dict[str, Any]]
                     ) -> torch.Tensor:
    """``threshold(x, density, sample_ratio)`` keyed by the state's seed and step."""
    x = _ev(it, args[0], scopes)
    density = float(_ev(it, args[1], scopes))
    sr = float(_ev(it, args[2], scopes))
    n = x.numel()
    if not (0 < density <= 1 and 0 < sr <= 1):
        raise ValueError(f"threshold: density and sample_ratio must be in (0, 1], found "
                         f"{density}, {sr}")
    s = sample_size(n, density, sr)
    if s >= n:
        mags, k = x.abs(), num_selected(density, n)
    else:
        pos = sample_positions(s, n, it.raw_seed, it.step * s, x.device)
        mags, k = x.index_select(0, pos).abs(), num_selected(density, s)
    return torch.topk(mags, k, sorted=False).values.min().to(torch.float32)


def interp_gather(it: Any, e: Any, args: List[Any], scopes: List[Dict[str, Any]]
                  ) -> torch.Tensor:
    """``gather(x, idx)``: x at the indices."""
    x = _ev(it, args[0], scopes)
    return x.index_select(0, _ev(it, args[1], scopes).long())


def interp_scatter(it: Any, e: Any, args: List[Any], scopes: List[Dict[str, Any]]) -> Any:
    """``scatter(x, idx, value)`` into a state array, or decode's ``scatter(idx, vals)``."""
    if len(args) == 3:
        x = _ev(it, args[0], scopes)
        x.index_fill_(0, _ev(it, args[1], scopes).long(), float(_ev(it, args[2], scopes)))
        return torch.zeros((), dtype=torch.int32)
    idx = _ev(it, args[0], scopes).long()
    vals = _ev(it, args[1], scopes)
    if idx.numel() != vals.numel():
        raise ValueError(f"scatter: {idx.numel()} indices for {vals.numel()} values")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= it.n
                        or bool((idx[1:] <= idx[:-1]).any())):
        raise ValueError(f"scatter: indices must lie in [0, {it.n}) and increase strictly")
    out = torch.zeros(it.n, dtype=torch.float32)
    out.index_copy_(0, idx, vals.to(torch.float32))
    return out


def interp_extract_array(it: Any, a: Any, t: Any, pos: int, scopes: List[Dict[str, Any]]
                         ) -> int:
    """Read ``name[count]`` from the body at ``pos`` (8-byte aligned after the first)."""
    dt = _DT[t.name]
    pos = (pos + 7) // 8 * 8
    cnt = int(_ev(it, a.args[1], scopes))
    nb = cnt * torch.empty((), dtype=dt).element_size()
    if cnt < 0 or cnt > it.n or pos + nb > it.body.numel():
        raise ValueError(f"payload body has {it.body.numel()} bytes, the program reads "
                         f"{pos + max(nb, 0)} ({cnt} elements of {a.args[0].args[0]})")
    val = it.body[pos:pos + nb].clone().view(dt)
    scope, _ = it._lookup(scopes, a.args[0].args[0])
    scope[a.args[0].args[0]] = val
    return pos + nb
