"""One rank of a Gluon ``plan="adaptive"`` job, for tests/frameworks/test_adaptive_mxnet.py.

The link estimate is injected (``hvd.Adaptive(estimate=fast_slow_fast)``, the
documented test source; it lives here so that every rank's process has it):
fast before step 8, slow for steps 8-15, fast again from 16, as in
tests/multiprocess/test_adaptive_plan.py. The compressor curves come from the
profile file the test wrote (``--profile``). A ``DistributedTrainer`` trains a
36 -> 96 -> 3 network for ``--steps`` steps; after every step each rank records
a digest of its weights, a digest of the engine's plan and the gradients it
compresses, and prints one ``RESULT {json}`` line at the end (with the steps
the planner checked and switched at). ``--save-at K --ckpt DIR`` checkpoints
after step K (the weights by rank 0, the trainer's states with
``all_ranks=True``) and trains on; ``--resume`` starts from that checkpoint at
step K. ``--ratio`` runs AR-Topk's ratio search instead: ``star_topk`` on a slow
link throughout (a profile from ``adaptive_common.ratio_profile``), the candidate
ratios ``adaptive_common.RATIOS`` two steps each, and the ratio on the
compressors recorded after every step.
"""
import argparse
import hashlib
import json
import os

import mxnet as mx
import numpy as np
from adaptive_common import ratio_history  # this job's folder is on sys.path
from mxnet import autograd, gluon

import hipress_like.mxnet as hvd
from hipress_like.cost_model import Link
from hipress_like.tuning.adaptive_cr import AdaptiveCRConfig
from hipress_like.tuning.ratio_search import searchable

FAST = (2e-6, 12.5e9)  # 2 us + 100 Gbit/s
SLOW = (1e-3, 1.25e6)  # 1 ms + 10 Mbit/s
BATCH, FEATURES, CLASSES = 6, 36, 3


def fast_slow_fast(step, rank):
    """The injected link: fast before step 8, slow for steps 8-15, fast again."""
    return Link(*SLOW) if 8 <= step < 16 else Link(*FAST)


def always_slow(step, rank):
    """The injected link of ``--ratio``: slow at every step (the kernel stays compressed)."""
    return Link(*SLOW)


def build_net():
    """36 -> 96 -> 3: one 13.8 KB weight (compressed on the slow link only) and small ones."""
    mx.random.seed(7)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(96, in_units=FEATURES, activation="relu"),
            gluon.nn.Dense(CLASSES, in_units=96))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    return net


def batch(rank, step):
    """This rank's batch of ``step``: a function of the rank and the step only."""
    rng = np.random.default_rng([11, rank, step])
    return (mx.nd.array(rng.standard_normal((BATCH, FEATURES)).astype("float32")),
            mx.nd.array(rng.integers(0, CLASSES, BATCH).astype("float32")))


def digest(net):
    h = hashlib.sha256()
    for _, p in sorted(net._collect_params_with_prefix().items()):
        h.update(p.data().asnumpy().tobytes())
    return h.hexdigest()[:16]


def states_digest(trainer):
    """A digest of Gluon's optimizer states (momentum) and update count."""
    h = hashlib.sha256()
    upd = trainer._updaters[0]
    for k in sorted(upd.states):
        st = upd.states[k]
        for a in (st if isinstance(st, (list, tuple)) else [st]):
            if a is not None:
                h.update(a.asnumpy().tobytes())
    h.update(str(trainer._optimizer.num_update).encode())
    return h.hexdigest()[:16]


def plan_digest(plan):
    text = json.dumps({n: g.to_dict() for n, g in plan.gradients.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--profile", required=True)
    p.add_argument("--compression", default="onebit")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-at", type=int, default=12)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ratio", nargs="*", type=float, default=None,
                   help="AR-Topk's ratio search over these candidate ratios")
    args = p.parse_args()

    hvd.init()
    net = build_net()
    compression = args.compression
    if args.ratio is None:
        settings = hvd.Adaptive(check_every=5, margin=0.1, max_switches=4,
                                profile=args.profile, estimate=fast_slow_fast)
    else:
        compression = hvd.Compression.get("star_topk", ratio=0.1)
        settings = hvd.Adaptive(check_every=4, profile=args.profile, estimate=always_slow,
                                ratio=AdaptiveCRConfig(candidates=tuple(args.ratio),
                                                       explore_iters=2, check_every=50))
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.05, "momentum": 0.9},
                                     compression=compression, plan=settings)
    assert trainer.online is not None, "plan='adaptive' built no online planner"
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    states = os.path.join(args.ckpt or ".", "trainer.states")
    first = 0
    if args.resume:
        net.load_parameters(os.path.join(args.ckpt, "net.params"), ctx=mx.cpu())
        trainer.load_states(states)  # switches to the saved plan, then the compressor state
        first = args.save_at
    else:
        hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    out = {"digests": [], "plans": [], "compressed": [], "ratios": [],
           "opt_digests": []}
    for step in range(first, args.steps):
        x, y = batch(hvd.rank(), step)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(BATCH)
        out["digests"].append(digest(net))
        out["plans"].append(plan_digest(trainer.engine.plan))
        out["compressed"].append(sorted(n for n, d in trainer.engine.layout().items()
                                        if d["compress"]))
        out["opt_digests"].append(states_digest(trainer))
        out["ratios"].append(sorted({c.ratio for c in searchable(trainer.engine)}))
        if args.ckpt and not args.resume and step + 1 == args.save_at:
            os.makedirs(args.ckpt, exist_ok=True)
            trainer.save_states(states, all_ranks=True)
            if hvd.rank() == 0:
                net.save_parameters(os.path.join(args.ckpt, "net.params"))
            hvd.barrier()
    online = trainer.online
    out.update(rank=hvd.rank(), size=hvd.size(), switches=online.switches,
               checks=[h["step"] for h in online.history if "judged" not in h],
               switched=[h["step"] for h in online.history if h.get("switched")],
               ratio_history=ratio_history(online),
               opt_variables=len(trainer._updaters[0].states))
    print("RESULT " + json.dumps(out), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
