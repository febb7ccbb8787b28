"""One rank of the TensorFlow-face checks (run by test_tensorflow.py on real ranks).

Each check exercises one behaviour through ``hipress_like.tensorflow`` only
and prints ``CHECK <name> ok`` or ``CHECK <name> FAIL <why>``; a failing
check does not stop the others (every check is collective, so all ranks run
them in the same order). The first group is the functional surface
(collectives, eagerly and inside ``tf.function``); the second is the bad
input the PyTorch face refuses, refused the same way: an unknown
compressor, a bad NaN policy, NaN gradients under ``nonfinite="raise"``
and ``"skip"``, non-float gradients, models that differ between ranks.
"""
import os
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hipress_like.tensorflow as hvd  # noqa: E402
from hipress_like.adapters.tensorflow.native import horovod_tf  # noqa: E402

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def _model(width=8, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(3)])


def _data(step=0):
    g = np.random.default_rng([hvd.rank(), step])
    return g.normal(size=(6, 4)).astype("float32"), g.integers(0, 3, 6)


_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _expect_error(fn, *needles):
    """Run fn; it must raise, and the error text must hold every needle."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the check inspects any error
        text = f"{type(e).__name__}: {e}"
        missing = [n for n in needles if n not in text]
        assert not missing, f"error lacks {missing}: {text[:600]}"
        return text
    raise AssertionError("no error was raised")


# -- the functional surface ---------------------------------------------------------------

@check
def rank_and_size():
    assert 0 <= hvd.rank() < hvd.size(), (hvd.rank(), hvd.size())
    env = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
    assert env is None or int(env) == hvd.rank(), (env, hvd.rank())


@check
def allreduce_eager_and_in_tf_function():
    r, n = hvd.rank(), hvd.size()
    t = tf.reshape(tf.range(6, dtype=tf.float32), (2, 3)) * (r + 1)
    total = tf.reshape(tf.range(6, dtype=tf.float32), (2, 3)) * sum(range(1, n + 1))
    np.testing.assert_array_equal(hvd.allreduce(t, op=hvd.Sum), total)
    np.testing.assert_allclose(hvd.allreduce(t), total / n)
    graph = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum) + 0)(t)
    assert graph.shape == (2, 3)
    np.testing.assert_array_equal(graph, total)
    ints = hvd.allreduce(tf.constant([r, 1], tf.int64), op=hvd.Sum)
    np.testing.assert_array_equal(ints, [sum(range(n)), n])


@check
def allgather_variable_size_and_broadcast():
    r, n = hvd.rank(), hvd.size()
    got = hvd.allgather(tf.fill((r + 1, 2), r))
    want = np.concatenate([np.full((k + 1, 2), k, np.int32) for k in range(n)])
    np.testing.assert_array_equal(got, want)
    graph = tf.function(lambda x: hvd.allgather(x))(tf.fill((r + 1, 2), r))
    np.testing.assert_array_equal(graph, want)
    np.testing.assert_array_equal(hvd.broadcast(tf.fill((3,), float(r)), root_rank=n - 1),
                                  np.full(3, n - 1, np.float32))


@check
def broadcast_variables_eager_and_in_tf_function():
    r, n = hvd.rank(), hvd.size()
    a = tf.Variable(tf.fill((2, 2), float(r)))
    b = tf.Variable(tf.constant(r, tf.int64))
    hvd.broadcast_variables([a, b], root_rank=n - 1)
    np.testing.assert_array_equal(a.numpy(), np.full((2, 2), n - 1, np.float32))
    assert int(b.numpy()) == n - 1
    m = _model(seed=r)

    @tf.function
    def sync_model():
        hvd.broadcast_variables(m.variables, root_rank=0)  # an op, run by the function
    sync_model()
    ws = hvd.allgather_object([w.tolist() for w in m.get_weights()])
    assert all(w == ws[0] for w in ws), "models differ after broadcast_variables"


@check
def broadcast_and_allgather_object():
    obj = {"hello": 123, "list": [1, 2]} if hvd.rank() == 0 else None
    assert hvd.broadcast_object(obj, root_rank=0) == {"hello": 123, "list": [1, 2]}
    assert hvd.allgather_object(hvd.rank()) == list(range(hvd.size()))


@check
def identity_compression_is_the_exact_average():
    """Compression.none through the engine: every gradient equals allreduce's average."""
    m = _model(seed=0)
    x, y = _data()
    with tf.GradientTape() as tape:
        loss = _LOSS(y, m(x))
    local = tape.gradient(loss, m.trainable_variables)
    with tf.GradientTape() as tape:
        loss = _LOSS(y, m(x))
    avg = hvd.DistributedGradientTape(tape, compression=hvd.Compression.none,
                                      plan=None).gradient(loss, m.trainable_variables)
    for g, a in zip(local, avg):
        np.testing.assert_allclose(a, hvd.allreduce(g), rtol=1e-6, atol=1e-7)


