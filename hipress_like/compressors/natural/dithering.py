"""Natural and standard dithering (Horvath et al., "Natural Compression for
Distributed Deep Learning", MSML 2022 / arXiv:1905.10988, natural dithering section).

Idea: dithering (QSGD's family) scales x by ||x||_p and rounds each
|x_i| / ||x||_p at random, without bias, between adjacent levels:
standard dithering D_sta^{p,s} has the uniform levels 0, 1/s, ..., 1;
natural dithering D_nat^{p,s} the levels 0, 2^(1-s), ..., 1/2, 1, "an
inexact version of natural compression" whose variance at a fixed number
of levels s is O(2^(s-1)/s) times smaller. BytePS's ``dithering``
compressor is the same family; its parameter names are accepted (``k``
for s, ``normalize`` "max"/"l2" for p = inf/2, ``partition`` naming the
compressor's own levels).

Payload (after the common header; bit planes in onebit's planar layout, as
``natural.py`` describes): extra = (||x||_p: float64, s: uint16, p: uint8
with 0 for inf); body = sign plane + b = ceil(log2(s+1)) code bit planes
(plane k holds bit k of each level code). Torch only: these are the
comparison points of C_nat, not a fast path (about 0.02x a memory copy at
64 MB here). Every encode advances ``state["step"]``.
"""
from __future__ import annotations

import math
import numbers
import struct
from typing import Any, Dict, Optional, Tuple

import torch

from ..base import Capabilities, Compressor, PayloadError, State, check_gradient, header_nbytes
from ..kernels import FusedDecode
from ..ops import packed_nbytes, uniform
from ..params import ParamError, ParamTypeError, check_int
from ..quantizers.terngrad import step_seed
from ..registry import register
from .natural import _advance, _check_state, _chunks, _emit, _pack_planes, _unpack_planes

__all__ = ["NaturalDithering", "Dithering"]

_DITH_EXTRA = struct.Struct("<dHB5x")  # ||x||_p, s, p code

_P_CODE = {1.0: 1, 2.0: 2, math.inf: 0}
_P_OF_CODE = {v: k for k, v in _P_CODE.items()}
_NORMALIZE = {"max": math.inf, "l2": 2.0}  # BytePS's dithering_normalize names
_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)


def _norm(grad: torch.Tensor, g: torch.Tensor, p: float) -> float:
    """||g||_p in float64; the standard error on NaN/Inf. Finite entries whose norm
    overflows float64 are scaled by max|g| first (a norm beyond float64 raises)."""
    norm = float(torch.linalg.vector_norm(g, ord=p, dtype=torch.float64))
    if math.isfinite(norm):
        return norm
    amax = float(g.abs().amax())
    if not math.isfinite(amax):
        check_gradient(grad, nonfinite="always")  # raises the standard NaN/Inf error
    norm = amax * float(torch.linalg.vector_norm(g.double() / amax, ord=p))
    if not math.isfinite(norm):
        raise ValueError(f"gradient: its {p:g}-norm exceeds the float64 range (max|x| = "
                         f"{amax:g}); scale it down, or use p=float('inf')")
    return norm


def _compute_dtype(dtype: torch.dtype, norm: float) -> torch.dtype:
    """float32, or float64 for float64 inputs and norms float32 cannot hold as a normal."""
    ok = norm == 0.0 or _F32_TINY <= norm <= _F32_MAX
    return torch.float64 if dtype == torch.float64 or not ok else torch.float32


def _check_levels(name: str, s: Any, k: Any, max_s: int) -> int:
    """The number of levels from ``s`` or BytePS's ``k`` (default 7: 3-bit codes)."""
    pname = "s"
    if k is not None:
        if s is not None:
            raise ParamError(f"{name}: the number of levels was given twice, s={s!r} and "
                             f"k={k!r} (k is BytePS's name for s); pass only s")
        s, pname = k, "k"
    v = check_int(name, pname, 7 if s is None else s, low=1, example=7)
    if v > max_s:
        raise ParamError(f"{name}: {pname} must be an integer in [1, {max_s}], found {s!r}; "
                         f"pass a smaller one, e.g. {pname}=7")
    return v


