"""PowerSGD's products on a GPU in the lane order (``powersgd.cu`` through cupy).

Idea: cuBLAS sums in an order of its own choosing, so on a GPU the hand-written
PowerSGD would give other bits than its CPU kernels and than the CompLL
program's generated CUDA. These kernels take every sum in the lane order
(``compll/matrices.py``; ``native.py`` on the CPU): round 0's M (elementwise)
and ``P = M Q``, round 1's ``Q = M^T P`` and Gram-Schmidt. ``lowrank.py`` uses
them for contiguous float32 CUDA tensors when cupy imports (``available``);
without cupy the products stay on torch's cuBLAS (the same values to rounding).
They run on torch's current stream. ``bench/gpu_check.py`` checks them on a GPU;
``tests/unit/test_native_powersgd.py`` compile-checks the source with ``nvcc -ptx``.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = ["SOURCE", "available", "usable", "launch_shape", "psgd_form_m", "psgd_mq",
           "psgd_mtp", "psgd_orthogonalize"]

#: The kernels' source file.
SOURCE = Path(__file__).with_name("powersgd.cu")
_OPTIONS = ("-std=c++17", "--fmad=false")

_lock = threading.Lock()
_mod: Optional[Any] = None
_tried = False


def available() -> bool:
    """True when cupy imports and the kernels compile (compiled on the first call);
    ``HIPRESS_NO_NATIVE=1`` turns them off as it does the CPU kernels."""
    global _mod, _tried
    if os.environ.get("HIPRESS_NO_NATIVE"):
        return False
    with _lock:
        if not _tried:
            _tried = True
            try:
                import cupy
                src = SOURCE.read_text()
                try:
                    mod = cupy.RawModule(code=src, options=_OPTIONS)
                    mod.get_function("psgd_mq")
                except Exception:  # NVRTC refused it: nvcc, where it exists
                    mod = cupy.RawModule(code=src, options=_OPTIONS, backend="nvcc")
                    mod.get_function("psgd_mq")
                _mod = mod
            except Exception:
                _mod = None
        return _mod is not None


def usable(*tensors: Optional[torch.Tensor]) -> bool:
    """All given tensors (None skipped) are contiguous float32 CUDA tensors on one
    device, and the kernels are available."""
    ts = [t for t in tensors if t is not None]
    if not ts or any(t.device.type != "cuda" or t.dtype != torch.float32
                     or not t.is_contiguous() or t.device != ts[0].device for t in ts):
        return False
    return available()


def launch_shape(name: str, rows: int, cols: int, rank: int = 1) -> tuple:
    """``(grid, block)`` of kernel ``name`` for a (rows, cols) matrix (``powersgd.cu``
    says what a block holds): one place for the launches and the tests' CPU emulation."""
    if name == "psgd_form_m":
        return (min(-(-rows * cols // 256), 65535 * 8),), (256,)
    if name == "psgd_mq":
        return (-(-rows // 8),), (8 * rank, 8)
    if name == "psgd_mtp":
        return (-(-cols // 32),), (32, 8)
    if name == "psgd_orthogonalize":
        return (1,), (256,)
    raise ValueError(f"no kernel {name!r} in {SOURCE.name}")


def _launch(name: str, grid: tuple, block: tuple, *args: Any) -> None:
    import cupy as cp
    conv = [cp.asarray(a) if isinstance(a, torch.Tensor) else a for a in args]
    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        _mod.get_function(name)(grid, block, tuple(conv))


def _i64(x: int) -> Any:
    import cupy as cp
    return cp.int64(x)


def _i32(x: int) -> Any:
    import cupy as cp
    return cp.int32(x)


def psgd_form_m(e: torch.Tensor, g: torch.Tensor, p_prev: Optional[torch.Tensor],
                qt_prev: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """``out = g + (e - P' Q'^T)`` (or ``g + e`` without pending factors), elementwise,
    the outer products summed as ``lowrank._outer_sum``; ``out`` may be ``e``."""
    rows, cols = out.shape
    prev = 0 if p_prev is None else int(p_prev.shape[1])
    n = rows * cols
    if n == 0:
        return
    with torch.cuda.device(out.device):
        _launch("psgd_form_m", *launch_shape("psgd_form_m", rows, cols), e, g,
                p_prev if prev else e, qt_prev if prev else e, _i32(prev), out, _i64(rows),
                _i64(cols))


def psgd_mq(m: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """``P = M Q`` (rows, rank) from ``m`` (rows, cols) and ``qt`` (rank, cols), rank at
    most ``native.PSGD_MAX_RANK``."""
    rows, cols = m.shape
    rank = int(qt.shape[0])
    p = torch.empty(rows, rank, dtype=torch.float32, device=m.device)
    if rows and rank:
        with torch.cuda.device(m.device):
            _launch("psgd_mq", *launch_shape("psgd_mq", rows, cols, rank), m, qt, _i32(rank), p,
                    _i64(rows), _i64(cols))
    return p


def psgd_mtp(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``Q = M^T P`` (cols, rank) from ``m`` (rows, cols) and ``p`` (rows, rank), rank at
    most ``native.PSGD_MAX_RANK``."""
    rows, cols = m.shape
    rank = int(p.shape[1])
    q = torch.empty(cols, rank, dtype=torch.float32, device=m.device)
    if cols and rank:
        with torch.cuda.device(m.device):
            _launch("psgd_mtp", *launch_shape("psgd_mtp", rows, cols, rank), m, p, _i32(rank), q,
                    _i64(rows), _i64(cols))
    return q


def psgd_orthogonalize(a: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``a`` (rows, cols), in place; returns ``a``."""
    rows, cols = a.shape
    if rows and cols:
        d = torch.empty(cols, dtype=torch.float32, device=a.device)
        with torch.cuda.device(a.device):
            _launch("psgd_orthogonalize", *launch_shape("psgd_orthogonalize", rows, cols), a,
                    _i64(rows), _i64(cols), d)
    return a

