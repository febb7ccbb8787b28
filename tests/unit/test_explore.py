"""plan="adaptive"'s exploration (tuning/explore.py): the candidates the model proposes,
the choice on measured times, and the engine trying them on real steps.

The engine runs on two in-process ranks (``run_threads``); the loop sleeps a time that
depends on whether the big gradient travels compressed, which is the wall time the
exploration measures. Every rank decides from agreed numbers, so both ranks try the
same plans at the same steps and end with the same gradients.
"""

import pytest
import torch
from test_online import FAST, SIZES, SLOW, _profile, _sleeping_run  # tests/unit (rootdir)

from hipress_like.casync.transport.inproc import run_threads
from hipress_like.cost_model import Link, Planner
from hipress_like.tuning.explore import (
    Exploration,
    alternatives,
    plan_key,
    size_rule,
    uncompressed,
)
from hipress_like.tuning.online import Adaptive, price_plan, profile_plan

# -- the candidates ---------------------------------------------------------------------


def _plans():
    prof = _profile()
    return prof, {bw: profile_plan(prof.with_link(Link(1e-3, bw)), ["onebit"], SIZES, 2, "ps")
                  for bw in (1e5, 1.25e6, 5e6, 12.5e9)}


def test_alternatives_are_the_models_plans_at_scaled_links_distinct_and_unlike_the_current():
    prof, _ = _plans()

    def plan_at(link):
        return profile_plan(prof.with_link(link), ["onebit"], SIZES, 2, "ps")

    def price(plan):
        return 1.0

    current = plan_at(Link(1e-3, 12.5e9))  # fast: nothing compressed
    got = alternatives(plan_at, price, Link(1e-3, 1.25e6), current)
    assert got, "a slow link: the model compresses, unlike the plan in force"
    keys = [plan_key(p) for _, p in got]
    assert len(set(keys)) == len(keys) and plan_key(current) not in keys
    assert got[0][0] in ("model", "model at 0.25x bandwidth", "model at 4x bandwidth")
    # on the current plan's own link, the model's plan is the current one: only scaled
    # links can propose another
    same = alternatives(plan_at, price, Link(1e-3, 12.5e9), current)
    assert all(why != "model" for why, _ in same)


def test_alternatives_drop_a_plan_priced_past_within_times_the_best():
    prof, plans = _plans()
    slow, fast = plans[1e5], plans[12.5e9]
    price = {plan_key(slow): 1.0, plan_key(fast): 3.0}
    current = plans[1.25e6]
    price[plan_key(current)] = 1.0

    def plan_at(link):
        return slow if link.bandwidth < 1e9 else fast

    got = alternatives(plan_at, lambda p: price.get(plan_key(p)), Link(1e-3, 1e8), current,
                       scales=(1e3,))
    assert [plan_key(p) for _, p in got] == [plan_key(slow)]  # fast: 3x the best
    got = alternatives(plan_at, lambda p: price.get(plan_key(p)), Link(1e-3, 1e8), current,
                       scales=(1e3,), within=4.0)
    assert [plan_key(p) for _, p in got] == [plan_key(slow), plan_key(fast)]


def test_the_engines_default_layout_is_a_candidate_the_model_need_not_propose():
    """``size_rule`` writes out what ``plan=None`` runs (the default ``SizeRule``: a
    gradient of 1 MB or more compressed, one partition per 16 MB rounded to a multiple
    of N), naming its compressor; ``alternatives`` tries it beside the model's plans,
    priced and filtered like them."""
    prof, plans = _plans()
    sizes = {"big": 40 << 20, "mid": 2 << 20, "small": 64 << 10}
    rule = size_rule(plans[12.5e9], "onebit", {}, sizes, 4)
    assert {n: (g.compress, g.partitions) for n, g in rule.gradients.items()} == {
        "big": (True, 4), "mid": (True, 1), "small": (False, 1)}
    assert rule.gradients["big"].compressor == "onebit"
    assert rule.decide("big", 40 << 20, 4) == rule.gradients["big"]
    current = plans[1.25e6]

    def plan_at(link):
        return current  # the model proposes nothing new

    got = alternatives(plan_at, lambda p: 1.0, Link(1e-3, 1e8), current, scales=(),
                       defaults=[("onebit by the engine's size rule", rule)])
    assert ("onebit by the engine's size rule", rule) in got
    priced_out = alternatives(plan_at, lambda p: 5.0 if p is rule else 1.0, Link(1e-3, 1e8),
                              current, scales=(), defaults=[("rule", rule)])
    assert all(p is not rule for _, p in priced_out)  # past within x the best


