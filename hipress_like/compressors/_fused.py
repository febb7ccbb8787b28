"""Fused encode/decode kernels for the quantizers (onebit, TBQ, TernGrad).

Idea: a quantizer is memory-bound, so its speed is set by how many times it
sweeps the gradient. Written as a chain of eager torch ops it sweeps (and
allocates) once per op; here each hot body is one pure torch function that
``torch.compile`` (inductor, CPU or GPU) turns into one or two loops, as
CompLL generates one CUDA kernel per operator chain (HiPress Sec. 4.3, 5).

Rules every kernel follows, so the compiled and the eager version give the
same payload bytes bit for bit:

1. Codes of the first ``m * per`` elements (``per = 8 // bits``) are
   computed on a ``(per, m)`` view and packed plane by plane
   (``ops._pack_planes``): byte j holds elements j, m + j, 2m + j, ... in
   its bit fields 0, 1, 2, ... Each plane is a contiguous stream, so the
   loop vectorises; the row layout of ``ops.pack_bits`` needs strided
   loads and ran ~5x slower here. The last ``n - m * per`` elements go
   into one extra byte (fields 0, 1, ...), computed eagerly by the same
   function on a padded copy.
2. Reductions are order independent: min/max, integer counts, and sums of
   integer-valued float64 numbers (exact below 2**53). Inductor runs with
   floating-point contraction off, so pointwise float maths rounds the same.
3. Randomness is the counter-based hash of ``ops.uniform`` in int32 ops,
   which fuses (``torch.rand`` does not; ENVIRONMENT.md).

``Kernel`` compiles lazily, once per (function, specialisation, input
dtype), with the tensors' sizes marked dynamic so one compilation serves
every size (each takes ~1-5 s the first time; inductor's on-disk cache makes
later processes fast). Decoders return into ``out`` buffers so callers
can reuse them (a fresh 64 MB tensor costs more in page faults than the
decode itself). Tensors
smaller than ``MIN_COMPILE_NUMEL`` run eagerly (the compiled call's fixed
overhead would dominate). ``HIPRESS_NO_COMPILE=1`` forces eager; a failed
compilation logs one warning and falls back to eager for good.

The GIL: inductor's default CPU wrapper calls its C++ loop *holding* the
GIL, so a 10 ms encode stops every other Python thread of the process for
10 ms: the engine's planner, round executor and the framework's own
threads (measured: the first coordinator round of a VGG-like step came
~100 ms late, all of it spent waiting for encodes). Eager torch ops release
the GIL; so does inductor's ``cpp_wrapper`` mode, at ~60 us more per call.
Calls whose first tensor has at least ``GIL_FREE_NUMEL`` elements (where
a loop takes a millisecond or more) therefore use a second compilation
with ``cpp_wrapper`` on; smaller calls keep the cheaper wrapper.
"""
from __future__ import annotations

import logging
import os
import threading
import types
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from . import _native
from .base import compute_dtype, write_extra_f64  # noqa: F401 (the quantizers use them here)
from .ops import _as_i32, _pack_planes, _plane_codes, _uniform_from_counter

__all__ = [
    "Kernel",
    "MIN_COMPILE_NUMEL",
    "GIL_FREE_NUMEL",
    "compile_enabled",
    "onebit_encode",
    "onebit_decode",
    "onebit_residual",
    "onebit_decode_add_many",
    "onebit_encode_accumulated",
    "tbq_encode",
    "tbq_decode",
    "minmax",
    "terngrad_encode",
    "affine_decode",
    "compute_dtype",
    "write_extra_f64",
]

_log = logging.getLogger(__name__)

#: Below this many elements the eager path is used (the compiled call costs
#: tens of microseconds of guards and dispatch; eager is as fast there).
MIN_COMPILE_NUMEL = 1 << 16

#: From this many elements a call runs the compilation that releases the GIL
#: (inductor ``cpp_wrapper``; see the module doc).
GIL_FREE_NUMEL = 1 << 20

_warned = False
_broken = False
_lock = threading.Lock()


def compile_enabled() -> bool:
    """True unless ``HIPRESS_NO_COMPILE=1`` or a compilation already failed."""
    return not _broken and os.environ.get("HIPRESS_NO_COMPILE", "0") != "1"


