"""How close to the no-communication floor PowerSGD can get at all (issue 19's floor goal).

A thin alias of ``bench/bound.py`` (issue 50 generalised it to every
configuration): the bound of the ``hp-<strategy>-powersgd<R>`` row at world
size N, i.e. the floor step plus PowerSGD's rounds, merges and decode that one
rank does per step (``bound.rank_ops``), plus the NaN/Inf scan the default
non-finite mode needs, all on one thread. Prints ``(floor + PowerSGD) /
floor`` and the same with the scan, lower bounds on the row's ``x floor`` in
``bench/train.py --nprocs N`` with a core per rank, and writes
results/powersgd_bound.json with the fields it always had.

    python bench/powersgd_bound.py --model vgg --rank 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bound  # noqa: E402


def main(argv=None) -> int:
    """Time the floor step, PowerSGD's work and the scan; print the ratio; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["vgg", "resnet18"], default="vgg")
    ap.add_argument("--rank", type=int, default=1, help="PowerSGD's rank (default 1)")
    ap.add_argument("--strategy", choices=["ps", "ring"], default="ring")
    ap.add_argument("--nprocs", type=int, default=2, help="world size N (default 2)")
    ap.add_argument("--steps", type=int, default=8, help="timed repetitions (median)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "powersgd_bound.json"))
    ns = ap.parse_args(argv)
    config = f"hp-{ns.strategy}-powersgd{ns.rank}"
    b = bound.Bounds(ns.model, ns.steps)
    r = b.bound(config, ns.nprocs)
    floor, scan = r["floor_ms"], r["scan_ms"]
    psgd = r["arith_ms"] - r["lane"]  # PowerSGD's own arithmetic, not the small gradients'
    mb = sum(g.numel() * g.element_size() for n, g in b.grads if n in r["compressed"]) / 1e6
    print(f"{ns.model}, one thread, {config} at N={ns.nprocs}: floor step {floor:.1f} ms; "
          f"PowerSGD on {len(r['compressed'])} gradients ({mb:.0f} MB) {psgd:.1f} ms; "
          f"small gradients' allreduce {r['lane']:.1f} ms; NaN/Inf scan {scan:.1f} ms")
    print(f"  (floor + PowerSGD) / floor          {(floor + psgd) / floor:.2f}")
    print(f"  (floor + PowerSGD + scan) / floor   {(floor + psgd + scan) / floor:.2f}")
    print(f"  a lower bound on the row's 'x floor' with a core per rank (--nprocs {ns.nprocs})")
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump({"model": ns.model, "rank": ns.rank, "config": config, "nprocs": ns.nprocs,
                   "floor_ms": floor, "powersgd_ms": psgd, "scan_ms": scan,
                   "weights": sorted(r["compressed"]), "megabytes": mb,
                   "bound": (floor + psgd) / floor,
                   "bound_with_scan": (floor + psgd + scan) / floor, "row": r}, f, indent=1)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
