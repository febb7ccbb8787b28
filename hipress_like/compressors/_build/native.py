"""The shared builder of the compressors' native CPU loops: compile, cache, load.

Idea: CompLL's point (HiPress Sec. 4.3) is that an encoder must run at
memory speed or it eats the time compression saves. ``torch.compile``
(``_build/fused.py``) gets most loops there, but not the ones that mix a byte
stream with several float planes, a hash per element, or streaming stores.
Those loops are a few lines each, so each algorithm writes them once in C, in
its own folder (``onebit/onebit.c``, ``natural/natural.c``, ``thc/thc.c``,
``powersgd/powersgd.c``, ``sparse/bloom.c``, ``sparse/topk.c``, ``sparse/accumulate.c``; each module's
``native.py`` says why its loops are in C). This module compiles every
``*.c`` file of the algorithm folders, with the shared header
``_build/hp_native.h``, into one shared library on first use and loads it
through ``ctypes``, which releases the GIL for the length of a call (the
engine's other threads keep running, as with inductor's ``cpp_wrapper``).
Each algorithm's Python binds its own functions: it hands ``bind`` a function
that declares their argument types, applied to the library when it loads.

Contract: same bytes and floats as the torch kernels, for every input (each
``.c`` file says how; ``tests/unit/test_native*.py`` check it against the
eager path). Used only for contiguous float32 CPU tensors; everything else,
and every machine without a working C compiler, keeps the torch path.
``HIPRESS_NO_NATIVE=1`` turns it off.

Build: ``$CC`` (else Python's configured compiler, else ``cc``) with ``-O3
-march=native -ffp-contract=off``, into ``$HIPRESS_CACHE_DIR`` (default
``~/.cache/hipress_like``), named by a hash of the sources, the compiler, the
flags and the CPU's feature flags, so a cache shared between different
machines never runs code built for another CPU. Ranks that start together
race harmlessly: each builds into its own temporary file and renames it into
place. One failed build logs one warning and the process stays on torch.

Threads: one call is split into ``torch.get_num_threads()`` byte ranges run
on a small thread pool when the tensor is large (``ranges``, ``rows``,
``parallel``), so a process that gives torch several cores gets them here too.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["PARALLEL_NUMEL", "available", "bind", "build_shared", "load", "parallel",
           "ranges", "rows", "sources", "usable"]

_log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_HEADER = _HERE / "hp_native.h"
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu99"]
_FALLBACK_FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu99"]

#: Below this many elements a call runs on the calling thread only.
PARALLEL_NUMEL = 1 << 20

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_tried = False
_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0
_binders: List[Callable[[ctypes.CDLL], None]] = []


def sources() -> List[Path]:
    """The algorithms' C files: every ``*.c`` in a folder of ``compressors/``, sorted."""
    return sorted(_HERE.parent.glob("*/*.c"))


def bind(declare: Callable[[ctypes.CDLL], None]) -> None:
    """Have ``declare(lib)`` set the argument and result types of an algorithm's
    functions when the library loads (at once, when it is loaded already).

    Args:
        declare: sets ``lib.<function>.argtypes`` and ``.restype`` for the
            functions of one algorithm's C file.
    """
    with _lock:
        _binders.append(declare)
        lib = _lib
    if lib is not None:
        declare(lib)


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


def _build(cc: str, flags: List[str], target: Path,
           srcs: Optional[Sequence[Path]] = None) -> None:
    """Compile ``srcs`` (default: every family's kernels, ``sources()``) into ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        files = list(srcs) if srcs is not None else sources()
        subprocess.run([cc, *flags, "-I", str(_HERE), "-o", tmp, *map(str, files)],
                       check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
                _build(cc, flags, target, [src])
            return ctypes.CDLL(str(target)), hit
        except (subprocess.CalledProcessError, OSError) as e:
            last = e
    assert last is not None
    raise last


def load() -> Optional[ctypes.CDLL]:
    """Build (once per machine and sources) and load the library; None if that fails."""
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
            _log.warning("native compressor kernels unavailable (%s: %s%s); using the torch "
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
    src = b"\0".join([_HEADER.read_bytes()] + [f.name.encode() + b"\0" + f.read_bytes()
                                                for f in sources()])
    last: Optional[Exception] = None
    for flags in (_FLAGS, _FALLBACK_FLAGS):
        key = hashlib.sha256(b"\0".join([src, cc.encode(), " ".join(flags).encode(),
                                         "".join(version).encode(),
                                         _cpu_flags().encode()])).hexdigest()[:20]
        target = _cache_dir() / f"kernels_{key}.so"
        try:
            if not target.exists():
                _build(cc, flags, target)
            lib = ctypes.CDLL(str(target))
            for declare in _binders:
                declare(lib)
            return lib
        except (subprocess.CalledProcessError, OSError) as e:
            last = e  # e.g. a compiler without -march=native: try the portable flags
    assert last is not None
    raise last


def available() -> bool:
    """True when the native kernels are enabled and built (building them on first call)."""
    return _enabled() and load() is not None


def usable(*tensors: torch.Tensor, dtypes=(torch.float32, torch.uint8)) -> bool:
    """True when ``tensors`` may take the native path: all contiguous, of ``dtypes``
    (default float32 values or uint8 payload bodies), on the CPU, and the library
    is available."""
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in dtypes:
            return False
    return available()


# ---------------------------------------------------------------- threading

def ranges(m: int, n: int) -> List[Tuple[int, int]]:
    """Byte ranges [j0, j1) of m full bytes, one per thread for large n."""
    if m == 0:
        return [(0, 0)]
    threads = torch.get_num_threads() if n >= PARALLEL_NUMEL else 1
    threads = max(1, min(threads, m // 4096 or 1))
    step = -(-m // threads)
    step += -step % 64  # whole cache lines of bytes per range
    return [(j, min(m, j + step)) for j in range(0, m, step)]


def rows(nrows: int, size: int) -> List[Tuple[int, int]]:
    """Row ranges [r0, r1) of ``nrows`` rows of ``size`` floats, one per thread
    when the rows are many."""
    threads = torch.get_num_threads() if nrows * size >= PARALLEL_NUMEL else 1
    threads = max(1, min(threads, nrows))
    step = -(-nrows // threads)
    return [(r, min(nrows, r + step)) for r in range(0, nrows, step)] or [(0, 0)]


def parallel(fn, parts: Sequence[Tuple[int, int]]) -> list:
    """``fn(j0, j1, last)`` over ``parts``; the first on this thread, the rest on the pool."""
    global _pool, _pool_size
    if len(parts) == 1:
        return [fn(*parts[0], True)]
    with _lock:
        if _pool is None or _pool_size < len(parts) - 1:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool_size = len(parts) - 1
            _pool = ThreadPoolExecutor(_pool_size, thread_name_prefix="hipress-native")
        pool = _pool
    last = len(parts) - 1
    futs = [pool.submit(fn, j0, j1, i == last) for i, (j0, j1) in enumerate(parts) if i]
    first = fn(*parts[0], last == 0)
    return [first] + [f.result() for f in futs]


