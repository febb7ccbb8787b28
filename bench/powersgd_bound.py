"""How close to the no-communication floor PowerSGD can get at all (issue 19's floor goal).

The idea: with one core per rank, everything a compressor does runs on the
core that also runs backward, so a step can be no shorter than the compute
plus the compressor's own arithmetic, however well communication and the
engine are hidden. This script times both on one thread in one process:

1. the floor: the model's training step (forward, backward, SGD with
   momentum) on a batch of 8 32x32 images, as bench/train.py's floor row;
2. PowerSGD's work per step on the gradients the engine compresses
   (``SizeRule``, the rule ``plan=None`` runs), each as one matrix: round 0 (``M = g + e - P'Q'^T``,
   ``P = M Q``), round 1 (orthogonalise, ``Q = M^T P``) and the decode
   (``P Q^T`` into the gradient), with one rank (N = 1: no exchange);
3. the NaN/Inf scan the engine runs on each submitted gradient
   (``compressors.base.all_finite``).

It prints ``(floor + PowerSGD) / floor``, a lower bound on the best
PowerSGD row's ``x floor`` in ``bench/train.py --nprocs 2``, and writes
results/powersgd_bound.json.

    python bench/powersgd_bound.py --model vgg --rank 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))


def main(argv=None) -> int:
    """Time the floor step, PowerSGD's work and the scan; print the ratio; write JSON."""
    import torch
    from models import MODELS

    from hipress_like.compressors.base import all_finite
    from hipress_like.compressors.powersgd.powersgd import PowerSGD
    from hipress_like.cost_model.plan import SizeRule
    from hipress_like.tuning.profiler import _time

    def median_ms(fn):
        return _time(fn, ns.steps, 0.0) * 1e3

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="vgg")
    ap.add_argument("--rank", type=int, default=1, help="PowerSGD's rank (default 1)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "powersgd_bound.json"))
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)  # a rank of bench/train.py runs one thread
    torch.manual_seed(0)
    model = MODELS[ns.model](num_classes=10, in_channels=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x, y = torch.randn(8, 1, 32, 32), torch.randint(0, 10, (8,))

    def floor_step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    floor = median_ms(floor_step)
    rule = SizeRule()  # two ranks, as --nprocs 2
    weights = [(n, p) for n, p in model.named_parameters()
               if rule.decide(p.numel() * p.element_size(), 2).compress]
    grads = [torch.randn_like(p) for _, p in weights]
    comp = PowerSGD(rank=ns.rank)
    states = [comp.init(g, world_size=1) for g in grads]

    def powersgd_step():
        for i, g in enumerate(grads):
            p0, st = comp.encode_round(0, g, states[i], None)
            p1, st = comp.encode_round(1, g, st, p0)  # N = 1: the sum is the payload
            _, states[i] = comp.decode_rounds(g, st, p1, out=g, average=True)

    psgd = median_ms(powersgd_step)
    scan = median_ms(lambda: [all_finite(g) for g in grads])
    mb = sum(g.numel() * g.element_size() for g in grads) / 1e6
    print(f"{ns.model}, one thread: floor step {floor:.1f} ms; PowerSGD rank {ns.rank} on "
          f"{len(grads)} gradients ({mb:.0f} MB) {psgd:.1f} ms; NaN/Inf scan {scan:.1f} ms")
    print(f"  (floor + PowerSGD) / floor          {(floor + psgd) / floor:.2f}")
    print(f"  (floor + PowerSGD + scan) / floor   {(floor + psgd + scan) / floor:.2f}")
    print("  a lower bound on a PowerSGD row's 'x floor' with a core per rank (--nprocs 2)")
    os.makedirs(os.path.dirname(ns.out), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump({"model": ns.model, "rank": ns.rank, "floor_ms": floor, "powersgd_ms": psgd,
                   "scan_ms": scan, "weights": [n for n, _ in weights], "megabytes": mb,
                   "bound": (floor + psgd) / floor,
                   "bound_with_scan": (floor + psgd + scan) / floor}, f, indent=1)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
