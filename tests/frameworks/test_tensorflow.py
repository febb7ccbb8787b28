"""The TensorFlow face on real ranks: torchrun-style env rendezvous, mpirun, horovodrun.

Every job is a separate set of processes started the way a user starts
them (``torchrun``, ``mpirun``, ``horovodrun``), running the examples or the
job scripts beside this file, and printing ``RESULT {json}`` / ``CHECK``
/ ``DONE`` lines the tests read. What must hold:

- 4 ranks end with bitwise-identical weights (Keras ``fit``; the
  ``GradientTape`` loop inside ``tf.function`` and eagerly);
- digits accuracy within 1 point of the same face's uncompressed run, for
  onebit under PS and PowerSGD under Ring;
- a checkpoint at step k and a resumed run give the losses of the
  uninterrupted run (fit: weights file with the compressor state; tape:
  ``tf.train.Checkpoint`` plus ``hvd.compressor_state()``);
- the bad input the PyTorch face refuses is refused the same way
  (``tf_surface_job.py``), and the collectives work eagerly and in graphs;
- a Horovod-style Keras script runs with only its import switched.

Needs TensorFlow next to torch: ``scripts/env_tensorflow.sh --test`` builds
that environment (.venv-tf) and runs this file in it.
"""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from .test_horovodrun import _env, command, results_of

pytestmark = pytest.mark.frameworks

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
FIT = ROOT / "examples" / "tensorflow_digits_fit.py"
TAPE = ROOT / "examples" / "tensorflow_digits_tape.py"
INSTALL = "scripts/env_tensorflow.sh --test"

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip(f"TensorFlow is not installed in this environment ({sys.prefix}); create one "
                f"and run these tests with {INSTALL}", allow_module_level=True)


def _horovod_why() -> str:
    """Why horovodrun cannot start TensorFlow jobs here ('' when it can)."""
    code = "import horovod.torch as h; assert h.gloo_built()"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode or not (BIN / "horovodrun").exists():
        return (f"Horovod is not installed in {sys.prefix} (horovodrun only launches and "
                "rendezvouses here; Horovod's own TensorFlow ops are not needed). Build it into "
                "this environment with HIPRESS_VENV=" + sys.prefix + " scripts/env_horovod.sh")
    return ""


_HVD_WHY = _horovod_why()
_MPI_WHY = "" if shutil.which("mpirun") and importlib.util.find_spec("mpi4py") else \
    "Open MPI (mpirun) or mpi4py is missing: apt-get install -y openmpi-bin libopenmpi-dev; " \
    "pip install mpi4py"


def _command(launcher: str, np: int, script: Path, *args: str) -> list:
    """The user's command line, asking the launcher to pass each rank's output on whole
    lines (a long RESULT line written by two ranks at once would interleave)."""
    if launcher == "mpirun":
        return ["mpirun", "-np", str(np), "--allow-run-as-root", "--oversubscribe",
                "--bind-to", "none", "--tag-output", "-x", "OMP_NUM_THREADS", "-x",
                "PYTHONPATH", "-x", "HIPRESS_NO_COMPILE", "-x", "TF_CPP_MIN_LOG_LEVEL",
                sys.executable, str(script), *args]
    cmd = command(launcher, np, script, *args)  # torchrun, gloo / mpi (horovodrun)
    if launcher == "torchrun":
        cmd.insert(1, "--tee=3")  # rank-prefixed lines, each rank's stream read apart
    return cmd


def run(script: Path, *args: str, np: int = 4, launcher: str = "torchrun",
        timeout: float = 1200, **env):
    """Start ``np`` ranks of ``script``; (RESULT dicts by rank, returncode, output)."""
    proc = subprocess.run(_command(launcher, np, script, *args),
                          env=_env(TF_CPP_MIN_LOG_LEVEL="2", **env), text=True,
                          capture_output=True, timeout=timeout, cwd=str(ROOT))
    out = proc.stdout + proc.stderr
    return results_of(out), proc.returncode, out


def _ok(res, rc, out, np=4):
    assert rc == 0 and sorted(res) == list(range(np)), f"job failed (rc {rc}):\n{out[-5000:]}"
    return res


def _identical(res):
    digests = {r["digest"] for r in res.values()}
    assert len(digests) == 1, f"replicas differ: {[r['digest'][:12] for r in res.values()]}"


# -- model.fit: replicas and accuracy ---------------------------------------------------------

EPOCHS = "10"


@lru_cache(maxsize=None)
def _fit(compression: str, strategy: str):
    return _ok(*run(FIT, "--json", "--epochs", EPOCHS, "--plan", "none", "--compression",
                    compression, "--strategy", strategy))