@check
def horovod_calls_eager_and_in_tf_function():
    """horovod.tensorflow's calls beyond the collectives: alltoall (its received splits),
    reducescatter (Horovod's row split), the grouped forms, broadcast_, the *_op
    queries, a process set; eagerly and inside tf.function."""
    r, n = hvd.rank(), hvd.size()
    x = tf.reshape(tf.range(4 * n, dtype=tf.float32), (2 * n, 2)) + 100.0 * r
    out = hvd.alltoall(x)  # no splits given: the rows alone, as horovod.tensorflow returns
    out_, recv = hvd.alltoall(x, splits=[2] * n)
    np.testing.assert_array_equal(out_, out)
    want = np.concatenate([(np.arange(4 * n, dtype="float32").reshape(2 * n, 2) + 100.0 * p)
                           [2 * r:2 * r + 2] for p in range(n)])
    np.testing.assert_array_equal(out, want)
    assert recv.numpy().tolist() == [2] * n
    g_out, g_recv = tf.function(lambda t: hvd.alltoall(t, splits=tf.fill([n], 2)))(x)
    np.testing.assert_array_equal(g_out, want)
    assert g_recv.numpy().tolist() == [2] * n
    sp = [r + 1 if p == 0 else 0 for p in range(n)]  # everything to rank 0
    rows = tf.fill([r + 1, 3], float(r))
    o, rv = hvd.alltoall(rows, splits=sp)
    if r == 0:
        assert rv.numpy().tolist() == [p + 1 for p in range(n)], rv
        assert o.shape[0] == n * (n + 1) // 2
    else:
        assert o.shape[0] == 0 and rv.numpy().tolist() == [0] * n
    summed = hvd.reducescatter(tf.ones((n + 1, 2)) * (r + 1), op=hvd.Sum)
    mine = 2 if r == 0 else 1  # Horovod's split: the first rows % n ranks get one more
    np.testing.assert_array_equal(summed, np.full((mine, 2), n * (n + 1) / 2, "float32"))
    f = tf.function(lambda t: hvd.reducescatter(t, op=hvd.Sum))(tf.ones((n + 1, 2)))
    assert f.shape == (mine, 2)
    a, b = hvd.grouped_allgather([tf.constant([r]), tf.constant([[r, r]])])
    assert a.numpy().tolist() == list(range(n)) and b.shape == (n, 2)
    c, d = hvd.grouped_reducescatter([tf.ones((n, 1)), tf.ones((n,))], op=hvd.Sum)
    assert c.numpy().tolist() == [[float(n)]] and d.numpy().tolist() == [float(n)]
    v = tf.Variable([float(r), 7.0])
    got = hvd.broadcast_([v], root_rank=n - 1)[0]  # the variable (Horovod: its new value)
    assert v.numpy().tolist() == [float(n - 1), 7.0]
    np.testing.assert_array_equal(got, v.numpy())
    assert int(hvd.size_op()) == n and int(hvd.rank_op()) == r
    assert int(hvd.local_size_op()) == hvd.local_size() and int(hvd.local_rank_op()) == \
        hvd.local_rank()
    ps = hvd.add_process_set([0])  # every rank adds it; only its member uses it
    try:
        if r == 0:
            np.testing.assert_array_equal(hvd.allreduce(tf.constant([3.0]), op=hvd.Sum,
                                                        process_set=ps), [3.0])
    finally:
        hvd.remove_process_set(ps)
    assert not hvd.ccl_built() and not hvd.ddl_built()


