"""The TensorFlow face under Keras 2 (TensorFlow 2.15 and older), on real ranks.

Horovod's own TensorFlow ops build against these TensorFlows (not 2.16+), so
this is the environment of Horovod's own TF test files (``horovod_suite.py
--file tensorflow``) and of most Horovod Keras scripts. ``DistributedOptimizer``
there is a run-time subclass of the user's optimizer class
(``adapters/tensorflow/optimizer_keras2.py``). What must hold, on 2 ranks
under torchrun: ``model.fit`` with onebit and with a legacy optimizer leaves
the replicas bitwise identical, the wrapper is still an instance of the
user's class with its config, ``nonfinite="skip"`` skips a step with NaN on
one rank on every rank, wrapping twice is an error, and AR-Topk's ratio
search under ``plan="adaptive"`` rewinds the weights and the optimizer.

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


NATIVE = Path(__file__).resolve().parent / "tf_native_job.py"


def _horovod_tf_why() -> str:
    import subprocess
    import sys

    code = "import horovod.tensorflow as h; h.init(); assert h.gloo_built()"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return "" if res.returncode == 0 else (
        f"Horovod with its TensorFlow ops is not in {sys.prefix}: HIPRESS_VENV={sys.prefix} "
        "scripts/env_horovod.sh")


def test_under_horovodrun_plain_calls_and_horovod_only_names_are_horovods():
    why = _horovod_tf_why()
    if why:
        pytest.skip(why)
    res = _ok(*run(NATIVE, np=2, launcher="gloo", timeout=600), np=2)
    for r in res.values():
        assert r["hook_is_horovods"] is True, r
        assert r["uint8_sum"] == [3, 3, 3, 3], r  # horovod.torch refuses uint8
        assert r["grad"] == [2.0, 2.0, 2.0], r  # Horovod's registered gradient (a sum)
        assert r["onebit_values"] <= 2, r  # this project's compressor: its own call


def test_under_torchrun_a_horovod_only_name_says_how_to_get_it():
    res = _ok(*run(NATIVE, np=2, timeout=600), np=2)
    for r in res.values():
        assert r["hook_is_horovods"] is None
        assert "horovodrun" in r["hook_error"] and "env_horovod.sh" in r["hook_error"], r
        assert r["uint8_sum"] == [3, 3, 3, 3], r
        assert r["onebit_values"] <= 2, r


@pytest.mark.parametrize("mode,flags", [("fit", ()), ("fit", ("--legacy",)),
                                        ("apply", ("--legacy",)),
                                        ("apply", ("--legacy", "--eager")),
                                        ("apply", ("--eager",))])
def test_keras2_ratio_search_rewinds_the_weights_and_the_optimizer(mode, flags, tmp_path):
    """AR-Topk's ratio search under Keras 2, with ``model.fit`` and with a custom loop
    calling ``apply_gradients``, each with the 2.11+ optimizer and the legacy one (a
    custom loop's first update creates the slots: the mixin creates them before the
    averaging, so the first snapshot holds them): after the search the weights and the
    optimizer's variables are those after step 1, bitwise, on every rank (Keras 3:
    test_adaptive_tensorflow.py)."""
    from . import adaptive_common
    from .test_adaptive_tensorflow import N, _agree, _run

    profile = adaptive_common.ratio_profile(tmp_path / "star_topk.json", N)
    r0 = _agree(_run("--mode", mode, "--profile", profile, "--steps", "9",
                     "--steps-per-epoch", "9", *flags,
                     "--ratio", *map(str, adaptive_common.RATIOS)))
    adaptive_common.check_ratio_search(r0)
