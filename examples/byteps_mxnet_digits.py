"""BytePS's Gluon MNIST example with gradient compression, on scikit-learn's digits.

The shape of BytePS's ``example/mxnet/train_gluon_mnist_byteps_gc.py``: the
same command-line flags (``--compressor``, ``--ef``, ``--compress-momentum``,
``--scaling``, ``--k``, ``--fp16-pushpull``, ...), the same
``compression_params`` dict built from them (every key, whatever the
compressor), BytePS's ``DistributedTrainer``, and the accuracies averaged
with ``byteps_push_pull`` after every epoch. What differs: the import line
(``hipress_like.byteps.mxnet`` for ``byteps.mxnet``); the data (the 1797
8x8 digits bundled with scikit-learn, 80/20 split, each worker a shard of
the training set, instead of downloading MNIST); a CNN sized for 8x8
images; and no ``nvidia-smi`` call (the context is the GPU when MXNet sees
one, else the CPU). Run it in the MXNet environment (``scripts/env_mxnet.sh``)
with torchrun or any launcher ``hipress_like.byteps.mxnet.init`` reads::

    .venv-mxnet/bin/torchrun --nproc_per_node=2 examples/byteps_mxnet_digits.py \\
        --compressor onebit --ef vanilla --scaling

A plain ``python examples/byteps_mxnet_digits.py`` trains on one process.
Each rank prints ``RESULT {...}`` (accuracy, a checksum of its weights) at the end.
"""
import argparse
import json
import logging
import time
import zlib

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hipress_like.byteps.mxnet as bps


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=16, help="images per worker per step")
    p.add_argument("--dtype", type=str, default="float32")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--j", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--lr", type=float, default=0.05, help="per worker; scaled by size()")
    p.add_argument("--wd", type=float, default=0.0001)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--no-cuda", action="store_true", default=False)
    p.add_argument("--compressor", type=str, default="", help="onebit, topk, randomk, dithering")
    p.add_argument("--ef", type=str, default="", help="'vanilla': error feedback")
    p.add_argument("--compress-momentum", type=str, default="", help="BytePS's 'nesterov'")
    p.add_argument("--scaling", action="store_true", default=False, help="onebit's scaling")
    p.add_argument("--k", type=int, default=1, help="topk/randomk: entries kept; "
                   "dithering: levels")
    p.add_argument("--fp16-pushpull", action="store_true", default=False)
    p.add_argument("--logging-file", type=str, default="", help="also log to this file")
    return p.parse_args(argv)


def digits_loaders(args, rank, size):
    """(train loader over this worker's shard, test loader, training-set size)."""
    digits = load_digits()
    x = (digits.images.astype(args.dtype) / 16.0 - 0.5)[:, None]  # NCHW, centred
    y = digits.target.astype("float32")
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0,
                                              stratify=y)
    train = gluon.data.ArrayDataset(x_tr[rank::size], y_tr[rank::size])
    test = gluon.data.ArrayDataset(x_te, y_te)
    return (gluon.data.DataLoader(train, args.batch_size, shuffle=True, num_workers=args.j,
                                  last_batch="discard"),
            gluon.data.DataLoader(test, args.batch_size, shuffle=False, num_workers=args.j),
            len(x_tr))


def conv_net():
    """BytePS's two convolutions and two dense layers, sized for 8x8 images."""
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(channels=20, kernel_size=3, activation="relu"))  # 6x6
        net.add(gluon.nn.MaxPool2D(pool_size=2, strides=2))  # 3x3
        net.add(gluon.nn.Conv2D(channels=50, kernel_size=3, padding=1, activation="relu"))
        net.add(gluon.nn.Flatten())
        net.add(gluon.nn.Dense(128, activation="relu"))
        net.add(gluon.nn.Dense(10))
    return net


def evaluate(model, data_iter, context):
    metric = mx.metric.Accuracy()
    for data, label in data_iter:
        metric.update([label.as_in_context(context)], [model(data.as_in_context(context))])
    return metric.get()


def main(argv=None):
    args = get_args(argv)
    if not args.no_cuda and mx.context.num_gpus() == 0:
        args.no_cuda = True  # no GPU: train on the CPU, as BytePS's example does
    bps.init()
    logger = logging.getLogger("byteps_mxnet_digits")
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.StreamHandler())
    if args.logging_file:
        logger.addHandler(logging.FileHandler(args.logging_file))
    logger.info(args)

    train_data, val_data, train_size = digits_loaders(args, bps.rank(), bps.size())
    context = mx.cpu() if args.no_cuda else mx.gpu(bps.local_rank())
    num_workers = bps.size()

    mx.random.seed(42)
    model = conv_net()
    model.cast(args.dtype)
    model.initialize(mx.init.MSRAPrelu(), ctx=context)
    if bps.rank() == 0:
        model.summary(nd.ones((1, 1, 8, 8), ctx=context))
    model.hybridize()

    optimizer_params = {"momentum": args.momentum, "wd": args.wd,
                        "learning_rate": args.lr * num_workers}
    compression_params = {  # every key, whatever the compressor: BytePS reads what applies
        "compressor": args.compressor,
        "ef": args.ef,
        "momentum": args.compress_momentum,
        "scaling": args.scaling,
        "k": args.k,
        "fp16": args.fp16_pushpull,
    }
    trainer = bps.DistributedTrainer(model.collect_params(), "sgd", optimizer_params,
                                     compression_params=compression_params)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    metric = mx.metric.Accuracy()

    total_time = 0.0
    bps.byteps_declare_tensor("acc")
    for epoch in range(args.epochs):
        tic = time.time()
        metric.reset()
        for i, (data, label) in enumerate(train_data):
            data, label = data.as_in_context(context), label.as_in_context(context)
            with autograd.record():
                output = model(data)
                loss = loss_fn(output, label)
            loss.backward()
            trainer.step(args.batch_size)
            metric.update([label], [output])
            if i % 20 == 0:
                name, acc = metric.get()
                logger.info("[Epoch %d Batch %d] Training: %s=%f", epoch, i, name, acc)
        elapsed = time.time() - tic
        total_time += elapsed
        logger.info("Epoch[%d]\tSpeed=%.2f samples/s\tTime cost=%f", epoch,
                    train_size / elapsed, elapsed)

        _, train_acc = metric.get()
        name, val_acc = evaluate(model, val_data, context)
        acc = mx.nd.array([train_acc, val_acc], ctx=context)
        bps.byteps_push_pull(acc, name="acc", is_average=False)
        acc /= bps.size()
        train_acc, val_acc = acc[0].asscalar(), acc[1].asscalar()
        if bps.rank() == 0:
            logger.info("Epoch[%d]\tTrain: %s=%f\tValidation: %s=%f", epoch, name, train_acc,
                        name, val_acc)

    logger.info("total time=%.2f", total_time)
    weights = np.concatenate([p.data().asnumpy().ravel()
                              for _, p in sorted(model.collect_params().items())])
    print("RESULT " + json.dumps({"rank": bps.rank(), "val_acc": float(val_acc),
                                  "train_acc": float(train_acc),
                                  "weights_crc": zlib.crc32(weights.tobytes())}), flush=True)
    bps.shutdown()


if __name__ == "__main__":
    main()