@check
def collectives_carry_horovods_gradients():
    """Each collective's gradient is the one Horovod registers for its op
    (horovod/tensorflow/mpi_ops.py), eagerly and inside tf.function; the same
    numbers come from Horovod's own ops under horovodrun."""
    r, n = hvd.rank(), hvd.size()
    x = tf.Variable(tf.range(2 * n, dtype=tf.float32) + 10.0 * r)
    ones = np.ones(2 * n, "float32")

    def grads():
        with tf.GradientTape(persistent=True) as tape:
            outs = {
                "allreduce_sum": hvd.allreduce(x, op=hvd.Sum),
                "allreduce_average": hvd.allreduce(x * 3.0),
                "allgather": hvd.allgather(x) * (r + 1.0),
                "broadcast": hvd.broadcast(x, root_rank=n - 1),
                "alltoall": hvd.alltoall(x),
                "reducescatter_sum": hvd.reducescatter(x, op=hvd.Sum),
                "reducescatter_average": hvd.reducescatter(x),
                "grouped_allgather": hvd.grouped_allgather([x, x * 2.0])[1],
                "grouped_allreduce": hvd.grouped_allreduce([x, x * 2.0], op=hvd.Sum)[1],
            }
        return {k: tape.gradient(y, x).numpy() for k, y in outs.items()}

    mean_factor = (n + 1) / 2.0  # the average over ranks of (rank + 1)
    want = {
        "allreduce_sum": ones * n,          # the same Sum of the upstream ones
        "allreduce_average": ones * 3.0,    # the average of 3s
        "allgather": ones * mean_factor,    # averaged, then this rank's rows
        "broadcast": ones * (r == n - 1),   # the average on the root, zero elsewhere
        "alltoall": ones,                   # sent back along the received splits
        "reducescatter_sum": ones * n,      # allgather of the upstream ones times n
        "reducescatter_average": ones,
        "grouped_allgather": ones * 2.0,
        "grouped_allreduce": ones * 2.0 * n,
    }
    eager = grads()
    for k, w in want.items():
        np.testing.assert_allclose(eager[k], w, err_msg=k)

    @tf.function
    def in_graph(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            y = hvd.allgather(v) * 2.0 + 0.0
            z = hvd.allreduce(v, op=hvd.Sum)
        return tape.gradient([y, z], v)

    np.testing.assert_allclose(in_graph(tf.ones(3)), np.full(3, 2.0 + n, "float32"))
    ints = tf.constant([1, 2])
    with tf.GradientTape() as tape:  # integer collectives: no gradient, no error
        tape.watch(x)
        y = hvd.allreduce(ints, op=hvd.Sum)
    assert tape.gradient(y, x) is None


@check
def collectives_of_a_session_graph_run_in_one_order():
    """Independent collectives of a tf.compat.v1 session graph (Horovod's graph-mode
    tests): the session would run them on parallel threads in any order, which
    crosses two ranks' collectives on the wire; each waits for the one built
    before it."""
    r, n = hvd.rank(), hvd.size()
    graph = tf.Graph()
    with graph.as_default():
        outs = [hvd.allgather(tf.fill([r + 1, 3], float(i))) for i in range(4)]
        outs += [hvd.allreduce(tf.constant([float(r + i)]), op=hvd.Sum) for i in range(4)]
        outs.append(hvd.broadcast(tf.constant([float(r)]), root_rank=0))
        with tf.compat.v1.Session(graph=graph) as sess:
            for _ in range(5):
                got = sess.run(outs)
    rows = n * (n + 1) // 2
    for i in range(4):
        np.testing.assert_array_equal(got[i], np.full((rows, 3), float(i), "float32"))
        np.testing.assert_array_equal(got[4 + i], [sum(p + i for p in range(n))])
    np.testing.assert_array_equal(got[8], [0.0])


@check
def sync_batch_normalization_is_the_global_batchs():
    """hvd.SyncBatchNormalization on one row per rank gives what BatchNormalization gives on
    the whole batch: outputs, moving statistics, and the gradient of the ranks' summed
    losses (Horovod's test_horovod_syncbn_cpu, plus the gradient)."""
    r, n = hvd.rank(), hvd.size()
    x = np.stack([np.array([[p, p + 1], [2 * p, 2 * p + 1], [3 * p + 1, p]], "float32")
                  for p in range(n)])
    w = np.arange(x.size, dtype="float32").reshape(x.shape) / x.size
    bn = keras.layers.BatchNormalization(axis=1)
    sync = hvd.SyncBatchNormalization(axis=1)
    full_x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(full_x)
        full = bn(full_x, training=True)
        loss = tf.reduce_sum(full * w)
    full_grad = tape.gradient(loss, full_x).numpy()
    mine = tf.constant(x[r:r + 1])
    with tf.GradientTape() as tape:
        tape.watch(mine)
        out = sync(mine, training=True)
        loss = tf.reduce_sum(out * w[r:r + 1])
    grad = tape.gradient(loss, mine).numpy()
    np.testing.assert_allclose(out.numpy(), full.numpy()[r:r + 1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sync.moving_mean.numpy(), bn.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), bn.moving_variance.numpy(),
                               rtol=1e-5)
    np.testing.assert_allclose(grad, full_grad[r:r + 1], rtol=1e-4, atol=1e-5)
    _expect_error(lambda: hvd.SyncBatchNormalization(fused=True), "fused")


@check
def a_mismatch_between_ranks_is_a_failed_precondition_eagerly():
    """Ranks that pass different shapes to an eager allreduce/allgather are refused on
    every rank with TFMismatchError: this project's CollectiveMismatchError naming the
    ranks, and tf.errors.FailedPreconditionError, as horovod.tensorflow raises."""
    from hipress_like.adapters.agreement import CollectiveMismatchError

    r = hvd.rank()
    for call in (lambda: hvd.allreduce(tf.ones([3 + r])),
                 lambda: hvd.allgather(tf.ones([2, 2 + r]))):
        try:
            call()
        except tf.errors.FailedPreconditionError as e:
            assert isinstance(e, CollectiveMismatchError) and isinstance(e, hvd.TFMismatchError)
            assert "rank" in str(e) and e.ranks, str(e)
        else:
            raise AssertionError("no error was raised")
    np.testing.assert_array_equal(hvd.allreduce(tf.ones(2), op=hvd.Sum), [2.0, 2.0])  # goes on


@check
def horovod_calls_refuse_bad_arguments():
    """Refusals a Horovod TF script catches as RuntimeError (and ValueError)."""
    n = hvd.size()
    if horovod_tf() is not None:
        # handed to horovod.tensorflow's ops (horovodrun): Horovod's own errors
        _expect_error(lambda: hvd.alltoall(tf.ones((n + 1, 2))), "splits")
        _expect_error(lambda: hvd.alltoall(tf.ones((2, 2)), splits=[5] + [0] * (n - 1)),
                      "splits")
        return
    text = _expect_error(lambda: hvd.alltoall(tf.ones((n + 1, 2))), "alltoall")
    assert text.startswith("TFCallError"), text
    _expect_error(lambda: hvd.alltoall(tf.ones((2, 2)), splits=[5] + [0] * (n - 1)), "alltoall")
    _expect_error(lambda: hvd.broadcast_([tf.constant(1.0)], root_rank=0), "tf.Variable")
    assert issubclass(hvd.TFCallError, RuntimeError) and issubclass(hvd.TFCallError, ValueError)


# -- bad input, refused as the PyTorch face refuses it --------------------------------------

@check
def unknown_compressor_is_refused():
    _expect_error(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                   compression="tpok"),
                  "ValueError", "unknown compressor 'tpok'", "available:", "topk")
    _expect_error(lambda: hvd.DistributedGradientTape(tf.GradientTape(), compression="tpok"),
                  "ValueError", "unknown compressor 'tpok'", "available:", "topk")
    _expect_error(lambda: hvd.Compression.tpok, "has no compressor 'tpok'", "available:")