def test_the_plan_in_force_stays_unless_another_measured_faster_by_the_margin():
    ex = Exploration("A", 1.0, [("x", "B")], steps=3, start=0, margin=0.1)
    assert ex.next_plan() == ("x", "B") and ex.at == 3
    ex.record(0.95)
    assert ex.next_plan() is None
    assert ex.choose() == ("in force", "A", 1.0)  # 5 % faster: within the margin
    ex = Exploration("A", 1.0, [("x", "B")], steps=3, start=0, margin=0.1)
    ex.next_plan()
    ex.record(0.8)
    assert ex.choose() == ("x", "B", 0.8)


def test_a_plan_in_force_without_a_time_is_measured_after_the_candidates():
    ex = Exploration("A", None, [("x", "B")], steps=2, start=10, margin=0.1)
    assert ex.next_plan() == ("x", "B")
    ex.record(0.5)
    assert ex.next_plan() == ("in force", "A") and ex.at == 14
    ex.record(0.4)
    assert ex.next_plan() is None
    assert ex.choose() == ("in force", "A", 0.4)
    ex = Exploration("A", None, [("x", "B")], steps=2, start=10, margin=0.1)
    ex.next_plan()
    ex.record(0.5)
    ex.next_plan()
    ex.record(None)  # a rank had no times: nothing to compare with, the plan stays
    assert ex.choose() == ("in force", "A", None)
    with pytest.raises(RuntimeError, match="next_plan"):
        Exploration("A", 1.0, [], steps=2, start=0, margin=0.1).record(1.0)


@pytest.mark.parametrize("kw", [{"explore": "yes"}, {"explore_start": 1}, {"explore_steps": 0},
                                {"explore_steps": True}, {"max_explorations": -1},
                                {"ratio": 0.1}, {"ratio": True}])
def test_bad_exploration_knobs_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        Adaptive(**kw)


def test_exploration_defaults_on_for_measured_links_and_off_for_injected_ones():
    assert Adaptive().explores and not Adaptive(estimate=lambda s, r: None).explores
    assert Adaptive(explore=True, estimate=lambda s, r: None).explores
    assert not Adaptive(explore=False).explores
    assert not Adaptive().explores_start and Adaptive(explore_start=True).explores_start
    assert not Adaptive(explore=False, explore_start=True).explores_start


# -- the engine tries them on real steps -------------------------------------------------

def _explore_run(t, sleep_s, schedule, steps=26, start=None, **kw):
    """FAST or SLOW as ``schedule(step)`` says; the loop sleeps ``sleep_s(step, on)``
    a step (``on``: w1 travels compressed), the wall time the exploration sees; the
    start plan made on the link ``start`` (default: the profile's)."""
    settings = Adaptive(check_every=4, explore=True, explore_steps=3,
                        estimate=lambda s, r: schedule(s), **kw)
    return _sleeping_run(t, settings, sleep_s, steps, start)


def _alike(res):
    (a, out0, c0, k0), (b, out1, c1, k1) = res
    assert c0 == c1 and k0 == k1
    assert all(torch.equal(x, y) for x, y in zip(out0, out1))
    assert a.history == b.history or [_agreed(h) for h in a.history] == \
        [_agreed(h) for h in b.history]
    return a, c0, k0


