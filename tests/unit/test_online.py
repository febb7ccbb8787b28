"""plan="adaptive" (tuning/online.py): the estimator, the agreement, the decision rule,
the pricing of plans on a changed link, and the engine's switch at a step boundary.
"""
import dataclasses
import io
import math

import pytest
import torch

from hipress_like.casync.engine import Engine, EngineConfig
from hipress_like.casync.timeline import Event
from hipress_like.casync.transport.inproc import run_threads
from hipress_like.cost_model import CompressorProfile, Curve, Link, Plan, Profile, SizeRule
from hipress_like.cost_model.planner import NEVER, Planner
from hipress_like.tuning.online import (
    Adaptive,
    LinkEstimator,
    OnlinePlanner,
    agree,
    price_plan,
    profile_plan,
    should_switch,
    timeline_samples,
)

FAST = Link(2e-6, 12.5e9)  # 2 us + 100 Gbit/s
SLOW = Link(1e-3, 1.25e6)  # 1 ms + 10 Mbit/s
SIZES = {"w1": 256 << 10, "w2": 64 << 10, "b": 512}


def _profile(link=FAST):
    pts = [float(4 << e) for e in range(8, 26, 2)]
    cp = CompressorProfile(name="onebit", category="quantization", ratio=1 / 32,
                           header_bytes=8, encode=Curve.linear(2e-5, 1e-9, pts),
                           decode=Curve.linear(1e-5, 5e-10, pts))
    return Profile(link=link, compressors={"onebit": cp}, meta={"ranks": 2})


# -- the decision rule -------------------------------------------------------------------

def test_should_switch_needs_more_than_the_margin():
    assert should_switch(1.0, 0.8, margin=0.1, switches=0, max_switches=4)
    assert not should_switch(1.0, 0.9, margin=0.1, switches=0, max_switches=4)  # exactly 10 %
    assert not should_switch(1.0, 0.95, margin=0.1, switches=0, max_switches=4)
    assert should_switch(1.0, 0.95, margin=0.0, switches=0, max_switches=4)
    assert not should_switch(1.0, 1.2, margin=0.0, switches=0, max_switches=4)  # slower


def test_should_switch_stops_at_the_cap():
    assert should_switch(1.0, 0.1, margin=0.1, switches=1, max_switches=2)
    assert not should_switch(1.0, 0.1, margin=0.1, switches=2, max_switches=2)
    assert not should_switch(1.0, 0.1, margin=0.1, switches=0, max_switches=0)
    assert not should_switch(0.0, 0.0, margin=0.1, switches=0, max_switches=2)


@pytest.mark.parametrize("kw", [{"check_every": 0}, {"margin": 1.0}, {"margin": -0.1},
                                {"max_switches": -1}, {"gain": 0.0}, {"estimate": 3},
                                {"check_every": True}, {"measure": "ping"},
                                {"probe_s": 0}, {"probe_s": True}, {"probe_s": 2.0},
                                {"probe_every": 0}])
def test_adaptive_rejects_bad_knobs(kw):
    with pytest.raises(ValueError):
        Adaptive(**kw)


# -- the estimator -------------------------------------------------------------------------

def test_estimator_fits_alpha_and_beta_from_two_sizes():
    est = LinkEstimator(gain=1.0)
    link = est.update([(m, SLOW(m)) for m in (1e3, 1e4, 1e5)])
    assert math.isclose(link.latency, SLOW.latency, rel_tol=1e-6)
    assert math.isclose(link.bandwidth, SLOW.bandwidth, rel_tol=1e-6)


def test_estimator_moves_by_its_gain_toward_a_new_link():
    est = LinkEstimator(gain=0.25)
    est.update([(m, FAST(m)) for m in (1e3, 1e5)])
    est.update([(m, SLOW(m)) for m in (1e3, 1e5)])
    beta = 1 / FAST.bandwidth + 0.25 * (1 / SLOW.bandwidth - 1 / FAST.bandwidth)
    assert math.isclose(1 / est.link.bandwidth, beta, rel_tol=1e-6)
    for _ in range(60):  # converges to the new link
        est.update([(m, SLOW(m)) for m in (1e3, 1e5)])
    assert math.isclose(est.link.bandwidth, SLOW.bandwidth, rel_tol=1e-3)
    assert est.steps == 62


