"""Encode/decode speed of every registered compressor, as ratios to a memory copy.

The physical limit of a memory-bound compressor on this hardware is a plain
memory copy of the same bytes (DESIGN.md, "Where to measure"), so every
time is reported next to ``dst.copy_(src)`` of the gradient, measured in the
same run and interleaved with the compressor (each repeat times the copy,
then encode, then decode), and medians are compared.

For each compressor in ``hipress_like.compressors.available()`` (aliases
skipped) and each size (default 1, 16 and 64 MB of float32), it prints
GB/s of gradient processed, the compression ratio (payload / gradient
bytes) and the ratio to the copy. ``decode`` returns a fresh tensor, and
for 64 MB the page faults of that allocation alone cost several copies
(see ``clone`` in the table); compressors whose ``decode`` takes ``out=``
are also timed decoding into a reused buffer (``dec->out``), the speed of
the kernel itself.

The sparse codecs (issue 25) have rows of their own, top-k 1% with another
index or value codec: ``topk+rle``, ``topk+bloom`` (fp-aware, conflict
sets), ``topk+bloom-random``, ``topk+curvefit`` and ``topk+bloom+curvefit``
(``bench/sparse_codecs.py`` measures the codecs alone, their bits and
policy error rates).

PowerSGD (rank 4, a 4096 x 4096 matrix) is timed through its two rounds
(encode_round 0, merge, encode_round 1, merge, decode_rounds into the
gradient buffer, world size 1, state carried across repeats as in
training) and compared with its own linear algebra alone: ``M @ Q``,
``orthogonalize(P)``, ``M^T @ P`` and the decompression ``P Q^T``
(ops.matmul, ops.orthogonalize_); the goal uses all three matmuls, and
the ratio without the decompression is printed too. The rounds compute two
of those products in fused kernels (``P = M Q`` in the sweep that forms M;
``P Q^T`` as a pointwise sum of outer products, faster than ``torch.mm``
here); a third ratio, informational, replaces the baseline's ``P Q^T``
matmul by that faster kernel, so it shows what error feedback and the
protocol cost on top of the fastest products this library has. The
CompLL program (``powersgd.compll``, generated C) runs the same rounds
in the same run, interleaved: its DSL column (speed ratio to the
hand-written rounds; its results equal within a float tolerance, not
bytes: docs/compll.md).

Goals (printed as pass/fail): at 64 MB, onebit/tbq/terngrad encode and
decode >= 0.30x copy; natural (C_nat) encode and decode >= 0.50x copy;
topk/dgc/graddrop and topk+bloom >= 0.05x copy; PowerSGD rounds <= 1.2x its matmuls and
orthogonalisation. natural_dithering and dithering (torch only) are measured
without a goal.

    .venv/bin/python bench/compressors.py                       # everything
    .venv/bin/python bench/compressors.py --only onebit,tbq --sizes 64 --repeats 9
    .venv/bin/python bench/compressors.py --quick               # 3 repeats, 1 and 64 MB
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hipress_like.compressors as C  # noqa: E402
from hipress_like.compressors import ops  # noqa: E402
from hipress_like.compressors.compll import bench as dsl_bench  # noqa: E402
from hipress_like.compressors.powersgd import lowrank  # noqa: E402
from hipress_like.compressors.registry import _REGISTRY  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a dev dependency
    tqdm = None

MB = 1 << 20
QUANT_GOAL = 0.30     # x copy, onebit/tbq/terngrad at 64 MB (issue goal)
NATURAL_GOAL = 0.50   # x copy, natural (C_nat) at 64 MB, single thread (issue goal)
SPARSE_GOAL = 0.05    # x copy, topk/dgc/graddrop at 64 MB
POWERSGD_GOAL = 1.2   # x its own matmuls + orthogonalisation
QUANTIZERS = ("onebit", "tbq", "terngrad")
GOALS = {**{q: QUANT_GOAL for q in QUANTIZERS}, "natural": NATURAL_GOAL}
SPARSIFIERS = ("topk", "dgc", "graddrop", "topk+bloom")
# sparse codec rows (issue 25): label -> (compressor, parameters)
CODEC_ROWS: Dict[str, Any] = {
    "topk+rle": ("topk", {"index_codec": "rle"}),
    "topk+bloom": ("topk", {"index_codec": "bloom"}),
    "topk+bloom-random": ("topk", {"index_codec": "bloom", "policy": "random"}),
    "topk+curvefit": ("topk", {"value_codec": "curvefit"}),
    "topk+bloom+curvefit": ("topk", {"index_codec": "bloom", "value_codec": "curvefit"}),
}


def distinct_names() -> List[str]:
    """Registered names without aliases (the first name of each factory)."""
    seen, out = set(), []
    for name in C.available():
        f = _REGISTRY.get(name)
        key = id(f) if f is not None else name
        if key in seen:
            continue
        seen.add(key)
        out.append(name)
    return out


def median(xs: List[float]) -> float:
    return statistics.median(xs)


def time_once(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def takes_out(c: Any) -> bool:
    """Whether ``c.decode`` accepts ``out=`` (decode into a reused buffer)."""
    try:
        return "out" in inspect.signature(c.decode).parameters
    except (TypeError, ValueError):
        return False


def _make(name: str) -> Any:
    """The compressor of a row: a registered name with defaults, or a codec row."""
    if name in CODEC_ROWS:
        base, params = CODEC_ROWS[name]
        return C.get(base, **params)
    return C.get(name)


def bench_single(name: str, size_mb: float, repeats: int) -> Dict[str, Any]:
    """Time encode/decode of one single-round compressor on a float32 gradient."""
    n = int(size_mb * MB) // 4
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    src, dst = torch.randn(n), torch.empty(n)
    c = _make(name)
    state = c.init(g, seed=0)
    payload, _ = c.encode(g, state)        # warm-up: compiles kernels, fills caches
    out = c.decode(payload)
    into = takes_out(c)
    if into:
        c.decode(payload, out=out)
    clone_t, copy_t, enc_t, dec_t, into_t = [], [], [], [], []
    for _ in range(repeats):
        copy_t.append(time_once(lambda: dst.copy_(src)))
        enc_t.append(time_once(lambda: c.encode(g, state)))
        dec_t.append(time_once(lambda: c.decode(payload)))
        if into:
            into_t.append(time_once(lambda: c.decode(payload, out=out)))
        clone_t.append(time_once(lambda: src.clone()))
    copy = median(copy_t)
    res = {
        "name": name, "params": c.params(), "size_mb": size_mb, "numel": n,
        "payload_bytes": int(payload.numel()), "ratio": payload.numel() / (4.0 * n),
        "copy_s": copy, "clone_s": median(clone_t), "encode_s": median(enc_t),
        "decode_s": median(dec_t), "decode_out_s": median(into_t) if into else None,
        "encode_min_s": min(enc_t), "decode_min_s": min(dec_t), "copy_min_s": min(copy_t),
        "repeats": repeats,
    }
    res["encode_x_copy"] = copy / res["encode_s"]
    res["decode_x_copy"] = copy / res["decode_s"]
    res["decode_out_x_copy"] = copy / res["decode_out_s"] if into else None
    res["clone_x_copy"] = copy / res["clone_s"]
    return res


def bench_powersgd(repeats: int, rows: int = 4096, cols: int = 4096,
                   rank: int = 4) -> Dict[str, Any]:
    """PowerSGD's two rounds against its linear algebra alone (Vogels et al. 2019, Alg. 1-2).

    The rounds run as the engine runs them in training: one state carried
    from step to step (error buffer and warm-start Q), the result decoded
    into the gradient's buffer (``out=``). The baseline is PowerSGD's own
    linear algebra through the same operators: ``M @ Q``, ``orth(P)``,
    ``M^T @ P`` and (``linalg_with_decompress``) the decompression
    ``P Q^T`` into a buffer. What the rounds add on top is error feedback
    (``M = g + e``, ``e = M - P Q^T / N``, two passes over the matrix),
    the warm start's orthogonalisation and payload packing.
    """
    c = C.get("powersgd", rank=rank)
    m = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(m)
    st = [c.init(m, seed=0, world_size=1)]

    def rounds() -> None:
        p0, s = c.encode_round(0, m, st[0], None)
        p1, s = c.encode_round(1, m, s, c.merge([p0]))
        _, st[0] = c.decode_rounds(m, s, c.merge([p1]), out=out)

    # the DSL column: the CompLL program's rounds (generated C) run the same way
    d = C.get("powersgd.compll", rank=rank)  # compll/__init__.PROGRAMS
    sd = [d.init(m, seed=0, world_size=1)]

    def dsl_rounds() -> None:
        p0, s = d.encode_round(0, m, sd[0], None)
        p1, s = d.encode_round(1, m, s, d.merge([p0]))
        _, sd[0] = d.decode_rounds(m, s, d.merge([p1]), out=out, average=True)

    q0 = torch.randn(cols, rank)

    def linalg() -> None:
        p = ops.matmul(m, q0)
        ops.orthogonalize_(p)
        ops.matmul(m.t(), p)

    def linalg_full() -> None:  # plus the decompression P Q^T the rounds also do
        p = ops.matmul(m, q0)
        ops.orthogonalize_(p)
        q = ops.matmul(m.t(), p)
        ops.matmul(p, q.t(), out=out)

    def linalg_kernel() -> None:  # the decompression through the rounds' own kernel
        p = ops.matmul(m, q0)
        ops.orthogonalize_(p)
        q = ops.matmul(m.t(), p)
        lowrank.powersgd_lowrank(p, q.t().contiguous(), out)

    fns = (rounds, linalg, linalg_full, linalg_kernel, dsl_rounds)
    for f in fns:
        f()
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for f, t in zip(fns, times):
            t.append(time_once(f))
    rt, lt, lft, lkt, dt = (median(t) for t in times)
    res = {"name": "powersgd", "rank": rank, "shape": [rows, cols], "rounds_s": rt,
           "linalg_s": lt, "linalg_with_decompress_s": lft,
           "linalg_with_kernel_decompress_s": lkt, "repeats": repeats}
    res["x_linalg"] = rt / lt
    res["x_linalg_with_decompress"] = rt / lft
    res["x_linalg_with_kernel_decompress"] = rt / lkt
    res["dsl_rounds_s"], res["dsl_ratio"] = dt, rt / dt  # DSL speed / hand-written speed
    return res


def fmt_row(r: Dict[str, Any]) -> str:
    gbs = lambda s: 4.0 * r["numel"] / s / 1e9
    into = (f"{r['decode_out_x_copy']:6.2f}" if r["decode_out_x_copy"] is not None
            else "     -")
    return (f"{r['name']:<19} {r['size_mb']:>5g} {r['ratio']:>7.4f} "
            f"{gbs(r['copy_s']):>6.1f} {gbs(r['encode_s']):>6.2f} {r['encode_x_copy']:>6.2f} "
            f"{gbs(r['decode_s']):>6.2f} {r['decode_x_copy']:>6.2f} {into} "
            f"{r['clone_x_copy']:>6.2f}")


def goals(results: List[Dict[str, Any]], psgd: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Evaluate the speed goals on the largest measured size (64 MB when measured)."""
    out = []
    by_name: Dict[str, Dict[str, Any]] = {}
    for r in results:
        if r["name"] not in by_name or r["size_mb"] > by_name[r["name"]]["size_mb"]:
            by_name[r["name"]] = r
    for name, r in sorted(by_name.items()):
        if name in GOALS or name in SPARSIFIERS:
            goal = GOALS.get(name, SPARSE_GOAL)
            dec = r["decode_out_x_copy"] if r["decode_out_x_copy"] is not None \
                else r["decode_x_copy"]
            dec_kind = "decode->out" if r["decode_out_x_copy"] is not None else "decode"
            out.append({"what": f"{name} encode @{r['size_mb']:g}MB", "value": r["encode_x_copy"],
                        "goal": f">= {goal}x copy", "pass": r["encode_x_copy"] >= goal})
            out.append({"what": f"{name} {dec_kind} @{r['size_mb']:g}MB", "value": dec,
                        "goal": f">= {goal}x copy", "pass": dec >= goal})
    if psgd is not None:
        # its own matmuls are M Q, M^T P and the decompression P Q^T
        v = psgd["x_linalg_with_decompress"]
        out.append({"what": "powersgd rounds vs its matmuls (MQ, M^T P, P Q^T) + orth",
                    "value": v, "goal": f"<= {POWERSGD_GOAL}x", "pass": v <= POWERSGD_GOAL})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,16,64", help="gradient sizes in MB (float32)")
    ap.add_argument("--only", default="", help="comma-separated compressor names")
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats (median)")
    ap.add_argument("--quick", action="store_true", help="3 repeats, sizes 1 and 64 MB")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--out", default=os.path.join("results", "compressors.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [float(s) for s in args.sizes.split(",") if s]
    repeats = args.repeats
    if args.quick:
        repeats, sizes = 3, [1.0, 64.0]
    names = distinct_names() + list(CODEC_ROWS)
    if args.only:
        wanted = [s.strip().lower() for s in args.only.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in C.available() and w not in CODEC_ROWS]
        if unknown:
            ap.error(f"unknown compressor(s) {unknown}; available: "
                     f"{', '.join(C.available() + list(CODEC_ROWS))}")
        names = [n for n in names if n in wanted] or wanted
    single = [n for n in names if _make(n).capabilities.rounds == 1]
    multi = [n for n in names if n not in single]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; compressors: {', '.join(names)}; "
          f"sizes {sizes} MB; {repeats} repeats (median)")
    tasks = [(n, s) for n in single for s in sizes]
    it = tqdm(tasks, desc="compressors", unit="case") if tqdm else tasks
    results: List[Dict[str, Any]] = []
    for name, size in it:
        if tqdm:
            it.set_postfix_str(f"{name} {size:g}MB")
        try:
            results.append(bench_single(name, size, repeats))
            dsl_bench.add_column(results[-1], repeats)  # the CompLL program, same run
        except Exception as e:  # report and go on: one broken compressor must not hide the rest
            print(f"\n{name} @{size:g}MB failed: {type(e).__name__}: {e}", file=sys.stderr)
    psgd = None
    if "powersgd" in multi:
        print("powersgd: 4096x4096, rank 4 ...", flush=True)
        psgd = bench_powersgd(repeats)
    skipped = [n for n in multi if n != "powersgd"]

    print()
    print("GB/s = gradient bytes / time; x copy = copy time / time (higher is better); "
          "clone = fresh-allocation copy")
    print(f"{'name':<19} {'MB':>5} {'ratio':>7} {'copy':>6} {'enc':>6} {'xcopy':>6} "
          f"{'dec':>6} {'xcopy':>6} {'dec->o':>6} {'clone':>6}")
    print(f"{'':<19} {'':>5} {'':>7} {'GB/s':>6} {'GB/s':>6} {'':>6} {'GB/s':>6} {'':>6} "
          f"{'xcopy':>6} {'xcopy':>6}")
    for r in results:
        print(fmt_row(r))
    table = dsl_bench.format_table(results)
    if table:
        print(table)
    if psgd is not None:
        print(f"powersgd rank {psgd['rank']} on {psgd['shape'][0]}x{psgd['shape'][1]}: two rounds "
              f"{psgd['rounds_s'] * 1e3:.1f} ms; M@Q + orth(P) + M^T@P alone "
              f"{psgd['linalg_s'] * 1e3:.1f} ms -> {psgd['x_linalg']:.2f}x "
              f"(with the P Q^T decompression in the baseline: "
              f"{psgd['x_linalg_with_decompress']:.2f}x as torch.mm, "
              f"{psgd['x_linalg_with_kernel_decompress']:.2f}x as the rounds' pointwise kernel)")
        print(f"powersgd.compll (CompLL, generated C; equal within 1e-4, not bytes): two rounds "
              f"{psgd['dsl_rounds_s'] * 1e3:.1f} ms -> {psgd['dsl_ratio']:.2f}x the hand-written "
              "speed")
    if skipped:
        print(f"not measured (multi-round, no benchmark recipe): {', '.join(skipped)}")
    g = goals(results, psgd)
    print("goals: " + "; ".join(f"{x['what']} {x['value']:.2f} ({x['goal']}) "
                                f"{'PASS' if x['pass'] else 'FAIL'}" for x in g))
    report = {
        "meta": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                 "machine": platform.machine(), "processor": platform.processor(),
                 "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "sizes_mb": sizes, "repeats": repeats,
                 "no_compile": os.environ.get("HIPRESS_NO_COMPILE", "0") == "1"},
        "results": results, "powersgd": psgd, "goals": g,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
