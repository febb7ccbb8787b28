"""plan="adaptive" on every face: taken where the face re-plans, refused where it does not.

``hipress_like.torch.DistributedOptimizer`` runs the online planner; the DDP comm
hook refuses the option (``engine_builder.refuse_adaptive``) with a message that
names the face, what it takes, what it found and what to use, rather than keep its
first plan and never adapt. The BytePS-style optimizer
takes it (BytePS's knobs' plan starts, ``hipress_like/byteps/adaptive.py``) and
still refuses any other plan; tests/multiprocess/test_adaptive_byteps.py
re-plans it on two ranks. TensorFlow's optimizer and
tape and the Gluon trainer run the online planner too: here they are checked
to take ``"adaptive"`` and ``Adaptive(...)`` (one rank: nothing to adapt, so
no planner) and to keep refusing ``compression_back`` with it, in their own
environments (``.venv-tf``, ``.venv-mxnet`` beside this one, built by
``scripts/env_tensorflow.sh`` / ``env_mxnet.sh``), one process each, when those
exist; tests/frameworks/test_adaptive_tensorflow.py and test_adaptive_mxnet.py
re-plan them on two ranks. Last, the candidates ``compression="auto"`` takes on
each torch face follow the parameters' device (``tuning.auto.default_candidates``).
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


def test_the_byteps_style_optimizer_takes_plan_adaptive_and_refuses_other_plans(one_rank):
    import hipress_like.byteps.torch as bps

    m = torch.nn.Linear(6, 3)
    for plan in ("auto", "plan.json", hpt.Compression.onebit):
        with pytest.raises(ValueError) as e:
            bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                     named_parameters=m.named_parameters(), plan=plan)
        msg = str(e.value)
        assert msg.startswith("hipress_like.byteps.torch.DistributedOptimizer plans from "
                              "BytePS's knobs (BYTEPS_MIN_COMPRESS_BYTES, "
                              "BYTEPS_PARTITION_BYTES)"), msg
        assert f"expected plan=None, found {plan!r}; set the knobs, or use " \
               "hipress_like.torch.DistributedOptimizer(..., plan=...)" in msg, msg
        assert "plan='adaptive'" in msg, msg
    for plan in (None, "adaptive", bps.Adaptive(check_every=5)):
        for params in (None, {"compressor": "onebit", "ef": "vanilla"}):
            opt = bps.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                           named_parameters=m.named_parameters(), plan=plan,
                                           compression_params=params)
            assert opt.online is None  # one rank: nothing to adapt (or the knobs, fixed)
            if params is not None:  # BytePS's knobs' plan, with or without re-planning
                assert opt.engine.plan.rule.min_compress_bytes == 65536
                assert (opt.engine.plan.meta.get("byteps") == "knobs") == (plan is not None)
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


# the faces that re-plan take the option (asserted in the script: a failure is its
# exit status and traceback) and still refuse compression_back with it (REFUSED lines)
_TF = """
import tensorflow as tf
import hipress_like.tensorflow as hvd
hvd.init()
v = [tf.Variable(tf.zeros((64, 64)))]
for plan in ("adaptive", hvd.Adaptive(check_every=5)):
    tape = hvd.DistributedGradientTape(tf.GradientTape(), compression="onebit", plan=plan)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression="onebit",
                                   plan=plan)
    opt.build(v)
    assert opt.engine is not None and opt.online is None  # one rank: nothing to adapt
    opt.close()
opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression="onebit",
                               compression_back="onebit", plan="adaptive")
try:
    opt.build(v)
except ValueError as e:
    print("REFUSED", str(e).replace("\\n", " "))
hvd.shutdown()
"""

_MX = """
import mxnet as mx
import hipress_like.mxnet as hvd
hvd.init()
net = mx.gluon.nn.Dense(64, in_units=64)
net.initialize()
for plan in ("adaptive", hvd.Adaptive(check_every=5)):
    tr = hvd.DistributedTrainer(net.collect_params(), "sgd", compression="onebit", plan=plan)
    assert tr.engine is not None and tr.online is None  # one rank: nothing to adapt
    tr.close()
try:
    hvd.DistributedTrainer(net.collect_params(), "sgd", compression="onebit",
                           compression_back="onebit", plan="adaptive")
except ValueError as e:
    print("REFUSED", str(e).replace("\\n", " "))
hvd.shutdown()
"""


@pytest.mark.frameworks
def test_the_tensorflow_faces_take_plan_adaptive():
    msgs = _run(_venv(".venv-tf"), _TF)
    assert len(msgs) == 1 and "compression_back is not supported with it" in msgs[0], msgs


@pytest.mark.frameworks
def test_the_mxnet_trainer_takes_plan_adaptive():
    msgs = _run(_venv(".venv-mxnet"), _MX)
    assert len(msgs) == 1 and "compression_back is not supported with it" in msgs[0], msgs


def test_compression_auto_takes_the_candidates_of_the_parameters_device(one_rank):
    """compression="auto" on CPU parameters chooses PowerSGD with a bfloat16 error memory
    (its C kernels read it); another device keeps float32 (``default_candidates``)."""
    from hipress_like.adapters.engine_builder import device_type_of
    from hipress_like.tuning.auto import DEFAULT_CANDIDATES, default_candidates

    m = torch.nn.Linear(6, 3)
    assert device_type_of(list(m.parameters())) == "cpu"
    for opt in (hpt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                         named_parameters=m.named_parameters(),
                                         compression="auto", plan="auto"),
                hpt.CaSyncHookState(m, compression="auto", plan="auto")):
        engine = opt.engine
        assert engine.config.plan.candidates == DEFAULT_CANDIDATES
        assert engine.plan.meta["profile"]["compressors"]["powersgd"]["params"] == {
            "rank": 2, "error_dtype": "bfloat16"}
        opt.close()
    gpu = default_candidates("cuda")
    assert gpu["powersgd"] == {"rank": 2} and gpu["onebit"] == DEFAULT_CANDIDATES["onebit"]
    assert DEFAULT_CANDIDATES["powersgd"]["error_dtype"] == "bfloat16"  # a copy was changed
