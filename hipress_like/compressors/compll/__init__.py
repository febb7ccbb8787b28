"""CompLL's DSL (HiPress Sec. 4.3): compression algorithms in a few lines, compiled.

A program (``*.compll``) states an algorithm's encode and decode over the
common operators (map, reduce, concat, extract, random) and user functions
on one element; ``register_dsl`` makes it a compressor with no integration
code. Pipeline, one module each:

    syntax.py    compll.lark -> nodes with line/column; located syntax errors
    checker.py   names, arity, types, bit widths; located type errors
    interp.py    the reference interpreter on torch tensors (the tests' oracle)
    arrays.py    the sparsification operators (filter, topk, threshold, gather,
                 scatter), state arrays and data-dependent payloads: their meaning
    render_c.py  C for CPUs, built by the native builder, cached by source hash
    render_seq.py   C for programs with state arrays / sparse operators
    render_cuda.py  CUDA C for GPUs (cupy.RawModule), compile-checked by nvcc
    render_cuda_seq.py  CUDA for state-array programs (compile-checked; no runner yet)
    matrices.py  round programs (@rounds(k)): matrix views, matmul, orthogonalize
    render_rounds.py, render_cuda_rounds.py  C and CUDA for round programs
    rounds_compressor.py  the MultiRoundCompressor of round programs (PowerSGD)
    compressor.py   DslCompressor and register_dsl
    sparse_compressor.py  the compressor of state-array programs (DGC, GradDrop)
    cli.py       ``hipress-profile compll check|build|show FILE``

The six HiPress algorithms ship as programs beside their hand-written
versions (onebit/onebit.compll, quantizers/tbq.compll, sparse/dgc.compll,
powersgd/powersgd.compll, ...); ``PROGRAMS`` maps their names to paths.
docs/compll.md is the guide.
"""
from __future__ import annotations

from pathlib import Path

from . import (
    rounds_compressor,  # noqa: F401  (registers the round program class)
    sparse_compressor,  # noqa: F401  (registers the state-array program class)
)
from .checker import check
from .compressor import DslCompressor, load, register_dsl
from .syntax import CompllError, parse

__all__ = ["CompllError", "DslCompressor", "PROGRAMS", "check", "load", "parse",
           "register_dsl", "program_path"]

_ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = {
    "onebit": ("onebit", "onebit.compll"),
    "tbq": ("quantizers", "tbq.compll"),
    "terngrad": ("quantizers", "terngrad.compll"),
    "dgc": ("sparse", "dgc.compll"),
    "graddrop": ("sparse", "graddrop.compll"),
    "powersgd": ("powersgd", "powersgd.compll"),
}


def program_path(name: str) -> Path:
    """The shipped program of algorithm ``name`` (a key of ``PROGRAMS``)."""
    folder, fname = PROGRAMS[name]
    return _ROOT / folder / fname
