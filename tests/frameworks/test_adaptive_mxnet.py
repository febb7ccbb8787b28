"""plan="adaptive" on the Gluon ``DistributedTrainer``, with 2 real ranks, in .venv-mxnet.

The link estimate is injected on a schedule (fast, slow from step 8, fast again
from step 16: ``mx_adaptive_job.fast_slow_fast``), with
``hvd.Adaptive(check_every=5, margin=0.1, profile=<file>, estimate=...)``, as
tests/multiprocess/test_adaptive_plan.py does on the PyTorch face. What must hold:

- every rank checks at the same steps and switches at the same steps (10: to
  1-bit on the large weight; 20: back to nothing compressed) to the same plan,
  and the replicas are bitwise identical after every step;
- ``save_states`` at step 12, after the first switch, and ``load_states`` in a
  new job resume on the switched plan at once, keep the planner's reference and
  switch count (it switches back at step 20), and give the uninterrupted run's
  weights bitwise after every step;
- ``compression="auto"`` (a compressor per gradient among the defaults) re-plans
  the same way;
- AR-Topk's ratio search (``star_topk``, ``Adaptive(ratio=...)``) runs from the
  trainer's snapshot and puts it back, alike on every rank.

The profiles are measured here (``profile_compressor``) and handed to every rank
as files. MXNet needs its own venv: ``scripts/env_mxnet.sh --test``.
"""
from functools import lru_cache
from pathlib import Path

import pytest

from . import adaptive_common
from .test_mxnet import _WHY, INSTALL, results, run

pytestmark = [pytest.mark.frameworks,
              pytest.mark.skipif(bool(_WHY), reason=f"{_WHY}; MXNet needs numpy 1.23.5 and "
                                 f"its own venv: run {INSTALL}")]

JOB = Path(__file__).resolve().with_name("mx_adaptive_job.py")
N, STEPS, SAVE_AT = 2, 24, 12


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    return adaptive_common.profiles(tmp_path_factory.mktemp("adaptive-mx"), N)


@lru_cache(maxsize=None)
def _job(*args: str) -> dict:
    rc, out = run("env", JOB, *args, np=N)
    res = results(out)
    assert rc == 0 and sorted(res) == list(range(N)), f"job failed (rc {rc}):\n{out[-5000:]}"
    return res


def _agree(res: dict) -> dict:
    return adaptive_common.agree(res, N)


@pytest.fixture(scope="module")
def onebit_jobs(profiles, tmp_path_factory):
    common = ("--profile", profiles["onebit"], "--compression", "onebit", "--steps",
              str(STEPS), "--save-at", str(SAVE_AT), "--ckpt",
              str(tmp_path_factory.mktemp("mx-ckpt")))
    return _job(*common), _job(*common, "--resume")


def test_every_rank_switches_at_the_same_steps_with_identical_replicas(onebit_jobs):
    adaptive_common.check_switches(_agree(onebit_jobs[0]), STEPS)


def test_states_saved_after_a_switch_resume_on_the_switched_plan(onebit_jobs):
    full, resumed = onebit_jobs
    adaptive_common.check_resume(full, resumed, _agree(resumed), SAVE_AT, N)


def test_compression_auto_re_plans_alike_on_every_rank(profiles):
    r0 = _agree(_job("--profile", profiles["auto"], "--compression", "auto", "--steps",
                     str(STEPS)))
    assert r0["checks"] == [5, 10, 15, 20]
    assert r0["switched"] and r0["switched"][0] == 10, r0["switched"]
    assert adaptive_common.changes(r0["plans"]) == r0["switched"]
    assert r0["compressed"][8] == [] and r0["compressed"][9], "slow link: nothing compressed"


def test_the_ratio_search_rewinds_the_trainer_and_every_rank_chooses_alike(tmp_path):
    """AR-Topk under plan="adaptive" on Gluon: the search runs from the trainer's
    snapshot (parameters and Gluon's optimizer states, momentum included), every rank
    tries and chooses alike, and the weights after the search are those after step 1."""
    profile = adaptive_common.ratio_profile(tmp_path / "star_topk.json", N)
    r0 = _agree(_job("--profile", profile, "--steps", "9", "--ratio",
                     *map(str, adaptive_common.RATIOS)))
    adaptive_common.check_ratio_search(r0)
