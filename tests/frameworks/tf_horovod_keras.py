"""A Horovod TensorFlow/Keras training script, written the way Horovod's examples are.

The structure of Horovod's ``tensorflow2_keras_mnist.py`` (init, pin the
threads, shard the data, scale the learning rate by the number of workers,
wrap the optimizer, broadcast from rank 0, average the metrics, warm the
learning rate up, checkpoint on rank 0 only, print on rank 0 only), on
scikit-learn's digits so that it runs offline. The only hipress-like line
is the import: with ``import horovod.tensorflow.keras as hvd`` it is a
Horovod script. The test runs it unchanged and reads the last line
(``DONE rank <r> <weights digest> <accuracy>``) of every rank.
"""
import hashlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import hipress_like.tensorflow.keras as hvd  # noqa: E402  (was: horovod.tensorflow.keras)

# join the other workers
hvd.init()

# several workers share this machine's cores: one intra-op thread each
tf.config.threading.set_intra_op_parallelism_threads(1)

digits = load_digits()
images = (digits.images.astype("float32") / 16.0)[..., None]
labels = digits.target.astype("int64")

# every worker reads a different slice of the images
shard = slice(hvd.rank(), None, hvd.size())
dataset = tf.data.Dataset.from_tensor_slices((images[shard], labels[shard]))
dataset = dataset.repeat().shuffle(1000, seed=hvd.rank()).batch(32)

keras.utils.set_random_seed(1234)
model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(32, 3, activation="relu"),
    keras.layers.Conv2D(64, 3, activation="relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Dropout(0.25),
    keras.layers.Flatten(),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dropout(0.5),
    keras.layers.Dense(10, activation="softmax"),
])

# the global batch grows with the number of workers, so does the step size
scaled_lr = 0.001 * hvd.size()
opt = keras.optimizers.Adam(scaled_lr)

# gradients are averaged over the workers before Adam sees them
opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)

model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt,
              metrics=["accuracy"])

callbacks = [
    # start every worker from worker 0's weights and optimizer slots
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),

    # report the mean of every worker's epoch metrics (keep it before callbacks that
    # read the metrics)
    hvd.callbacks.MetricAverageCallback(),

    # ramp the scaled learning rate up over the first epoch (Goyal et al., 2017)
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1, verbose=1),
]

# one writer for the checkpoint files: worker 0
if hvd.rank() == 0 and len(sys.argv) > 1:
    callbacks.append(keras.callbacks.ModelCheckpoint(
        os.path.join(sys.argv[1], "checkpoint-{epoch}.weights.h5"), save_weights_only=True))

# a progress bar from worker 0 only
verbose = 1 if hvd.rank() == 0 else 0

# the same number of images per epoch whatever the number of workers
history = model.fit(dataset, steps_per_epoch=120 // hvd.size(), callbacks=callbacks,
                    epochs=4, verbose=verbose)

# every worker must end with the same weights and the same averaged metrics
digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes()
                                 for w in model.get_weights())).hexdigest()
print(f"DONE rank {hvd.rank()} {digest} {history.history['accuracy'][-1]:.6f}", flush=True)
