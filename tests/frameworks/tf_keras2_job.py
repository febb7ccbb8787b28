"""A Horovod-style Keras 2 job (TensorFlow 2.15 and older): ``model.fit`` with
``hvd.DistributedOptimizer`` around a 2.11+ optimizer and around a legacy one,
and the NaN/Inf policy ``skip``; prints ``RESULT {json}`` per rank."""
import hashlib
import json

import numpy as np
import tensorflow as tf

import hipress_like.tensorflow.keras as hvd


def digest(model):
    return hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.weights)).hexdigest()


def main():
    hvd.init()
    tf.random.set_seed(hvd.rank())  # different initial weights: the callback broadcasts
    model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu", input_shape=(8,)),
                                 tf.keras.layers.Dense(3)])
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    base = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, compression=hvd.Compression.onebit)
    model.compile(optimizer=opt, loss=loss)
    rng = np.random.RandomState(hvd.rank())  # every rank its own data
    x, y = rng.randn(64, 8).astype("float32"), rng.randint(0, 3, 64)
    hist = model.fit(x, y, batch_size=16, epochs=3, verbose=0,
                     callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out = {"rank": hvd.rank(), "subclass": isinstance(opt, type(base)),
           "config_kept": opt.get_config()["momentum"] == 0.9,
           "engine": opt.engine is not None, "losses": hist.history["loss"],
           "fit": digest(model)}
    legacy = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.05))
    model.compile(optimizer=legacy, loss=loss)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    out["legacy"] = digest(model)
    # nonfinite="skip": a NaN on rank 1 skips the step on every rank
    skip = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), nonfinite="skip")
    before = [v.numpy().copy() for v in model.trainable_variables]
    grads = [tf.fill(v.shape, np.nan if hvd.rank() == 1 else 1.0)
             for v in model.trainable_variables]
    skip.apply_gradients(zip(grads, model.trainable_variables))
    out["skipped"] = all(np.array_equal(a, v.numpy())
                         for a, v in zip(before, model.trainable_variables))
    try:
        hvd.DistributedOptimizer(opt)
        out["rewrap"] = ""
    except ValueError as e:
        out["rewrap"] = str(e)
    print("RESULT " + json.dumps(out), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