def _agreed(h):
    return {k: v for k, v in h.items() if not k.startswith("step_s_")}


def _slow_after_5(step):
    return FAST if step < 5 else SLOW


def test_a_moved_link_tries_the_models_plans_and_keeps_the_fastest_measured():
    # compressing measures faster: the exploration at the check of step 8 tries the
    # model's plans for 3 steps each (the plan in force was timed before it), and switches
    online, compressed, kinds = _alike(run_threads(
        lambda t: _explore_run(t, lambda s, on: 0.002 if on else 0.08, _slow_after_5), 2))
    start = next(h for h in online.history if h.get("exploring"))
    assert start["step"] == 8 and start["exploring"] == "link moved"
    ends = [h for h in online.history if "explored" in h and "chose" in h]
    assert ends[0]["switched"] and ends[0]["chose"] != "in force"
    n = len(start["candidates"])
    assert len(ends[0]["explored"]) == n + 1  # every candidate, and the plan in force
    assert ends[0]["step"] == 8 + 3 * n
    assert all(compressed[ends[0]["step"]:])
    first = kinds[:n + 1]  # (a loaded host may start more explorations on noise)
    assert first == [("plan_explore", 8 + 3 * i) for i in range(n)] + \
        [("plan_switch", ends[0]["step"])]
    assert online.switches >= 1


def test_the_first_check_explores_the_start_plan_against_the_alternatives():
    """``explore_start``: the link never moves, but the plan chosen at start was made on
    a slow link (w1 compressed), and compressing measures slower here. The first check
    records the reference and explores (the model's plan on the profile's fast link
    sends w1 as it is); the plan in force has no time yet (the steps before carry the
    warm-up), so it runs a window of its own after the candidates; the fastest
    measured is kept. Off (the default) nothing is explored: the link never moved."""
    def same_link(step):
        return FAST

    def sleep_s(step, on):
        return 0.06 if on else 0.002

    online, compressed, kinds = _alike(run_threads(
        lambda t: _explore_run(t, sleep_s, same_link, start=SLOW, explore_start=True), 2))
    first = online.history[0]
    assert first["step"] == 4 and first["reference"] and first["exploring"] == "start"
    assert all(compressed[:4]) and not compressed[4]  # the first candidate from step 4 on
    n = len(first["candidates"])
    end = next(h for h in online.history if "chose" in h)
    assert [r["why"] for r in end["explored"]][-1] == "in force"  # timed last, in a window
    assert end["step"] == 4 + 3 * (n + 1) and end["switched"] and end["chose"] != "in force"
    assert not any(compressed[end["step"]:])
    assert kinds[0] == ("plan_explore", 4) and ("plan_switch", end["step"]) in kinds

    online, compressed, kinds = _alike(run_threads(
        lambda t: _explore_run(t, sleep_s, same_link, start=SLOW), 2))  # off by default
    assert online.explorations == 0 and all(compressed) and not kinds


def test_a_model_that_wants_compression_is_overruled_by_measured_steps():
    # the same link change, but compressing measures slower (60 ms a step against 20):
    # the plan in force stays and no switch is counted (a loaded host may start more
    # explorations on noise; each measures the same and keeps the plan)
    online, compressed, kinds = _alike(run_threads(
        lambda t: _explore_run(t, lambda s, on: 0.06 if on else 0.02, _slow_after_5), 2))
    ends = [h for h in online.history if "chose" in h]
    assert ends and all(h["chose"] == "in force" and not h["switched"] for h in ends)
    assert online.switches == 0 and online.explorations == len(ends)
    assert not any(compressed[ends[-1]["step"]:])
    assert ("plan_explore", ends[0]["step"]) in kinds
    assert not any(k == "plan_switch" for k, _ in kinds)


