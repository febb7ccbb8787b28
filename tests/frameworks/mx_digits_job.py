"""One rank of an MXNet digits job for tests/frameworks/test_mxnet.py (any launcher).

The data, model and batches are examples/mxnet_digits.py's (``load_data``,
``build_net``, ``shard``), trained with ``hipress_like.mxnet``. Cases:

``train`` (default)
    ``--steps`` steps (or ``--epochs``); prints ``RESULT {json}`` with the
    test accuracy, a digest of the weights (replicas must agree bitwise)
    and this rank's loss per step (as float hex, compared exactly).
    ``--save-at K --ckpt DIR`` also checkpoints after step K (weights by
    rank 0, the trainer's states with ``all_ranks=True`` or, with
    ``--per-rank``, one file per rank) and trains on; ``--resume`` starts
    from that checkpoint at step K.
``optimizer``
    the same loop with ``gluon.Trainer(..., hvd.DistributedOptimizer(opt),
    kvstore=None)`` (Horovod's per-update allreduce).
``refusals``
    the bad inputs the PyTorch face refuses, one after the other; prints
    ``CHECK <name> <ok|FAIL> <detail>`` per check.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hipress_like.mxnet as hvd

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("mxnet_digits",
                                                  ROOT / "examples" / "mxnet_digits.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EX = _example()


def digest(net):
    items = sorted(net._collect_params_with_prefix().items())
    h = hashlib.sha256()
    for _, p in items:
        h.update(p.data().asnumpy().tobytes())
    return h.hexdigest()[:16]


def make_net(seed, hidden=512, broadcast=True):
    mx.random.seed(seed)
    net = EX.build_net() if hidden == 512 else _net_with(hidden)
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    if broadcast:
        hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    return net


def _net_with(hidden):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(32, 3, padding=1, activation="relu"),
            gluon.nn.Conv2D(64, 3, padding=1, activation="relu"),
            gluon.nn.Flatten(), gluon.nn.Dense(hidden, activation="relu"), gluon.nn.Dense(10))
    return net


def batches(xtr, args):
    """Every step's batch of this rank, epoch after epoch."""
    out, epoch = [], 1
    while len(out) < args.steps:
        out += EX.shard(len(xtr), epoch, args.seed, hvd.rank(), hvd.size(), args.batch_size)
        epoch += 1
    return out[: args.steps]


def train(args):
    xtr, xte, ytr, yte = EX.load_data()
    net = make_net(args.seed)
    plan = None if args.plan == "none" else args.plan
    opt_params = {"learning_rate": args.lr, "momentum": 0.9}
    if args.case == "optimizer":
        opt = hvd.DistributedOptimizer(mx.optimizer.create("sgd", **opt_params))
        trainer = gluon.Trainer(net.collect_params(), opt, kvstore=None)
    else:
        trainer = hvd.DistributedTrainer(
            net.collect_params(), "sgd", opt_params,
            compression=hvd.Compression.get(args.compression), strategy=args.strategy,
            plan=plan, collective=args.collective)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    states = os.path.join(args.ckpt or ".", f"trainer{hvd.rank() if args.per_rank else ''}"
                          ".states")
    first = 0
    if args.resume:
        net(mx.nd.array(xtr[:1]))  # finish deferred initialisation (a collective broadcast)
        net.load_parameters(os.path.join(args.ckpt, "net.params"), ctx=mx.cpu())
        trainer.load_states(states)
        first = args.save_at
    losses = []
    for step, idx in enumerate(batches(xtr, args)):
        if step < first:
            continue
        data, label = mx.nd.array(xtr[idx]), mx.nd.array(ytr[idx])
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(args.batch_size)
        losses.append(float(loss.mean().asscalar()).hex())
        if args.save_at and step + 1 == args.save_at and not args.resume:
            os.makedirs(args.ckpt, exist_ok=True)
            trainer.save_states(states, all_ranks=not args.per_rank)
            if hvd.rank() == 0:
                net.save_parameters(os.path.join(args.ckpt, "net.params"))
            hvd.barrier()
    acc = EX.evaluate(net, xte, yte)
    engine = getattr(trainer, "engine", None)
    result = {"rank": hvd.rank(), "size": hvd.size(), "acc": acc, "digest": digest(net),
              "losses": losses, "first": first,
              "transport": type(engine.transport).__name__ if engine else None,
              "layout": {n: v["workflow"] for n, v in engine.layout().items()} if engine
              else None}
    print("RESULT " + json.dumps(result), flush=True)


# -- refusals -------------------------------------------------------------------------------

def _check(name, fn, expect, match):
    """Run ``fn``; it must raise ``expect`` whose message contains ``match``."""
    try:
        fn()
    except expect as e:
        ok = match in str(e)
        print(f"CHECK {name} {'ok' if ok else 'FAIL'} {type(e).__name__}: "
              f"{str(e)[:1000]!r}", flush=True)
        return
    except Exception as e:  # the wrong error
        print(f"CHECK {name} FAIL wrong error {type(e).__name__}: {str(e)[:300]!r}", flush=True)
        traceback.print_exc()
        return
    print(f"CHECK {name} FAIL no error", flush=True)


