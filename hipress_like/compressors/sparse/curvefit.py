"""Curve-fitted values: the sparse values as a fitted curve plus their order (thesis Sec. 4).

The thesis ("Sparse communication for deep learning", Sec. 4) observes that
sorted gradient magnitudes follow a smooth curve, so ``r`` kept values can
travel as a few coefficients plus the *mapping* from each value to its
place on the curve (Sec. 4.1), applied on top of top-k (Sec. 4.4):

1. sort the magnitudes decreasingly: ``y_j = |v|_(j)``, ``j = 0 .. r-1``;
2. fit ``y`` by least squares (Sec. 2.4, 4.2: ``w = (X^T X)^-1 X^T y``,
   solved here by ``torch.linalg.lstsq``, which also takes rank-deficient
   ``X``) in one of three families:

   - ``poly``: the curve cut into ``segments`` pieces of equal length, each
     a polynomial of ``degree`` in a local coordinate ``t`` in (-1, 1)
     (Sec. 4.2.2; Table 8 uses degree 3 and one or two segments);
   - ``logit``: a polynomial of ``degree`` in ``L(u) = ln((2 - u) / u)``,
     ``u = (j + 1/2) / r``, i.e. ``logit(1 - u/2)``: the logit basis of
     Sec. 4.2.1 on the magnitude side (the upper half of a symmetric
     quantile curve);
   - ``dexp``: ``y = a e^(b u) + c e^(d u)`` (Sec. 4.3.1). The thesis calls
     its least-squares solution analytical; it is not linear in ``b, d``,
     so they come from the linear regression of Jacquelin's integral
     equation (J. Jacquelin, "Regressions et equations integrales", 2009):
     such a ``y`` solves ``y'' = (b + d) y' - b d y``, so integrating
     twice, ``y = B S1 + A S2 + C u + D`` with ``S1``, ``S2`` the first and
     second cumulative integrals, ``B = b + d``, ``A = -b d``; then ``a, c``
     by linear least squares. Complex roots, too few points or a
     non-finite result fall back to one cubic (``poly``, 1 segment,
     degree 3: the same four coefficients, so the size does not change);
3. send the coefficients (float64, as Table 8 counts them), the rank of
   each value on the curve (the mapping, ``ceil(log2 r)`` bits each) and
   its sign (one bit: the thesis folds signs into the mapping, Sec. 4.2.2).

The decoder evaluates the curve at every rank, clamps it at zero and puts
value ``i`` = ``sign_i * curve(rank_i)``. Lossy: pair it with error
feedback, which keeps each value's fitting error.

Fields (header extra): fit id, degree, segments, number of coefficients,
rank bits. Section: the coefficients, the packed ranks, the packed signs.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Dict, Tuple

import torch

from ..base import view_as_dtype
from ..params import ParamError, check_int
from ..payload import PayloadError
from .codecs import (
    ValueCode,
    ValueCodec,
    ceil_log2,
    pack_uint,
    register_value_codec,
    unpack_uint,
)

__all__ = ["FITS", "CurveFit", "fit_sorted", "eval_sorted", "n_coefficients", "fit_rmse"]

FITS = ("poly", "logit", "dexp")
_MAX_DEGREE = 8       # monomials on (-1, 1) stay well conditioned up to here
_MAX_SEGMENTS = 4096  # a u16 field; more segments than this cost more than they save


def n_coefficients(fit: str, k: int, segments: int, degree: int) -> int:
    """Coefficients of a fit of ``k`` values: ``min(segments, k) (degree + 1)`` for
    ``poly``, ``degree + 1`` for ``logit``, 4 for ``dexp``; 0 when ``k == 0``."""
    if k == 0:
        return 0
    if fit == "poly":
        return min(segments, k) * (degree + 1)
    if fit == "logit":
        return degree + 1
    return 4


def _u(k: int) -> torch.Tensor:
    return (torch.arange(k, dtype=torch.float64) + 0.5) / k


def _bounds(k: int, segments: int) -> list:
    s = min(segments, k)
    return [(i * k) // s for i in range(s + 1)]


def _poly_basis(t: torch.Tensor, degree: int) -> torch.Tensor:
    return torch.vander(t, N=degree + 1, increasing=True)  # 1, t, t**2, ... by products


def _local_t(length: int) -> torch.Tensor:
    return (2.0 * torch.arange(length, dtype=torch.float64) + 1.0) / length - 1.0


def _lstsq(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Least squares ``argmin |x w - y|``: through the normal equations
    ``(X^T X) w = X^T y`` (thesis Sec. 4.2) when the rows are many (one pass over
    ``x``; the small system is solved by SVD, so a singular one still gives the
    minimum-norm solution), else directly by SVD."""
    if x.shape[0] > 8 * x.shape[1]:
        xt = x.t()
        return torch.linalg.lstsq(xt @ x, (xt @ y).unsqueeze(1),
                                  driver="gelsd").solution.reshape(-1)
    return torch.linalg.lstsq(x, y.unsqueeze(1), driver="gelsd").solution.reshape(-1)


