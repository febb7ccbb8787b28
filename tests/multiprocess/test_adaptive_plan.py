"""plan="adaptive" on real ranks (gloo on loopback, run_workers), without root.

The link estimate is injected (``Adaptive(estimate=...)``, the documented test
source) on a schedule: fast, then slow, then fast again. Every rank switches
at the same step to the same plan, replicas stay bitwise identical at every
step, before and after each switch, the replayed schedule of the uncompressed
plan is dropped while the compressed one runs and recorded again after, and
the compressor state is reset on the way back (logged). With estimates that
jitter around a link where another plan is predicted only a few percent
faster, nothing switches (the margin). The first check's estimate is the
reference: the link the profile was measured on.

The compressor's curves are measured here (``profile_compressor``) and
shared with every rank through a profile file, as ``Adaptive(profile=...)``
takes one. The default path (profiled at start as ``plan="auto"``, the link
probed) and ``measure="timeline"`` (estimates from the engine's own rounds)
run too: whatever they decide, every rank decides it alike from the agreed
numbers. The profile is measured once,
and the three jobs run in turn on one launch of N ranks (``shared_launch``).
"""
import hashlib
import json
import math

import pytest
import torch
import torch.nn.functional as F
from shared_launch import ranks, run_shared  # tests/multiprocess is on sys.path (rootdir)
from test_torch_optimizer import _batch, _digest, _model  # the same model and batches

import hipress_like.torch as hpt
from hipress_like.cost_model import Link, Planner, Profile
from hipress_like.tuning.online import price_plan, profile_plan
from hipress_like.tuning.profiler import profile_compressor

FAST = (2e-6, 12.5e9)  # 2 us + 100 Gbit/s
SLOW = (1e-3, 1.25e6)  # 1 ms + 10 Mbit/s
N = 2


def _fast_slow_fast(step, rank):
    """The injected link: fast before step 8, slow for steps 8-15, fast again."""
    return Link(*SLOW) if 8 <= step < 16 else Link(*FAST)


def _plan_digest(plan):
    return hashlib.sha256(json.dumps({n: g.to_dict() for n, g in plan.gradients.items()},
                                     sort_keys=True).encode()).hexdigest()


