"""The torch.compile ``Kernel`` machinery of the fused quantizer kernels, and their drivers.

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
from typing import Any, Callable, Dict, Tuple

import torch

__all__ = ["GIL_FREE_NUMEL", "Kernel", "MIN_COMPILE_NUMEL", "compile_enabled", "compute_dtype"]

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


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype of the quantizers: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------
# Shared by the kernel bodies and drivers of onebit/fused.py and
# quantizers/fused.py. Encoders take a flat tensor of m * per elements, view
# it as (per, m) planes with a constant ``per`` and write m bytes into
# ``out``. Decoders fill one plane (m contiguous outputs) per call from the
# codes in bit field k of the m bytes: a single-output kernel writes straight
# into the caller's buffer (a multi-plane one would go through a temporary).
# Drivers split the flat tensor into full bytes (kernel) and the tail.
# --------------------------------------------------------------------------

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


def _max2(a: Any, b: Any) -> torch.Tensor:
    return a if b is None else b if a is None else torch.maximum(a, b)


def _divisor(out: torch.Tensor, d: float) -> torch.Tensor:
    return torch.tensor(d, dtype=out.dtype, device=out.device)