@pytest.mark.parametrize("compression, strategy", [("onebit", "ps"), ("powersgd", "ring")])
def test_fit_replicas_identical_and_accuracy_within_a_point(compression, strategy):
    base = _fit("none", "ps")  # no compressor: strategy-independent (the allreduce lane)
    res = _fit(compression, strategy)
    _identical(base)
    _identical(res)
    acc, ref = res[0]["acc"], base[0]["acc"]
    print(f"digits fit {compression}/{strategy}: {acc:.2f}% vs uncompressed {ref:.2f}%")
    assert acc >= ref - 1.0, f"{compression}/{strategy}: {acc:.2f}% vs {ref:.2f}% uncompressed"


# -- GradientTape: tf.function and eager --------------------------------------------------------

@pytest.mark.parametrize("mode, compression, strategy",
                         [("graph", "onebit", "ps"), ("eager", "powersgd", "ring")])
def test_tape_replicas_identical_in_tf_function_and_eagerly(mode, compression, strategy):
    args = ["--json", "--steps", "40", "--plan", "none", "--compression", compression,
            "--strategy", strategy] + (["--eager"] if mode == "eager" else [])
    res = _ok(*run(TAPE, *args))
    _identical(res)
    losses = res[0]["losses"]
    assert sum(losses[-5:]) < sum(losses[:5]), f"nothing learned: {losses}"


def test_tape_collective_reaches_the_engine(tmp_path):
    """``DistributedGradientTape(collective=...)``: STAR-Topk by ART-Tree trains with the
    replicas bitwise identical; asking it to be gathered (AR-Topk has no allgather form)
    stops the job with the layout's error, so the option did reach the engine."""
    from hipress_like.cost_model.plan import Plan, SizeRule

    plan = tmp_path / "plan.json"
    Plan(compressor="star_topk", params={"ratio": 0.05},
         rule=SizeRule(min_compress_bytes=0)).save(plan)
    common = ["--json", "--steps", "40", "--plan", str(plan), "--compression", "star_topk"]
    res = _ok(*run(TAPE, *common, "--collective", "tree"))
    _identical(res)
    losses = res[0]["losses"]
    assert sum(losses[-5:]) < sum(losses[:5]), f"nothing learned: {losses}"
    _, rc, out = run(TAPE, *common, "--collective", "allgather", np=2)
    assert rc != 0 and "AR-Topk's Allgather counterpart is 'topk'" in out, out[-3000:]


# -- checkpoints ------------------------------------------------------------------------------

@pytest.mark.parametrize("compression, strategy", [("onebit", "ps"), ("powersgd", "ring")])
def test_tape_checkpoint_resume_gives_the_uninterrupted_losses(compression, strategy, tmp_path):
    common = ["--json", "--steps", "24", "--plan", "none", "--compression", compression,
              "--strategy", strategy, "--checkpoint-dir", str(tmp_path)]
    full = _ok(*run(TAPE, *common, "--checkpoint-step", "12"))
    resumed = _ok(*run(TAPE, *common, "--resume-step", "12"))
    _identical(full)
    for r in range(4):
        assert resumed[r]["losses"] == full[r]["losses"][12:], f"rank {r}"
        assert resumed[r]["digest"] == full[r]["digest"], f"rank {r}"


def test_fit_checkpoint_resume_gives_the_uninterrupted_losses(tmp_path):
    common = ["--json", "--epochs", "3", "--plan", "none", "--compression", "onebit",
              "--checkpoint-dir", str(tmp_path)]
    full = _ok(*run(FIT, *common))
    resumed = _ok(*run(FIT, *common, "--resume-epoch", "2"))
    per_epoch = len(full[0]["losses"]) // 3
    for r in range(4):
        assert resumed[r]["losses"] == full[r]["losses"][2 * per_epoch:], f"rank {r}"
        assert resumed[r]["digest"] == full[r]["digest"], f"rank {r}"


# -- the surface and bad input ------------------------------------------------------------------

SURFACE = HERE / "tf_surface_job.py"
CHECKS = ("rank_and_size", "allreduce_eager_and_in_tf_function",
          "allgather_variable_size_and_broadcast",
          "broadcast_variables_eager_and_in_tf_function", "broadcast_and_allgather_object",
          "identity_compression_is_the_exact_average", "horovod_calls_eager_and_in_tf_function",
          "collectives_carry_horovods_gradients", "collectives_of_a_session_graph_run_in_one_order",
          "sync_batch_normalization_is_the_global_batchs",
          "a_mismatch_between_ranks_is_a_failed_precondition_eagerly",
          "horovod_calls_refuse_bad_arguments", "unknown_compressor_is_refused",
          "bad_options_are_refused", "non_float_gradients_are_refused",
          "models_that_differ_between_ranks_are_refused",
          "nan_gradient_with_nonfinite_raise_fails_every_rank",
          "nan_gradient_with_nonfinite_skip_skips_the_step_on_every_rank")


