"""plan="adaptive" on the faces that do not re-plan: refused where the face is built.

Only ``hipress_like.torch.DistributedOptimizer`` runs the online planner; the
DDP comm hook, the BytePS-style optimizer, TensorFlow's optimizer and tape and
the Gluon trainer refuse the option (``engine_builder.refuse_adaptive``) with
a message that names the face, what it takes, what it found and what to use,
rather than keep their first plan and never adapt. The TensorFlow and MXNet
faces are checked in their own environments (``.venv-tf``, ``.venv-mxnet``
beside this one, built by ``scripts/env_tensorflow.sh`` / ``env_mxnet.sh``),
one process each, when those exist.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hipress_like.torch as hpt

ROOT = Path(__file__).resolve().parents[2]


def _says_what_to_do(msg, face, found):
    assert face in msg, msg
    assert "expected" in msg and f"found {found}" in msg, msg
    assert "hipress_like.torch.DistributedOptimizer(..., plan='adaptive')" in msg, msg


@pytest.fixture
def one_rank():
    hpt.init()
    yield
    hpt.shutdown()


@pytest.mark.parametrize("plan", ["adaptive", hpt.Adaptive(check_every=5)],
                         ids=["string", "Adaptive"])
def test_the_ddp_hook_refuses_plan_adaptive(one_rank, plan):
    with pytest.raises(ValueError) as e:
        hpt.CaSyncHookState(torch.nn.Linear(6, 3), compression="onebit", plan=plan)
    _says_what_to_do(str(e.value), "hpt.CaSyncHookState (the DDP comm hook)", repr(plan))
    assert "plan='auto'" in str(e.value)


def test_the_byteps_style_optimizer_refuses_plan_adaptive_and_other_plans(one_rank):
    import hipress_like.byteps.torch as bps

    m = torch.nn.Linear(6, 3)
    with pytest.raises(ValueError) as e:
        bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=m.named_parameters(), plan="adaptive")
    msg = str(e.value)
    _says_what_to_do(msg, "hipress_like.byteps.torch.DistributedOptimizer", "'adaptive'")
    assert "plan=None (BytePS's knobs plan)" in msg and "BYTEPS_PARTITION_BYTES" in msg
    with pytest.raises(ValueError, match="expected plan=None, found 'auto'"):
        bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=m.named_parameters(), plan="auto")
    opt = bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), plan=None)
    assert opt.online is None  # the default: BytePS's knobs, as before
    opt.close()


def _venv(name):
    py = Path(sys.prefix).parent / name / "bin" / "python"
    if not py.exists():
        pytest.skip(f"{py} does not exist; build it (scripts/env_tensorflow.sh or "
                    "scripts/env_mxnet.sh) to check this face")
    return str(py)


def _run(python, code):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    res = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [ln[len("REFUSED "):] for ln in res.stdout.splitlines() if ln.startswith("REFUSED ")]


_TF = """
import tensorflow as tf
import hipress_like.tensorflow as hvd
for build in (lambda: hvd.DistributedGradientTape(tf.GradientTape(), plan="adaptive"),
              lambda: hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), plan="adaptive")):
    try:
        build()
        print("ACCEPTED")
    except ValueError as e:
        print("REFUSED", str(e).replace("\\n", " "))
"""

_MX = """
import mxnet as mx
import hipress_like.mxnet as hvd
hvd.init()
net = mx.gluon.nn.Dense(3)
net.initialize()
try:
    hvd.DistributedTrainer(net.collect_params(), "sgd", plan="adaptive")
    print("ACCEPTED")
except ValueError as e:
    print("REFUSED", str(e).replace("\\n", " "))
hvd.shutdown()
"""


@pytest.mark.frameworks
def test_the_tensorflow_faces_refuse_plan_adaptive():
    msgs = _run(_venv(".venv-tf"), _TF)
    assert len(msgs) == 2, msgs
    for msg, face in zip(msgs, ("DistributedGradientTape", "DistributedOptimizer")):
        _says_what_to_do(msg, f"hipress_like.tensorflow.{face}", "'adaptive'")


@pytest.mark.frameworks
def test_the_mxnet_trainer_refuses_plan_adaptive():
    msgs = _run(_venv(".venv-mxnet"), _MX)
    assert len(msgs) == 1, msgs
    _says_what_to_do(msgs[0], "hipress_like.mxnet.DistributedTrainer", "'adaptive'")
