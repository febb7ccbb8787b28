"""One rank of a TensorFlow ``plan="adaptive"`` job (tests/frameworks/test_adaptive_tensorflow.py).

The link estimate is injected (``hvd.Adaptive(estimate=fast_slow_fast)``, the
documented test source; it lives here so that every rank's process has it):
fast before step 8, slow for steps 8-15, fast again from 16, as in
tests/multiprocess/test_adaptive_plan.py. The compressor curves come from the
profile file the test wrote (``--profile``). Modes:

``tape``
    a ``@tf.function`` step with ``hvd.DistributedGradientTape``; the checkpoint
    is a ``tf.train.Checkpoint`` plus ``hvd.compressor_state()`` (per rank).
``fit``
    ``model.fit`` with the Keras ``hvd.DistributedOptimizer``, one epoch of
    ``--steps-per-epoch`` steps per ``fit`` call; the checkpoint is
    ``model.save_weights`` (per rank; the optimizer's entry holds the
    compressor state and the planner's).

After every step each rank records a digest of its weights, a digest of the
engine's plan and the gradients it compresses, and prints one ``RESULT
{json}`` line at the end (with the steps the planner switched at).
``--save-at K --ckpt DIR`` checkpoints after step K and trains on;
``--resume`` starts from that checkpoint at step K. ``--ratio R ...`` runs
AR-Topk's ratio search instead: ``star_topk`` on a slow link throughout (a
profile from ``adaptive_common.ratio_profile``), each candidate ratio two steps;
the ratio on the compressors and a digest of the optimizer's variables are
recorded after every step (of the Keras optimizer's variables only: a tape
never sees its optimizer, and its search trains on instead of rewinding,
``adapters/tensorflow/rewind.py``).
"""
import argparse
import hashlib
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from adaptive_common import ratio_history  # noqa: E402  (this job's folder is on sys.path)

import hipress_like.tensorflow.keras as hvd  # noqa: E402
from hipress_like.cost_model import Link  # noqa: E402
from hipress_like.tuning.adaptive_cr import AdaptiveCRConfig  # noqa: E402
from hipress_like.tuning.ratio_search import searchable  # noqa: E402

FAST = (2e-6, 12.5e9)  # 2 us + 100 Gbit/s
SLOW = (1e-3, 1.25e6)  # 1 ms + 10 Mbit/s
BATCH, FEATURES, CLASSES = 6, 36, 3


def fast_slow_fast(step, rank):
    """The injected link: fast before step 8, slow for steps 8-15, fast again."""
    return Link(*SLOW) if 8 <= step < 16 else Link(*FAST)


def always_slow(step, rank):
    """The injected link of ``--ratio``: slow at every step (the kernel stays compressed)."""
    return Link(*SLOW)


def build_model():
    """36 -> 96 -> 3: one 13.8 KB kernel (compressed on the slow link only) and small ones."""
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((FEATURES,)),
                             keras.layers.Dense(96, activation="relu"),
                             keras.layers.Dense(CLASSES)])


def batch(rank, step):
    """This rank's batch of ``step``: a function of the rank and the step only."""
    rng = np.random.default_rng([11, rank, step])
    return (rng.standard_normal((BATCH, FEATURES)).astype("float32"),
            rng.integers(0, CLASSES, BATCH).astype("int64"))


def digest(model):
    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes()
                                   for w in model.get_weights())).hexdigest()[:16]


