"""THC's encode and aggregator merge speed, as ratios measured in the same run.

Encode: both rounds a worker runs (round 0: the per-block norms or ranges;
round 1: transform, quantize, pack; world size 1, so the merged range is
the worker's own), for a float32 gradient of ``--mb`` MB, with and without
the randomized Hadamard transform, against ``dst.copy_(src)`` of the same
tensor. Each repeat times the copy, then the compressor (interleaved), and
medians are compared. Compilation happens in a warm-up call first.

Merge: the aggregator's ``merge_round(1)`` of N index payloads (a PS
aggregator) and of [partial sum, own indices] (a Ring hop), against what
onebit's aggregator does with the same gradient size: decode-add the N
payloads into a float32 buffer (``kernels.decode_add_many_``) and encode
the sum (``encode``), its decode-merge-encode. Both are per byte of
gradient, so the ratio is the time ratio.

Goals (issue): encode with transform >= 0.1x copy, without >= 0.3x; merge
<= 0.3x onebit's decode-merge-encode.

    .venv/bin/python bench/thc_speed.py                # 64 MB, N = 4, 7 repeats
    .venv/bin/python bench/thc_speed.py --mb 16 --ranks 8 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hipress_like.compressors as C  # noqa: E402
from hipress_like.compressors.thc.thc import THC  # noqa: E402

ENCODE_GOAL = {True: 0.1, False: 0.3}  # x copy, with / without the transform
MERGE_GOAL = 0.3  # x onebit's decode-merge-encode


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns: List[Callable[[], Any]], repeats: int) -> List[float]:
    """Median seconds of each function, timed round-robin ``repeats`` times."""
    for f in fns:
        f()  # warm-up: compilation, workspaces
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for t, f in zip(times, fns):
            t.append(_time(f))
    return [statistics.median(t) for t in times]


def bench_encode(x: torch.Tensor, transform: bool, repeats: int) -> None:
    c = THC(transform=transform)
    st = c.init(x, seed=1, world_size=1, shared_seed=3)
    dst = torch.empty_like(x)
    out = {}

    def round0() -> None:
        out["p0"] = c.merge_round(0, [c.encode_round(0, x, st, None)[0]])

    def round1() -> None:
        out["p1"] = c.encode_round(1, x, st, out["p0"])[0]

    def both() -> None:
        round0()
        round1()

    copy, t0, t1, tb = interleaved([lambda: dst.copy_(x), round0, round1, both], repeats)
    ratio = copy / tb
    goal = ENCODE_GOAL[transform]
    print(f"encode transform={transform!s:5}  copy {copy * 1e3:6.1f} ms | round 0 "
          f"{t0 * 1e3:6.1f} ms, round 1 {t1 * 1e3:6.1f} ms, both {tb * 1e3:6.1f} ms "
          f"({x.numel() * 4 / tb / 1e9:.2f} GB/s) = {ratio:.3f}x copy "
          f"[goal >= {goal}x: {'pass' if ratio >= goal else 'FAIL'}]")


def bench_merge(x: torch.Tensor, ranks: int, repeats: int) -> None:
    c = THC()
    gs = [x * (1 + 0.1 * r) for r in range(ranks)]
    sts = [c.init(g, seed=r, world_size=ranks, shared_seed=3) for r, g in enumerate(gs)]
    rng = c.merge_round(0, [c.encode_round(0, g, s, None)[0] for g, s in zip(gs, sts)])
    idx = [c.encode_round(1, g, s, rng)[0] for g, s in zip(gs, sts)]
    partial = c.merge_round(1, idx[:-1])
    ob = C.get("onebit")
    obp = [ob.encode(g, ob.init(g, seed=r))[0] for r, g in enumerate(gs)]
    acc = torch.empty_like(x)
    ob_st = ob.init(x)

    def onebit_dme() -> None:  # decode-merge-encode at a PS aggregator
        acc.zero_()
        ob.kernels.decode_add_many_(obp, acc)
        ob.encode(acc, ob_st)

    def onebit_hop() -> None:  # a Ring hop: decode one payload, add, encode
        acc.copy_(x)
        ob.kernels.decode_add_(obp[0], acc)
        ob.encode(acc, ob_st)

    t_ps, t_hop, t_ob, t_obhop = interleaved(
        [lambda: c.merge_round(1, idx), lambda: c.merge_round(1, [partial, idx[-1]]),
         onebit_dme, onebit_hop], repeats)
    for what, t, base in ((f"PS merge of {ranks} index payloads", t_ps, t_ob),
                          ("Ring hop [partial sum, indices]", t_hop, t_obhop)):
        r = t / base
        print(f"{what:36} {t * 1e3:7.1f} ms vs onebit decode-merge-encode "
              f"{base * 1e3:7.1f} ms = {r:.3f}x [goal <= {MERGE_GOAL}x: "
              f"{'pass' if r <= MERGE_GOAL else 'FAIL'}]")
    dec = torch.empty_like(x)
    st1 = c.encode_round(1, gs[0], sts[0], rng)[1]
    total = c.merge_round(1, idx)
    copy, t_dec = interleaved([lambda: dec.copy_(x),
                               lambda: c.decode_rounds(gs[0], st1, total, out=dec,
                                                       average=True)], repeats)
    print(f"decode_rounds (transform, into a buffer) {t_dec * 1e3:7.1f} ms = "
          f"{copy / t_dec:.3f}x copy (no goal)")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="gradient size (float32 MB)")
    ap.add_argument("--ranks", type=int, default=4, help="N payloads merged at a PS")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    n = int(args.mb * (1 << 20)) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    print(f"THC b=4 g=30 p=1/32, {args.mb:g} MB float32 ({n} elements), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    for transform in (True, False):
        bench_encode(x, transform, args.repeats)
    bench_merge(x, args.ranks, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