@check
def bad_options_are_refused():
    sgd = keras.optimizers.SGD(0.1)
    _expect_error(lambda: hvd.DistributedOptimizer(sgd, nonfinite="ignore"),
                  "ValueError", "nonfinite must be")
    _expect_error(lambda: hvd.DistributedGradientTape(tf.GradientTape(), nonfinite="bogus"),
                  "ValueError", "nonfinite must be")
    _expect_error(lambda: hvd.DistributedOptimizer(sgd, strategy="tree"), "strategy must be")
    _expect_error(lambda: hvd.DistributedOptimizer(sgd, op=hvd.Adasum), "Adasum")
    _expect_error(lambda: hvd.DistributedOptimizer(sgd, backward_passes_per_step=2),
                  "gradient_accumulation_steps")
    _expect_error(lambda: hvd.DistributedOptimizer("sgd"), "TypeError", "Keras 3 optimizer")


@check
def non_float_gradients_are_refused():
    w = tf.Variable(tf.ones((3,)))
    counts = tf.Variable(tf.zeros((3,), tf.int32))

    def tape_path():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * tf.cast(counts + 1, tf.float32))
        hvd.DistributedGradientTape(tape, plan=None).gradient(loss, [w, counts])
    _expect_error(tape_path, "TypeError", "int32", "float32/float64")
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), plan=None)
    _expect_error(lambda: opt.build([w, counts]), "TypeError", "int32", "float32/float64")