def _one_step(net, trainer, x, y, nan_rank=None):
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    loss.backward()
    if nan_rank == hvd.rank():
        g = net.collect_params()[sorted(net.collect_params().keys())[0]].grad()
        g[:] = float("nan")
    trainer.step(x.shape[0])


def refusals(args):
    from hipress_like.casync.errors import EngineError, GradientMismatchError

    xtr, _, ytr, _ = EX.load_data()
    x, y = mx.nd.array(xtr[:8]), mx.nd.array(ytr[:8])
    net = make_net(args.seed)
    net(x)  # finish deferred initialisation
    params = net.collect_params()
    sgd = {"learning_rate": 0.1}

    _check("unknown_compressor", lambda: hvd.DistributedTrainer(
        params, "sgd", sgd, compression="tpok"), ValueError,
        "unknown compressor 'tpok'")
    _check("unknown_compressor_attr", lambda: hvd.Compression.tpok, AttributeError, "available")
    _check("nonfinite_policy", lambda: hvd.DistributedTrainer(
        params, "sgd", sgd, nonfinite="ignore"), ValueError, "nonfinite must be")
    _check("strategy", lambda: hvd.DistributedTrainer(params, "sgd", sgd, strategy="tree"),
           ValueError, "strategy must be one of")
    _check("collective", lambda: hvd.DistributedTrainer(params, "sgd", sgd,
                                                        collective="butterfly"),
           ValueError, "unknown collective 'butterfly'")

    counter = gluon.Parameter("counter", shape=(4,), dtype="int32", init=mx.init.Zero())
    counter.initialize(ctx=mx.cpu())
    _check("non_float_gradient", lambda: hvd.DistributedTrainer(
        [*params.values(), counter], "sgd", sgd, plan=None), TypeError, "int32")

    # rank 1 builds a narrower model (not broadcast: the shapes differ)
    other = make_net(args.seed, hidden=256 if hvd.rank() == 1 else 512, broadcast=False)
    other(x)
    _check("mismatched_models", lambda: hvd.DistributedTrainer(
        other.collect_params(), "sgd", sgd, compression="onebit", plan=None),
        GradientMismatchError, "differ across ranks")

    # NaN on rank 2 only, nonfinite="skip": no rank updates, every rank agrees
    before = digest(net)
    tr = hvd.DistributedTrainer(params, "sgd", sgd, compression="onebit", plan=None,
                                nonfinite="skip")
    _one_step(net, tr, x, y, nan_rank=2)
    same = digest(net) == before
    digests = hvd.allgather_object(digest(net))
    print(f"CHECK nan_skip {'ok' if same and len(set(digests)) == 1 else 'FAIL'} "
          f"unchanged={same} digests={digests}", flush=True)
    _one_step(net, tr, x, y)  # the next step trains again
    moved = digest(net) != before
    digests = hvd.allgather_object(digest(net))
    print(f"CHECK nan_skip_then_train {'ok' if moved and len(set(digests)) == 1 else 'FAIL'} "
          f"moved={moved}", flush=True)
    tr.close()

    # nonfinite="propagate" (the default): every rank's weights go non-finite alike
    net2 = make_net(args.seed + 1)
    net2(x)
    tr = hvd.DistributedTrainer(net2.collect_params(), "sgd", sgd, compression="onebit",
                                plan=None)
    _one_step(net2, tr, x, y, nan_rank=2)
    finite = all(np.isfinite(p.data().asnumpy()).all() for p in net2.collect_params().values())
    digests = hvd.allgather_object(digest(net2))
    print(f"CHECK nan_propagate {'ok' if not finite and len(set(digests)) == 1 else 'FAIL'} "
          f"finite={finite} digests={digests}", flush=True)
    tr.close()

    # nonfinite="raise": every rank raises, naming the gradient
    tr = hvd.DistributedTrainer(params, "sgd", sgd, compression="onebit", plan=None,
                                nonfinite="raise")
    _check("nan_raise", lambda: _one_step(net, tr, x, y, nan_rank=2), (ValueError, EngineError),
           "conv0_bias'")  # every rank names the Gluon parameter
    tr.close()

    # ordering: update() without allreduce_grads(), allreduce_grads() twice
    tr = hvd.DistributedTrainer(params, "sgd", sgd, plan=None)
    _check("update_without_allreduce", lambda: tr.update(8, ignore_stale_grad=True),
           hvd.OrderingError, "without allreduce_grads")

    def twice():
        with autograd.record():
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
        loss.backward()
        tr.allreduce_grads()
        tr.allreduce_grads()
    _check("allreduce_twice", twice, hvd.OrderingError, "twice")
    tr.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", default="train", choices=["train", "optimizer", "refusals"])
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--compression", default="none")
    p.add_argument("--strategy", default="ps")
    p.add_argument("--plan", default="none")
    p.add_argument("--collective", default=None)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--per-rank", action="store_true")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    hvd.init()
    if not args.steps:
        xtr = EX.load_data()[0]
        args.steps = args.epochs * (len(xtr) // hvd.size() // args.batch_size)
    if args.case == "refusals":
        refusals(args)
    else:
        train(args)
    hvd.shutdown()


if __name__ == "__main__":
    sys.exit(main())