def _run(ctx, settings, steps):
    hpt.init()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression="onebit", plan=settings)
    init = _digest(model)
    out = {"digests": [], "plans": [], "replayed": [], "compressed": []}
    for step in range(steps):
        x, y = _batch(ctx.rank, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        out["digests"].append(_digest(model))
        out["plans"].append(_plan_digest(opt.engine.plan))
        out["replayed"].append(opt.engine.replayed_steps)
        out["compressed"].append(sorted(n for n, d in opt.engine.layout().items()
                                        if d["compress"]))
    assert out["digests"][-1] != init, "nothing was learned"
    out["history"] = opt.online.history
    out["switch_events"] = [e.step for e in opt.engine.timeline.events
                            if e.kind == "plan_switch"]
    opt.close()
    return out


def switch_worker(ctx, profile_path):
    settings = hpt.Adaptive(check_every=5, margin=0.1, max_switches=4, profile=profile_path,
                            estimate=_fast_slow_fast)
    return _run(ctx, settings, 24)


def noise_worker(ctx, profile_path, latency, bandwidth):
    def jitter(step, rank):  # the profile's link (the reference), then bandwidth +-2 %
        if step < 3:
            return Link(*FAST)
        return Link(latency, bandwidth * (1 + 0.02 * math.sin(7 * step + 3 * rank)))

    settings = hpt.Adaptive(check_every=3, margin=0.1, profile=profile_path, estimate=jitter)
    return _run(ctx, settings, 15)


# verify=False, explore=False in both: a switch on measured numbers would open a trial (or
# an exploration: tests/multiprocess/test_adaptive_explore.py), which skips the
# checks until it is judged (tests/unit/test_online.py pins trials), and these jobs check
# that every check step decides alike on every rank
def measured_worker(ctx):
    # the default path: profiled at start (as plan="auto"), the link probed at every other
    # check at least (probe_every=1, doubled under the start plan, which compresses nothing
    # on loopback), and sooner when the step time moved
    return _run(ctx, hpt.Adaptive(check_every=3, probe_every=1, verify=False,
                                  explore=False), 15)


def timeline_worker(ctx):
    # measure="timeline": estimates from the engine's own rounds, agreed as medians
    return _run(ctx, hpt.Adaptive(check_every=3, measure="timeline", verify=False,
                                  explore=False), 9)


def _decisions(history):
    """A history without its wall-clock step times (each rank's own)."""
    return [{k: v for k, v in h.items() if not k.startswith("step_s")} for h in history]


def _profile(tmp_path):
    cp = profile_compressor("onebit", sizes=[4096, 16384, 65536], repeats=3, min_time=0.0)
    prof = Profile(link=Link(*FAST), compressors={"onebit": cp}, meta={"ranks": N})
    path = tmp_path / "profile.json"
    prof.save(path)
    return prof, str(path)


def _sizes():
    return {n: p.numel() * 4 for n, p in _model().named_parameters()}


def _gain(prof, bw):
    """How much faster the plan profiled for ``Link(FAST[0], bw)`` is predicted to be
    than the one for the profile's own link, on that link (a fraction)."""
    sizes = _sizes()
    current = profile_plan(prof, ["onebit"], sizes, N, "ps")
    p = prof.with_link(Link(FAST[0], bw))
    planners = [Planner(p, "onebit", N, "ps")]
    now = price_plan(current, planners, sizes, N)
    return (now - price_plan(profile_plan(p, ["onebit"], sizes, N, "ps"), planners,
                             sizes, N)) / now


def _near_the_margin(prof):
    """A bandwidth where another plan is predicted about 5 % faster: bisected between
    FAST (gain 0) and SLOW (gain > 0.1)."""
    hi, lo = FAST[1], SLOW[1]
    for _ in range(60):
        mid = math.sqrt(hi * lo)
        hi, lo = (mid, lo) if _gain(prof, mid) < 0.05 else (hi, mid)
    return math.sqrt(hi * lo)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(profile, bandwidth near the margin, {job: each rank's outcome}): the switching,
    jittering and measured jobs, one after another on one launch of N ranks."""
    prof, path = _profile(tmp_path_factory.mktemp("adaptive"))
    bw = _near_the_margin(prof)
    entries = run_shared(N, [(switch_worker, (path,)), (noise_worker, (path, FAST[0], bw)),
                             (measured_worker, ()), (timeline_worker, ())], timeout=600)
    return prof, bw, dict(zip(("switch", "noise", "measured", "timeline"), entries))


def test_every_rank_switches_at_the_same_step_with_identical_replicas(jobs):
    res = ranks(jobs[2]["switch"])
    r0 = res[0]
    for r in res[1:]:  # the same parameters and plan on every rank, at every step
        assert r["digests"] == r0["digests"]
        assert r["plans"] == r0["plans"]
        assert _decisions(r["history"]) == _decisions(r0["history"])
        assert r["switch_events"] == r0["switch_events"]
    assert [h["step"] for h in r0["history"]] == [5, 10, 15, 20]
    assert [h["switched"] for h in r0["history"]] == [False, True, False, True]
    assert r0["switch_events"] == [10, 20]
    # the plan changed exactly at the switches (entry i is after engine step i + 1)
    changes = [i + 1 for i in range(1, len(r0["plans"]))
               if r0["plans"][i] != r0["plans"][i - 1]]
    assert changes == [10, 20]
    assert r0["compressed"][8] == [] and r0["compressed"][9], "slow link: nothing compressed"
    assert r0["compressed"][18] == r0["compressed"][9] and r0["compressed"][19] == []
    assert sorted(r0["history"][3]["reset"]) == r0["compressed"][9]  # EF memories dropped
    assert r0["history"][1]["gain"] > 0.1 and r0["history"][3]["gain"] > 0.1
    # the steps around the first switch were timed and reported
    assert r0["history"][1]["step_s_before"] > 0 and r0["history"][1]["step_s_after"] > 0
    # replay: the uncompressed plan replays, the compressed one cannot, then again
    rep = r0["replayed"]
    assert rep[8] > 0 and rep[18] == rep[9] and rep[23] > rep[19]


def test_estimates_jittering_within_the_margin_do_not_switch(jobs):
    prof, bw, outcomes = jobs
    assert _gain(prof, FAST[1]) <= 0.0 < 0.1 < _gain(prof, SLOW[1])  # the bisection's ends
    assert 0.03 < _gain(prof, bw) < 0.07
    res = ranks(outcomes["noise"])
    for r in res:
        assert r["digests"] == res[0]["digests"]
        assert [h["step"] for h in r["history"]] == [3, 6, 9, 12, 15]
        assert not any(h["switched"] for h in r["history"]), r["history"]
        assert r["switch_events"] == []
        assert len(set(r["plans"])) == 1
        # the link moved, and another plan was predicted faster by less than the
        # margin: hysteresis held
        assert r["history"][0]["reference"]
        assert all(h["moved"] > 0.1 and 0.0 < h["gain"] < 0.1 for h in r["history"][1:]), \
            r["history"]


@pytest.mark.parametrize("how", ["measured", "timeline"])
def test_measured_estimates_are_agreed_and_decided_alike_on_every_rank(jobs, how):
    res = ranks(jobs[2][how])
    r0 = res[0]
    steps = [h["step"] for h in r0["history"]]
    if how == "measured":  # every other check at least (a moved step time probes sooner)
        assert steps[0] == 3 and set(steps) <= {3, 6, 9, 12, 15} and len(steps) >= 3, steps
        assert all(b - a <= 6 for a, b in zip(steps, steps[1:])), steps
    else:
        assert steps == [3, 6, 9]
    assert r0["history"][0]["reference"] and r0["history"][0]["bandwidth_Bps"] > 0
    assert all(h["current_s"] > 0 and "gain" in h for h in r0["history"][1:])
    for r in res[1:]:
        assert r["digests"] == r0["digests"] and r["plans"] == r0["plans"]
        assert _decisions(r["history"]) == _decisions(r0["history"])
        assert r["switch_events"] == r0["switch_events"]
