"""Native CPU loops for onebit, the compressor on the PS fast path (HiPress Sec. 6.2),
for natural compression C_nat (natural.py), THC's Hadamard transform (thc.py),
PowerSGD's matrix sweeps (powersgd.py),
the Bloom-filter index codec's universe query and conflict-set policy (bloom.py),
and top-k's threshold filter (ops.topk_abs).

Idea: CompLL's point (HiPress Sec. 4.3) is that an encoder must run at
memory speed or it eats the time compression saves. ``torch.compile``
(``_fused``) gets most loops there, but not the ones that mix a byte stream
with eight float planes: on this project's reference host (AVX2, one core per
two ranks) inductor's code for onebit's decode ran at 2.4 GB/s against
~13 GB/s for the same loop written in C, and its fused ``mem += grad; pack``
at 1.8 GB/s against 5.5. C_nat's loops are of the same kind (a hash and a few
integer operations per element into a byte stream and a bit plane; its eager
torch path is ~100x slower). Those loops are a few lines each, so they are
written once in C (``_native.c``), built with the system C compiler on first
use, and called through ``ctypes``, which releases the GIL for the length of
the call (the engine's other threads keep running, as with inductor's
``cpp_wrapper``).

Top-k's prefilter (``ops.topk_abs``) is a compare per element whose ~1%
survivors are kept: torch writes two bool tensors, ORs them and scans the
result with ``nonzero`` (~60 ms for 16 M floats here); one pass that walks a
16-bit comparison mask takes ~10 ms, and halves top-k's encode time.

THC's transform is another loop of that kind: per block of 4096 floats, a
hash per element (the signs D) and twelve butterfly stages, all in the L1
cache, where torch makes a pass over memory per factor.

PowerSGD's two sweeps over a gradient-sized matrix (round 0's ``M = g + e -
P' Q'^T`` with ``P = M Q``, and the decode's ``P Q^T``) write with streaming
stores, which torch's kernels never use: a store to a line not in the cache
reads it first, so a sweep into another buffer moves a third more bytes
(``_fused_lowrank``; ``tests/unit/test_native_powersgd.py`` checks them).

Contract: same bytes and floats as the torch kernels, for every input
(``_native.c`` says how; ``tests/unit/test_native.py`` checks it against the
eager path). Used only for contiguous float32 CPU tensors; everything else,
and every machine without a working C compiler, keeps the torch path.
``HIPRESS_NO_NATIVE=1`` turns it off.

Build: ``$CC`` (else Python's configured compiler, else ``cc``) with ``-O3
-march=native -ffp-contract=off``, into ``$HIPRESS_CACHE_DIR`` (default
``~/.cache/hipress_like``), named by a hash of the source, the compiler, the
flags and the CPU's feature flags, so a cache shared between different
machines never runs code built for another CPU. Ranks that start together
race harmlessly: each builds into its own temporary file and renames it into
place. One failed build logs one warning and the process stays on torch.

Threads: one call is split into ``torch.get_num_threads()`` byte ranges run
on a small thread pool when the tensor is large, so a process that gives
torch several cores gets them here too.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import struct
import subprocess
import sysconfig
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["abs_at_least_indices", "available", "build_shared", "bloom_build",
           "bloom_conflict_blocks",
           "bloom_query", "natural_decode", "natural_encode", "onebit_pack",
           "onebit_sums", "onebit_unpack", "onebit_unpack_add_many", "psgd_form_m",
           "psgd_lowrank",
           "PSGD_MAX_RANK", "sums_scale_ok",
           "thc_fwht", "thc_merge_b4w8", "thc_rht", "usable"]

_log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu99"]
_FALLBACK_FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu99"]

#: Below this many elements a call runs on the calling thread only.
PARALLEL_NUMEL = 1 << 20

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False
_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0


def _enabled() -> bool:
    return os.environ.get("HIPRESS_NO_NATIVE", "0") != "1"


def _compiler() -> Optional[str]:
    for cand in (os.environ.get("CC"), (sysconfig.get_config_var("CC") or "").split(" ")[0],
                 "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so a binary built with -march=native is
    only reused on a CPU that has what it was built for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _cache_dir() -> Path:
    base = os.environ.get("HIPRESS_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "hipress_like")
    return Path(base) / "native"


def _build(cc: str, flags: List[str], target: Path, source: Optional[Path] = None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, str(source or _SOURCE)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _load() -> Optional[ctypes.CDLL]:
    """Build (once per machine and source) and load the library; None if that fails."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _lib = _load_locked()
        except Exception as e:  # a missing or broken toolchain must not break training
            err = getattr(e, "stderr", "") or ""
            _log.warning("native onebit kernels unavailable (%s: %s%s); using the torch "
                         "kernels (same results, slower)", type(e).__name__, e,
                         f"; {err.strip()[-500:]}" if err else "")
            _lib = None
        _tried = True
    return _lib