def _check_norm(name: str, p: Any, normalize: Any) -> float:
    """p from ``p`` or BytePS's ``normalize`` ("max": inf, "l2": 2; default inf)."""
    if normalize is not None:
        if p is not None:
            raise ParamError(f"{name}: the norm was given twice, p={p!r} and "
                             f"normalize={normalize!r}; pass only p")
        if not isinstance(normalize, str):
            raise ParamTypeError(f"{name}: normalize must be a string, found "
                                 f"{type(normalize).__name__} {normalize!r}; pass "
                                 "normalize='max' or 'l2' (or p=inf / p=2)")
        if normalize.lower() not in _NORMALIZE:
            raise ParamError(f"{name}: normalize must be 'max' or 'l2', found {normalize!r}; "
                             "or pass p=1, 2 or float('inf')")
        p = _NORMALIZE[normalize.lower()]
    p = math.inf if p is None else p
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise ParamTypeError(f"{name}: p must be a number, found {type(p).__name__} {p!r}; "
                             "pass p=1, p=2 or p=float('inf')")
    if float(p) not in _P_CODE:
        raise ParamError(f"{name}: p must be 1, 2 or inf, found {p!r}; pass p=2 or "
                         "p=float('inf')")
    return float(p)


def _check_partition(name: str, partition: Any, own: str) -> None:
    """BytePS's ``partition`` is accepted when it names this compressor's levels."""
    if partition is None:
        return
    if not isinstance(partition, str):
        raise ParamTypeError(f"{name}: partition must be a string, found "
                             f"{type(partition).__name__} {partition!r}; pass "
                             f"partition={own!r} or leave it out")
    if partition.lower() != own:
        other = "natural_dithering" if own == "linear" else "dithering"
        raise ParamError(f"{name}: partition must be {own!r} here, found {partition!r}; the "
                         f"{partition!r} partition is the {other!r} compressor: "
                         f"get({other!r}, s=..., p=...)")


