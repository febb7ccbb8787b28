"""A digits training job with ``hvd.elastic`` for tests/frameworks/test_tensorflow_elastic.py,
started by torchrun's elastic agent (``--max-restarts``).

Each step trains on a global batch of ``BATCH`` images chosen by the step
number alone, split over the ranks; the state (a Keras model, its SGD
optimizer with momentum, ``step``) is committed every ``JOB_COMMIT_EVERY``
steps and checkpointed to ``$HIPRESS_ELASTIC_CHECKPOINT``. With ``JOB_KILL``
= ``"<step>:<rank>"`` that rank kills itself with SIGKILL at that step on the
first start; torchrun's agent restarts the group and ``hvd.elastic.run``
resumes from the checkpoint. Every rank prints ``RESULT {...}`` at the end
(its digest of the model's and optimizer's variables) and appends its first
step after a restore to ``$JOB_OUT/events.jsonl``.
"""
import hashlib
import json
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import hipress_like.tensorflow as hvd  # noqa: E402

BATCH = 32


def _digest(variables):
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return h.hexdigest()


def main():
    out = os.environ["JOB_OUT"]
    steps = int(os.environ.get("JOB_STEPS", "40"))
    every = int(os.environ.get("JOB_COMMIT_EVERY", "10"))
    kill = os.environ.get("JOB_KILL", "")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init(timeout=20)
    d = load_digits()
    x, y = (d.data / 16.0).astype("float32"), d.target.astype("int64")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(model.trainable_variables)  # its slots exist from the start: the state keeps them
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    state = hvd.elastic.TensorFlowKerasState(model, opt, step=0)

    @hvd.elastic.run
    def train(state):
        first = True
        while state.step < steps:
            r, n = hvd.rank(), hvd.size()
            idx = np.random.default_rng(1000 + state.step).permutation(len(x))[:BATCH]
            mine = idx[r * BATCH // n:(r + 1) * BATCH // n]
            with tf.GradientTape() as tape:
                loss = loss_fn(y[mine], model(x[mine], training=True))
            tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.none)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            state.step += 1
            if first and state.restored_from is not None:
                with open(os.path.join(out, "events.jsonl"), "a") as f:
                    f.write(json.dumps({"what": "resumed", "rank": r, "step": state.step - 1})
                            + "\n")
            first = False
            if state.step % every == 0:
                state.commit()
            if kill and state.restored_from is None:
                at, who = kill.split(":")
                if state.step == int(at) and hvd.rank() == int(who):
                    os.kill(os.getpid(), signal.SIGKILL)
        return float(np.mean(np.argmax(model(x).numpy(), 1) == y))

    acc = train(state)
    print("RESULT " + json.dumps({
        "rank": hvd.rank(), "size": hvd.size(), "acc": acc, "step": state.step,
        "digest": _digest(list(model.variables) + list(opt.variables)),
        "restored_from": state.restored_from, "commits": state.commits,
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
