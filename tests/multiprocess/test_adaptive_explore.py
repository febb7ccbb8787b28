"""plan="adaptive"'s exploration on real ranks (gloo on loopback), without root.

The link estimate is injected on test_adaptive_plan's schedule (fast, slow for steps
8-15, fast again) with ``explore=True``: at the check after each change the ranks try
the model's plans on real training steps, agree on each window's median step time and
keep the fastest. Which plan wins depends on this host's wall times; what must hold
whatever it is: every rank tries the same plans at the same steps and keeps the same
one, and the replicas stay bitwise identical at every step, through every trial.
"""
from shared_launch import ranks, run_shared  # tests/multiprocess is on sys.path (rootdir)
from test_adaptive_plan import _decisions, _fast_slow_fast, _profile, _run

import hipress_like.torch as hpt

N = 2


def explore_worker(ctx, profile_path):
    settings = hpt.Adaptive(check_every=4, margin=0.1, max_switches=4, profile=profile_path,
                            estimate=_fast_slow_fast, explore=True, explore_steps=2)
    return _run(ctx, settings, 28)


def _agreed(history):
    """A history without each rank's own wall times (``step_s_before``/``_after``)."""
    return _decisions(history)


def test_every_rank_tries_the_same_plans_at_the_same_steps_and_keeps_the_same(tmp_path):
    _, path = _profile(tmp_path)
    res = ranks(run_shared(N, [(explore_worker, (path,))], timeout=600)[0])
    r0 = res[0]
    for r in res[1:]:
        assert r["digests"] == r0["digests"], "replicas diverged"
        assert r["plans"] == r0["plans"]
        assert _agreed(r["history"]) == _agreed(r0["history"])
    starts = [h for h in r0["history"] if h.get("exploring")]
    # the check of step 12 is the first to see the slow link (the estimate of step 11)
    assert starts and starts[0]["step"] == 12 and starts[0]["exploring"] == "link moved"
    tried = [h["step"] for h in r0["history"] if "trying" in h]
    assert tried[:len(starts[0]["candidates"])] == [12 + 2 * i for i in
                                                    range(len(starts[0]["candidates"]))]
    # the plan changed at a trial's start or an exploration's end, nowhere else
    ends = [h["step"] for h in r0["history"] if "chose" in h]
    changes = {i + 1 for i in range(1, len(r0["plans"])) if r0["plans"][i] != r0["plans"][i - 1]}
    assert changes <= set(tried) | set(ends), (changes, tried, ends)