class _Dithering(FusedDecode, Compressor):
    """Random dithering D^{p,s} (shared by the natural and the standard partition).

    Algorithm (QSGD's random dithering; the paper's D_sta^{p,s} and D_nat^{p,s}):
        1. y_i = |x_i| / ||x||_p, in [0, 1]
        2. l <= y_i < l' adjacent levels; round up to l' with probability
           (y_i - l) / (l' - l), else down to l (unbiased)
        3. send (||x||_p, s, p, sign plane, level codes); decode
           sign(x_i) ||x||_p level(code_i).

    Unbiased up to the 2^-24 resolution of the uniforms and the rounding of
    y_i (as TernGrad), except that a decoded value beyond the dtype's range
    (p = 1 or 2 on a half tensor, or on values near float32's maximum)
    saturates at its largest finite value (biased there, never Inf).
    Variance per entry: ||x||_p^2 (y - l)(l' - y); for standard dithering
    and p = 2 at most min(d/s^2, sqrt(d)/s) ||x||_2^2 in total (QSGD,
    Alistarh et al. 2017, Lemma 3.1), and the paper's natural dithering
    section states natural dithering's is O(2^(s-1)/s) times smaller at equal
    s (their table: D_nat^{p,s} in 8 + d(2 + log2 s) bits against
    31 + d(2 + s) for D_sta^{p,2^s-1}).

    Args:
        s: number of nonzero levels, an int in [1, ``max_s``] (default 7: 3-bit
            codes). BytePS's name ``k`` (its ``compressor_k``) is accepted.
        p: the norm, 1, 2 or float("inf") (default inf, BytePS's default
            normalisation "max"). BytePS's ``normalize="max"``/``"l2"`` (its
            ``dithering_normalize`` 0/1) is accepted instead.
        partition: BytePS's ``dithering_partition`` ("linear" 0 / "natural" 1),
            accepted when it names this class's levels (the other partition is
            the other compressor). BytePS's ``seed`` comes from ``init`` here.
    """

    partition = "linear"
    max_s = 255
    capabilities = Capabilities("quantization", aggregatable=False, fixed_size=True,
                                unbiased=True, stateful=True,
                                checks_finite=True)  # the norm's pass

    def __init__(self, s: Any = None, p: Any = None, *, k: Any = None, normalize: Any = None,
                 partition: Any = None) -> None:
        self.s = _check_levels(self.name, s, k, self.max_s)
        self.p = _check_norm(self.name, p, normalize)
        _check_partition(self.name, partition, self.partition)

    def params(self) -> Dict[str, Any]:
        """Constructor parameters (BytePS aliases resolved)."""
        return {"s": self.s, "p": self.p}

    def _levels(self, s: int) -> list:
        """The s + 1 levels, code 0 (zero) to code s (one)."""
        raise NotImplementedError

    def _codes(self, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Level codes of ``y`` in [0, 1] with uniforms ``u`` (step 2)."""
        raise NotImplementedError

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Dither ``grad``; the new state has ``step`` + 1.

        Raises:
            TypeError: non-tensor or non-float input.
            ValueError: empty input, NaN/Inf in it, or a state without
                ``seed``/``step`` (create it with ``init``).
        """
        check_gradient(grad, nonfinite="ignore")  # NaN/Inf: caught by the norm
        _check_state(self.name, state)
        g = grad.detach().contiguous().reshape(-1)
        n = g.numel()
        norm = _norm(grad, g, self.p)
        cdt = _compute_dtype(g.dtype, norm)
        b = self.s.bit_length()  # ceil(log2(s + 1))
        q = packed_nbytes(n, 1)
        payload, body = self.frame_payload(grad, _DITH_EXTRA.pack(norm, self.s, _P_CODE[self.p]),
                                           (1 + b) * q)
        nt = torch.tensor(norm, dtype=cdt, device=g.device)
        seed = step_seed(int(state["seed"]), int(state["step"]))
        codes = torch.empty(n, dtype=torch.uint8, device=g.device)
        for i0, i1 in _chunks(n):
            y = g[i0:i1].abs().to(cdt)
            if norm > 0.0:  # clamp: a norm rounded below max|x| must not make a level > 1
                y = (y / nt).clamp_(max=1.0)
            u = uniform(i1 - i0, seed, offset=i0, device=g.device)
            codes[i0:i1] = self._codes(y, u).to(torch.uint8)
        _pack_planes(torch.signbit(g).view(torch.uint8), 1, body[:q])
        _pack_planes(codes, b, body[q:])
        return payload, _advance(state)

    def _decode(self, payload: torch.Tensor, out: Optional[torch.Tensor], mode: str,
                d: float) -> torch.Tensor:
        """``sign * ||x||_p * level(code)`` in the original shape and dtype, by ``mode``
        (``FusedDecode``)."""
        h, (norm, s, pcode), body, out = self.unframe_payload(
            payload, _DITH_EXTRA, self._body_nbytes, out,
            lambda norm, s, pcode: f" (sign and {s.bit_length()} code planes)")
        n, b = h.numel, s.bit_length()
        q = packed_nbytes(n, 1)
        dev = payload.device
        cdt = _compute_dtype(h.dtype, norm)
        nc = float(torch.tensor(norm, dtype=cdt))  # the norm encode divided by
        # a level times the norm may lie beyond the dtype (a half tensor, or a float32 one
        # near its maximum, with p = 1 or 2): it saturates there, biased, never Inf
        top = float(torch.finfo(h.dtype).max)
        lut = torch.tensor([min(nc * v, top) for v in self._levels(s)], dtype=cdt, device=dev)
        codes = _unpack_planes(body[q:], n, b)
        if int(codes.max()) > s:
            raise PayloadError(f"{self.name} payload holds a level code above s={s}")
        sg = _unpack_planes(body[:q], n, 1)
        flat = out.view(-1)
        for i0, i1 in _chunks(n):
            v = lut[codes[i0:i1].to(torch.int64)]
            _emit(flat[i0:i1], torch.where(sg[i0:i1] != 0, -v, v), mode, d)
        return out

    def _body_nbytes(self, h: Any, norm: float, s: int, pcode: int) -> int:
        """A payload's body size: a sign plane and ceil(log2(s+1)) code planes,
        once its fields (norm, s, p) are checked to be in range."""
        if not 1 <= s <= self.max_s or pcode not in _P_OF_CODE:
            raise PayloadError(f"{self.name} payload declares s={s}, p code {pcode}; expected "
                               f"s in [1, {self.max_s}] and p code in {sorted(_P_OF_CODE)}")
        if not (math.isfinite(norm) and norm >= 0.0):
            raise PayloadError(f"{self.name} payload declares norm {norm!r}, expected a "
                               "finite number >= 0")
        return (1 + s.bit_length()) * packed_nbytes(h.numel, 1)

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Header (16 bytes of norm, s, p) plus (1 + ceil(log2(s+1))) ceil(numel/8) bytes."""
        return (header_nbytes(ndim, _DITH_EXTRA.size)
                + (1 + self.s.bit_length()) * packed_nbytes(numel, 1))


@register("natural_dithering")
class NaturalDithering(_Dithering):
    """Natural dithering D_nat^{p,s} (Horvath et al.): levels 0, 2^(1-s), ..., 1/2, 1.

    Between two nonzero levels the rounding is C_nat of y (the paper: natural
    dithering is an inexact C_nat); below 2^(1-s) it is between 0 and 2^(1-s).
    ``s`` at most 127 (the smallest level stays a float32 normal number).
    Arguments and the rest of the algorithm: ``_Dithering``.

    Example:
        >>> import hipress_like as hp
        >>> c = hp.compressors.get("natural_dithering", s=3, p=float("inf"))
        >>> g = torch.tensor([1.0, -0.5, 0.25, 0.0])
        >>> p, st = c.encode(g, c.init(g, seed=0))
        >>> c.decode(p).tolist()      # every entry sits on a level
        [1.0, -0.5, 0.25, 0.0]
    """

    name = "natural_dithering"
    algo_id = 41
    partition = "natural"
    max_s = 127

    def _levels(self, s: int) -> list:
        return [0.0] + [2.0 ** (j - s) for j in range(1, s + 1)]

    def _codes(self, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        s = self.s
        m, ex = torch.frexp(y)  # y = m 2^ex, m in [0.5, 1): floor(log2 y) = ex - 1
        up = (u < (2.0 * m - 1.0)).to(torch.int32)  # (y - 2^a) / 2^a, exact
        low = (u < y * 2.0 ** (s - 1)).to(torch.int32)  # y / 2^(1-s), exact
        return torch.where(y >= 2.0 ** (1 - s), ex.to(torch.int32) - 1 + s + up, low)


@register("dithering")
class Dithering(_Dithering):
    """Standard random dithering D_sta^{p,s} (QSGD, Alistarh et al. 2017): levels
    0, 1/s, ..., 1; ``s`` at most 255. Arguments and algorithm: ``_Dithering``.

    Example:
        >>> import hipress_like as hp
        >>> c = hp.compressors.get("dithering", k=4, normalize="max")   # BytePS's names
        >>> c.params()
        {'s': 4, 'p': inf}
    """

    name = "dithering"
    algo_id = 42
    partition = "linear"
    max_s = 255

    def _levels(self, s: int) -> list:
        return [j / s for j in range(s + 1)]

    def _codes(self, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        r = y * float(self.s)
        fl = torch.floor(r)
        return (fl + (u < (r - fl)).to(r.dtype)).clamp_(max=self.s).to(torch.int32)