def _fail(name: str, err: BaseException) -> None:
    global _warned, _broken
    with _lock:
        _broken = True
        if not _warned:
            _warned = True
            _log.warning("torch.compile of %s failed (%s: %s); using eager kernels from now "
                         "on (same results, slower)", name, type(err).__name__, err)


def _clone(fn: Callable, tag: str) -> Callable:
    """A copy of ``fn`` with its own code object, hence its own dynamo cache.

    Dynamo keys its cache (and its recompile limit) by code object; one copy
    per specialisation keeps, e.g., four TernGrad bitwidths times four dtypes
    from exhausting the limit of a single function.
    """
    code = fn.__code__.replace(co_name=f"{fn.__name__}__{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


class Kernel:
    """A family of pure torch functions, run compiled (lazily, cached) or eagerly.

    ``factory(*spec)`` returns the function for the Python constants in
    ``spec`` (e.g. the bitwidth): constants must be closed over, not passed,
    so inductor sees fixed row widths and vectorises.

    Args:
        factory: ``factory(*spec) -> fn``; ``fn``'s first argument is the
            tensor whose size decides compiled vs eager.
        name: for logs.

    Example:
        >>> k = Kernel(lambda c: (lambda x: x * c), "scale")
        >>> k(torch.ones(3), spec=(2.0,)).tolist()
        [2.0, 2.0, 2.0]
    """

    def __init__(self, factory: Callable[..., Callable], name: str) -> None:
        self.factory = factory
        self.name = name
        self._eager: Dict[Tuple[Any, ...], Callable] = {}
        self._compiled: Dict[Tuple[Any, ...], Callable] = {}

    def eager(self, spec: Tuple[Any, ...]) -> Callable:
        """The uncompiled function for ``spec``."""
        f = self._eager.get(spec)
        if f is None:
            f = self._eager[spec] = self.factory(*spec)
        return f

    def compiled(self, spec: Tuple[Any, ...], dtype: torch.dtype,
                 gil_free: bool = False) -> Callable:
        """The compiled function for ``spec`` and ``dtype`` (compiled on first use);
        ``gil_free`` selects the compilation whose calls release the GIL."""
        key = (spec, dtype, gil_free)
        f = self._compiled.get(key)
        if f is None:
            with _lock:
                f = self._compiled.get(key)
                if f is None:
                    tag = "_".join(str(s).split(".")[-1] for s in (*spec, dtype))
                    tag += "_nogil" if gil_free else ""
                    # dynamic=None + mark_dynamic (in __call__): sizes are symbolic, but the
                    # closed-over constants stay constants (dynamic=True would turn them
                    # into symbols and break the fixed-width plane loops).
                    # emulate_precision_casts: a cast to a half dtype inside a kernel
                    # rounds as it does eagerly (inductor otherwise keeps the float32
                    # value), so e.g. a fused decode-and-add of half outputs gives the
                    # bits of decode-then-add (rule 2).
                    options = {"emulate_precision_casts": True}
                    if gil_free:
                        options["cpp_wrapper"] = True
                    f = torch.compile(_clone(self.eager(spec), tag), dynamic=None,
                                      fullgraph=True, options=options)
                    self._compiled[key] = f
        return f

    def __call__(self, *args: Any, spec: Tuple[Any, ...] = (), numel: int = -1) -> Any:
        """Run on ``args``; compiled when ``numel`` (default: ``args[0].numel()``) is large."""
        if numel < 0:
            numel = args[0].numel()
        if numel >= MIN_COMPILE_NUMEL and compile_enabled():
            dtype = spec[-1] if spec and isinstance(spec[-1], torch.dtype) else args[0].dtype
            try:
                # the GIL matters per call: a decode runs one call per bit plane
                work = args[0].numel() if isinstance(args[0], torch.Tensor) else numel
                f = self.compiled(spec, dtype, work >= GIL_FREE_NUMEL)
                for a in args:
                    if isinstance(a, torch.Tensor) and a.dim() == 1 and a.numel() > 1:
                        torch._dynamo.mark_dynamic(a, 0)
                return f(*args)
            except Exception as e:  # inductor/toolchain problems must not break training
                _fail(self.name, e)
        return self.eager(spec)(*args)


# --------------------------------------------------------------------------
# Kernel bodies. Encoders take a flat tensor of m * per elements, view it as
# (per, m) planes with a constant ``per`` and write m bytes into ``out``.
# Decoders fill one plane (m contiguous outputs) per call from the codes in
# bit field k of the m bytes: a single-output kernel writes straight into the
# caller's buffer (a multi-plane one would go through a temporary).
# --------------------------------------------------------------------------

def _onebit_pack_fn() -> Callable:
    def onebit_pack(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Sign bits of x (1 for x >= 0: 1-bit SGD's threshold 0, Seide et al. 2014,
        Sec. 2) into ``out``; returns max|x| (NaN/Inf propagate)."""
        out.copy_(_pack_planes(torch.where(x.view(8, -1) >= 0, 1.0, 0.0), 1))
        return x.abs().amax()
    return onebit_pack


def _onebit_pack_acc_fn() -> Callable:
    def onebit_pack_acc(mem: torch.Tensor, grad: torch.Tensor, out: torch.Tensor
                        ) -> torch.Tensor:
        """``mem += grad`` (error feedback's compensation), then ``onebit_pack`` of the
        sum, in one sweep: the sum is stored and packed without reading it back."""
        x = mem + grad
        mem.copy_(x)
        out.copy_(_pack_planes(torch.where(x.view(8, -1) >= 0, 1.0, 0.0), 1))
        return x.abs().amax()
    return onebit_pack_acc


def _onebit_sums_fn() -> Callable:
    def onebit_sums(x: torch.Tensor, scale: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Exact, order-independent sums for 1-bit SGD's two reconstruction values.

        Each value becomes a fixed-point integer ``rint(x * scale)`` in float64
        (|.| <= 2**20), so the sums are exact for up to 2**33 elements whatever
        the reduction order. Returns (sum over x >= 0, sum over all, #(x >= 0)).
        """
        q = torch.round(x.to(torch.float64) * scale)
        pos = x >= 0
        return torch.where(pos, q, 0.0).sum(), q.sum(), pos.sum()
    return onebit_sums


def _emit(out: torch.Tensor, v: torch.Tensor, mode: str, d: torch.Tensor) -> None:
    """Store decoded values ``v``: ``out = v``, ``out += v`` or ``out = v / d``.

    ``v`` is first cast to ``out``'s dtype, so each mode rounds exactly as
    decoding into a buffer and then adding it (``add_``) or dividing it
    (``div_``) would: the fused forms give the same bits in one pass.
    """
    v = v.to(out.dtype)
    if mode == "add":
        out.copy_(out + v)
    elif mode == "div":
        out.copy_(v / d)
    else:
        out.copy_(v)


def _onebit_unpack_fn(mode: str, out_dtype: torch.dtype) -> Callable:
    def onebit_unpack(packed: torch.Tensor, out: torch.Tensor, pos: torch.Tensor,
                      neg: torch.Tensor, d: torch.Tensor, shift: torch.Tensor) -> None:
        """One plane: ``pos`` where the bit at ``shift`` of the byte is 1, ``neg`` where it is 0."""
        _emit(out, torch.where(_plane_codes(packed, 1, shift) != 0, pos, neg), mode, d)
    return onebit_unpack


def _onebit_unpack_add_many_fn(count: int) -> Callable:
    def onebit_unpack_add_many(out: torch.Tensor, shift: torch.Tensor, *planes: torch.Tensor
                               ) -> None:
        """One plane of ``count`` payloads added into float32 ``out`` in order:
        ``planes`` is (packed, pos, neg) per payload. The float32 sums round
        as the same additions one payload at a time would."""
        acc = out
        for i in range(count):
            packed, pos, neg = planes[3 * i: 3 * i + 3]
            acc = acc + torch.where(_plane_codes(packed, 1, shift) != 0, pos, neg)
        out.copy_(acc)
    return onebit_unpack_add_many


def _onebit_residual_fn(dtype: torch.dtype) -> Callable:
    def onebit_residual(x: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> None:
        """``x -= (pos if x >= 0 else neg)``: x minus its 1-bit reconstruction."""
        x.copy_(x - torch.where(x >= 0, pos, neg))
    return onebit_residual


def _tbq_pack_fn() -> Callable:
    def tbq_pack(x: torch.Tensor, out: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """TBQ codes (Strom 2015, Sec. 3): 1 for x > tau, 2 for x < -tau, else 0.

        Packs 2-bit codes into ``out``; returns max|x| so the caller can reject
        NaN/Inf without another sweep.
        """
        xc = x.view(4, -1).to(tau.dtype)
        codes = torch.where(xc > tau, 1.0, torch.where(xc < -tau, 2.0, 0.0))
        out.copy_(_pack_planes(codes, 2))
        return x.abs().amax()
    return tbq_pack


def _tbq_unpack_fn(mode: str, out_dtype: torch.dtype) -> Callable:
    def tbq_unpack(packed: torch.Tensor, out: torch.Tensor, tau: torch.Tensor,
                   d: torch.Tensor, shift: torch.Tensor) -> None:
        """One plane (field at bit ``shift``): 2-bit codes -> {0, +tau, -tau}.

        Code 3 is never produced; it decodes as 0.
        """
        c = _plane_codes(packed, 2, shift)
        zero = torch.zeros_like(tau)
        _emit(out, torch.where(c == 1, tau, torch.where(c == 2, -tau, zero)), mode, d)
    return tbq_unpack


def _minmax_fn() -> Callable:
    def minmax(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(min, max) of x; NaN propagates (HiPress Fig. 5 lines 11-12)."""
        return x.amin(), x.amax()
    return minmax


def _terngrad_pack_fn(bits: int) -> Callable:
    per = 8 // bits
    top = float((1 << bits) - 1)

    def terngrad_pack(x: torch.Tensor, out: torch.Tensor, lo: torch.Tensor, gap: torch.Tensor,
                      seed: torch.Tensor, base: torch.Tensor) -> None:
        """Stochastic rounding to 2**bits levels (HiPress Fig. 5, ``floatToUint``).

        Fig. 5 lines 6-7: ``r = (g - min) / gap``; ``code = floor(r + u)``, u ~
        U[0, 1). Computed as ``floor(r) + (u < r - floor(r))``: the same random
        variable, but the fraction stays exact (``r + u`` would round), so
        E[code] = r up to u's 2**-24 resolution and decode is unbiased. u is
        ``ops.uniform``'s number ``base + i`` of the stream keyed by ``seed``.
        """
        xv = x.view(per, -1)
        m = xv.shape[1]
        ramp = torch.arange(m, dtype=torch.int32, device=x.device)
        planes = []
        for k in range(per):  # one expression per plane, so inductor fuses it into the packing
            r = ((xv[k].to(lo.dtype) - lo) / gap).clamp(0.0, top)
            fl = torch.floor(r)
            u = _uniform_from_counter(ramp + (base + k * m), seed)
            planes.append(fl.to(torch.float32) + torch.where(u < (r - fl), 1.0, 0.0))
        out.copy_(_pack_planes(planes, bits))
    return terngrad_pack


def _affine_unpack_fn(bits: int, mode: str, out_dtype: torch.dtype) -> Callable:
    def affine_unpack(packed: torch.Tensor, out: torch.Tensor, lo: torch.Tensor,
                      gap: torch.Tensor, d: torch.Tensor, shift: torch.Tensor) -> None:
        """One plane (field at bit ``shift``): ``min + code * gap``, in ``out``'s dtype.

        The decode of Fig. 5's encode.
        """
        _emit(out, lo + _plane_codes(packed, bits, shift).to(lo.dtype) * gap, mode, d)
    return affine_unpack


_K_ONEBIT_PACK = Kernel(_onebit_pack_fn, "onebit encode")
_K_ONEBIT_PACK_ACC = Kernel(_onebit_pack_acc_fn, "onebit accumulate+encode")
_K_ONEBIT_SUMS = Kernel(_onebit_sums_fn, "onebit sums")
_K_ONEBIT_UNPACK = Kernel(_onebit_unpack_fn, "onebit decode")
_K_ONEBIT_RESIDUAL = Kernel(_onebit_residual_fn, "onebit residual")
_K_ONEBIT_UNPACK_ADD_MANY = Kernel(_onebit_unpack_add_many_fn, "onebit decode-add (many)")
_K_TBQ_PACK = Kernel(_tbq_pack_fn, "tbq encode")
_K_TBQ_UNPACK = Kernel(_tbq_unpack_fn, "tbq decode")
_K_MINMAX = Kernel(_minmax_fn, "minmax")
_K_TERN_PACK = Kernel(_terngrad_pack_fn, "terngrad encode")
_K_AFFINE_UNPACK = Kernel(_affine_unpack_fn, "affine decode")


# --------------------------------------------------------------------------
# Drivers: split the flat tensor into full bytes (kernel) and the tail.
# --------------------------------------------------------------------------

def _split(x: torch.Tensor, per: int, pad: Any = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flat ``x`` -> (its first m*per elements, a padded (per,) copy of the rest or empty)."""
    n = x.numel()
    m = n // per
    t = n - m * per
    if t == 0:
        return x, x.new_empty((0,))
    tail = torch.full((per,), pad, dtype=x.dtype, device=x.device)
    tail[:t] = x[m * per:]
    return x[: m * per], tail


def _run_pack(kernel: Kernel, x: torch.Tensor, body: torch.Tensor, per: int,
              args: Tuple[Any, ...], tail_args: Tuple[Any, ...], spec: Tuple[Any, ...] = (),
              pad: Any = 0.0) -> Tuple[Any, Any]:
    """Run an encode kernel on the full bytes and (eagerly) on the padded tail byte."""
    main, tail = _split(x, per, pad)
    m = main.numel() // per
    r_main = kernel(main, body[:m], *args, spec=spec) if m else None
    r_tail = kernel.eager(spec)(tail, body[m:], *tail_args) if tail.numel() else None
    return r_main, r_tail


def _run_unpack(kernel: Kernel, body: torch.Tensor, out: torch.Tensor, per: int,
                args: Tuple[Any, ...], spec: Tuple[Any, ...] = ()) -> None:
    """Fill flat ``out`` plane by plane from the full bytes, then the last partial byte."""
    n = out.numel()
    m = n // per
    spec = spec + (out.dtype,)
    if m:
        for k in range(per):
            kt = torch.tensor(k * (8 // per), dtype=torch.int32, device=body.device)
            kernel(body[:m], out[k * m: (k + 1) * m], *args, kt, spec=spec, numel=n)
    if n - m * per:
        _run_unpack_tail(kernel, body, out, per, args, spec[:-1])


def _run_unpack_tail(kernel: Kernel, body: torch.Tensor, out: torch.Tensor, per: int,
                     args: Tuple[Any, ...], spec: Tuple[Any, ...]) -> None:
    """The elements of the last partial byte (fields 0, 1, ...), eagerly."""
    n = out.numel()
    m = n // per
    fn = kernel.eager(spec + (out.dtype,))
    for k in range(n - m * per):
        kt = torch.tensor(k * (8 // per), dtype=torch.int32, device=body.device)
        tmp = out[m * per + k: m * per + k + 1].clone()  # "add" reads it
        fn(body[m: m + 1], tmp, *args, kt)
        out[m * per + k] = tmp[0]


def _native_f32(*tensors: torch.Tensor) -> bool:
    """True when onebit may run ``_native``'s C loops on these tensors: float32
    values (uint8 bodies) on the CPU, contiguous, and the library built."""
    return (any(t.dtype == torch.float32 for t in tensors) and _native.usable(*tensors))


def _max2(a: Any, b: Any) -> torch.Tensor:
    return a if b is None else b if a is None else torch.maximum(a, b)


def onebit_encode(x: torch.Tensor, body: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    """Pack sign bits of flat ``x`` into ``body``; return (value for 1, value for 0, max|x|).

    The values are 1-bit SGD's reconstruction (Seide et al. 2014, Sec. 2):
    the means of the x >= 0 and the x < 0 parts, as float64 0-d tensors (0
    for an empty part), from exact fixed-point sums.
    """
    if _native_f32(x, body):
        return _onebit_values(x, _native.onebit_pack(x, body))
    amax = _max2(*_run_pack(_K_ONEBIT_PACK, x, body, 8, (), ()))
    return _onebit_values(x, amax)


def onebit_encode_accumulated(mem: torch.Tensor, grad: torch.Tensor, body: torch.Tensor,
                              residual: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
                              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mem += grad``, then ``onebit_encode(mem, body)``, with the addition fused into
    the packing sweep (flat contiguous tensors of one dtype; same bits as the two
    steps: the float sum rounds the same in the kernel as in ``add_``).

    ``residual`` = (value for 1, value for 0), 0-d tensors of ``mem``'s dtype:
    first ``onebit_residual(mem, *residual)`` (the last step's residual, deferred
    by error feedback); the native loop does it in the same sweep, same bits.
    """
    if _native_f32(mem, grad, body):
        res = None if residual is None else (float(residual[0]), float(residual[1]))
        return _onebit_values(mem, _native.onebit_pack(mem, body, grad, res))
    if residual is not None:
        onebit_residual(mem, *residual)
    n = mem.numel()
    full = n - n % 8
    r_main = r_tail = None
    if full:
        r_main = _K_ONEBIT_PACK_ACC(mem[:full], grad[:full], body[: full // 8])
    if full < n:
        mem[full:].add_(grad[full:])
        _, tail = _split(mem, 8)
        r_tail = _K_ONEBIT_PACK.eager(())(tail, body[full // 8:])
    return _onebit_values(mem, _max2(r_main, r_tail))


def _onebit_values(x: torch.Tensor, amax: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1-bit SGD's two reconstruction values of flat ``x`` (packed already), and max|x|."""
    # Fixed-point unit: the power of two with max|x| * scale in [2**19, 2**20], so the
    # sums of rint(x * scale) are exact up to 2**33 elements (float64 has 53 bits) and
    # dividing by scale is exact. (0 -> 2**20; tiny inputs are capped at 2**1000.)
    exp = torch.frexp(amax.to(torch.float64)).exponent
    scale = torch.ldexp(torch.ones((), dtype=torch.float64, device=x.device),
                        (20 - exp).clamp(max=1000))
    if (_native_f32(x) and bool(torch.isfinite(amax))
            and _native.sums_scale_ok(float(scale))):  # else the error path or ~1e-32 values
        ps_, ts_, cnt_ = _native.onebit_sums(x, float(scale))
        ps = torch.tensor(float(ps_), dtype=torch.float64, device=x.device)
        ts = torch.tensor(float(ts_), dtype=torch.float64, device=x.device)
        cnt = torch.tensor(cnt_, dtype=torch.int64, device=x.device)
    else:
        ps, ts, cnt = _K_ONEBIT_SUMS(x, scale)
    n = x.numel()
    cnt_f = cnt.to(torch.float64)
    zero = torch.zeros_like(ps)
    pos = torch.where(cnt > 0, ps / cnt_f.clamp(min=1) / scale, zero)
    neg = torch.where(cnt < n, (ts - ps) / (n - cnt_f).clamp(min=1) / scale, zero)
    return pos, neg, amax


def _divisor(out: torch.Tensor, d: float) -> torch.Tensor:
    return torch.tensor(d, dtype=out.dtype, device=out.device)


def onebit_decode(body: torch.Tensor, out: torch.Tensor, pos: torch.Tensor,
                  neg: torch.Tensor, mode: str = "set", d: float = 1.0) -> None:
    """``pos`` where the bit is 1 and ``neg`` where it is 0, stored into flat ``out``
    as ``mode`` says (``_emit``: set, add, or divide by ``d``)."""
    if _native_f32(out, body, pos, neg):
        v = torch.stack([pos, neg]).to(out.dtype)  # rounds as _emit does
        a, b = (v / _divisor(out, d) if mode == "div" else v).tolist()
        _native.onebit_unpack(body, out, a, b, add=mode == "add")
        return
    _run_unpack(_K_ONEBIT_UNPACK, body, out, 8, (pos, neg, _divisor(out, d)), spec=(mode,))


def onebit_decode_add_many(bodies: Sequence[torch.Tensor], out: torch.Tensor,
                           values: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``out += decode(body_i)`` for each payload in order, one pass over float32 ``out``.

    ``values[i]`` is payload i's (value for 1, value for 0) as 0-d float32
    tensors. Planes go through one kernel for all payloads; the elements of the
    last partial byte are added payload by payload (same order, same bits).
    """
    if _native_f32(out, *bodies, *(v for pn in values for v in pn)):
        _native.onebit_unpack_add_many(bodies, out, [(float(p), float(q)) for p, q in values])
        return
    n = out.numel()
    m = n // 8
    count = len(bodies)
    if m:
        args = [t for body, (pos, neg) in zip(bodies, values) for t in (body[:m], pos, neg)]
        for k in range(8):
            kt = torch.tensor(k, dtype=torch.int32, device=out.device)
            _K_ONEBIT_UNPACK_ADD_MANY(out[k * m: (k + 1) * m], kt, *args, spec=(count,),
                                      numel=n)
    if n - m * 8:
        one = torch.ones((), dtype=out.dtype, device=out.device)
        for body, (pos, neg) in zip(bodies, values):
            _run_unpack_tail(_K_ONEBIT_UNPACK, body, out, 8, (pos, neg, one), ("add",))


def onebit_residual(x: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> None:
    """``x -= pos where x >= 0 else neg``, in place, one pass (flat contiguous ``x``)."""
    _K_ONEBIT_RESIDUAL(x, pos, neg, spec=(x.dtype,))


def tbq_encode(x: torch.Tensor, body: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Pack TBQ 2-bit codes of flat ``x`` into ``body``; return max|x|."""
    return _max2(*_run_pack(_K_TBQ_PACK, x, body, 4, (tau,), (tau,)))


def tbq_decode(body: torch.Tensor, out: torch.Tensor, tau: torch.Tensor, mode: str = "set",
               d: float = 1.0) -> None:
    """Decode TBQ codes into flat ``out`` (``tau`` in ``out``'s dtype; ``mode`` as
    ``onebit_decode``)."""
    _run_unpack(_K_TBQ_UNPACK, body, out, 4, (tau, _divisor(out, d)), spec=(mode,))


def minmax(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of flat ``x`` in one sweep (NaN propagates)."""
    return _K_MINMAX(x)


def terngrad_encode(x: torch.Tensor, body: torch.Tensor, lo: torch.Tensor, gap: torch.Tensor,
                    seed_mixed: int, bits: int) -> None:
    """Stochastically round flat ``x`` to ``lo + k * gap`` and pack the k into ``body``.

    Args:
        x: flat gradient.
        body: output bytes, ``ops.packed_nbytes(x.numel(), bits)`` of them.
        lo, gap: 0-d tensors in the compute dtype; ``gap > 0``.
        seed_mixed: ``ops.mix_seed(seed)``; element i uses number i of
            ``ops.uniform(n, seed)``.
        bits: code width (1, 2, 4 or 8).
    """
    per = 8 // bits
    dev = x.device
    s = torch.tensor(_as_i32(seed_mixed), dtype=torch.int32, device=dev)
    m = x.numel() // per
    base0 = torch.zeros((), dtype=torch.int32, device=dev)
    base1 = torch.tensor(_as_i32(m * per), dtype=torch.int32, device=dev)
    # padding with lo gives r = 0, i.e. code 0, for the unused fields of the last byte
    _run_pack(_K_TERN_PACK, x, body, per, (lo, gap, s, base0), (lo, gap, s, base1),
              spec=(bits,), pad=float(lo))


def affine_decode(body: torch.Tensor, out: torch.Tensor, lo: torch.Tensor, gap: torch.Tensor,
                  bits: int, mode: str = "set", d: float = 1.0) -> None:
    """``lo + k * gap`` for the packed codes k, stored into flat ``out`` (``mode`` as
    ``onebit_decode``)."""
    _run_unpack(_K_AFFINE_UNPACK, body, out, 8 // bits, (lo, gap, _divisor(out, d)),
                spec=(bits, mode))
