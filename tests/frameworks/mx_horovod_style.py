"""A Horovod MXNet training script, written the way Horovod's ``mxnet_mnist.py`` is.

Gluon, ``hvd.init()``, one context per rank, the data sharded by rank,
``hvd.DistributedTrainer(params, opt)`` over an ``mx.optimizer`` instance,
``hvd.broadcast_parameters(params, root_rank=0)`` before training, metrics
with ``mx.metric``, logging only. The single line naming hipress-like is the
import: with ``import horovod.mxnet as hvd`` in its place this is a Horovod
script (test_mxnet.py checks both claims). The data is scikit-learn's
digits (bundled, offline) instead of a downloaded MNIST.

    torchrun --nproc_per_node 4 tests/frameworks/mx_horovod_style.py --epochs 5
"""
import argparse
import logging
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hipress_like.mxnet as hvd

# Training settings
parser = argparse.ArgumentParser(description="MXNet digits example",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--batch-size", type=int, default=16, help="training batch size")
parser.add_argument("--dtype", type=str, default="float32", help="training data type")
parser.add_argument("--epochs", type=int, default=5, help="number of training epochs")
parser.add_argument("--lr", type=float, default=0.02, help="learning rate")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=True,
                    help="disable training on GPU (default: True)")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer (default: 1.0)")
parser.add_argument("--save-dir", type=str, default="",
                    help="save every rank's final parameters here")
args = parser.parse_args()

logging.basicConfig(level=logging.INFO)
logging.info(args)


# Function to get the digits iterators, sharded by rank
def get_digits_iterator(rank, num_parts):
    digits = load_digits()
    x = (digits.images.astype("float32") / 16.0)[:, None]
    xtr, xval, ytr, yval = train_test_split(x, digits.target.astype("float32"),
                                            test_size=0.2, random_state=0,
                                            stratify=digits.target)
    part = len(xtr) // num_parts
    xtr, ytr = xtr[rank * part:(rank + 1) * part], ytr[rank * part:(rank + 1) * part]
    train_iter = mx.io.NDArrayIter(xtr, ytr, args.batch_size, shuffle=True,
                                   last_batch_handle="discard")
    val_iter = mx.io.NDArrayIter(xval, yval, args.batch_size)
    return train_iter, val_iter


# Function to define neural network
def conv_nets():
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(channels=20, kernel_size=3, padding=1, activation="relu"))
        net.add(gluon.nn.MaxPool2D(pool_size=2, strides=2))
        net.add(gluon.nn.Conv2D(channels=50, kernel_size=3, padding=1, activation="relu"))
        net.add(gluon.nn.Flatten())
        net.add(gluon.nn.Dense(256, activation="relu"))
        net.add(gluon.nn.Dense(10))
    return net


# Function to evaluate accuracy for a model
def evaluate(model, data_iter, context):
    data_iter.reset()
    metric = mx.metric.Accuracy()
    for _, batch in enumerate(data_iter):
        data = batch.data[0].as_in_context(context)
        label = batch.label[0].as_in_context(context)
        output = model(data.astype(args.dtype, copy=False))
        metric.update([label], [output])
    return metric.get()


# Initialize Horovod
hvd.init()

# Horovod: pin context to local rank
context = mx.cpu(hvd.local_rank()) if args.no_cuda else mx.gpu(hvd.local_rank())
num_workers = hvd.size()

# Load training and validation data
np.random.seed(hvd.rank())
train_data, val_data = get_digits_iterator(hvd.rank(), num_workers)

# Build model
model = conv_nets()
model.cast(args.dtype)
model.hybridize()

# Create optimizer
optimizer_params = {"momentum": args.momentum, "learning_rate": args.lr * hvd.size()}
opt = mx.optimizer.create("sgd", **optimizer_params)

# Initialize parameters
initializer = mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2)
model.initialize(initializer, ctx=context)

# Horovod: fetch and broadcast parameters
params = model.collect_params()
if params is not None:
    hvd.broadcast_parameters(params, root_rank=0)

# Horovod: create DistributedTrainer, a subclass of gluon.Trainer
trainer = hvd.DistributedTrainer(params, opt,
                                 gradient_predivide_factor=args.gradient_predivide_factor)

# Create loss function and train metric
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
metric = mx.metric.Accuracy()

# Train model
for epoch in range(args.epochs):
    tic = time.time()
    train_data.reset()
    metric.reset()
    for nbatch, batch in enumerate(train_data, start=1):
        data = batch.data[0].as_in_context(context)
        label = batch.label[0].as_in_context(context)
        with autograd.record():
            output = model(data.astype(args.dtype, copy=False))
            loss = loss_fn(output, label)
        loss.backward()
        trainer.step(args.batch_size)
        metric.update([label], [output])

        if nbatch % 10 == 0:
            name, acc = metric.get()
            logging.info("[Epoch %d Batch %d] Training: %s=%f", epoch, nbatch, name, acc)

    if hvd.rank() == 0:
        elapsed = time.time() - tic
        speed = nbatch * args.batch_size * hvd.size() / elapsed
        logging.info("Epoch[%d]\tSpeed=%.2f samples/s\tTime cost=%f", epoch, speed, elapsed)

    # Evaluate model accuracy
    _, train_acc = metric.get()
    name, val_acc = evaluate(model, val_data, context)
    if hvd.rank() == 0:
        logging.info("Epoch[%d]\tTrain: %s=%f\tValidation: %s=%f", epoch, name, train_acc,
                     name, val_acc)

    if hvd.rank() == 0 and epoch == args.epochs - 1:
        assert val_acc > 0.9, "Achieved accuracy (%f) is lower than expected (0.9)" % val_acc

if args.save_dir:
    model.save_parameters(os.path.join(args.save_dir, "rank%d.params" % hvd.rank()))
