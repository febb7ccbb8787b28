"""Train a Gluon CNN on scikit-learn's digits with hipress_like.mxnet (a Horovod-style script).

Real data (1797 8x8 images, bundled with scikit-learn), the same 80/20
train/test split and CNN shape as examples/pytorch_digits.py, test accuracy
per epoch. Runs in the MXNet environment (``scripts/env_mxnet.sh`` creates
``.venv-mxnet``). Launch with torchrun, which starts any Python script and
gives it ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``::

    .venv-mxnet/bin/torchrun --nproc_per_node=4 examples/mxnet_digits.py --compression onebit

or with Open MPI (rendezvous over MPI; mpi4py is in the environment)::

    mpirun -np 4 --allow-run-as-root --oversubscribe --bind-to none \\
        -x OMP_NUM_THREADS=1 .venv-mxnet/bin/python examples/mxnet_digits.py \\
        --compression powersgd --strategy ring

A plain ``python examples/mxnet_digits.py`` trains on one process.
``--checkpoint DIR`` saves the weights and the trainer (optimizer and
compressor state) after every epoch; ``--resume`` continues from there.
Apart from the import line and the ``compression``/``strategy``/``plan``
arguments, this is the shape of Horovod's ``mxnet_mnist.py``.
"""
import argparse
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hipress_like.mxnet as hvd


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="images per worker per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--compression", default="onebit",
                   help="none, fp16, onebit, terngrad, dgc, powersgd, ...")
    p.add_argument("--strategy", default="ps", choices=["ps", "ring"])
    p.add_argument("--collective", default=None,
                   help="how compressed gradients travel: ring, tree, backend, allgather or "
                        "auto (default: the strategy's PS or Ring)")
    p.add_argument("--plan", default="auto", help="'auto', 'none' or a plan JSON file")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpoint", default=None, help="directory for per-epoch checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    return p.parse_args(argv)


def load_data():
    """(x_train, y_train, x_test, y_test) as float32/int NumPy arrays, NCHW."""
    digits = load_digits()
    x = (digits.images.astype("float32") / 16.0)[:, None]
    return train_test_split(x, digits.target.astype("float32"), test_size=0.2,
                            random_state=0, stratify=digits.target)


def build_net():
    """Two 3x3 convolutions and two dense layers (input sizes inferred on first use)."""
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(32, 3, padding=1, activation="relu"),
            gluon.nn.Conv2D(64, 3, padding=1, activation="relu"),
            gluon.nn.Flatten(),
            gluon.nn.Dense(512, activation="relu"),
            gluon.nn.Dense(10))
    return net


def shard(n, epoch, seed, rank, size, batch_size):
    """This rank's batches of one epoch: a seeded permutation dealt round-robin
    (as torch's DistributedSampler deals it), incomplete batches dropped."""
    order = np.random.RandomState(seed + epoch).permutation(n)
    per_rank = n // size
    mine = order[rank: per_rank * size: size]
    steps = len(mine) // batch_size
    return [mine[i * batch_size:(i + 1) * batch_size] for i in range(steps)]


def evaluate(net, x, y):
    """Test accuracy in percent, averaged over the ranks (identical on every rank)."""
    pred = net(mx.nd.array(x)).argmax(axis=1).asnumpy()
    acc = mx.nd.array([float((pred == y).mean())])
    return hvd.allreduce(acc, name="test_accuracy").asscalar() * 100


def main(argv=None):
    args = get_args(argv)
    hvd.init()
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    xtr, xte, ytr, yte = load_data()

    net = build_net()
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.hybridize()
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)  # deferred: right after the first forward
    plan = None if args.plan == "none" else args.plan
    trainer = hvd.DistributedTrainer(
        params, "sgd", {"learning_rate": args.lr, "momentum": args.momentum},
        compression=hvd.Compression.get(args.compression), strategy=args.strategy, plan=plan,
        collective=args.collective)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    first = 1
    if args.checkpoint and args.resume:
        state = os.path.join(args.checkpoint, "epoch.txt")
        first = int(open(state).read()) + 1
        net(mx.nd.array(xtr[:1]))  # finish deferred initialisation before loading
        net.load_parameters(os.path.join(args.checkpoint, "net.params"), ctx=mx.cpu())
        trainer.load_states(os.path.join(args.checkpoint, "trainer.states"))
        if hvd.rank() == 0:
            print(f"resumed after epoch {first - 1}", flush=True)

    for epoch in range(first, args.epochs + 1):
        t0 = time.perf_counter()
        batches = shard(len(xtr), epoch, args.seed, hvd.rank(), hvd.size(), args.batch_size)
        for idx in batches:
            data, label = mx.nd.array(xtr[idx]), mx.nd.array(ytr[idx])
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(args.batch_size)
        mean_loss = loss.mean().asscalar()
        seconds = time.perf_counter() - t0
        acc = evaluate(net, xte, yte)
        images = len(batches) * args.batch_size * hvd.size()
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  loss {mean_loss:.4f}  test accuracy {acc:5.1f}%  "
                  f"{images / seconds:7.0f} images/s", flush=True)
        if args.checkpoint:
            os.makedirs(args.checkpoint, exist_ok=True)
            trainer.save_states(os.path.join(args.checkpoint, "trainer.states"),
                                all_ranks=True)  # every rank's compressor state, one file
            if hvd.rank() == 0:
                net.save_parameters(os.path.join(args.checkpoint, "net.params"))
                with open(os.path.join(args.checkpoint, "epoch.txt"), "w") as f:
                    f.write(str(epoch))
            hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
