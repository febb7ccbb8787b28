"""The DSL column of ``bench/compressors.py``: generated C beside the hand-written kernels.

For a row of a hand-written compressor that has a shipped CompLL program,
``add_column`` registers the program (``<name>_dsl``), checks once that both
give the same payload, and times both in the same run, interleaved with a
memory copy (copy, hand-written encode, DSL encode, hand-written decode into
a buffer, DSL decode into it; medians). ``format_table`` lays out the ratios
(DSL speed / hand-written speed) with the issue's goals (>= 0.8 for onebit,
TBQ, TernGrad; >= 0.5 for DGC, GradDrop), the C compile time and whether
the build came from the cache.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

import torch

from . import PROGRAMS, program_path

__all__ = ["add_column", "format_table", "GOALS"]

GOALS = {"onebit": 0.8, "tbq": 0.8, "terngrad": 0.8, "dgc": 0.5, "graddrop": 0.5}


def _once(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median(xs: List[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def add_column(row: Dict[str, Any], repeats: int) -> None:
    """Time the DSL version of ``row``'s compressor and add ``row["dsl"]`` (no-op without one)."""
    import hipress_like as hp
    name = row["name"]
    if name not in PROGRAMS or not program_path(name).exists():
        return
    key = f"{name}_dsl"
    t0 = time.perf_counter()
    cls = hp.compressors.register_dsl(program_path(name), name=key, replace=True)
    # a hand-written option left at None (DGC's clip_norm) is one the program does not have
    params = {k: v for k, v in row["params"].items() if v is not None}
    h, d = hp.compressors.get(name, **params), hp.compressors.get(key, **params)
    nat = d._native()
    load_s = time.perf_counter() - t0
    n = row["numel"]
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    src, dst, out = torch.randn(n), torch.empty(n), torch.empty(n)
    sh, sd = h.init(g, seed=0), d.init(g, seed=0)
    ph, _ = h.encode(g, sh)
    pd, _ = d.encode(g, sd)
    same = bool(torch.equal(ph, pd))
    h.decode(ph, out=out)
    d.decode(pd, out=out)
    t: Dict[str, List[float]] = {k: [] for k in ("copy", "eh", "ed", "dh", "dd")}
    for _ in range(repeats):
        t["copy"].append(_once(lambda: dst.copy_(src)))
        t["eh"].append(_once(lambda: h.encode(g, sh)))
        t["ed"].append(_once(lambda: d.encode(g, sd)))
        t["dh"].append(_once(lambda: h.decode(ph, out=out)))
        t["dd"].append(_once(lambda: d.decode(pd, out=out)))
    m = {k: _median(v) for k, v in t.items()}
    row["dsl"] = {
        "program": str(program_path(name)), "equal_bytes": same,
        "backend": "c" if nat is not None else "interpreter",
        "compile_s": getattr(nat, "compile_s", None), "cache_hit": getattr(nat, "cache_hit", None),
        "load_s": load_s, "copy_s": m["copy"],
        "encode_hand_s": m["eh"], "encode_dsl_s": m["ed"],
        "decode_hand_s": m["dh"], "decode_dsl_s": m["dd"],
        "encode_ratio": m["eh"] / m["ed"], "decode_ratio": m["dh"] / m["dd"],
        "goal": GOALS.get(name), "class": cls.__name__,
    }


def format_table(results: List[Dict[str, Any]]) -> str:
    """The DSL rows of ``results`` (those ``add_column`` filled) as a text table ("" if none)."""
    rows = [r for r in results if "dsl" in r]
    if not rows:
        return ""
    lines = ["", "CompLL DSL (generated C) vs hand-written, same run, interleaved; ratio = DSL "
             "speed / hand-written speed (goal in brackets)",
             f"{'name':<10} {'MB':>5} {'bytes':>6} {'enc hand':>9} {'enc dsl':>8} {'ratio':>6} "
             f"{'dec hand':>9} {'dec dsl':>8} {'ratio':>6} {'compile':>8} {'cache':>6}"]
    for r in rows:
        x = r["dsl"]
        goal = x["goal"]
        ok = ("" if goal is None else
              " PASS" if min(x["encode_ratio"], x["decode_ratio"]) >= goal else " FAIL")
        comp = "-" if x["compile_s"] is None else f"{x['compile_s']:.2f}s"
        lines.append(
            f"{r['name']:<10} {r['size_mb']:>5g} {'same' if x['equal_bytes'] else 'DIFF':>6} "
            f"{x['encode_hand_s'] * 1e3:>7.2f}ms {x['encode_dsl_s'] * 1e3:>6.2f}ms "
            f"{x['encode_ratio']:>6.2f} {x['decode_hand_s'] * 1e3:>7.2f}ms "
            f"{x['decode_dsl_s'] * 1e3:>6.2f}ms {x['decode_ratio']:>6.2f} {comp:>8} "
            f"{'hit' if x['cache_hit'] else 'miss':>6} [{goal}]{ok}")
    return "\n".join(lines)
