"""The TensorFlow face under Keras 2 (TensorFlow 2.15 and older), on real ranks.

Horovod's own TensorFlow ops build against these TensorFlows (not 2.16+), so
this is the environment of Horovod's own TF test files (``horovod_suite.py
--file tensorflow``) and of most Horovod Keras scripts. ``DistributedOptimizer``
there is a run-time subclass of the user's optimizer class
(``adapters/tensorflow/optimizer_keras2.py``). What must hold, on 2 ranks
under torchrun: ``model.fit`` with onebit and with a legacy optimizer leaves
the replicas bitwise identical, the wrapper is still an instance of the
user's class with its config, ``nonfinite="skip"`` skips a step with NaN on
one rank on every rank, and wrapping twice is an error.

Needs a Keras 2 TensorFlow beside torch:
``HIPRESS_TF_VENV=.venv-tf214 HIPRESS_TF_VERSION=2.14.1 scripts/env_tensorflow.sh``,
then ``.venv-tf214/bin/python -m pytest -m frameworks tests/frameworks/test_tensorflow_keras2.py``;
under Keras 3 this file skips saying so.
"""
from pathlib import Path

import pytest

from .test_tensorflow import _ok, run

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

pytestmark = pytest.mark.frameworks
if int(keras.__version__.split(".")[0]) >= 3:
    pytest.skip(f"Keras {keras.__version__} is Keras 3: the Keras 2 face needs TensorFlow "
                "2.15 or older (HIPRESS_TF_VENV=.venv-tf214 HIPRESS_TF_VERSION=2.14.1 "
                "scripts/env_tensorflow.sh)", allow_module_level=True)

JOB = Path(__file__).resolve().parent / "tf_keras2_job.py"


def test_keras2_fit_replicas_identical_and_the_optimizer_is_the_users_class():
    res = _ok(*run(JOB, np=2, timeout=600), np=2)
    for key in ("fit", "legacy"):
        assert res[0][key] == res[1][key], f"replicas differ after {key}"
    for r in res.values():
        assert r["subclass"] and r["config_kept"] and r["engine"], r
        assert r["skipped"], "a NaN on rank 1 must skip the step on every rank"
        assert "already a DistributedOptimizer" in r["rewrap"], r["rewrap"]
    assert res[0]["losses"][-1] < res[0]["losses"][0], res[0]["losses"]