def test_estimator_with_one_size_keeps_the_latency():
    est = LinkEstimator(gain=1.0)
    est.update([(m, SLOW(m)) for m in (1e3, 1e5)])
    link = est.update([(5e4, SLOW(5e4)), (5e4, SLOW(5e4))])
    assert math.isclose(link.bandwidth, SLOW.bandwidth, rel_tol=1e-6)
    assert est.update([]) == link  # a step without samples changes nothing


def test_timeline_samples_convert_rounds_and_buckets_to_one_way_bytes():
    evs = [Event("round", "", 2, 0.0, 0.5, 1000, "comm", 3),
           Event("bucket", "", 4, 1.0, 1.25, 400, "comm", 3),
           Event("encode", "w", 0, 0.0, 0.1, 400, "compute", 3),
           Event("round", "", 2, 0.0, 0.5, 1000, "comm", 2),  # another step
           Event("round", "", 2, 0.0, 0.5, 0, "comm", 3)]  # metadata only
    assert timeline_samples(evs, 3, 4) == [(500.0, 0.5), (600.0, 0.25)]


def test_timeline_since_returns_what_is_new_within_its_bound():
    from hipress_like.casync.timeline import Timeline

    tl = Timeline(max_events=5)
    ev = [Event("round", "w", i, 0.0, 1.0, 8, "comm", i) for i in range(8)]
    for e in ev[:3]:
        tl.add(e)
    got, mark = tl.since(0)
    assert got == ev[:3] and mark == 3
    assert tl.since(mark) == ([], 3)
    for e in ev[3:]:  # 8 added, the bound keeps 5: the oldest dropped in order
        tl.add(e)
    assert tl.events == ev[3:]
    assert tl.since(mark) == (ev[3:], 8)  # all that is new and still kept
    assert tl.since(6) == (ev[6:], 8)


def test_agree_takes_the_same_median_on_every_rank():
    links = [Link(1e-3, 1e6), Link(3e-3, 4e6), Link(2e-3, 2e6)]

    def body(t):
        return agree(t, links[t.rank], 10.0)

    got = run_threads(body, 3)
    assert got[0] == got[1] == got[2] == Link(2e-3, 2e6)
    assert run_threads(lambda t: agree(t, None if t.rank else Link(1, 1), 10.0), 2) == [None,
                                                                                     None]


# -- plans on a changed link ----------------------------------------------------------------

def test_best_plan_follows_the_link_and_prices_below_the_current_one():
    prof = _profile()
    fast = profile_plan(prof, ["onebit"], SIZES, 2, "ps")
    slow_prof = prof.with_link(SLOW)
    slow = profile_plan(slow_prof, ["onebit"], SIZES, 2, "ps")
    assert not any(g.compress for g in fast.gradients.values())
    assert slow.gradients["w1"].compress and slow.gradients["w2"].compress
    planners = [Planner(slow_prof, "onebit", 2, "ps")]
    now, best = price_plan(fast, planners, SIZES, 2), price_plan(slow, planners, SIZES, 2)
    assert best < 0.5 * now
    # a plan naming a compressor the profile lacks cannot be priced
    other = Plan(compressor="topk", strategy="ps", rule=SizeRule(min_compress_bytes=0))
    assert price_plan(other, planners, SIZES, 2) is None
    never = Plan(compressor="onebit", strategy="ps", rule=SizeRule(min_compress_bytes=NEVER))
    assert math.isclose(price_plan(never, planners, SIZES, 2), now, rel_tol=1e-9)


# -- the switch, on an in-process engine -------------------------------------------------------