@pytest.fixture(scope="module")
def surface():
    _, rc, out = run(SURFACE, np=2, HIPRESS_TIMEOUT="60", timeout=600)
    found = {}
    # torchrun prefixes each worker's lines ("[default1]:"); two workers' writes can
    # interleave so that a prefix lands right after "ok" on the same line
    for m in re.finditer(r"(?m)CHECK (\w+) (ok(?=\[|$)|FAIL.*$)", out):
        found.setdefault(m.group(1), []).append(m.group(2))
    return rc, found, out


@pytest.mark.parametrize("name", CHECKS)
def test_surface_and_bad_input(surface, name):
    rc, found, out = surface
    got = found.get(name, [])
    assert got == ["ok", "ok"], f"{name}: {got}\n{out[-3000:]}"


HOROVOD_CALLS = ("horovod_calls_eager_and_in_tf_function", "horovod_calls_refuse_bad_arguments",
                 "collectives_carry_horovods_gradients")


def test_horovod_calls_under_horovodrun():
    """The same checks with the calls handed to Horovod's own ops (horovodrun)."""
    if _HVD_WHY:
        pytest.skip(_HVD_WHY)
    # Horovod adds process sets after init only when told so (its own tests set it too)
    _, rc, out = run(SURFACE, np=2, launcher="gloo", HIPRESS_TIMEOUT="60", timeout=600,
                     SURFACE_ONLY=",".join(HOROVOD_CALLS), HOROVOD_DYNAMIC_PROCESS_SETS="1")
    for name in HOROVOD_CALLS:
        got = re.findall(rf"CHECK {name} (ok|FAIL.*)", out)
        assert got == ["ok", "ok"], f"{name}: {got}\n{out[-3000:]}"


# -- launchers and a Horovod-style script --------------------------------------------------------

HOROVOD_STYLE = HERE / "tf_horovod_keras.py"


def _launcher_skip(launcher: str) -> None:
    if launcher == "mpirun" and _MPI_WHY:
        pytest.skip(_MPI_WHY)
    if launcher == "gloo" and _HVD_WHY:
        pytest.skip(_HVD_WHY)


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "gloo"])
def test_a_horovod_keras_script_runs_with_only_its_import_switched(launcher, tmp_path):
    """tf_horovod_keras.py is a Horovod Keras script but for its import line; under
    torchrun, mpirun and horovodrun --gloo it trains, and every rank ends identical."""
    _launcher_skip(launcher)
    text = HOROVOD_STYLE.read_text()
    assert "import hipress_like.tensorflow.keras as hvd" in text
    assert text.count("hipress_like") == 1, "only the import may name hipress_like"
    _, rc, out = run(HOROVOD_STYLE, str(tmp_path), np=2, launcher=launcher, timeout=600)
    done = re.findall(r"DONE rank (\d) (\w+) ([\d.]+)", out)
    assert rc == 0 and sorted(int(d[0]) for d in done) == [0, 1], out[-4000:]
    assert len({d[1] for d in done}) == 1, f"replicas differ: {done}"
    assert len({d[2] for d in done}) == 1, f"metrics not averaged: {done}"
    assert float(done[0][2]) > 0.8, f"did not learn: {done}"
    assert (tmp_path / "checkpoint-4.weights.h5").exists()


@pytest.mark.parametrize("launcher, example", [("mpirun", "tape"), ("gloo", "fit")])
def test_examples_under_mpirun_and_horovodrun(launcher, example):
    _launcher_skip(launcher)
    script, budget = (TAPE, ["--steps", "20"]) if example == "tape" else (FIT, ["--epochs", "1"])
    res = _ok(*run(script, "--json", "--plan", "none", *budget, launcher=launcher))
    _identical(res)
    assert {r["size"] for r in res.values()} == {4}


def test_the_environment_script_is_idempotent():
    """A second run of scripts/env_tensorflow.sh over a ready environment installs nothing."""
    stamp = Path(sys.prefix) / ".hipress-tf-stamp"
    if not stamp.exists():
        pytest.skip(f"{sys.prefix} was not made by scripts/env_tensorflow.sh")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "env_tensorflow.sh")],
                         env={**os.environ, "HIPRESS_TF_VENV": sys.prefix},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "nothing to install" in res.stderr, res.stderr
