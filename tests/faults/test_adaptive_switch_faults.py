"""plan="adaptive": a rank killed during a plan switch is reported by every survivor.

``fault_job.py`` with ``JOB_PLAN=adaptive`` (``harness.Fault.plan``) trains on
three ranks with an injected link estimate that makes every rank switch the
plan after step 5; rank 1 is killed as it enters ``Engine.set_plan``, while
the others are inside the switch's agreement on the plan. Every survivor must
raise an error that names the death and rank 1 alone, within the job's timeout
plus ``harness.MARGIN``, and exit non-zero; nothing hangs or is left behind,
and every checkpoint written (it holds the adaptive plan's state) loads.
"""
import pytest
from harness import CATALOG, MARGIN, TIMEOUT, logs_of, run_trial

pytestmark = pytest.mark.faults


def test_a_rank_killed_in_a_plan_switch_is_named_by_every_survivor(fault_trials):
    fault = CATALOG["kill/switch@3"]
    trial = run_trial(fault)
    fault_trials.append(trial)
    assert trial.fault_seen, "no rank reached the switch:\n" + logs_of(trial)
    assert trial.hangs == 0 and trial.left_behind == 0, logs_of(trial)
    assert trial.corrupted == 0 and trial.checkpoints > 0, logs_of(trial)
    assert sorted(s.rank for s in trial.survivors) == [0, 2]
    for s in trial.survivors:
        assert s.error_s is not None, f"rank {s.rank} raised nothing:\n" + logs_of(trial)
        assert s.rc not in (0, None), logs_of(trial)
        assert s.named == [1], f"rank {s.rank} named {s.named}:\n" + logs_of(trial)
        assert s.names_cause, f"rank {s.rank}: {s.error}"
        assert s.error_s <= TIMEOUT + MARGIN, logs_of(trial)