def _load_locked() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()[:1]
    src = _SOURCE.read_bytes()
    last: Optional[Exception] = None
    for flags in (_FLAGS, _FALLBACK_FLAGS):
        key = hashlib.sha256(b"\0".join([src, cc.encode(), " ".join(flags).encode(),
                                         "".join(version).encode(),
                                         _cpu_flags().encode()])).hexdigest()[:20]
        target = _cache_dir() / f"onebit_{key}.so"
        try:
            if not target.exists():
                _build(cc, flags, target)
            return _declare(ctypes.CDLL(str(target)))
        except (subprocess.CalledProcessError, OSError) as e:
            last = e  # e.g. a compiler without -march=native: try the portable flags
    assert last is not None
    raise last


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    f32 = ctypes.c_float
    lib.hp_onebit_pack.argtypes = [p, p, p, i64, i64, i64, i32, p]
    lib.hp_onebit_pack.restype = ctypes.c_uint32
    lib.hp_onebit_sums.argtypes = [p, i64, i64, f32, p]
    lib.hp_onebit_sums.restype = None
    lib.hp_onebit_unpack.argtypes = [p, p, i64, i64, i64, i32, f32, f32, i32]
    lib.hp_onebit_unpack.restype = None
    lib.hp_onebit_unpack_add_many.argtypes = [p, p, i32, p, i64, i64, i64, i32]
    lib.hp_onebit_unpack_add_many.restype = None
    u32 = ctypes.c_uint32
    lib.hp_natural_encode_fast.argtypes = [p, p, p, i64, i64, i64, u32, i32, i32, p]
    lib.hp_natural_encode_fast.restype = None
    lib.hp_natural_rebase.argtypes = [p, i64, i64, i32]
    lib.hp_natural_rebase.restype = None
    lib.hp_natural_emax.argtypes = [p, i64, i64, i64, u32, i32, i32]
    lib.hp_natural_emax.restype = ctypes.c_int32
    lib.hp_natural_encode.argtypes = [p, p, p, i64, i64, i64, u32, i32, i32, i32]
    lib.hp_natural_encode.restype = None
    lib.hp_natural_decode.argtypes = [p, p, p, i64, i64, i64, i32, i32, f32, i32]
    lib.hp_natural_decode.restype = None
    lib.hp_thc_rht.argtypes = [p, p, i64, p, u32, i64, i64, i64]
    lib.hp_thc_rht.restype = None
    lib.hp_thc_fwht.argtypes = [p, i64, i64, i64]
    lib.hp_thc_fwht.restype = None
    lib.hp_thc_merge_b4w8.argtypes = [p, i32, p, i32, p, p, i64, i64, i64]
    lib.hp_thc_merge_b4w8.restype = i32
    lib.hp_bloom_query.argtypes = [p, i64, p, p, i32, i32, u32, u32, i64, i64, i64, p, i64]
    lib.hp_bloom_query.restype = i64
    lib.hp_bloom_conflict_blocks.argtypes = [p, p, p, p, i64, i64, i32, u32, u32, u32, p, p,
                                             i32]
    lib.hp_bloom_conflict_blocks.restype = i32
    lib.hp_bloom_build.argtypes = [p, i64, i32, p, p, i32, u32, u32, p]
    lib.hp_bloom_build.restype = None
    lib.hp_abs_at_least.argtypes = [p, i64, i64, f32, p, i64]
    lib.hp_abs_at_least.restype = i64
    lib.hp_psgd_form_m.argtypes = [p, p, p, p, i32, p, i32, p, p, i64, i64, i64]
    lib.hp_psgd_form_m.restype = None
    lib.hp_psgd_lowrank.argtypes = [p, p, i32, p, i64, i64, i64]
    lib.hp_psgd_lowrank.restype = None
    return lib


