"""Train a CNN on scikit-learn's digits with a custom ``GradientTape`` loop and hipress_like.

The shape of Horovod's ``tensorflow2_mnist.py``: a ``@tf.function`` training
step wraps its tape in ``hvd.DistributedGradientTape`` and, on the first
batch, broadcasts the model's and the optimizer's variables from rank 0.
``--eager`` runs the same step without ``tf.function``. Launch like the
``model.fit`` example::

    torchrun --nproc-per-node=4 examples/tensorflow_digits_tape.py --compression powersgd \\
        --strategy ring
    mpirun -np 4 --allow-run-as-root --oversubscribe --bind-to none \\
        -x OMP_NUM_THREADS=1 python examples/tensorflow_digits_tape.py

Checkpoints: ``--checkpoint-dir D --checkpoint-step K`` saves, on every rank
after step K, a ``tf.train.Checkpoint`` of the model and the optimizer plus
the tapes' compressor state (``hvd.compressor_state()``, a side file);
``--resume-step K`` restores them and continues exactly as the
uninterrupted run (the batches are a function of the seed, the rank and the
step). ``--json`` prints one ``RESULT {...}`` line per rank for tests.
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

import hipress_like.tensorflow as hvd  # noqa: E402


def get_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=220, help="training steps (10 epochs of "
                   "digits at 4 ranks x 16 images)")
    p.add_argument("--batch-size", type=int, default=16, help="images per worker per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--compression", default="onebit",
                   help="none, fp16, onebit, terngrad, dgc, powersgd, ...")
    p.add_argument("--strategy", default="ps", choices=["ps", "ring"])
    p.add_argument("--collective", default=None,
                   help="how compressed gradients travel: ring, tree, backend, allgather or "
                        "auto (default: the strategy's PS or Ring)")
    p.add_argument("--plan", default="auto", help="'auto', 'none' (the engine's size rule) "
                   "or a plan JSON file")
    p.add_argument("--nonfinite", default="propagate", choices=["propagate", "skip", "raise"])
    p.add_argument("--eager", action="store_true", help="run the step without tf.function")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-step", type=int, default=0)
    p.add_argument("--resume-step", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print RESULT lines (for tests)")
    return p.parse_args()


def digits():
    """The digits split every rank shares: (x_train, x_test, y_train, y_test), NHWC."""
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


def main():
    args = get_args()
    hvd.init()
    keras.utils.set_random_seed(args.seed)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    xtr, xte, ytr, yte = digits()
    xs, ys = xtr[hvd.rank()::hvd.size()], ytr[hvd.rank()::hvd.size()]

    model = build_model()
    opt = keras.optimizers.SGD(args.lr, momentum=args.momentum)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plan = None if args.plan == "none" else args.plan
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)

    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        # hipress-like: the tape averages the gradients over all ranks, compressed
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.get(
            args.compression), strategy=args.strategy, plan=plan, nonfinite=args.nonfinite,
            collective=args.collective)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # Broadcast after the first step, when the optimizer's variables exist
        # (Horovod's pattern; replicas are identical from here on).
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    step_fn = training_step if args.eager else tf.function(training_step)

    start = 0
    if args.resume_step:
        opt.build(model.trainable_variables)
        prefix = os.path.join(args.checkpoint_dir, f"step{args.resume_step}.rank{hvd.rank()}")
        ckpt.read(prefix).assert_consumed()
        with open(prefix + ".hipress", "rb") as f:
            hvd.load_compressor_state(f.read())
        start = args.resume_step
    losses = []
    for step in range(start, args.steps):
        # the batch depends on the seed, the rank and the step only: resumable
        idx = np.random.default_rng([args.seed, hvd.rank(), step]).integers(
            0, len(xs), args.batch_size)
        loss = step_fn(tf.constant(xs[idx]), tf.constant(ys[idx]), step == 0)
        losses.append(float(loss))
        if args.checkpoint_dir and step + 1 == args.checkpoint_step:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            prefix = os.path.join(args.checkpoint_dir, f"step{step + 1}.rank{hvd.rank()}")
            ckpt.write(prefix)
            with open(prefix + ".hipress", "wb") as f:  # this rank's compressor state
                f.write(hvd.compressor_state())
        if hvd.rank() == 0 and (step + 1) % 22 == 0:
            print(f"step {step + 1:4d}  loss {float(loss):.4f}", flush=True)
    logits = model(xte, training=False)
    acc = float(np.mean(np.argmax(logits, 1) == yte)) * 100
    acc = float(hvd.allreduce(tf.constant(acc), name="test_accuracy"))
    if hvd.rank() == 0:
        print(f"test accuracy {acc:5.1f}%", flush=True)
    if args.json:
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes()
                                         for w in model.get_weights())).hexdigest()
        print("RESULT " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "acc": acc,
                                      "digest": digest, "losses": losses}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
