"""plan="adaptive" on the TensorFlow face, with 2 real ranks (torchrun), in .venv-tf.

The link estimate is injected on a schedule (fast, slow from step 8, fast again
from step 16: ``tf_adaptive_job.fast_slow_fast``), with
``hvd.Adaptive(check_every=5, margin=0.1, profile=<file>, estimate=...)``, as
tests/multiprocess/test_adaptive_plan.py does on the PyTorch face. What must hold:

- ``DistributedGradientTape`` inside ``tf.function``: every rank checks at the
  same steps and switches at the same steps (10: to 1-bit on the large kernel;
  20: back to nothing compressed) to the same plan, and the replicas are
  bitwise identical after every step;
- a checkpoint taken at step 12, after the first switch (``tf.train.Checkpoint``
  plus ``hvd.compressor_state()``), resumes on the switched plan at once, keeps
  the planner's reference and switch count (it switches back at step 20), and
  gives the uninterrupted run's weights bitwise after every step;
- Keras ``model.fit`` with ``hvd.DistributedOptimizer(compression="auto")``: the
  same agreement, and ``model.save_weights``/``load_weights`` carries the plan
  and the planner the same way;
- AR-Topk's ratio search (``star_topk``, ``Adaptive(ratio=...)``) rewinds the
  weights and the optimizer's variables, alike on every rank, with the tape and
  with ``model.fit``.

The profile is measured here (``profile_compressor``) and handed to every rank
as a file. Needs TensorFlow: ``scripts/env_tensorflow.sh --test`` builds .venv-tf.
"""
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.frameworks

if importlib.util.find_spec("tensorflow") is None:
    pytest.skip(f"TensorFlow is not installed in this environment ({sys.prefix}); run these "
                "tests with .venv-tf/bin/python (scripts/env_tensorflow.sh builds it)",
                allow_module_level=True)

from . import adaptive_common  # noqa: E402
from .test_horovodrun import _env, command, results_of  # noqa: E402

JOB = Path(__file__).resolve().with_name("tf_adaptive_job.py")
ROOT = Path(__file__).resolve().parents[2]
N, STEPS, SAVE_AT = 2, 24, 12


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    return adaptive_common.profiles(tmp_path_factory.mktemp("adaptive-tf"), N)


def _run(*args: str) -> dict:
    """Run ``N`` ranks of the job under torchrun; their RESULT records by rank."""
    import subprocess

    cmd = command("torchrun", N, JOB, *args)
    cmd.insert(1, "--tee=3")  # rank-prefixed lines, each rank's stream read apart
    proc = subprocess.run(cmd, env=_env(TF_CPP_MIN_LOG_LEVEL="2"), text=True,
                          capture_output=True, timeout=900, cwd=str(ROOT))
    out = proc.stdout + proc.stderr
    res = results_of(out)
    assert proc.returncode == 0 and sorted(res) == list(range(N)), \
        f"job failed (rc {proc.returncode}):\n{out[-5000:]}"
    return res


def _agree(res: dict) -> dict:
    return adaptive_common.agree(res, N)


@lru_cache(maxsize=None)
def _jobs(mode: str, compression: str, profile: str, ckpt: str):
    common = ["--mode", mode, "--compression", compression, "--profile", profile,
              "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--ckpt", ckpt]
    return _run(*common), _run(*common, "--resume")


@pytest.fixture(scope="module")
def tape_jobs(profiles, tmp_path_factory):
    return _jobs("tape", "onebit", profiles["onebit"],
                 str(tmp_path_factory.mktemp("tape-ckpt")))


@pytest.fixture(scope="module")
def fit_jobs(profiles, tmp_path_factory):
    return _jobs("fit", "auto", profiles["auto"], str(tmp_path_factory.mktemp("fit-ckpt")))


def test_tape_every_rank_switches_at_the_same_steps_with_identical_replicas(tape_jobs):
    adaptive_common.check_switches(_agree(tape_jobs[0]), STEPS)


def test_tape_checkpoint_after_a_switch_resumes_on_the_switched_plan(tape_jobs):
    full, resumed = tape_jobs
    adaptive_common.check_resume(full, resumed, _agree(resumed), SAVE_AT, N)


def test_fit_with_compression_auto_switches_alike_and_resumes(fit_jobs):
    full, resumed = fit_jobs
    f0 = _agree(full)
    assert f0["checks"] == [5, 10, 15, 20]
    assert f0["switched"] and f0["switched"][0] == 10, f0["switched"]
    assert adaptive_common.changes(f0["plans"]) == f0["switched"]
    assert f0["compressed"][8] == [] and f0["compressed"][9], "slow link: nothing compressed"
    r0 = _agree(resumed)
    assert r0["plans"][0] == f0["plans"][SAVE_AT - 1] != f0["plans"][0]
    assert r0["plans"] == f0["plans"][SAVE_AT:]
    assert r0["switched"] == f0["switched"]
    for r in range(N):
        assert resumed[r]["digests"] == full[r]["digests"][SAVE_AT:], f"rank {r}"


@pytest.mark.parametrize("mode,flags", [("tape", ()), ("fit", ()), ("apply", ("--eager",))])
def test_the_ratio_search_rewinds_and_every_rank_chooses_alike(mode, flags, tmp_path):
    """AR-Topk under plan="adaptive" on TensorFlow, every rank trying and choosing
    alike. With ``model.fit`` the planner runs before the update, so the snapshot holds
    the step's averages and the variables before it (``rewind.py``): after the search
    the weights and the optimizer's momentum slots and iterations are those after step
    1, bitwise; the same in an eager custom loop calling ``apply_gradients``. A tape
    never sees its optimizer: its search trains on."""
    profile = adaptive_common.ratio_profile(tmp_path / "star_topk.json", N)
    r0 = _agree(_run("--mode", mode, *flags, "--profile", profile, "--steps", "9",
                     "--steps-per-epoch", "9", "--ratio", *map(str, adaptive_common.RATIOS)))
    adaptive_common.check_ratio_search(r0, rewinds=mode != "tape")