def _mid_link():
    """A link on which the model compresses w1 but prices the plan with nothing
    compressed within 2x of its best (a candidate an exploration tries)."""
    prof = _profile()
    for e in range(80):
        link = Link(FAST.latency, FAST.bandwidth / 1.25 ** e)
        planners = [Planner(prof.with_link(link), "onebit", 2, "ps")]
        best = profile_plan(prof.with_link(link), ["onebit"], SIZES, 2, "ps")
        if not best.decide("w1", SIZES["w1"], 2).compress:
            continue
        t_best = price_plan(best, planners, SIZES, 2)
        if price_plan(uncompressed(best), planners, SIZES, 2) < 1.5 * t_best:
            return link
    raise AssertionError("no such link for this profile")


def test_a_slower_step_on_an_unchanged_link_explores_as_the_work_changed():
    # the link moves at step 5 to one where compressing w1 pays, and measures so: the
    # exploration switches to a compressed plan. From step 24 compressing costs more
    # (a CPU hog: 200 ms a step against 60 ms uncompressed) on the same link: two checks
    # in a row see the step time moved, and the second explores again, a plan with w1
    # uncompressed among the candidates (the model's at 4x bandwidth or "nothing
    # compressed": the same plan here)
    mid = _mid_link()

    def schedule(step):
        return FAST if step < 5 else mid

    def sleep_s(step, on):
        return (0.005 if step < 24 else 0.2) if on else 0.06

    res = run_threads(lambda t: _explore_run(t, sleep_s, schedule, steps=52), 2)
    online, compressed, kinds = _alike(res)
    starts = [h for h in online.history if h.get("exploring")]
    ends = [h for h in online.history if "chose" in h]
    assert starts[0]["exploring"] == "link moved" and starts[0]["step"] == 8
    assert ends[0]["switched"] and compressed[ends[0]["step"]]
    # (a loaded host may start an exploration on noise before the hog: it keeps the plan)
    hog = [h for h in starts if h["step"] > 24]
    assert hog and hog[0]["exploring"] == "step time moved", starts
    end = next(h for h in ends if h["step"] > hog[0]["step"])
    assert end["switched"] and not any(compressed[end["step"]:])
    assert online.switches >= 2


def test_the_exploration_caps_hold():
    online, compressed, kinds = _alike(run_threads(
        lambda t: _explore_run(t, lambda s, on: 0.002 if on else 0.03, _slow_after_5,
                               max_explorations=0), 2))
    assert online.explorations == 0 and kinds == [] and not any(compressed)
    assert any(h.get("capped") for h in online.history)


def test_one_partition_keeps_every_decision_but_its_partitions():
    from hipress_like.tuning.explore import one_partition

    _, plans = _plans()
    slow = plans[1e5]
    got = one_partition(slow)
    assert {n: g.compress for n, g in got.gradients.items()} == \
        {n: g.compress for n, g in slow.gradients.items()}
    assert all(g.partitions == 1 for g in got.gradients.values())
    assert got.rule == slow.rule and got.compressor == slow.compressor


def test_recalled_plans_come_first_whatever_the_model_prices_them_at():
    prof, plans = _plans()
    slow, fast, current = plans[1e5], plans[12.5e9], plans[1.25e6]
    price = {plan_key(slow): 1.0, plan_key(fast): 10.0, plan_key(current): 1.0}

    def plan_at(link):
        return slow

    got = alternatives(plan_at, lambda p: price.get(plan_key(p)), Link(1e-3, 1e8), current,
                       scales=(), recalled=[("kept at step 5", fast), ("kept at 9", current)])
    # the recalled plan is tried first although priced 10x the best; the plan in force is
    # never a candidate, recalled or not
    assert [(why, plan_key(p)) for why, p in got] == [("kept at step 5", plan_key(fast)),
                                                     ("model", plan_key(slow))]


def _back_to_fast(step):
    return FAST if step < 5 or step >= 22 else SLOW