def build_shared(source_text: str, name: str,
                 extra_flags: Sequence[str] = ()) -> Tuple[ctypes.CDLL, bool]:
    """Build C ``source_text`` into a shared library with this module's compiler, flags
    (plus ``extra_flags``, e.g. ``-fopenmp``) and hash-keyed cache, and load it
    (generated code: CompLL's C renderer).

    Returns:
        (the loaded library, True when it came from the cache).

    Raises:
        RuntimeError: no C compiler; subprocess.CalledProcessError: it does not compile
            with either flag set (the error's stderr has the compiler's message).
    """
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()[:1]
    last: Optional[Exception] = None
    for flags in (_FLAGS + list(extra_flags), _FALLBACK_FLAGS + list(extra_flags)):
        key = hashlib.sha256(b"\0".join([source_text.encode(), cc.encode(),
                                         " ".join(flags).encode(), "".join(version).encode(),
                                         _cpu_flags().encode()])).hexdigest()[:20]
        target = _cache_dir() / f"{name}_{key}.so"
        hit = target.exists()
        try:
            if not hit:
                src = _cache_dir() / f"{name}_{key}.c"
                src.parent.mkdir(parents=True, exist_ok=True)
                src.write_text(source_text)
                _build(cc, flags, target, src)
            return ctypes.CDLL(str(target)), hit
        except (subprocess.CalledProcessError, OSError) as e:
            last = e
    assert last is not None
    raise last


def available() -> bool:
    """True when the native kernels are enabled and built (building them on first call)."""
    return _enabled() and _load() is not None


def usable(*tensors: torch.Tensor, dtypes=(torch.float32, torch.uint8)) -> bool:
    """True when ``tensors`` may take the native path: all contiguous, of ``dtypes``
    (default float32 values or uint8 payload bodies), on the CPU, and the library
    is available."""
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in dtypes:
            return False
    return available()


# ---------------------------------------------------------------- threading