def _random_step(eng, online, g):
    """One step of random gradients (from ``g``) on ``eng``, then ``online``'s turn; the
    step's gradients, concatenated."""
    grads = {n: torch.randn(nb // 4, generator=g) for n, nb in SIZES.items()}
    for n, x in grads.items():
        eng.submit(n, x)
    eng.synchronize()
    online.after_step(eng)
    return torch.cat(list(grads.values()))


def _engine_run(t, schedule, settings_kw):
    prof = _profile()
    plan = profile_plan(prof, ["onebit"], SIZES, t.size, "ps", meta={"profile": prof.to_dict()})
    eng = Engine(t, EngineConfig(compressor="onebit", plan=plan, threads=False))
    eng.register([(n, (nb // 4,), torch.float32) for n, nb in SIZES.items()])
    settings = Adaptive(estimate=lambda step, rank: schedule(step), **settings_kw)
    online = OnlinePlanner.for_engine(eng, settings)
    g = torch.Generator().manual_seed(t.rank)
    out = []
    for _ in range(13):  # 5 steps after the switch at step 8: timed
        out.append(_random_step(eng, online, g))
    layout = {n: d["compress"] for n, d in eng.layout().items()}
    eng.close()
    return online.history, out, layout, [e.step for e in eng.timeline.events
                                         if e.kind == "plan_switch"]


def test_engine_switches_at_the_same_step_and_keeps_results_identical():
    def schedule(step):
        return FAST if step < 5 else SLOW

    res = run_threads(lambda t: _engine_run(t, schedule, {"check_every": 4}), 2)
    (h0, out0, lay0, ev0), (h1, out1, lay1, ev1) = res
    assert [r["switched"] for r in h0] == [False, True, False]  # checks at steps 4, 8, 12
    def decisions(h):  # without the wall-clock step times, each rank's own
        return [{k: v for k, v in r.items() if not k.startswith("step_s")} for r in h]

    assert decisions(h0) == decisions(h1) and ev0 == ev1 == [8]
    assert h0[1]["step_s_before"] > 0 and h0[1]["step_s_after"] > 0  # timed, reported
    assert lay0 == lay1 and lay0["w1"] and lay0["w2"]
    for a, b in zip(out0, out1):
        assert torch.equal(a, b)
    assert h0[1]["gain"] > 0.1 and h0[1]["reset"] == []


def test_engine_switch_back_resets_the_compressor_state_it_cannot_carry():
    def schedule(step):  # slow, fast, slow again: the third change meets the cap
        return FAST if 5 <= step < 8 else SLOW

    prof = _profile(SLOW)

    def run(t):
        plan = profile_plan(prof, ["onebit"], SIZES, t.size, "ps",
                            meta={"profile": prof.to_dict()})
        eng = Engine(t, EngineConfig(compressor="onebit", plan=plan, threads=False))
        eng.register([(n, (nb // 4,), torch.float32) for n, nb in SIZES.items()])
        online = OnlinePlanner.for_engine(eng, Adaptive(check_every=3, max_switches=1,
                                                        estimate=lambda s, r: schedule(s)))
        states = []
        for _ in range(9):
            for n, nb in SIZES.items():
                eng.submit(n, torch.ones(nb // 4) * (t.rank + 1))
            eng.synchronize()
            online.after_step(eng)
            states.append(sorted({k.split("|")[0] for k in eng.state_dict()["states"]}))
        eng.close()
        return online.history, states

    (h, states), _ = run_threads(run, 2)
    assert [r["switched"] for r in h] == [False, True, False]  # at step 9: the cap (1)
    assert h[2]["gain"] > 0.1
    assert sorted(h[1]["reset"]) == ["b", "w1", "w2"]  # compressed on the slow link, no more
    assert states[4] == ["b", "w1", "w2"] and states[5] == []  # reset at the switch (step 6)


def test_set_plan_refuses_inside_a_step_and_different_plans_on_different_ranks():
    from hipress_like.casync.errors import ConfigMismatchError

    prof = _profile()

    def run(t):
        plan = profile_plan(prof, ["onebit"], SIZES, t.size, "ps")
        eng = Engine(t, EngineConfig(compressor="onebit", plan=plan, threads=False))
        eng.register([(n, (nb // 4,), torch.float32) for n, nb in SIZES.items()])
        eng.submit("b", torch.ones(SIZES["b"] // 4))
        with pytest.raises(RuntimeError, match="inside a step"):
            eng.set_plan(plan)
        for n in ("w1", "w2"):
            eng.submit(n, torch.ones(SIZES[n] // 4))
        eng.synchronize()
        mine = profile_plan(prof.with_link(SLOW if t.rank else FAST), ["onebit"], SIZES,
                            t.size, "ps")
        with pytest.raises(ConfigMismatchError, match=r"ranks \[1\]"):
            eng.set_plan(mine)
        assert eng.plan is plan  # nothing changed
        eng.close()
        return True

    assert run_threads(run, 2) == [True, True]


def test_calibrated_profile_moves_every_link_fit_by_the_change_from_the_reference():
    prof = dataclasses.replace(_profile(), link_one=Link(1e-5, 25e9), lane=Link(5e-5, 5e9))
    online = OnlinePlanner(Adaptive(), prof, ["onebit"], SIZES, 2, "ps")
    online.reference = Link(1e-4, 1e9)  # what the rounds measured at the first check
    same = online.calibrated(Link(1e-4, 1e9))
    assert (same.link, same.link_one, same.lane, same.allreduce) == (
        prof.link, prof.link_one, prof.lane, None)
    moved = online.calibrated(Link(3e-4, 2.5e8))  # +200 us, a quarter of the bandwidth
    assert math.isclose(moved.link.latency, 2e-6 + 2e-4)
    assert math.isclose(moved.link.bandwidth, 12.5e9 / 4)
    assert math.isclose(moved.lane.bandwidth, 5e9 / 4)
    assert math.isclose(moved.link_one.latency, 1e-5 + 2e-4)
    assert moved.compressors == prof.compressors


def test_a_plan_the_model_would_not_pick_stays_while_the_link_does_not_move():
    """The first check is the reference; without a change of link beyond the margin a
    plan stays, even one the model prices above its own best (trials may keep one)."""
    prof = _profile()
    every = Plan(compressor="onebit", strategy="ps", rule=SizeRule(min_compress_bytes=0))

    def run(t, schedule):
        eng = Engine(t, EngineConfig(compressor="onebit", plan=dataclasses.replace(
            every, meta={"profile": prof.to_dict()}), threads=False))
        eng.register([(n, (nb // 4,), torch.float32) for n, nb in SIZES.items()])
        online = OnlinePlanner.for_engine(eng, Adaptive(check_every=2,
                                                        estimate=lambda s, r: schedule(s)))
        for _ in range(8):
            for n, nb in SIZES.items():
                eng.submit(n, torch.ones(nb // 4))
            eng.synchronize()
            online.after_step(eng)
        eng.close()
        return online.history

    h = run_threads(lambda t: run(t, lambda s: FAST), 2)[0]
    assert h[0]["reference"] and not any(r["switched"] for r in h)
    assert all(r["gain"] > 0.5 and r["moved"] == 0 for r in h[1:])  # tempting, not moved
    h = run_threads(lambda t: run(t, lambda s: SLOW if s >= 4 else FAST), 2)[0]
    assert [r["switched"] for r in h] == [False, False, True, False]  # once the link moved
    assert h[1]["moved"] == 0 and h[2]["moved"] > 0.1 and h[2]["gain"] > 0.1


def test_front_end_option_off_runs_nothing_and_one_rank_has_nothing_to_adapt():
    import hipress_like.torch as hpt

    hpt.init()
    try:
        def wrap(**kw):
            m = torch.nn.Linear(6, 3)
            return hpt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                            named_parameters=m.named_parameters(), **kw)

        for plan in (None, "auto"):
            opt = wrap(compression="onebit", plan=plan)
            assert opt.online is None
            opt.close()
        opt = wrap(compression="onebit", plan=hpt.Adaptive(check_every=2))
        assert opt.online is None  # one rank: the plan stays fixed (logged)
        opt.close()
        with pytest.raises(ValueError, match="compression_back"):
            wrap(compression="onebit", compression_back="onebit", plan="adaptive")
        with pytest.raises(TypeError, match="'adaptive'"):
            wrap(compression="onebit", plan=3)
        # a face that does not re-plan refuses it instead of keeping the first plan
        with pytest.raises(ValueError, match="re-plans at step boundaries"):
            hpt.CaSyncHookState(torch.nn.Linear(6, 3), compression="onebit", plan="adaptive")
    finally:
        hpt.shutdown()


def test_controller_state_round_trips_the_switched_plan_and_refuses_what_is_not_it():
    """``OnlinePlanner.state_dict`` after a switch, loaded into a fresh engine on the
    first plan: the switched plan, the reference and the switch count come back;
    another world size keeps the first plan; a foreign dict is refused."""
    prof = _profile()

    def build(t):
        plan = profile_plan(prof, ["onebit"], SIZES, t.size, "ps",
                            meta={"profile": prof.to_dict()})
        eng = Engine(t, EngineConfig(compressor="onebit", plan=plan, threads=False))
        eng.register([(n, (nb // 4,), torch.float32) for n, nb in SIZES.items()])
        return eng, OnlinePlanner.for_engine(
            eng, Adaptive(check_every=2, estimate=lambda s, r: SLOW if s >= 2 else FAST))

    def run(t):
        eng, online = build(t)
        for _ in range(4):
            for n, nb in SIZES.items():
                eng.submit(n, torch.ones(nb // 4))
            eng.synchronize()
            online.after_step(eng)
        online.rejected.append(("{}", SLOW, 3))  # a revert that stood (trials: below)
        online.reverts = 1
        sd = online.state_dict(eng)
        switched = eng.plan.to_dict()
        eng.close()
        fresh, again = build(t)
        first = fresh.plan.to_dict()
        old = {k: v for k, v in sd.items() if k not in ("rejected", "reverts")}
        assert again.load_state_dict(fresh, old)  # saved before trials existed
        assert again.rejected == [] and again.reverts == 0
        fresh.close()
        fresh, again = build(t)
        assert not again.load_state_dict(fresh, dict(sd, world_size=t.size + 1))
        assert fresh.plan.to_dict() == first  # another world size: the first plan stays
        assert again.load_state_dict(fresh, sd)
        loaded = fresh.plan.to_dict()
        with pytest.raises(ValueError, match="not a plan='adaptive' state"):
            again.load_state_dict(fresh, {"format": "hipress-like-engine"})
        fresh.close()
        assert again.rejected == [("{}", SLOW, 3)] and again.reverts == 1
        return switched, first, loaded, again.switches, again.reference, again.history

    for switched, first, loaded, switches, ref, hist in run_threads(run, 2):
        assert switched != first and loaded == switched
        assert switches == 1 and ref == FAST
        assert [h["switched"] for h in hist] == [False, True]
    sd = run_threads(lambda t: _state_only(t, prof), 2)[0]
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == sd


def _state_only(t, prof):
    plan = profile_plan(prof, ["onebit"], SIZES, t.size, "ps", meta={"profile": prof.to_dict()})
    eng = Engine(t, EngineConfig(compressor="onebit", plan=plan, threads=False))
    eng.register([(n, (nb // 4,), torch.float32) for n, nb in SIZES.items()])
    online = OnlinePlanner.for_engine(eng, Adaptive(check_every=1,
                                                    estimate=lambda s, r: FAST))
    for n, nb in SIZES.items():
        eng.submit(n, torch.ones(nb // 4))
    eng.synchronize()
    online.after_step(eng)
    sd = online.state_dict(eng)
    eng.close()
    return sd


def _probed_history(t, settings, steps, sleep_s=lambda step: 0.0):
    """``steps`` steps of an in-process engine under ``settings`` (no injected link: the
    probe measures the threads' exchange); the history's check steps and links."""
    import time

    prof = _profile()
    # a plan that compresses (one that does not is probed half as often)
    plan = profile_plan(prof.with_link(SLOW), ["onebit"], SIZES, t.size, "ps",
                        meta={"profile": prof.to_dict()})
    eng = Engine(t, EngineConfig(compressor="onebit", plan=plan, threads=False))
    eng.register([(n, (nb // 4,), torch.float32) for n, nb in SIZES.items()])
    online = OnlinePlanner.for_engine(eng, settings)
    for step in range(steps):
        time.sleep(sleep_s(step))
        for n, nb in SIZES.items():
            eng.submit(n, torch.ones(nb // 4))
        eng.synchronize()
        online.after_step(eng)
    eng.close()
    return [(r["step"], r["latency_s"], r["bandwidth_Bps"]) for r in online.history]


def test_the_probe_measures_the_link_alike_on_every_rank_at_each_check():
    """measure="probe" (the default): each check times a real exchange; every rank
    records the same link (rank 0's fit, broadcast), and the first is the reference."""
    settings = Adaptive(check_every=3, verify=False, explore=False, probe_every=1,
                        max_switches=0)
    h0, h1 = run_threads(lambda t: _probed_history(t, settings, 9), 2)
    assert h0 == h1 and [s for s, _, _ in h0] == [3, 6, 9]
    assert all(lat >= 0 and bw > 0 for _, lat, bw in h0)


def test_a_check_probes_only_when_the_step_time_moved_or_probe_every_says_so():
    """Steps of 20 ms, then of 100 ms from the seventh: the checks at steps 6 and 12
    see the step time of the last probe (within the margin) and do not probe; the
    one at step 9 sees it moved and probes; probe_every=2 probes at step 15 anyway."""
    settings = Adaptive(check_every=3, verify=False, explore=False, margin=0.5,
                        probe_every=2, max_switches=0)
    res = run_threads(lambda t: _probed_history(t, settings, 15,
                                                lambda step: 0.02 if step < 6 else 0.1), 2)
    assert [[s for s, _, _ in h] for h in res] == [[3, 9, 15]] * 2


def test_a_check_agrees_on_step_times_carried_by_the_replayed_step_with_no_allgather(
        monkeypatch):
    """A plan whose gradients all travel by allreduce replays its schedule, and each
    step carries the step times every rank shared after the step before
    (``Engine.share``): the checks agree on them with no collective of their own
    (``agree_values`` is never called), alike on both ranks; a plan that does not
    replay (1-bit over PS) agrees by an allgather."""
    import time

    from hipress_like.tuning import online as mod

    calls = []
    real = mod.agree_values

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(mod, "agree_values", counted)
    prof = _profile()

    def history(t, link):
        plan = profile_plan(prof.with_link(link), ["onebit"], SIZES, t.size, "ps",
                            meta={"profile": prof.to_dict()})
        eng = Engine(t, EngineConfig(compressor="onebit", plan=plan, threads=False))
        eng.register([(n, (nb // 4,), torch.float32) for n, nb in SIZES.items()])
        online = OnlinePlanner.for_engine(eng, Adaptive(check_every=3, verify=False,
                                                        explore=False, probe_every=1))
        agreed, agree = [], online._agree_step_times
        online._agree_step_times = lambda e: agreed.append((e.step, agree(e))) or agreed[-1][1]
        for _ in range(9):
            time.sleep(0.01)
            for n, nb in SIZES.items():
                eng.submit(n, torch.ones(nb // 4))
            eng.synchronize()
            online.after_step(eng)
        replayed = eng.replayed_steps
        eng.close()
        return replayed, agreed

    (rep0, a0), (rep1, a1) = run_threads(lambda t: history(t, FAST), 2)
    assert rep0 == rep1 == 8 and a0 == a1 and [s for s, _ in a0] == [3, 6, 9]
    assert all(t is not None and t > 0.005 for _, t in a0)
    assert calls == []
    # 1-bit over PS: the checks at steps 3 and 6 (on both ranks) agree by allgather (the
    # probe's fast link then switches to a plan that replays)
    (rep0, a0), (rep1, a1) = run_threads(lambda t: history(t, SLOW), 2)
    assert a0 == a1 and [s for s, _ in a0] == [3, 6, 9] and len(calls) >= 2 * 2


def test_a_probe_on_a_link_far_slower_than_the_reference_is_four_times_larger(
        monkeypatch):
    """``_measure``'s probe sizes (``measure_link`` scripted): ``probe_s`` of wire time
    at the last probed link; four times that on a link 4x or more slower than the
    reference (a return to the fast link would hide in the host's noise); sized again by
    what it read when it took under half of ``probe_s``; capped at 4 MB."""
    from hipress_like.tuning import online as mod

    sizes, readings = [], []

    def scripted(transport, sz, **kw):
        sizes.append(sz[1])
        return readings.pop(0), ()

    monkeypatch.setattr(mod, "measure_link", scripted)
    online = OnlinePlanner(Adaptive(probe_s=0.004), _profile(), ["onebit"], SIZES, 2, "ps")
    eng = type("E", (), {"transport": None})()
    slow, fast = Link(1e-3, 25e6), Link(1e-3, 1.25e9)  # 200 Mbit/s, 10 Gbit/s

    def probe(last, *read):
        sizes.clear()
        online._probed, readings[:] = last, list(read)
        got = online._measure(eng, 0.1)
        assert not readings
        return got, list(sizes)

    online.reference = None  # the first check: the profile's link sizes it
    assert probe(slow, slow) == (slow, [100_000])
    online.reference = fast
    # 50x slower than the reference: 16 ms of wire time at 200 Mbit/s, not 4
    assert probe(slow, slow) == (slow, [400_000])
    # the fast link back: 400 KB in 3 ms (a timeslice of noise in it) read as 1 Gbit/s
    # is a 5x move already; read as 10 Gbit/s it is too small, and probed again at 4 MB
    assert probe(slow, Link(1e-3, 133e6)) == (Link(1e-3, 133e6), [400_000])
    assert probe(slow, fast, fast) == (fast, [400_000, 4 << 20])
    # 2.5x slower than the reference: probe_s at its bandwidth
    assert probe(Link(1e-3, 0.5e9), Link(1e-3, 0.5e9))[1] == [2_000_000]


# -- a switch is a trial judged by measured step times ----------------------------------------

def _trial_run(t, sleep_s, steps=24):
    """FAST until step 5, SLOW after (the model then wants onebit on w1 and w2); the
    loop sleeps ``sleep_s(step, compressed)`` a step: the wall time the trial sees."""
    def schedule(step):
        return FAST if step < 5 else SLOW

    return _sleeping_run(t, Adaptive(check_every=4, verify=True,
                                     estimate=lambda s, r: schedule(s)), sleep_s, steps)


def _sleeping_run(t, settings, sleep_s, steps, start=None):
    """``steps`` random steps under ``settings`` on ``_profile``'s plan (made on the link
    ``start`` instead of the profile's own when given), each after a sleep of
    ``sleep_s(step, on)`` (``on``: w1 travels compressed): (planner, each step's
    gradients, ``on`` per step, the timeline's plan events)."""
    import time

    prof = _profile()
    plan = profile_plan(prof if start is None else prof.with_link(start), ["onebit"], SIZES,
                        t.size, "ps", meta={"profile": prof.to_dict()})
    eng = Engine(t, EngineConfig(compressor="onebit", plan=plan, threads=False))
    eng.register([(n, (nb // 4,), torch.float32) for n, nb in SIZES.items()])
    online = OnlinePlanner.for_engine(eng, settings)
    g = torch.Generator().manual_seed(t.rank)
    out, compressed = [], []
    for step in range(steps):
        on = eng.layout()["w1"]["compress"]
        compressed.append(on)
        time.sleep(sleep_s(step, on))
        out.append(_random_step(eng, online, g))
    eng.close()
    kinds = [(e.kind, e.step) for e in eng.timeline.events if e.kind.startswith("plan_")]
    return online, out, compressed, kinds


def _same_on_both_ranks(res):
    (a, out0, c0, k0), (b, out1, c1, k1) = res
    assert c0 == c1 and k0 == k1
    assert all(torch.equal(x, y) for x, y in zip(out0, out1))
    return a, c0, k0


def test_a_switch_that_measures_slower_is_reverted_and_then_refused():
    res = run_threads(lambda t: _trial_run(t, lambda s, on: 0.03 if on else 0.002), 2)
    online, compressed, kinds = _same_on_both_ranks(res)
    # switch at the check of step 8, judged 5 steps later (13): slower -> reverted; the
    # plan it left is measured 5 steps more (18): faster -> the revert stands
    assert kinds == [("plan_switch", 8), ("plan_revert", 13)]
    assert compressed[8:13] == [True] * 5 and not any(compressed[13:])
    judged = [r for r in online.history if "judged" in r]
    assert [r["verdict"] for r in judged] == ["reverted", "revert stands"]
    assert judged[0]["step_s_new"] > judged[0]["step_s_old"] * 1.1
    assert online.reverts == 1 and online.switches == 1 and len(online.rejected) == 1
    # no check while the trial ran (steps 12 and 16), checks again after it (20, 24)
    assert [r["step"] for r in online.history if "judged" not in r] == [4, 8, 20, 24]
    # the refused plan: refused on the link it measured slower on, not on a far one
    rejected_plan = profile_plan(_profile(SLOW), ["onebit"], SIZES, 2, "ps")
    assert online.refused(rejected_plan, SLOW, online.planners(SLOW)) == 8
    far = Link(SLOW.latency * 50, SLOW.bandwidth / 50)
    assert online.refused(rejected_plan, far, online.planners(far)) is None


def test_a_revert_that_measures_slower_still_is_undone():
    # the plan before the switch was timed on a faster world than the one after it:
    # after the switch the compressed plan takes 20 ms, and after the revert the
    # uncompressed one takes 80 ms: the switch is restored and kept
    def sleep_s(step, on):
        return 0.002 if step < 9 else (0.02 if on else 0.08)

    online, compressed, kinds = _same_on_both_ranks(
        run_threads(lambda t: _trial_run(t, sleep_s), 2))
    assert kinds == [("plan_switch", 8), ("plan_revert", 13), ("plan_restore", 18)]
    assert all(compressed[18:]) and not any(compressed[13:18])
    assert [r["verdict"] for r in online.history if "judged" in r] == ["reverted", "restored"]
    assert online.rejected == []


def test_a_switch_measured_no_slower_is_kept_and_verify_defaults_off_for_injected_links():
    online, compressed, kinds = _same_on_both_ranks(
        run_threads(lambda t: _trial_run(t, lambda s, on: 0.002 if on else 0.05), 2))
    assert kinds == [("plan_switch", 8)] and all(compressed[9:])
    assert [r["verdict"] for r in online.history if "judged" in r] == ["kept"]
    assert Adaptive().verifies and not Adaptive(estimate=lambda s, r: None).verifies
    assert Adaptive(verify=True, estimate=lambda s, r: None).verifies
    with pytest.raises(ValueError, match="verify"):
        Adaptive(verify="yes")


def test_a_plan_that_hides_link_changes_from_the_step_time_is_probed_twice_as_often():
    """``_link_blind``: the plan's sync time, priced at a quarter and at four times the
    decided link's bandwidth, moves by less than twice the margin of the step time, so a
    changed link would not move the step time; ``_should_probe`` then probes every
    ceil(probe_every / 2) checks (every other one at the most) instead of every
    probe_every; a plan that compresses nothing, every 2 probe_every."""
    prof = _profile()
    never = Plan(compressor="onebit", strategy="ps", rule=SizeRule(min_compress_bytes=NEVER))
    online = OnlinePlanner(Adaptive(margin=0.1, probe_every=5), prof, ["onebit"], SIZES, 2,
                           "ps")
    online.reference = FAST
    engine = type("E", (), {"plan": never})()
    online.decided_on, online._probe_step_s = SLOW, 0.05
    # uncompressed at 10 Mbit/s: 320 KB take ~260 ms at that rate, 65 ms at 4x: the step
    # time shows a change
    assert not online._link_blind(engine)
    online.decided_on = FAST  # 100 Gbit/s: microseconds either way, against a 50 ms step
    assert online._link_blind(engine)
    online.decided_on = SLOW
    online._probe_step_s = 100.0  # a step so long that even the slow link hides in it
    assert online._link_blind(engine)

    # the probe cadence: with the plan blind, the third unprobed check probes
    online._blind = (None, False)
    online._probe_step_s = 0.05
    online.decided_on = FAST
    online._agree_step_times = lambda eng: 0.05  # every check agrees on 50 ms
    probes = []
    for check in range(1, 7):
        probe, _ = online._should_probe(engine, 5 * check)
        probes.append(probe)
        if probe:
            online._checks_unprobed = 0
    assert probes == [False, False, True, False, False, True]
    online.decided_on = SLOW  # not blind, and it compresses nothing: every tenth check
    online._checks_unprobed, online._blind = 0, (None, False)
    probes = [online._should_probe(engine, 5 * c)[0] for c in range(1, 11)]
    assert probes == [False] * 9 + [True]
    # one that compresses the big gradient, not blind on the slow link: every fifth
    engine.plan = profile_plan(prof.with_link(SLOW), ["onebit"], SIZES, 2, "ps")
    online._checks_unprobed, online._blind = 0, (None, False)
    assert not online._link_blind(engine)
    probes = [online._should_probe(engine, 5 * c)[0] for c in range(1, 6)]
    assert probes == [False, False, False, False, True]


def test_the_reference_link_is_the_median_of_three_probes():
    """``_reference_link``: with probes the first check's reading and two more, the one
    of median bandwidth kept (every later link is priced as a change from it); an
    injected estimate is taken once."""
    online = OnlinePlanner(Adaptive(), _profile(), ["onebit"], SIZES, 2, "ps")
    readings = [Link(2e-3, 4e8), Link(1e-3, 2e8)]
    online._measure = lambda engine, step_s: readings.pop(0)
    assert online._reference_link(None, Link(3e-3, 1.8e8), 0.1) == Link(1e-3, 2e8)
    assert not readings
    online.settings = Adaptive(estimate=lambda s, r: FAST)
    assert online._reference_link(None, FAST, 0.1) == FAST