def plan_digest(plan):
    text = json.dumps({n: g.to_dict() for n, g in plan.gradients.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Record:
    """Per-step digests of the weights, of the optimizer's variables and of the plan, the
    compressed gradients and the AR-Topk ratios."""

    def __init__(self):
        self.out = {"digests": [], "plans": [], "compressed": [], "ratios": [],
                    "opt_digests": []}
        self.optimizer = None

    def after(self, model, engine):
        self.out["digests"].append(digest(model))
        self.out["ratios"].append(sorted({c.ratio for c in searchable(engine)}))
        if self.optimizer is not None:
            vs = self.optimizer.variables
            vs = vs() if callable(vs) and not isinstance(vs, list) else vs
            self.out["opt_variables"] = len(vs)
            self.out["opt_digests"].append(hashlib.sha256(b"".join(
                np.ascontiguousarray(v.numpy()).tobytes() for v in vs)).hexdigest()[:16])
        self.out["plans"].append(plan_digest(engine.plan))
        self.out["compressed"].append(sorted(n for n, d in engine.layout().items()
                                             if d["compress"]))


def run_tape(args, settings, rec):
    model = build_model()
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    held = {}

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=args.compression_spec,
                                           plan=settings)
        held["tape"] = tape  # traced once: the tape whose engine every step uses
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    start = 0
    opt.build(model.trainable_variables)
    if args.resume:
        prefix = os.path.join(args.ckpt, f"step{args.save_at}.rank{hvd.rank()}")
        ckpt.read(prefix).assert_consumed()
        with open(prefix + ".hipress", "rb") as f:
            hvd.load_compressor_state(f.read())  # loaded when the tape's engine is built
        start = args.save_at
    else:
        hvd.broadcast_variables(model.variables, root_rank=0)
    for step in range(start, args.steps):
        step_fn(*map(tf.constant, batch(hvd.rank(), step)))
        sync = held["tape"].sync
        rec.after(model, sync.engine)
        if args.ckpt and not args.resume and step + 1 == args.save_at:
            os.makedirs(args.ckpt, exist_ok=True)
            prefix = os.path.join(args.ckpt, f"step{step + 1}.rank{hvd.rank()}")
            ckpt.write(prefix)
            with open(prefix + ".hipress", "wb") as f:
                f.write(hvd.compressor_state())
    return sync.online


class _AfterBatch(keras.callbacks.Callback):
    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def on_train_batch_end(self, batch, logs=None):
        self.rec.after(self.model, self.model.optimizer.engine)


def run_fit(args, settings, rec):
    model = build_model()
    sgd = keras.optimizers.legacy.SGD if args.legacy else keras.optimizers.SGD  # Keras 2
    opt = hvd.DistributedOptimizer(sgd(0.05, momentum=0.9),
                                   compression=args.compression_spec, plan=settings)
    rec.optimizer = opt  # Keras 3: its variables and the inner one's; Keras 2: a subclass
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    per = args.steps_per_epoch
    first = 0
    callbacks = [_AfterBatch(rec)]
    if args.resume:
        first = args.save_at // per
        opt.build(model.trainable_variables)  # the engine too: it receives its state
        model.load_weights(os.path.join(args.ckpt, f"epoch{first}.rank{hvd.rank()}.weights.h5"))
    else:
        callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
    for epoch in range(first, args.steps // per):
        xs, ys = zip(*(batch(hvd.rank(), s) for s in range(epoch * per, (epoch + 1) * per)))
        model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=BATCH,
                  initial_epoch=epoch, epochs=epoch + 1, shuffle=False, verbose=0,
                  callbacks=callbacks)
        if args.ckpt and not args.resume and (epoch + 1) * per == args.save_at:
            os.makedirs(args.ckpt, exist_ok=True)
            model.save_weights(os.path.join(args.ckpt,
                                            f"epoch{epoch + 1}.rank{hvd.rank()}.weights.h5"))
    return opt.online


def run_apply(args, settings, rec):
    """A step that calls ``opt.apply_gradients`` of the Keras ``hvd.DistributedOptimizer``
    itself (a custom loop, no ``model.fit``), traced or ``--eager``; no checkpoint."""
    model = build_model()
    sgd = keras.optimizers.legacy.SGD if args.legacy else keras.optimizers.SGD  # Keras 2
    opt = hvd.DistributedOptimizer(sgd(0.05, momentum=0.9),
                                   compression=args.compression_spec, plan=settings)
    rec.optimizer = opt
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step_fn = train_step if args.eager else tf.function(train_step)

    hvd.broadcast_variables(model.variables, root_rank=0)
    for step in range(args.steps):
        step_fn(*map(tf.constant, batch(hvd.rank(), step)))
        rec.after(model, opt.engine)
    return opt.online


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["tape", "fit", "apply"], default="tape")
    p.add_argument("--profile", required=True)
    p.add_argument("--compression", default="onebit")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--steps-per-epoch", type=int, default=12)
    p.add_argument("--save-at", type=int, default=12)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--legacy", action="store_true",
                   help="fit: Keras 2's legacy optimizer (slots created at its first update)")
    p.add_argument("--eager", action="store_true", help="apply: run the step eagerly")
    p.add_argument("--ratio", nargs="*", type=float, default=None,
                   help="AR-Topk's ratio search over these candidate ratios")
    args = p.parse_args()

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    args.compression_spec = args.compression
    if args.ratio is None:
        settings = hvd.Adaptive(check_every=5, margin=0.1, max_switches=4,
                                profile=args.profile, estimate=fast_slow_fast)
    else:
        args.compression_spec = hvd.Compression.get("star_topk", ratio=0.1)
        settings = hvd.Adaptive(check_every=4, profile=args.profile, estimate=always_slow,
                                ratio=AdaptiveCRConfig(candidates=tuple(args.ratio),
                                                       explore_iters=2, check_every=50))
    rec = Record()
    run = {"tape": run_tape, "fit": run_fit, "apply": run_apply}[args.mode]
    online = run(args, settings, rec)
    assert online is not None, "plan='adaptive' built no online planner"
    rec.out.update(rank=hvd.rank(), size=hvd.size(), switches=online.switches,
                   checks=[h["step"] for h in online.history if "judged" not in h],
                   switched=[h["step"] for h in online.history if h.get("switched")],
                   ratio_history=ratio_history(online))
    print("RESULT " + json.dumps(rec.out), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