def test_a_link_that_comes_back_gets_back_the_plan_kept_on_it():
    # FAST (nothing compressed measures fastest), SLOW from step 5 (compressing does), FAST
    # again from step 22: the exploration there tries the plan kept at the first check
    # (recalled) first, and keeps it; the kept list travels in the state dict
    def sleep_s(step, on):
        if 5 <= step < 22:
            return 0.002 if on else 0.08
        return 0.03 if on else 0.004

    online, compressed, kinds = _alike(run_threads(
        lambda t: _explore_run(t, sleep_s, _back_to_fast, steps=44), 2))
    back = [h for h in online.history if h.get("exploring") and h["step"] >= 22]
    assert back, online.history
    assert back[0]["candidates"][0] == "kept at step 4", back[0]["candidates"]
    assert not any(compressed[-6:]), "the fast link's plan (nothing compressed) is back"
    # the newest kept decision is the first plan again, chosen anew at the return (a
    # loaded host may add explorations on noise, so only the order is pinned)
    link, plan, at = online.kept[-1]
    assert at > back[0]["step"] and link.bandwidth == FAST.bandwidth
    assert not plan.decide("w1", SIZES["w1"], 2).compress
    state = online.state_dict(type("E", (), {"plan": online.kept[-1][1]})())
    assert [at for _, _, at in state["kept"]] == [at for _, _, at in online.kept]


def test_an_exploration_the_link_moved_during_is_void_and_begins_again_on_the_new_link():
    # SLOW from step 5 (the check of step 8 explores), ``_mid_link`` from step 10, while
    # the exploration still runs: at its end the link measured there moved far from the
    # exploration's, so its times (taken on two links) decide nothing: the plan in force
    # before it is back, nothing is kept for SLOW, and a new exploration starts on the
    # new link at once (the model compresses w1 there), the plan in force timed last
    mid = _mid_link()

    def schedule(step):
        return FAST if step < 5 else SLOW if step < 10 else mid

    def sleep_s(step, on):
        return 0.02 if on else 0.004  # compressing measures slower on either link

    online, compressed, kinds = _alike(run_threads(
        lambda t: _explore_run(t, sleep_s, schedule, steps=40), 2))
    first = next(h for h in online.history if h.get("exploring"))
    assert first["step"] == 8 and first["exploring"] == "link moved"
    void = next(h for h in online.history if h.get("voided"))
    assert void["step"] == 8 + 3 * len(first["candidates"])
    assert void["bandwidth_Bps"] == mid.bandwidth and not void["switched"]
    again = next(h for h in online.history if h.get("exploring") and h is not first)
    assert again["step"] == void["step"]
    assert again["exploring"] == "link moved during an exploration"
    end = next(h for h in online.history if "chose" in h and h["step"] > void["step"])
    assert end["explored"][-1]["why"] == "in force"
    assert end["step"] == void["step"] + 3 * (len(again["candidates"]) + 1)
    assert not any(compressed[end["step"]:])
    assert SLOW.bandwidth not in {link.bandwidth for link, _, _ in online.kept}
    assert online.explorations >= 2 and ("plan_explore", void["step"]) in kinds


def test_a_probe_that_reads_a_move_at_an_explorations_end_must_read_it_twice():
    """``_moved_during`` with probes (``_measure`` scripted): a first reading 2x or
    more from the exploration's link is probed again, and only a second such reading
    voids it; the timeline's estimate (plan-dependent) never voids one."""
    from hipress_like.tuning.online import OnlinePlanner

    online = OnlinePlanner(Adaptive(), _profile(), ["onebit"], SIZES, 2, "ps")
    ex = Exploration("A", 1.0, [], steps=3, start=0, margin=0.1, link=Link(1e-3, 1e8))
    readings = []
    online._measure = lambda engine, step_s: readings.pop(0)
    readings[:] = [Link(1e-3, 3e8), Link(1e-3, 1.2e8)]  # a move, then none: noise
    assert online._moved_during(None, ex) is None and not readings
    readings[:] = [Link(1e-3, 3e8), Link(1e-3, 4e8)]
    assert online._moved_during(None, ex) == Link(1e-3, 4e8)
    readings[:] = [Link(1e-3, 1.5e8)]  # under 2x: one probe
    assert online._moved_during(None, ex) is None and not readings
    online.settings = Adaptive(measure="timeline")
    readings[:] = [Link(1e-3, 1e10)]
    assert online._moved_during(None, ex) is None and readings