def _logit_basis(k: int, degree: int) -> torch.Tensor:
    u = _u(k)
    return _poly_basis(torch.log((2.0 - u) / u), degree)


def _cumint(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Cumulative trapezoid integral of ``y`` over ``x``, starting at 0."""
    out = torch.zeros_like(y)
    out[1:] = torch.cumsum((y[1:] + y[:-1]) * (x[1:] - x[:-1]) / 2.0, 0)
    return out


def _fit_dexp(y: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """``[a, b, c, d]`` of ``a e^(b u) + c e^(d u)`` (module docstring), and whether it held."""
    k = y.numel()
    if k < 6:
        return torch.zeros(4, dtype=torch.float64), False
    u = _u(k)
    s1 = _cumint(y, u)
    s2 = _cumint(s1, u)
    coef = _lstsq(torch.stack([s2, s1, u, torch.ones_like(u)], 1), y)
    a_, b_ = float(coef[0]), float(coef[1])  # y = A S2 + B S1 + ...
    disc = b_ * b_ + 4.0 * a_
    if not (math.isfinite(disc) and disc >= 0.0):
        return torch.zeros(4, dtype=torch.float64), False
    r1, r2 = (b_ + math.sqrt(disc)) / 2.0, (b_ - math.sqrt(disc)) / 2.0
    ac = _lstsq(torch.stack([torch.exp(r1 * u), torch.exp(r2 * u)], 1), y)
    out = torch.tensor([float(ac[0]), r1, float(ac[1]), r2], dtype=torch.float64)
    return out, bool(torch.isfinite(out).all()) and bool(torch.isfinite(_eval_dexp(out, k)).all())


def _eval_dexp(c: torch.Tensor, k: int) -> torch.Tensor:
    u = _u(k)
    return c[0] * torch.exp(c[1] * u) + c[2] * torch.exp(c[3] * u)


def fit_sorted(y: torch.Tensor, fit: str, segments: int, degree: int
               ) -> Tuple[str, int, int, torch.Tensor]:
    """Least-squares fit of decreasing magnitudes ``y`` (float64), thesis Sec. 4.2-4.3.

    Returns:
        (fit used, segments used, degree used, float64 coefficients): ``dexp``
        may fall back to ``poly`` with 1 segment of degree 3.
    """
    k = y.numel()
    if k == 0:
        return fit, (1 if fit == "poly" else 1), degree, torch.zeros(0, dtype=torch.float64)
    if fit == "dexp":
        coef, ok = _fit_dexp(y)
        if ok:
            return "dexp", 1, 0, coef
        fit, segments, degree = "poly", 1, 3
    if fit == "logit":
        coef = _lstsq(_logit_basis(k, degree), y)
        return "logit", 1, degree, coef
    b = _bounds(k, segments)
    coefs = [_lstsq(_poly_basis(_local_t(b[i + 1] - b[i]), degree), y[b[i]: b[i + 1]])
             for i in range(len(b) - 1)]
    return "poly", len(b) - 1, degree, torch.cat(coefs)


def eval_sorted(fit: str, coef: torch.Tensor, k: int, segments: int,
                degree: int) -> torch.Tensor:
    """The fitted curve at ranks ``0 .. k-1`` (float64, not clamped)."""
    if k == 0:
        return torch.zeros(0, dtype=torch.float64)
    if fit == "dexp":
        return _eval_dexp(coef, k)
    if fit == "logit":
        return _logit_basis(k, degree) @ coef
    b = _bounds(k, segments)
    c = coef.view(len(b) - 1, degree + 1)
    return torch.cat([_poly_basis(_local_t(b[i + 1] - b[i]), degree) @ c[i]
                      for i in range(len(b) - 1)])


def _values(fit: str, coef: torch.Tensor, k: int, segments: int, degree: int,
            rank: torch.Tensor, neg: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Value ``i`` = ``-+ max(curve(rank_i), 0)`` (the encoder's ``wire`` and the decode)."""
    y = eval_sorted(fit, coef, k, segments, degree).clamp_min(0.0)[rank]
    return torch.where(neg, -y, y).to(dtype)


def fit_rmse(vals: torch.Tensor, fit: str = "poly", segments: int = 2,
             degree: int = 3) -> float:
    """RMSE of the fitted sorted magnitudes of ``vals`` (thesis Sec. 4.2, Table 8)."""
    y = torch.sort(vals.detach().reshape(-1).abs().to(torch.float64), descending=True).values
    used, s, d, coef = fit_sorted(y, fit, segments, degree)
    est = eval_sorted(used, coef, y.numel(), s, d).clamp_min(0.0)
    return float(torch.sqrt(torch.mean((est - y) ** 2))) if y.numel() else 0.0


@register_value_codec
class CurveFit(ValueCodec):
    """Values as a least-squares curve over their sorted magnitudes (module docstring).

    Args:
        fit: "poly" (default), "logit" or "dexp".
        segments: curve pieces for ``poly`` (default 2), 1..4096.
        degree: polynomial degree for ``poly`` and ``logit`` (default 3), 0..8.

    Raises:
        ParamError: a parameter out of range.
    """

    name = "curvefit"
    codec_id = 1
    fields = struct.Struct("<BBHII")  # fit id, degree, segments, coefficients, rank bits
    param_names = ("fit", "segments", "degree")
    lossless = False

    def __init__(self, owner: str = "sparse", fit: str = "poly", segments: int = 2,
                 degree: int = 3) -> None:
        if fit not in FITS:
            raise ParamError(f"{owner}: fit must be one of {FITS}, found {fit!r}")
        self.fit = fit
        self.segments = check_int(owner, "segments", segments, low=1, example=2)
        self.degree = check_int(owner, "degree", degree, low=0, example=3)
        if self.segments > _MAX_SEGMENTS or self.degree > _MAX_DEGREE:
            raise ParamError(f"{owner}: segments must be <= {_MAX_SEGMENTS} and degree <= "
                             f"{_MAX_DEGREE}, found {segments!r}, {degree!r}")

    def params(self) -> Dict[str, Any]:
        """Constructor parameters."""
        return {"fit": self.fit, "segments": self.segments, "degree": self.degree}

    def encode(self, vals: torch.Tensor) -> ValueCode:
        """Sort, fit, and pack coefficients, ranks and signs; ``wire`` is the decoded values."""
        k = vals.numel()
        mag = vals.detach().abs().to(torch.float64).cpu()
        order = torch.argsort(mag, descending=True, stable=True)
        rank = torch.empty(k, dtype=torch.int64)
        rank[order] = torch.arange(k, dtype=torch.int64)
        fit, seg, deg, coef = fit_sorted(mag[order], self.fit, self.segments, self.degree)
        rb = ceil_log2(k)
        neg = (vals.detach() < 0).cpu()
        fields = self.fields.pack(FITS.index(fit), deg, seg, coef.numel(), rb)
        section = torch.cat([coef.contiguous().view(torch.uint8), pack_uint(rank, rb),
                             pack_uint(neg, 1)]).to(vals.device)
        wire = _values(fit, coef, k, seg, deg, rank, neg, vals.dtype).to(vals.device)
        return ValueCode(fields, section, wire)

    @classmethod
    def section_nbytes(cls, fields: Tuple[Any, ...], k: int, dtype: torch.dtype) -> int:
        """``8 * coefficients + ceil(k * rank_bits / 8) + ceil(k / 8)``."""
        _, _, _, ncoef, rb = fields
        return 8 * ncoef + (k * rb + 7) // 8 + (k + 7) // 8

    @classmethod
    def decode(cls, fields: Tuple[Any, ...], section: torch.Tensor, k: int,
               dtype: torch.dtype) -> torch.Tensor:
        """Evaluate the curve at each value's rank, clamp at 0, apply the signs.

        Raises:
            PayloadError: unknown fit, inconsistent counts, non-finite
                coefficients, or ranks that are not a permutation.
        """
        fid, deg, seg, ncoef, rb = fields
        if fid >= len(FITS):
            raise PayloadError(f"curvefit payload has unknown fit id {fid} (known: "
                               f"{', '.join(f'{i} ({f})' for i, f in enumerate(FITS))})")
        fit = FITS[fid]
        ok = (deg <= _MAX_DEGREE and 1 <= seg <= max(1, min(k, _MAX_SEGMENTS))
              and (fit == "poly" or seg == 1) and rb == ceil_log2(k)
              and ncoef == n_coefficients(fit, k, seg, deg))
        if not ok:
            raise PayloadError(f"curvefit payload fields are inconsistent: fit {fit}, degree "
                               f"{deg}, segments {seg}, {ncoef} coefficients, {rb} rank bits "
                               f"for {k} values")
        if k == 0:
            return torch.empty(0, dtype=dtype, device=section.device)
        sec = section.cpu()
        coef = view_as_dtype(sec[: 8 * ncoef], torch.float64)
        if not bool(torch.isfinite(coef).all()):
            raise PayloadError("curvefit payload has non-finite coefficients (corrupted)")
        off = 8 * ncoef
        rank = unpack_uint(sec[off:], rb, k)
        if int(rank.max()) >= k or not bool((torch.bincount(rank, minlength=k) == 1).all()):
            raise PayloadError("curvefit payload ranks are not a permutation (corrupted)")
        neg = unpack_uint(sec[off + (k * rb + 7) // 8:], 1, k).to(torch.bool)
        return _values(fit, coef, k, seg, deg, rank, neg, dtype).to(section.device)

    def max_section_nbytes(self, k: int, itemsize: int) -> int:
        """Exact: the sizes depend only on ``k`` (``dexp`` falls back to four coefficients)."""
        fields = (0, 0, 0, n_coefficients(self.fit, k, self.segments, self.degree),
                  ceil_log2(k))
        return self.section_nbytes(fields, k, torch.float32)
