"""Which calls the TensorFlow face hands to ``horovod.tensorflow`` (adapters/tensorflow/native.py):
under horovodrun with Horovod's TF ops, the plain collectives and Horovod-only names are
Horovod's (uint8 allreduce, a registered gradient, ``BroadcastGlobalVariablesHook``), a
collective with one of this project's compressors stays this project's; elsewhere a
Horovod-only name is an AttributeError that says how to get it. Prints ``RESULT {json}``."""
import json

import numpy as np
import tensorflow as tf

import hipress_like.tensorflow as hvd


def main():
    hvd.init()
    out = {"rank": hvd.rank()}
    try:
        import horovod.tensorflow as htf
        out["hook_is_horovods"] = \
            hvd.BroadcastGlobalVariablesHook is htf.BroadcastGlobalVariablesHook
    except (ImportError, AttributeError) as e:
        out["hook_is_horovods"] = None
        out["hook_error"] = str(e)
    out["uint8_sum"] = hvd.allreduce(tf.ones(4, dtype=tf.uint8) * (hvd.rank() + 1),
                                     op=hvd.Sum).numpy().tolist()
    x = tf.Variable(tf.ones(3) * (hvd.rank() + 1))
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum))
    grad = tape.gradient(y, x)
    out["grad"] = None if grad is None else grad.numpy().tolist()
    # a compressor of this project's: its own collective (onebit's two values)
    v = tf.constant(np.linspace(-1.0, 1.0, 4096, dtype="float32") + hvd.rank())
    c = hvd.allreduce(v, compression=hvd.Compression.onebit)
    out["onebit_values"] = len(np.unique(c.numpy()))
    print("RESULT " + json.dumps(out), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
