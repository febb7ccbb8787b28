"""``hvd.elastic`` on the TensorFlow face under torchrun's elastic agent: a rank killed
mid-run restarts, the group resumes from the last checkpointed commit and ends bitwise
where the uninterrupted run ends.

Needs TensorFlow next to torch (``scripts/env_tensorflow.sh --test``).
"""
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .test_horovodrun import _env, results_of

pytestmark = pytest.mark.frameworks
pytest.importorskip("tensorflow")

JOB = Path(__file__).resolve().parent / "tf_elastic_job.py"
ROOT = Path(__file__).resolve().parents[2]
EVERY = 10


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(out: Path, restarts: int, **env):
    """Run the job on 2 ranks under torchrun's elastic agent; (results by rank, rc, output)."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:1",
           "--nproc-per-node", "2", "--max-restarts", str(restarts), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"tfelastic{port}",
           "--monitor-interval", "0.1", "--tee=3", str(JOB)]
    proc = subprocess.run(cmd, env=_env(JOB_OUT=str(out), JOB_COMMIT_EVERY=str(EVERY),
                                        HIPRESS_ELASTIC_CHECKPOINT=str(out / "ck.npz"),
                                        OMP_NUM_THREADS="1", **env),
                          text=True, capture_output=True, timeout=600, cwd=str(ROOT))
    text = proc.stdout + proc.stderr
    return results_of(text), proc.returncode, text


def test_killed_rank_restarts_and_resumes_from_the_last_commit_bitwise(tmp_path):
    steps, kill_at = 40, 25
    ref, rc, out = _job(tmp_path / "reference", 0, JOB_STEPS=str(steps))
    assert rc == 0 and sorted(ref) == [0, 1], out[-4000:]
    res, rc, out = _job(tmp_path / "elastic", 1, JOB_STEPS=str(steps),
                        JOB_KILL=f"{kill_at}:1")
    assert rc == 0 and sorted(res) == [0, 1], out[-4000:]
    events = [json.loads(line) for line in
              open(tmp_path / "elastic" / "events.jsonl")]
    assert {e["step"] for e in events} == {kill_at - kill_at % EVERY}, events  # the commit
    assert all(r["restart"] == 1 and r["restored_from"] for r in res.values()), res
    assert len({r["digest"] for r in res.values()}) == 1, "replicas differ after the restart"
    assert res[0]["digest"] == ref[0]["digest"] == ref[1]["digest"], \
        "the resumed job does not end where the uninterrupted one does"
    assert res[0]["acc"] == ref[0]["acc"]


def test_states_refuse_what_they_cannot_keep():
    import keras
    import tensorflow as tf

    import hipress_like.tensorflow as hvd

    with pytest.raises(ValueError, match="variables"):
        hvd.elastic.TensorFlowState([])
    with pytest.raises(ValueError, match="sessions"):
        hvd.elastic.TensorFlowState([tf.Variable(1.0)], session=object())
    with pytest.raises(ValueError, match="built"):
        hvd.elastic.TensorFlowKerasState(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="checkpoint_every"):
        hvd.elastic.TensorFlowState([tf.Variable(1.0)], checkpoint_every=0)


def test_a_commit_and_a_restore_in_one_process(tmp_path):
    """Horovod's semantics: construction and sync are points restore goes back to; a
    commit replaces them; a fresh state reads the checkpoint file; a scalar msgpack cannot
    write is refused naming it; a corrupted file is a CheckpointError."""
    import numpy as np
    import tensorflow as tf

    import hipress_like.tensorflow as hvd
    from hipress_like.adapters.checkpoint_io import CheckpointError

    v = tf.Variable([1.0, 2.0])
    path = str(tmp_path / "ck.npz")
    s = hvd.elastic.TensorFlowState([v], checkpoint=path, step=0)
    v.assign([5.0, 5.0])
    s.step = 3
    assert s.restore() and v.numpy().tolist() == [1.0, 2.0] and s.step == 0
    v.assign([7.0, 8.0])
    s.step = 4
    s.commit()
    v.assign([0.0, 0.0])
    assert s.restore() and v.numpy().tolist() == [7.0, 8.0] and s.step == 4
    w = tf.Variable([0.0, 0.0])
    fresh = hvd.elastic.TensorFlowState([w], checkpoint=path, step=0)
    fresh._baseline = None  # as in a process torchrun started: nothing kept yet
    assert fresh.restore() and fresh.restored_from == path
    np.testing.assert_array_equal(w.numpy(), [7.0, 8.0])
    assert fresh.step == 4 and fresh.commits == 1
    s.blob = object()
    s._names.append("blob")
    with pytest.raises(TypeError, match="scalar"):
        s.commit()
    with open(path, "wb") as f:
        f.write(b"not a checkpoint")
    bad = hvd.elastic.TensorFlowState([w], checkpoint=path)
    bad._baseline = None
    with pytest.raises(CheckpointError):
        bad.restore()


def test_keras_callbacks_keep_the_state_in_step_with_fit():
    """CommitStateCallback commits every N batches and at each epoch's end; the batch and
    epoch callbacks keep state.batch / state.epoch as Horovod's Keras callbacks do."""
    import keras
    import numpy as np

    import hipress_like.tensorflow.keras as hvd

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=3)
    batches = []

    class Seen(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append(state.batch)

    x, y = np.ones((12, 4), "float32"), np.zeros((12, 2), "float32")
    model.fit(x, y, batch_size=4, epochs=2, verbose=0,
              callbacks=[hvd.elastic.UpdateBatchStateCallback(state),
                         hvd.elastic.UpdateEpochStateCallback(state),
                         hvd.elastic.CommitStateCallback(state, batches_per_commit=2), Seen()])
    assert batches == [0, 1, 2, 0, 1, 2]
    assert state.epoch == 5 and state.batch == 0
    assert state.commits == 3 + 2  # after batches 2, 4 and 6 (of 6), and at two epoch ends
    with pytest.raises(ValueError, match="batches_per_commit"):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)
