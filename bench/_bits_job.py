"""Worker side of ``bench/ab_bits.py``: run every compressor under a fixed plan and
print a digest of the averaged gradients per (compressor, strategy).

Imports ``hipress_like`` from whatever tree is first on ``PYTHONPATH``, so the
same job runs against the previous commit (a temporary worktree) and the
current one. Written against the engine API both sides share.
"""
from __future__ import annotations

import argparse
import hashlib
import json

import torch

SHAPES = [(3,), (64, 33), (40, 40), (128, 20), (257,), (96, 64), (4099,)]


def job(ctx, names):
    """Two steps of every compressor under PS and Ring; digests of the results."""
    from hipress_like.casync.engine import Engine, EngineConfig
    from hipress_like.cost_model.plan import Plan, SizeRule

    out = {}
    for name in names:
        for strategy in ("ps", "ring"):
            plan = Plan(compressor=name, rule=SizeRule(min_compress_bytes=0,
                                                       bytes_per_partition=4096,
                                                       max_partitions=3))
            eng = Engine(ctx.transport, EngineConfig(compressor=None, plan=plan,
                                                     strategy=strategy, timeout=120))
            try:
                eng.register([(f"g{i}", s, torch.float32) for i, s in enumerate(SHAPES)])
                h = hashlib.sha256()
                for step in range(2):
                    g = torch.Generator().manual_seed(1000 * step + ctx.rank)
                    grads = [torch.randn(s, generator=g) for s in SHAPES]
                    for i, t in enumerate(grads):
                        eng.submit(f"g{i}", t)
                    eng.synchronize()
                    for t in grads:
                        h.update(t.numpy().tobytes())
                out[f"{name}/{strategy}"] = h.hexdigest()
            finally:
                eng.close()
    return out


def main() -> None:
    """Run ``job`` on ``--ranks`` gloo ranks and write rank 0's digests to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--names", required=True, help="comma-separated compressor names")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from hipress_like import compressors
    from hipress_like.launch.launch import run_workers

    names = [n for n in a.names.split(",") if n in compressors.available()]
    res = run_workers(job, a.ranks, args=(names,), timeout=900)
    if any(r != res[0] for r in res):
        raise SystemExit("ranks disagree within one run")
    with open(a.out, "w") as f:
        json.dump(res[0], f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