def _ranges(m: int, n: int) -> List[Tuple[int, int]]:
    """Byte ranges [j0, j1) of m full bytes, one per thread for large n."""
    if m == 0:
        return [(0, 0)]
    threads = torch.get_num_threads() if n >= PARALLEL_NUMEL else 1
    threads = max(1, min(threads, m // 4096 or 1))
    step = -(-m // threads)
    step += -step % 64  # whole cache lines of bytes per range
    return [(j, min(m, j + step)) for j in range(0, m, step)]


def _map(fn, ranges: Sequence[Tuple[int, int]]) -> list:
    """``fn(j0, j1, last)`` over ranges; the first on this thread, the rest on the pool."""
    global _pool, _pool_size
    if len(ranges) == 1:
        return [fn(*ranges[0], True)]
    with _lock:
        if _pool is None or _pool_size < len(ranges) - 1:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool_size = len(ranges) - 1
            _pool = ThreadPoolExecutor(_pool_size, thread_name_prefix="hipress-native")
        pool = _pool
    last = len(ranges) - 1
    futs = [pool.submit(fn, j0, j1, i == last) for i, (j0, j1) in enumerate(ranges) if i]
    first = fn(*ranges[0], last == 0)
    return [first] + [f.result() for f in futs]


# ---------------------------------------------------------------- kernels

def _bits_to_float(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


def onebit_pack(x: torch.Tensor, body: torch.Tensor, grad: Optional[torch.Tensor] = None,
                residual: Optional[Tuple[float, float]] = None) -> torch.Tensor:
    """Pack the sign bits of flat float32 ``x`` into ``body``; return max|x| as a
    float32 0-d tensor (NaN/Inf propagate).

    With ``grad``, ``x += grad`` first (stored back); with ``residual`` =
    (a, b) as well, ``x -= (a if x >= 0 else b)`` before that (float32 values).
    """
    if residual is not None and grad is None:
        raise ValueError("onebit_pack: a residual is only taken out together with grad")
    lib = _load()
    n = x.numel()
    xp, bp = x.data_ptr(), body.data_ptr()
    gp = grad.data_ptr() if grad is not None else None
    res = (ctypes.c_float * 2)(*residual) if residual is not None else None
    parts = _map(lambda j0, j1, last: lib.hp_onebit_pack(xp, gp, bp, n, j0, j1, int(last), res),
                 _ranges(n // 8, n))
    return torch.tensor(_bits_to_float(max(parts)), dtype=torch.float32)


def sums_scale_ok(scale: float) -> bool:
    """True when onebit's fixed-point ``scale`` is a float32 normal number, which
    ``onebit_sums`` needs (it is, unless max|x| is below ~1e-32)."""
    return 2.0 ** -126 <= scale <= 2.0 ** 127


def onebit_sums(x: torch.Tensor, scale: float) -> Tuple[int, int, int]:
    """onebit's exact fixed-point sums of flat float32 ``x`` (``_fused._onebit_sums_fn``):
    (sum of rint(x*scale) over x >= 0, over all, count of x >= 0), as integers.

    ``x`` must be finite, ``scale`` a power of two passing ``sums_scale_ok``
    with max|x| * scale <= 2**20 (how ``_fused._onebit_values`` picks it).
    """
    lib = _load()
    n = x.numel()
    xp = x.data_ptr()

    def part(j0, j1, last):
        res = (ctypes.c_int64 * 3)()
        lib.hp_onebit_sums(xp, j0 * 8, n if last else j1 * 8, scale, res)
        return res[0], res[1], res[2]

    parts = _map(part, _ranges(n // 8, n))
    return tuple(sum(p[i] for p in parts) for i in range(3))


def onebit_unpack(body: torch.Tensor, out: torch.Tensor, a: float, b: float,
                  add: bool) -> None:
    """``out = a where the bit is 1 else b`` (or ``out +=`` that, when ``add``), flat float32."""
    lib = _load()
    n = out.numel()
    bp, op = body.data_ptr(), out.data_ptr()
    _map(lambda j0, j1, last: lib.hp_onebit_unpack(bp, op, n, j0, j1, int(add), a, b, int(last)),
         _ranges(n // 8, n))


def onebit_unpack_add_many(bodies: Sequence[torch.Tensor], out: torch.Tensor,
                           values: Sequence[Tuple[float, float]]) -> None:
    """``out += decode(body_i)`` for each i in order (``values[i]`` = (a_i, b_i)), flat float32."""
    lib = _load()
    n = out.numel()
    count = len(bodies)
    ptrs = (ctypes.c_void_p * count)(*[bd.data_ptr() for bd in bodies])
    vals = (ctypes.c_float * (2 * count))(*[v for ab in values for v in ab])
    op = out.data_ptr()
    _map(lambda j0, j1, last: lib.hp_onebit_unpack_add_many(ptrs, vals, count, op, n, j0, j1,
                                                            int(last)),
         _ranges(n // 8, n))


# ---------------------------------------------------------------- natural compression

def natural_encode(x: torch.Tensor, signs: torch.Tensor, codes: torch.Tensor, key: int,
                   cap: int) -> Optional[int]:
    """C_nat of flat float32 ``x`` (natural.py defines the rules): the sign plane into
    ``signs`` (ceil(n/8) bytes) and one exponent code per element into ``codes``
    (n bytes), from the hash stream keyed by ``key``, output exponents capped at
    ``cap``. Returns the base exponent, or None when ``x`` holds a NaN or an Inf
    (the bytes are then garbage).

    One sweep over ``x`` writes each element's output exponent and finds their
    maximum (the base), a byte-wide sweep turns exponents into codes. An input
    with a subnormal number takes two general sweeps instead (max, then codes).
    """
    lib = _load()
    n = x.numel()
    xp, sp, cp = x.data_ptr(), signs.data_ptr(), codes.data_ptr()
    key &= 0xFFFFFFFF
    ranges = _ranges(n // 8, n)

    def fast(j0, j1, last):
        st = (ctypes.c_uint32 * 3)()
        lib.hp_natural_encode_fast(xp, sp, cp, n, j0, j1, key, cap, int(last), st)
        return st[0], st[1], st[2]

    parts = _map(fast, ranges)
    if max(p[0] for p in parts) >= 0x7F800000:
        return None
    if min(p[1] for p in parts) >= 0x7FFFFF:  # no subnormal: exponents are exact
        base = max(p[2] for p in parts)
        _map(lambda j0, j1, last: lib.hp_natural_rebase(cp, j0 * 8, n if last else j1 * 8,
                                                        base), ranges)
        return base
    emax = max(_map(lambda j0, j1, last: lib.hp_natural_emax(xp, n, j0, j1, key, cap,
                                                             int(last)), ranges))
    base = emax if emax > -(1 << 31) else 0
    _map(lambda j0, j1, last: lib.hp_natural_encode(xp, sp, cp, n, j0, j1, key, base, cap,
                                                    int(last)), ranges)
    return base


def natural_decode(signs: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, base: int,
                   mode: str, d: float = 1.0) -> None:
    """``out = v``, ``out += v`` or ``out = v / d`` (``mode`` "set", "add", "div") for
    the C_nat values v of a payload, flat float32 ``out``."""
    lib = _load()
    n = out.numel()
    sp, cp, op = signs.data_ptr(), codes.data_ptr(), out.data_ptr()
    mcode = {"set": 0, "add": 1, "div": 2}[mode]
    _map(lambda j0, j1, last: lib.hp_natural_decode(sp, cp, op, n, j0, j1, base, mcode, d,
                                                    int(last)),
         _ranges(n // 8, n))


# ---------------------------------------------------------------- THC

def _rows(rows: int, size: int) -> List[Tuple[int, int]]:
    """Row ranges [r0, r1), one per thread when the rows are many."""
    threads = torch.get_num_threads() if rows * size >= PARALLEL_NUMEL else 1
    threads = max(1, min(threads, rows))
    step = -(-rows // threads)
    return [(r, min(rows, r + step)) for r in range(0, rows, step)] or [(0, 0)]


def thc_rht(x: torch.Tensor, y: torch.Tensor, size: int, scale: torch.Tensor, key: int,
            first: int) -> None:
    """``y = H D (x * scale[row])`` per row of ``size`` floats (THC Sec. 5.1), unnormalised:
    flat float32 ``x`` and ``y`` of rows * size elements, float32 ``scale`` per row, D's
    signs from ``key`` with elements numbered from ``first`` (``thc_kernels._rademacher``). The
    floats equal ``thc_kernels._fwht_rows``' butterfly path."""
    lib = _load()
    rows = x.numel() // size
    xp, yp, sp = x.data_ptr(), y.data_ptr(), scale.data_ptr()
    key &= 0xFFFFFFFF
    _map(lambda r0, r1, last: lib.hp_thc_rht(xp, yp, size, sp, key, first, r0, r1),
         _rows(rows, size))


def thc_fwht(y: torch.Tensor, size: int) -> None:
    """``y = H y`` in place per row of ``size`` floats (flat float32), unnormalised."""
    lib = _load()
    yp = y.data_ptr()
    _map(lambda r0, r1, last: lib.hp_thc_fwht(yp, size, r0, r1), _rows(y.numel() // size, size))


def thc_merge_b4w8(indices: Sequence[torch.Tensor], sums: Sequence[torch.Tensor],
                   table: torch.Tensor, out: torch.Tensor, m: int) -> None:
    """THC's round-1 merge for 4-bit indices into 8-bit sums (thc.py ``merge_round``):
    ``out`` (two arrays of ``m`` int32 words) = sum over ``indices`` (m words each) of
    ``table[z]`` per field, plus ``sums`` (two arrays of m words each, width 8). Every
    sum must fit 8 bits (the caller checked N g <= 255); ``table`` is 16 uint8 values."""
    lib = _load()
    ip = (ctypes.c_void_p * max(1, len(indices)))(*[t.data_ptr() for t in indices])
    sp = (ctypes.c_void_p * max(1, len(sums)))(*[t.data_ptr() for t in sums])
    tp, op = table.data_ptr(), out.data_ptr()
    ni, ns = len(indices), len(sums)
    threads = torch.get_num_threads() if m * 8 >= PARALLEL_NUMEL else 1
    step = -(-m // max(1, threads))
    step += -step % 8  # whole vectors of words per thread
    ranges = [(j, min(m, j + step)) for j in range(0, m, step)] or [(0, 0)]
    _map(lambda j0, j1, last: lib.hp_thc_merge_b4w8(ip, ni, sp, ns, tp, op, m, j0, j1), ranges)


# ---------------------------------------------------------------- top-k's filter

def abs_at_least_indices(x: torch.Tensor, t: float, cap: int) -> Tuple[torch.Tensor, int]:
    """Sorted int64 positions of flat float32 ``x`` where ``|x| >= t`` (NaN never).

    One pass instead of ``ops.abs_at_least`` and ``torch.nonzero`` (two bool
    tensors and a scan); split over threads by element ranges for a large ``x``.

    Returns:
        (at most ``cap`` positions, how many there are in all, which may
        exceed ``cap``: call again with that count).
    """
    lib = _load()
    n, xp = x.numel(), x.data_ptr()
    ranges = [(j0 * 16, min(n, j1 * 16)) for j0, j1 in _ranges(-(-n // 16), n)]
    bufs = {r: torch.empty(max(1, cap), dtype=torch.int64) for r in ranges}
    found = _map(lambda i0, i1, last: int(lib.hp_abs_at_least(
        xp, i0, i1, t, bufs[(i0, i1)].data_ptr(), cap)), ranges)
    total = sum(found)
    if total > cap:
        return bufs[ranges[0]][:0], total
    return torch.cat([bufs[r][:c] for r, c in zip(ranges, found)]), total


# ---------------------------------------------------------------- Bloom filters

def _block_ranges(weights: torch.Tensor, n: int) -> List[Tuple[int, int]]:
    """Block ranges [b0, b1), one per thread for a large universe, of similar weight."""
    nb = weights.numel()
    threads = torch.get_num_threads() if n >= PARALLEL_NUMEL else 1
    threads = max(1, min(threads, nb))
    if threads == 1:
        return [(0, nb)]
    cum = torch.cumsum(weights.to(torch.float64), 0)
    total = float(cum[-1]) if nb else 0.0
    cuts = [0] + [int(torch.searchsorted(cum, total * t / threads)) + 1
                  for t in range(1, threads)] + [nb]
    cuts = sorted(set(min(max(c, 0), nb) for c in cuts))
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a] or [(0, nb)]


def bloom_build(x: torch.Tensor, log2u: int, mb: torch.Tensor, off: torch.Tensor, nbytes: int,
                nh: int, s1: int, s2: int) -> torch.Tensor:
    """The ``nbytes`` filter bytes of int64 ``x`` (``bloom.build_filter``'s bits)."""
    lib = _load()
    x, mb, off = x.contiguous(), mb.contiguous(), off.contiguous()
    filt = torch.zeros(nbytes, dtype=torch.uint8)
    lib.hp_bloom_build(x.data_ptr(), x.numel(), log2u, mb.data_ptr(), off.data_ptr(), nh,
                       s1 & 0xFFFFFFFF, s2 & 0xFFFFFFFF, filt.data_ptr())
    return filt


def bloom_query(filt: torch.Tensor, log2u: int, mb: torch.Tensor, off: torch.Tensor, nh: int,
                s1: int, s2: int, n: int, cap: int) -> Tuple[torch.Tensor, int]:
    """Positives of blocked Bloom filters over the universe [0, n) (``bloom.query``).

    Args:
        filt: the filters' bytes (uint8, contiguous, CPU); ``log2u``, ``mb``
            (bits per block), ``off`` (byte offset per block) their layout.
        nh, s1, s2: probes and hash seeds.
        n: the universe size (below 2**32).
        cap: at most this many positives are returned.

    Returns:
        (sorted int64 positives, at most ``cap`` of them; how many there are
        in all, which may exceed ``cap``).
    """
    lib = _load()
    mb, off, filt = mb.contiguous(), off.contiguous(), filt.contiguous()
    ranges = _block_ranges((mb > 0).to(torch.int64), n)
    bufs = {r: torch.empty(max(1, cap), dtype=torch.int64) for r in ranges}
    fp, mp, op = filt.data_ptr(), mb.data_ptr(), off.data_ptr()
    found = _map(lambda b0, b1, last: int(lib.hp_bloom_query(
        fp, filt.numel(), mp, op, log2u, nh, s1 & 0xFFFFFFFF, s2 & 0xFFFFFFFF, n, b0, b1,
        bufs[(b0, b1)].data_ptr(), cap)), ranges)
    kept = [bufs[r][: min(c, cap)] for r, c in zip(ranges, found)]
    return torch.cat(kept)[:cap], sum(found)


def bloom_conflict_blocks(cand: torch.Tensor, cstart: torch.Tensor, mb: torch.Tensor,
                          rb: torch.Tensor, sel: torch.Tensor, nh: int, s1: int, s2: int,
                          kseed: int, rounds: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """bloom.py's "conflict" rounds in every block (``bloom._conflict``, the same selection).

    Args:
        cand: sorted int64 positives; cstart: (B + 1) offsets of each block's
            candidates; mb, rb: bits and positions per block.
        sel: bool preselection (not modified).
        nh, s1, s2: probes and seeds; kseed: the keys' seed; rounds: the cap;
        n: the universe size (threads are used for a large one).

    Returns:
        (the bool selection after the rounds, the int64 keys ``hash32(cand, kseed)``).

    Raises:
        MemoryError: the workspaces could not be allocated.
    """
    lib = _load()
    cand, cstart = cand.contiguous(), cstart.contiguous()
    mb, rb = mb.contiguous(), rb.contiguous()
    flags = sel.to(torch.uint8).contiguous()
    key = torch.empty(cand.numel(), dtype=torch.int64)
    ptrs = (cand.data_ptr(), cstart.data_ptr(), mb.data_ptr(), rb.data_ptr())
    ranges = _block_ranges(cstart[1:] - cstart[:-1], n)
    done = _map(lambda b0, b1, last: int(lib.hp_bloom_conflict_blocks(
        *ptrs, b0, b1, nh, s1 & 0xFFFFFFFF, s2 & 0xFFFFFFFF, kseed & 0xFFFFFFFF,
        key.data_ptr(), flags.data_ptr(), rounds)), ranges)
    if min(done) < 0:
        raise MemoryError(f"bloom conflict policy: no memory for {cand.numel()} candidates")
    return flags.to(torch.bool), key


# ---------------------------------------------------------------- PowerSGD

#: The largest rank (and pending rank) ``psgd_form_m`` takes.
PSGD_MAX_RANK = 8


def psgd_form_m(e: torch.Tensor, g: torch.Tensor, p_prev: Optional[torch.Tensor],
                qt_prev: Optional[torch.Tensor], qt: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """PowerSGD's round 0 into a second buffer: ``out = (g + e) - P' Q'^T`` with the
    bits of ``_fused_lowrank``'s pointwise formula, written with streaming stores,
    and ``P = out Q`` returned (rows, rank) from the same sweep (``_native.c``
    says why). All contiguous float32 (rows, cols) / (rows, r') / (r', cols) /
    (rank, cols) on the CPU, ranks at most ``PSGD_MAX_RANK``."""
    lib = _load()
    rows, cols = out.shape
    rank = int(qt.shape[0])
    prev = 0 if p_prev is None else int(p_prev.shape[1])
    p = torch.empty(rows, rank, dtype=torch.float32)
    ep, gp, qtp, op, pp = e.data_ptr(), g.data_ptr(), qt.data_ptr(), out.data_ptr(), p.data_ptr()
    ppp = p_prev.data_ptr() if prev else None
    qpp = qt_prev.data_ptr() if prev else None
    _map(lambda r0, r1, last: lib.hp_psgd_form_m(ep, gp, ppp, qpp, prev, qtp, rank, op, pp,
                                                  cols, r0, r1), _rows(rows, cols))
    return p


def psgd_lowrank(p: torch.Tensor, qt: torch.Tensor, out: torch.Tensor) -> None:
    """PowerSGD's decode ``out = P Q^T`` with the bits of ``_fused_lowrank``'s
    outer-product sum, written with streaming stores: contiguous float32 (rows, r),
    (r, cols) and (rows, cols) on the CPU, r at least 1."""
    lib = _load()
    rows, cols = out.shape
    rank = int(p.shape[1])
    pp, qtp, op = p.data_ptr(), qt.data_ptr(), out.data_ptr()
    _map(lambda r0, r1, last: lib.hp_psgd_lowrank(pp, qtp, rank, op, cols, r0, r1),
         _rows(rows, cols))
