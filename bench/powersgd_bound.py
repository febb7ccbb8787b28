"""How close to the no-communication floor PowerSGD can get at all (issue 19's floor goal).

A thin alias of ``bench/bound.py`` (issue 50 generalised it to every
configuration): the bound of the ``hp-<strategy>-powersgd<R>`` row at world
size N, i.e. the floor step plus PowerSGD's rounds, merges and decode that one
rank does per step (``bound.rank_ops``), plus the NaN/Inf scan the default
non-finite mode needs, all on one thread. Prints ``(floor + PowerSGD) /
floor`` and the same with the scan, lower bounds on the row's ``x floor`` in
``bench/train.py --nprocs N`` with a core per rank, and writes
results/powersgd_bound.json with the fields it always had.

It also times, in the same run and on the same thread, the memory traffic
PowerSGD's arithmetic is judged against (issue 50, item 2): over buffers of
the compressed gradients' sizes, ``torch.add(g, e, out=m)`` (two reads of a
gradient-sized matrix and one write: forming ``M = g + e``) and a memcpy,
each the fastest of the repetitions, and prints PowerSGD's arithmetic over
each. What one step of PowerSGD moves at least (``lowrank.py``,
``powersgd.c``): round 0 reads the gradient and the previous ``M`` (the
error feedback, kept in factored form) and writes ``M`` with ``P = M Q`` in
the same sweep; ``P`` is summed over the ranks before it is orthogonalised,
so round 1's ``Q = M^T P_hat`` reads ``M`` again; the decode writes ``P Q^T``
into the gradient: three reads and two writes, against the two reads and
one write of the yardstick, so a kernel at the memory's speed sits near
5/3 of it (``passes_floor`` printed beside). With ``--error-dtype bfloat16`` M
is stored in 16 bits: the previous M, the new M and round 1's read of it move
half the bytes, two reads and one and a half writes in all.

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


def memory_traffic(grads, repeats: int, m_half: bool = False) -> dict:
    """On one thread, over float32 buffers of the sizes of ``grads``, the fastest of
    ``repeats`` timings of ``M = g + e`` (``torch.add``: two reads, one write), of a
    memcpy (one read, one write) and of ``P Q^T``'s write alone (``fill_``), in ms;
    ``passes_floor``: PowerSGD's three reads and two writes (two and one and a half
    with ``m_half``, M in bfloat16) over the yardstick's two and one, at the speeds
    just measured (read = form - fill, write = fill)."""
    import torch

    torch.set_num_threads(1)
    bufs = [tuple(torch.randn(g.numel()) for _ in range(3)) for g in grads]

    def form():
        for g, e, m in bufs:
            torch.add(g, e, out=m)

    def copy():
        for g, _, m in bufs:
            m.copy_(g)

    def fill():
        for _, _, m in bufs:
            m.fill_(1.0)

    form_ms, copy_ms, fill_ms = (bound._fastest_ms(f, repeats) for f in (form, copy, fill))
    read_ms = max(0.0, (form_ms - fill_ms) / 2)
    return {"form_ms": form_ms, "copy_ms": copy_ms, "fill_ms": fill_ms,
            "passes_floor": ((2 if m_half else 3) * read_ms
                             + (1.5 if m_half else 2) * fill_ms) / form_ms}


def main(argv=None) -> int:
    """Time the floor step, PowerSGD's work and the scan; print the ratio; write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["vgg", "resnet18"], default="vgg")
    ap.add_argument("--rank", type=int, default=1, help="PowerSGD's rank (default 1)")
    ap.add_argument("--strategy", choices=["ps", "ring"], default="ring")
    ap.add_argument("--error-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="PowerSGD's error memory (bfloat16: error_dtype='bfloat16')")
    ap.add_argument("--nprocs", type=int, default=2, help="world size N (default 2)")
    ap.add_argument("--steps", type=int, default=8, help="timed repetitions (median)")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "powersgd_bound.json"))
    ns = ap.parse_args(argv)
    config = f"hp-{ns.strategy}-powersgd{ns.rank}" + ("bf" if ns.error_dtype == "bfloat16" else "")
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
    traffic = memory_traffic([g for n, g in b.grads if n in r["compressed"]], ns.steps,
                             m_half=ns.error_dtype == "bfloat16")
    print(f"  memory traffic over the same {mb:.0f} MB: M = g + e (2 reads, 1 write) "
          f"{traffic['form_ms']:.1f} ms, memcpy {traffic['copy_ms']:.1f} ms")
    print(f"  PowerSGD / (2 reads + 1 write)      {psgd / traffic['form_ms']:.2f}   (issue 50 "
          f"item 2: <= 1.3; its passes at memory speed: about "
          f"{traffic['passes_floor']:.2f})")
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump({"model": ns.model, "rank": ns.rank, "config": config, "nprocs": ns.nprocs,
                   "error_dtype": ns.error_dtype,
                   "floor_ms": floor, "powersgd_ms": psgd, "scan_ms": scan,
                   "weights": sorted(r["compressed"]), "megabytes": mb,
                   "bound": (floor + psgd) / floor,
                   "bound_with_scan": (floor + psgd + scan) / floor, "row": r,
                   "traffic": traffic, "powersgd_over_traffic": psgd / traffic["form_ms"]},
                  f, indent=1)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