@check
def models_that_differ_between_ranks_are_refused():
    """Rank 1's hidden layer is wider: every rank raises GradientMismatchError, for the
    tape (inside tf.function: raised while tracing) and for model.fit (at build)."""
    wide = 9 if hvd.rank() == 1 else 8
    m = _model(width=wide)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _LOSS(y, m(x))
        return hvd.DistributedGradientTape(tape, plan=None, timeout=60).gradient(
            loss, m.trainable_variables)
    x, y = _data()
    _expect_error(lambda: step(x, y), "GradientMismatchError")
    m2 = _model(width=wide)
    m2.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), plan=None,
                                                  timeout=60), loss=_LOSS)
    _expect_error(lambda: m2.fit(x, y, verbose=0), "GradientMismatchError")


@check
def nan_gradient_with_nonfinite_raise_fails_every_rank():
    m = _model()
    x, y = _data()
    if hvd.rank() == 1:
        x[0, 0] = np.nan
    with tf.GradientTape() as tape:
        loss = _LOSS(y, m(x))
    tape = hvd.DistributedGradientTape(tape, compression="onebit", plan=None,
                                       nonfinite="raise", timeout=60)
    text = _expect_error(lambda: tape.gradient(loss, m.trainable_variables), "rank 1")
    if hvd.rank() == 1:
        assert "NaN or Inf" in text, text


@check
def nan_gradient_with_nonfinite_skip_skips_the_step_on_every_rank():
    """Eager tape: step_ok is False everywhere; model.fit: no rank changes its weights."""
    m = _model()
    x, y = _data()
    if hvd.rank() == 1:
        x[0, 0] = np.nan
    with tf.GradientTape() as tape:
        loss = _LOSS(y, m(x))
    tape = hvd.DistributedGradientTape(tape, compression="onebit", plan=None,
                                       nonfinite="skip")
    tape.gradient(loss, m.trainable_variables)
    assert not bool(tape.step_ok), "step_ok should be False on every rank"
    m2 = _model()
    before = [w.copy() for w in m2.get_weights()]
    m2.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), plan=None,
                                                  nonfinite="skip"), loss=_LOSS)
    m2.fit(x, y, batch_size=6, epochs=1, verbose=0)
    for a, b in zip(before, m2.get_weights()):
        np.testing.assert_array_equal(a, b)
    x2, y2 = _data(step=1)  # finite everywhere: the next step does train
    m2.fit(x2, y2, batch_size=6, epochs=1, verbose=0)
    assert any(not np.array_equal(a, b) for a, b in zip(before, m2.get_weights()))


def main():
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    only = os.environ.get("SURFACE_ONLY")  # a comma-separated subset of the checks
    for fn in CHECKS:
        if only and fn.__name__ not in only.split(","):
            continue
        try:
            fn()
            print(f"CHECK {fn.__name__} ok", flush=True)
        except Exception:  # noqa: BLE001 - report and go on to the next check
            why = traceback.format_exc().strip().splitlines()
            print(f"CHECK {fn.__name__} FAIL {' | '.join(why[-4:])}", flush=True)
    print(f"DONE rank {hvd.rank()}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