def test_a_faster_link_under_a_plan_that_compresses_nothing_starts_no_exploration():
    """``_check`` with probes (scripted, the caps reached so a wanted exploration shows as
    ``capped``): a link read 2x faster than the decided one leaves a plan that compresses
    nothing as it is (no plan gains more from a faster link), while the same reading
    under a compressing plan, and a slower reading under the uncompressed one, would
    each explore."""
    from hipress_like.tuning.online import OnlinePlanner

    prof = _profile()
    bare = profile_plan(prof.with_link(FAST), ["onebit"], SIZES, 2, "ps")
    squeezed = profile_plan(prof.with_link(SLOW), ["onebit"], SIZES, 2, "ps")
    assert not any(g.compress for g in bare.gradients.values())
    assert any(g.compress for g in squeezed.gradients.values())
    online = OnlinePlanner(Adaptive(max_explorations=0), prof, ["onebit"], SIZES, 2, "ps")
    online.reference = online.decided_on = Link(1e-3, 1e9)
    online._should_probe = lambda eng, step: (True, 0.05)
    readings = []
    online._measure = lambda eng, step_s: readings.pop(0)

    def check(plan, bandwidth, step):
        readings[:] = [Link(1e-3, bandwidth)] * 2  # a 2x move is read twice
        online._check(type("E", (), {"plan": plan})(), step)
        assert not readings
        return online.history[-1]

    rec = check(bare, 3e9, 10)
    assert rec["faster_uncompressed"] and "capped" not in rec and "exploring" not in rec
    assert online.decided_on == Link(1e-3, 1e9), "the decided link stays"
    rec = check(squeezed, 3e9, 15)
    assert rec["capped"] and "faster_uncompressed" not in rec
    rec = check(bare, 3e8, 20)
    assert rec["capped"] and "faster_uncompressed" not in rec


def test_a_check_whose_probe_reads_a_move_probes_again_and_keeps_the_second_reading():
    """``_check`` with probes (``_measure`` scripted, the caps reached so nothing is
    switched): a first reading 2x or more from the decided link is taken again and the
    second is the check's link; a reading under 2x is taken once."""
    from hipress_like.tuning.online import OnlinePlanner

    prof = _profile()
    # a plan that compresses (a faster link under one that does not explores nothing)
    plan = profile_plan(prof.with_link(SLOW), ["onebit"], SIZES, 2, "ps",
                        meta={"profile": prof.to_dict()})
    online = OnlinePlanner(Adaptive(max_explorations=0), prof, ["onebit"], SIZES, 2, "ps")
    engine = type("E", (), {"plan": plan})()
    online.reference = online.decided_on = Link(1e-3, 1e8)
    online._should_probe = lambda eng, step: (True, 0.05)
    readings = []
    online._measure = lambda eng, step_s: readings.pop(0)
    readings[:] = [Link(1e-3, 3e9), Link(1e-3, 4e8)]  # an outlier, then a 4x move
    online._check(engine, 10)
    rec = online.history[-1]
    assert not readings and rec["probed_twice"] and rec["bandwidth_Bps"] == 4e8
    assert rec["bandwidth_ratio"] == 4.0 and rec["capped"]
    readings[:] = [Link(1e-3, 1.5e8)]
    online._check(engine, 15)
    assert not readings and "probed_twice" not in online.history[-1]
    online.settings = Adaptive(max_explorations=0, estimate=lambda s, r: FAST, explore=True)
    readings[:] = [Link(1e-3, 1e10)]  # an injected estimate is the same at a second look
    online._check(engine, 20)
    assert not readings and "probed_twice" not in online.history[-1]
