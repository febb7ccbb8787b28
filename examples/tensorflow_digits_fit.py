"""Train a CNN on scikit-learn's digits with Keras ``model.fit`` and hipress_like.tensorflow.

Real data (1797 8x8 images, bundled with scikit-learn), an 80/20
train/test split, test accuracy per epoch. The shape of Horovod's
``tensorflow2_keras_mnist.py``: ``hvd.init()``, ``hvd.DistributedOptimizer``,
``BroadcastGlobalVariablesCallback(0)``, ``MetricAverageCallback()``.
Launch with torchrun (any script; the runtime reads RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT)::

    torchrun --nproc-per-node=4 examples/tensorflow_digits_fit.py --compression onebit

with Open MPI (rendezvous over MPI; mpi4py required)::

    mpirun -np 4 --allow-run-as-root --oversubscribe --bind-to none \\
        -x OMP_NUM_THREADS=1 python examples/tensorflow_digits_fit.py --compression powersgd \\
        --strategy ring

or with ``horovodrun -np 4 -H localhost:4 python examples/tensorflow_digits_fit.py`` where
Horovod is installed. A plain ``python examples/tensorflow_digits_fit.py`` trains on one
process. Needs TensorFlow: ``scripts/env_tensorflow.sh`` makes an environment.

Checkpoints: ``--checkpoint-dir D`` saves every rank's weights after every
epoch (``D/epoch<e>.rank<r>.weights.h5``: the model, the optimizer's
variables and this rank's compressor state); ``--resume-epoch E`` continues
from the end of epoch E exactly as the uninterrupted run would have (each
epoch's order is a function of the seed and the epoch). ``--json`` prints
one ``RESULT {...}`` line per rank (accuracy, a digest of the weights, the
per-step losses) for tests.
"""
import argparse
import hashlib
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hipress_like.tensorflow.keras as hvd  # noqa: E402


def get_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="images per worker per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--compression", default="onebit",
                   help="none, fp16, onebit, terngrad, dgc, powersgd, ...")
    p.add_argument("--strategy", default="ps", choices=["ps", "ring"])
    p.add_argument("--plan", default="auto", help="'auto', 'none' (the engine's size rule) "
                   "or a plan JSON file")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--resume-epoch", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print RESULT lines (for tests)")
    return p.parse_args()


def digits():
    """The digits split every rank shares: (x_train, y_train, x_test, y_test), NHWC."""
    d = load_digits()
    x = (d.images.astype("float32") / 16.0)[..., None]
    return train_test_split(x, d.target.astype("int64"), test_size=0.2, random_state=0,
                            stratify=d.target)


def build_model():
    """The PyTorch example's Net in Keras: two 3x3 convolutions, FC 4096 -> 512 -> 10."""
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])


def digest(model):
    """SHA-256 of every weight's bytes: equal on every rank when replicas are identical."""
    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes()
                                   for w in model.get_weights())).hexdigest()


class StepLosses(keras.callbacks.Callback):
    """Records the running loss after every batch (equal runs give equal lists)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def main():
    args = get_args()
    hvd.init()
    keras.utils.set_random_seed(args.seed)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    xtr, xte, ytr, yte = digits()
    # Each rank trains on its own shard, all shards one length, so every rank
    # runs the same number of steps per epoch.
    per_rank = len(xtr) // hvd.size() // args.batch_size * args.batch_size
    xs = xtr[hvd.rank()::hvd.size()][:per_rank]
    ys = ytr[hvd.rank()::hvd.size()][:per_rank]

    model = build_model()
    opt = keras.optimizers.SGD(args.lr, momentum=args.momentum)
    opt = hvd.DistributedOptimizer(
        opt, compression=hvd.Compression.get(args.compression), strategy=args.strategy,
        plan=None if args.plan == "none" else args.plan)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    if args.resume_epoch:
        opt.build(model.trainable_variables)  # the engine too: it receives its state
        model.load_weights(os.path.join(
            args.checkpoint_dir, f"epoch{args.resume_epoch}.rank{hvd.rank()}.weights.h5"))
    losses = StepLosses()
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(), losses]
    if args.resume_epoch:
        callbacks = callbacks[1:]  # every rank loaded its own weights: nothing to broadcast
    for epoch in range(args.resume_epoch, args.epochs):
        # the epoch's order depends on the seed and the epoch only, so a resumed run
        # sees the batches the uninterrupted one saw
        order = np.random.default_rng(args.seed * 1000 + epoch).permutation(per_rank)
        hist = model.fit(xs[order], ys[order], batch_size=args.batch_size,
                         initial_epoch=epoch, epochs=epoch + 1, shuffle=False, verbose=0,
                         callbacks=callbacks)
        _, acc = model.evaluate(xte, yte, batch_size=120, verbose=0)
        acc = float(hvd.allreduce(tf.constant(acc), name="test_accuracy")) * 100
        if args.checkpoint_dir:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            model.save_weights(os.path.join(args.checkpoint_dir,
                                            f"epoch{epoch + 1}.rank{hvd.rank()}.weights.h5"))
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:2d}  loss {hist.history['loss'][-1]:.4f}  "
                  f"test accuracy {acc:5.1f}%", flush=True)
    if args.json:
        # 7 significant digits: equal runs still give equal lists, and the line stays
        # under the 4 KB a pipe writes whole (a longer one can interleave with another
        # rank's output under torchrun; 10 epochs are 220 losses)
        print("RESULT " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "acc": acc,
                                      "digest": digest(model),
                                      "losses": [float(f"{v:.7g}") for v in losses.losses]}),
              flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
