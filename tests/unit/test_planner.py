"""Planner: choices equal a brute-force minimum of Eq. 1/2, HiPress's plan shape, plan files."""
import dataclasses
import json
import math

import pytest

from hipress_like.casync.transport.inproc import run_threads
from hipress_like.cost_model import (
    CompressorProfile,
    Curve,
    GradientPlan,
    Link,
    Plan,
    PlanError,
    Planner,
    Profile,
    ProfileError,
    SizeRule,
)
from hipress_like.cost_model.model import sync_params, t_sync_cpr, t_sync_orig
from hipress_like.cost_model.planner import NEVER
from hipress_like.tuning import AutoPlanner

SIZES = [4 << e for e in range(8, 28)]  # 1 KB .. 512 MB


def make_profile(category="quantization", ratio=1 / 32, header=0):
    pts = [float(4 << e) for e in range(10, 30, 2)]
    cp = CompressorProfile(name="q", category=category, ratio=ratio, header_bytes=header,
                           encode=Curve.linear(2e-5, 1e-9, pts),
                           decode=Curve.linear(1e-5, 5e-10, pts))
    # 100 us + bytes / 1 Gbit/s
    return Profile(link=Link(latency=1e-4, bandwidth=1.25e8), compressors={"q": cp})


@pytest.fixture
def profile():
    return make_profile()


@pytest.mark.parametrize("strategy, model", [("ps", "ps-colocated"), ("ring", "ring")])
def test_choice_is_brute_force_minimum(profile, strategy, model):
    pl = Planner(profile, "q", 4, strategy, k_tolerance=0.0, raw_collective=False)
    cp, p = profile.compressor("q"), sync_params(model, "quantization")
    c4 = 4 if strategy == "ring" else 1  # the engine's Ring: K partitions of N chunks each
    for m in (4096, 1 << 20, 64 << 20):
        orig = {k: t_sync_orig(m, k * c4, 4, profile.link, p) for k in range(1, 17)}
        cpr = {k: t_sync_cpr(m, k * c4, 4, cp.rate(m / (k * c4)), profile.link, cp.encode,
                             cp.decode, p)
               for k in range(1, 17)}
        c = pl.choose(m)
        assert c.t_orig == pytest.approx(min(orig.values()))
        assert c.t_cpr == pytest.approx(min(cpr.values()))
        assert c.compress == (min(cpr.values()) < min(orig.values()))
        best = cpr if c.compress else orig
        assert best[c.partitions] == pytest.approx(min(best.values()))


def test_engine_ring_partitions_are_chunked(profile):
    """The engine's Ring allreduces each partition over N chunks, so its K = 1 is HiPress's
    Ring with N partitions (one batch), and its K = 2 HiPress's 2N in two batches: a whole
    gradient never goes hop by hop (Eq. 2 at K = 1 priced 32 MB Ring + onebit at 218 ms
    where the engine took 113 ms)."""
    ring = Planner(profile, "q", 4, "ring", raw_collective=False)
    cp, p = profile.compressor("q"), sync_params("ring", "quantization")
    m = 32 << 20
    for k in (1, 2):
        want = t_sync_cpr(m, 4 * k, 4, cp.rate(m / (4 * k)), profile.link, cp.encode,
                          cp.decode, p)
        assert ring.eq2(m, k) == pytest.approx(want)
        assert ring.t_orig(m, k) == pytest.approx(t_sync_orig(m, 4 * k, 4, profile.link, p))
    whole = t_sync_cpr(m, 1, 4, cp.rate(m), profile.link, cp.encode, cp.decode, p)
    assert ring.eq2(m, 1) < whole / 2
    # a cost-model row asked for explicitly keeps HiPress's own K
    paper = Planner(profile, "q", 4, "ps", model_strategy="ring", raw_collective=False)
    assert paper.chunks == 1 and paper.eq2(m, 1) == pytest.approx(whole)


def test_wire_time_counts_payload_bytes_only(profile):
    """Eq. 2's transfers without their latency: co-located PS at N = 4, K = 4 sends
    alpha = 6 payloads of m/4 (Sec. 6.1); the engine's Ring at K = 1 sends 2(N-1) = 6 of
    m/4 (N chunks). onebit-like r = 1/32 of 32 MB: 6 x 256 KB at 1 Gbit/s."""
    m = 32 << 20
    cp = profile.compressor("q")
    for strategy, k in (("ps", 4), ("ring", 1)):
        pl = Planner(profile, "q", 4, strategy)
        a, _, _ = pl.params.values(4, 4)
        assert pl.wire_time(m, k) == pytest.approx(a * cp.payload_bytes(m / 4) / 1.25e8)
        assert pl.wire_time(m, k) < pl.eq2(m, k)


def test_hand_computed_choice():
    # N = 2, co-located PS: alpha = 2, beta = K, gamma = 2; K <= 2 only.
    pts = (1e3, 1e9)
    cp = CompressorProfile(name="q", category="quantization", ratio=0.25, header_bytes=0,
                           encode=Curve.linear(0.0, 1e-9, pts), decode=Curve.linear(0.0, 1e-9, pts))
    prof = Profile(link=Link(latency=1e-3, bandwidth=1e9), compressors={"q": cp})
    pl = Planner(prof, "q", 2, "ps", max_partitions=2, k_tolerance=0.0, raw_collective=False)
    # m = 8e6: orig K=1: 2*(1+8) = 18 ms, K=2: 2*(1+4) = 10 ms
    #          cpr K=1: 2*(1+2) + 1*8 + 2*2 = 18 ms; K=2: 2*(1+1) + 2*4 + 2*1 = 14 ms
    c = pl.choose(8_000_000)
    assert (c.t_orig, c.k_orig) == (pytest.approx(10e-3), 2)
    assert (c.t_cpr, c.k_cpr) == (pytest.approx(14e-3), 2)
    assert not c.compress and c.partitions == 2 and c.time == pytest.approx(10e-3)


@pytest.mark.parametrize("strategy", ["ps", "ring"])
def test_plan_shape_threshold_then_growing_k(profile, strategy):
    pl = Planner(profile, "q", 4, strategy, raw_collective=False)
    choices = [pl.choose(s) for s in SIZES]
    flags = [c.compress for c in choices]
    # no compression below a threshold, compression from it on
    first = flags.index(True)
    assert first > 0 and all(flags[first:]) and not any(flags[:first])
    ks = [c.partitions for c in choices if c.compress]
    assert ks == sorted(ks), ks  # K non-decreasing with size
    assert ks[-1] > ks[0]
    thr = pl.threshold()
    assert SIZES[first - 1] < thr <= SIZES[first]
    assert pl.choose(thr).compress and not pl.choose(thr - 64).compress


def test_link_concurrency_and_overhead():
    base = make_profile()
    prof = Profile(link=Link(1e-4, 1.25e8), compressors=base.compressors,
                   link_one=Link(1e-4, 5e8), sync_overhead=3e-3)
    pl = Planner(prof, "q", 4, "ps", k_tolerance=0.0, raw_collective=False)
    p = sync_params("ps-colocated", "quantization")
    # K = 1: one aggregator, one busy link -> link_one; plus the measured overhead
    assert pl.t_orig(1e6, 1) == pytest.approx(6 * (1e-4 + 1e6 / 5e8) + 3e-3)
    # K = 2: two busy links share 4 * 1.25e8 = 5e8 B/s -> 2.5e8 each
    assert pl.t_orig(1e6, 2) == pytest.approx(6 * (1e-4 + 5e5 / 2.5e8) + 3e-3)
    assert pl.t_orig(1e6, 4) == pytest.approx(t_sync_orig(1e6, 4, 4, prof.link, p) + 3e-3)
    # Ring keeps every link busy whatever K
    assert Planner(prof, "q", 4, "ring", raw_collective=False).link(1) == prof.link
    # a single node has nothing to synchronise: no overhead either
    assert Planner(prof, "q", 1, "ps", raw_collective=False).t_orig(1e6, 1) == 0.0
    # compressed paths use the compressor's own measured overhead when there is one
    cp = prof.compressor("q")
    eq2 = t_sync_cpr(1e6, 4, 4, cp.rate(2.5e5), prof.link, cp.encode, cp.decode, p)
    assert pl.t_cpr(1e6, 4) == pytest.approx(eq2 + 3e-3)
    prof2 = dataclasses.replace(prof, compressors={"q": dataclasses.replace(cp,
                                                                            sync_overhead=5e-3)})
    pl2 = Planner(prof2, "q", 4, "ps", raw_collective=False)
    assert pl2.t_cpr(1e6, 4) == pytest.approx(eq2 + 5e-3)


def test_threshold_never_and_always():
    # compression that does not shrink anything never pays
    pl = Planner(make_profile(ratio=1.0), "q", 4, "ps", raw_collective=False)
    assert pl.threshold() == NEVER
    assert not any(pl.choose(s).compress for s in SIZES)
    # a single node never communicates: nothing to gain
    assert Planner(make_profile(), "q", 1, "ps", raw_collective=False).threshold() == NEVER


def test_threshold_survives_a_loss_at_the_top():
    # encode explodes past 32 MB (think: an extrapolated or swapping curve), so a 1 GB
    # gradient in 16 partitions of 64 MB loses, but the threshold below must remain
    pts = (4096.0, 32 << 20, 64 << 20)
    cp = CompressorProfile(name="q", category="quantization", ratio=1 / 32, header_bytes=0,
                           encode=Curve(pts, (2e-5, 0.035, 100.0)),
                           decode=Curve.linear(1e-5, 5e-10, pts))
    pl = Planner(Profile(link=Link(1e-4, 1.25e8), compressors={"q": cp}), "q", 4, "ps",
                 raw_collective=False)
    assert not pl.choose(1 << 30).compress and pl.choose(16 << 20).compress
    thr = pl.threshold()
    assert thr < (16 << 20) and pl.choose(thr).compress


def test_lowrank_uses_table3_counts():
    pl = Planner(make_profile("lowrank"), "q", 4, "ring", raw_collective=False)
    assert pl.params.values(4, 2) == (6, 1, 1)
    pl = Planner(make_profile(), "q", 4, "ps", model_strategy="ps", raw_collective=False)
    assert pl.params.values(4, 2) == (8, 3, 5)


def test_plan_entries_rule_and_meta(profile, tmp_path):
    pl = Planner(profile, "q", 4, "ps", raw_collective=False)
    grads = {"small.bias": 1024, "mid.weight": 1 << 20, "big.weight": 64 << 20}
    plan = pl.plan(grads, meta={"model": "test"})
    for name, nbytes in grads.items():
        c = pl.choose(nbytes)
        assert plan.gradients[name] == GradientPlan(c.compress, c.partitions)
        assert plan.decide(name, nbytes) == plan.gradients[name]
    assert plan.compressor == "q" and plan.strategy == "ps" and plan.world_size == 4
    assert plan.rule.min_compress_bytes == pl.threshold()
    assert plan.rule.max_partitions == 16
    assert plan.meta["model"] == "test" and plan.meta["model_strategy"] == "ps-colocated"
    tot = plan.meta["predicted_total_s"]
    assert tot["plan"] <= min(tot["no_compression"], tot["compress_all"]) + 1e-12
    # the rule follows the model for unnamed gradients far from the threshold
    for s in (1024, 64 << 20):
        assert plan.decide("unnamed", s).compress == pl.choose(s).compress
    # round trip through JSON
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert json.loads(path.read_text())["format"] == "hipress-like-plan"


def test_size_rule_is_close_to_the_model(profile):
    pl = Planner(profile, "q", 4, "ps", raw_collective=False)
    rule = pl.size_rule()
    worst = 0.0
    for s in SIZES:
        d = rule.decide(s, 4)
        t = pl.t_cpr(s, d.partitions) if d.compress else pl.t_orig(s, d.partitions)
        worst = max(worst, t / pl.choose(s).time - 1)
    assert worst < 0.5, worst


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=3), "version 3 is not supported"),
    (lambda d: d.update(version=1) or d["gradients"].update(
        x={"compress": True, "partitions": 1, "compressor": "topk"}), "invalid plan entry"),
    (lambda d: d["gradients"].update(x={"compress": False, "compressor": "topk"}),
     "does not compress"),
    (lambda d: d["gradients"].update(x={"compress": True, "params": {"k": 1}}),
     "without a compressor"),
    (lambda d: d["gradients"].update(x={"compress": True, "compressor": "topk",
                                        "params": {"ratio": {"a": 1}}}), "params.ratio"),
    (lambda d: d.update(format="nope"), "not a plan file"),
    (lambda d: d.update(surprise=1), "unknown plan keys"),
    (lambda d: d.update(strategy="tree"), "strategy"),
    (lambda d: d["gradients"].update(x={"compress": True, "partitions": 0}), "partitions"),
    (lambda d: d["gradients"].update(x={"compress": "yes", "partitions": 1}), "compress"),
    (lambda d: d["rule"].update(bytes_per_partition=0), "bytes_per_partition"),
    (lambda d: d["gradients"].update(x={"compress": True, "k": 2}), "invalid plan entry"),
])
def test_plan_validation_errors(profile, tmp_path, mutate, message):
    d = Planner(profile, "q", 4, "ps", raw_collective=False).plan({"a": 4096}).to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=message):
        Plan.load(path)


def test_plan_load_unreadable(tmp_path):
    with pytest.raises(PlanError, match="cannot read plan"):
        Plan.load(tmp_path / "missing.json")


def test_planner_errors(profile):
    with pytest.raises(ValueError, match="N must be an integer >= 1"):
        Planner(profile, "q", 0, raw_collective=False)
    with pytest.raises(ValueError, match="unknown strategy"):
        Planner(profile, "q", 4, "tree", raw_collective=False)
    with pytest.raises(ProfileError, match="no compressor 'onebit'"):
        Planner(profile, "onebit", 4, raw_collective=False)
    with pytest.raises(ValueError, match="max_partitions"):
        Planner(profile, "q", 4, max_partitions=0, raw_collective=False)
    pl = Planner(profile, "q", 4, raw_collective=False)
    with pytest.raises(ValueError, match="no gradients"):
        pl.plan({})
    with pytest.raises(ValueError, match="duplicate"):
        pl.plan([("a", 4), ("a", 8)])
    with pytest.raises(ValueError, match=">= 1 byte"):
        pl.choose(0)


def test_plan_table_rows(profile):
    rows = Planner(profile, "q", 4, raw_collective=False).table([64 << 20, 4096, 4096])
    assert [r.nbytes for r in rows] == [4096, 64 << 20]
    assert rows[1].speedup > 1


# -- plan="auto" --------------------------------------------------------------------
def test_auto_planner_single_process():
    auto = AutoPlanner("fp16", strategy="ring", warmup_iterations=2, link=Link(1e-4, 1.25e8),
                       repeats=1)
    assert not auto.ready and auto.plan is auto.provisional_plan
    assert not auto.provisional_plan.decide("x", 1 << 30, 4).compress
    auto.observe("w", 1 << 16)
    auto.observe("b", 64)
    assert auto.end_iteration(None) is None  # first warm-up iteration
    plan = auto.end_iteration(None)
    assert plan is not None and auto.ready and auto.plan is plan
    assert set(plan.gradients) == {"w", "b"} and plan.compressor == "fp16"
    assert plan.strategy == "ring" and plan.world_size == 1
    assert auto.end_iteration(None) is None  # fixed: nothing more to do
    with pytest.raises(ValueError, match="changed size"):
        auto.observe("w", 8)


def test_auto_planner_ranks_agree():
    def rank(t):
        auto = AutoPlanner("fp16", strategy="ps", repeats=1, max_profile_bytes=1 << 16,
                           max_link_bytes=1 << 14)
        auto.observe("w", 1 << 16)
        auto.observe("b", 256)
        plan = auto.end_iteration(t).to_dict()
        term = Planner(auto.profile, "fp16", 3, "ps").engine_term
        return plan, auto.profile.lane is not None, auto.profile.compressor("fp16"), term

    out = run_threads(rank, 3, timeout=120)
    plans = [p for p, _, _, _ in out]
    assert plans[0] == plans[1] == plans[2]
    assert plans[0]["world_size"] == 3 and set(plans[0]["gradients"]) == {"w", "b"}
    # the engine was timed (lane and compressed syncs), so the plan charges its cost
    for _, has_lane, cp, term in out:
        assert has_lane and term is not None
        assert {k for _, k, _ in cp.engine_samples} == {1, 2, 3, 9}
        assert {m for m, _, _ in cp.engine_samples} == {4096, 8192, 1 << 16}


def test_auto_planner_without_engine_timing_plans_with_eq2_alone():
    def rank(t):
        auto = AutoPlanner("fp16", strategy="ps", repeats=1, max_profile_bytes=1 << 16,
                           max_link_bytes=1 << 14, engine_timing=False)
        auto.observe("w", 1 << 16)
        auto.end_iteration(t)
        return auto.profile

    for prof in run_threads(rank, 2, timeout=120):
        assert prof.lane is None and prof.compressor("fp16").engine_samples == ()
        assert Planner(prof, "fp16", 2, "ps").engine_term is None


def test_auto_planner_detects_different_gradients():
    def rank(t):
        auto = AutoPlanner("fp16", link=Link(1e-4, 1.25e8), repeats=1)
        auto.observe("w", 4096 if t.rank == 0 else 8192)
        return auto.end_iteration(t)

    with pytest.raises(ValueError, match="ranks observed different gradients"):
        run_threads(rank, 2, timeout=60)


def test_auto_planner_errors():
    with pytest.raises(ValueError, match="strategy"):
        AutoPlanner(strategy="tree")
    with pytest.raises(ValueError, match="warmup_iterations"):
        AutoPlanner(warmup_iterations=0)
    with pytest.raises(ValueError, match="observed no gradient"):
        AutoPlanner("fp16").end_iteration(None)
    with pytest.raises(ValueError, match=">= 1 byte"):
        AutoPlanner().observe("x", 0)
    with pytest.raises(ValueError, match="nonfinite must be"):
        AutoPlanner(nonfinite="warn")


def test_auto_plan_trials_run_under_the_runs_nonfinite_policy():
    """The trial engines take the run's NaN/Inf policy (a stateful compressor pays its
    per-step state snapshot under "propagate", as in training)."""
    from hipress_like.casync.engine import EngineConfig
    from hipress_like.tuning import auto_plan

    for policy in ("propagate", "raise"):
        planner = auto_plan().planner(EngineConfig(compressor="dgc", nonfinite=policy))
        assert planner.nonfinite == policy and planner.compressor == "dgc"


def test_engine_default_rule_is_a_size_rule():
    # the provisional plan of plan="auto" keeps the plan format the engine reads
    p = AutoPlanner("fp16").provisional_plan
    assert isinstance(p.rule, SizeRule) and Plan.from_dict(p.to_dict()) == p


def test_uncompressed_is_a_ring_allreduce_with_the_collective_lane():
    """raw_collective (the engine default): t_orig = Table I Ring-AR on the all-links fit."""
    from hipress_like.cost_model.collectives import ring_allreduce

    prof = make_profile()
    pl = Planner(prof, "q", 4, "ps", k_tolerance=0.0)
    assert pl.raw_collective
    link = prof.link
    for m in (1e3, 1e6, 64e6):
        want = ring_allreduce(m, 4, link.latency, 1 / link.bandwidth) + prof.sync_overhead
        for k in (1, 3, 8):
            assert pl.t_orig(m, k) == pytest.approx(want)
    # 2(N-1) alpha + 2(N-1)/N m beta, by hand for N=4
    hand = 6 * link.latency + 1.5 * 1e6 / link.bandwidth + prof.sync_overhead
    assert pl.t_orig(1e6, 1) == pytest.approx(hand)
    assert pl.choose(1 << 20).partitions >= 1
    assert not pl.choose(1 << 10).compress or pl.choose(1 << 10).t_cpr < pl.t_orig(1 << 10, 1)


def test_measured_allreduce_fit_prices_the_collective_lane_and_round_trips():
    prof = dataclasses.replace(make_profile(), allreduce=Link(2e-3, 5e8),
                               allreduce_samples=((4096, 2.1e-3), (1 << 20, 4.1e-3)))
    back = Profile.from_dict(prof.to_dict())
    assert back.allreduce == Link(2e-3, 5e8) and back.allreduce_samples == prof.allreduce_samples
    pl = Planner(back, "q", 4, "ps")
    assert pl.t_orig(1e6, 5) == pytest.approx(2e-3 + 1e6 / 5e8 + back.sync_overhead)
    # Eq. 1 when the engine sends raw bytes through the workflow instead
    assert Planner(back, "q", 4, "ps", raw_collective=False).t_orig(1e6, 1) != \
        pytest.approx(pl.t_orig(1e6, 1))


def _timed_profile(ranks=4):
    """make_profile() plus engine timings made from a known EngineTerm (5 ms + 2 ms per
    extra partition + 1 ns per byte) and a timed lane (3 ms + bytes / 400 MB/s)."""
    from hipress_like.cost_model.planner import EngineTerm

    base = make_profile()
    pl = Planner(base, "q", 4, "ps")
    true = EngineTerm(fixed=5e-3, per_partition=2e-3, per_byte=1e-9)
    samples = tuple((m, k, pl.eq2(m, k) + true(m, k))
                    for m in (64 << 10, 4 << 20, 32 << 20) for k in (1, 4, 12))
    cp = dataclasses.replace(base.compressor("q"), engine_samples=samples)
    lane = Link(3e-3, 4e8)
    return dataclasses.replace(base, compressors={"q": cp}, lane=lane,
                               lane_samples=((4096, lane(4096)), (1 << 20, lane(1 << 20))),
                               meta={"ranks": ranks}), true


def test_engine_term_fit_recovers_the_engine_cost_beyond_eq2():
    prof, true = _timed_profile()
    pl = Planner(prof, "q", 4, "ps")
    t = pl.engine_term
    assert t.fixed == pytest.approx(true.fixed, rel=1e-6)
    assert t.per_partition == pytest.approx(true.per_partition, rel=1e-6)
    assert t.per_byte == pytest.approx(true.per_byte, rel=1e-6)
    # by hand at m = 1 MB, K = 2: Eq. 2 + 5 ms + 2 ms + 1e6 ns
    assert pl.t_cpr(1e6, 2) == pytest.approx(pl.eq2(1e6, 2) + 5e-3 + 2e-3 + 1e-3)
    # the timed lane prices "no compression" whole, whatever K, with no constant added
    assert pl.t_orig(1e6, 3) == pytest.approx(3e-3 + 1e6 / 4e8)


def test_engine_term_is_floored_at_one_partitions_work():
    # a fit that says the engine is faster than Eq. 2 by a lot cannot go below
    # one encode + one transfer + one decode of a partition
    base = make_profile()
    pl0 = Planner(base, "q", 4, "ps")
    samples = tuple((m, k, 1e-6) for m in (1 << 20, 16 << 20) for k in (1, 4))
    cp = dataclasses.replace(base.compressor("q"), engine_samples=samples)
    pl = Planner(dataclasses.replace(base, compressors={"q": cp}, meta={"ranks": 4}),
                 "q", 4, "ps")
    cpq = pl.cp

    def floor(m):
        part = m / 4
        return (cpq.encode(part) + pl.link(4)(cpq.payload_bytes(part))
                + cpq.decode(cpq.payload_bytes(part)))

    for m in (1 << 20, 16 << 20):
        assert pl.t_cpr(m, 4) == pytest.approx(
            max(floor(m), pl.eq2(m, 4) + pl.engine_term(m, 4)))
        assert pl.t_cpr(m, 4) < pl0.t_cpr(m, 4)
    assert pl.t_cpr(1 << 20, 4) == pytest.approx(floor(1 << 20))  # the floor holds it


def test_engine_timings_of_another_world_size_are_not_used(caplog):
    prof, _ = _timed_profile(ranks=8)
    with caplog.at_level("WARNING"):
        pl = Planner(prof, "q", 4, "ps")
    assert pl.engine_term is None and "8 ranks, not N=4" in caplog.text
    assert pl.t_cpr(1e6, 2) == pytest.approx(pl.eq2(1e6, 2) + prof.sync_overhead)


def test_each_strategy_fits_its_own_engine_timings_and_never_the_others():
    from hipress_like.cost_model.planner import EngineTerm

    prof, true = _timed_profile()  # PS timings only
    ring = Planner(prof, "q", 4, "ring")
    assert ring.engine_term is None  # a Ring term fitted to PS timings would misprice Ring
    assert ring.t_cpr(1e6, 2) == pytest.approx(ring.eq2(1e6, 2) + prof.sync_overhead)
    # Ring timings of their own, from another known term
    ring_true = EngineTerm(fixed=9e-3, per_partition=1e-3, per_byte=3e-9)
    samples = tuple((m, k, ring.eq2(m, k) + ring_true(m, k))
                    for m in (64 << 10, 4 << 20, 32 << 20) for k in (1, 4, 12))
    cp = dataclasses.replace(prof.compressor("q"), engine_samples_by={"ring": samples})
    both = dataclasses.replace(prof, compressors={"q": cp})
    t = Planner(both, "q", 4, "ring").engine_term
    assert (t.fixed, t.per_partition, t.per_byte) == pytest.approx(
        (ring_true.fixed, ring_true.per_partition, ring_true.per_byte), rel=1e-6)
    t = Planner(both, "q", 4, "ps").engine_term
    assert t.per_byte == pytest.approx(true.per_byte, rel=1e-6)
    back = Profile.from_dict(json.loads(json.dumps(both.to_dict())))
    assert back.compressor("q").samples_for("ring") == samples
    assert back.compressor("q").samples_for("ps") == prof.compressor("q").engine_samples
    # a profile written before the strategy was recorded reads as PS timings
    d = prof.to_dict()
    for key in ("engine_strategy", "engine_samples_by"):
        d["compressors"]["q"].pop(key)
    assert Profile.from_dict(d).compressor("q").engine_strategy == "ps"
    for key, bad in (("engine_strategy", "tree"), ("engine_samples_by", {"tree": []}),
                     ("engine_samples_by", {"ring": [[1, 0, 1.0]]})):
        d = prof.to_dict()
        d["compressors"]["q"][key] = bad
        with pytest.raises(ProfileError, match="engine_s"):
            Profile.from_dict(d)


def test_engine_timings_round_trip_and_bad_ones_are_rejected():
    prof, _ = _timed_profile()
    back = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert back.lane == prof.lane and back.lane_samples == prof.lane_samples
    assert back.compressor("q").engine_samples == prof.compressor("q").engine_samples
    for bad in ([[4096, 0, 1e-3]], [[4096, 1, -1.0]], [[4096.5, 1, 1e-3]], [[4096, 1]],
                "x", [[4096, 1, float("nan")]]):
        d = prof.to_dict()
        d["compressors"]["q"]["engine_samples"] = bad
        with pytest.raises(ProfileError, match="engine_samples"):
            Profile.from_dict(d)
    d = prof.to_dict()
    d["lane"] = {"latency": 1e-3}
    with pytest.raises(ProfileError, match="lane"):
        Profile.from_dict(d)


def test_planner_chooses_among_given_partition_counts():
    pl_all = Planner(make_profile(), "q", 4, "ps", k_tolerance=0.0, raw_collective=False)
    pl = Planner(make_profile(), "q", 4, "ps", k_tolerance=0.0, raw_collective=False,
                 partitions=[1, 2, 4, 8, 16])
    assert pl.max_partitions == 16
    for m in SIZES:
        c = pl.choose(m)
        assert c.partitions in (1, 2, 4, 8, 16)
        best = min((pl.t_cpr(m, k), k) for k in (1, 2, 4, 8, 16))
        assert c.t_cpr == pytest.approx(best[0])
        assert c.time >= pl_all.choose(m).time - 1e-15  # fewer options never predict better
    for bad in ([], [0, 2], [2.0], [True]):
        with pytest.raises(ValueError, match="partitions"):
            Planner(make_profile(), "q", 4, "ps", partitions=bad)
    with pytest.raises(ValueError, match="exceed max_partitions"):
        Planner(make_profile(), "q", 4, "ps", partitions=[1, 32], max_partitions=16)


def test_plan_per_gradient_picks_the_cheapest_compressor_or_none():
    """Each gradient gets the candidate with the smallest predicted time, or none
    when sending it raw is cheaper: small gradients stay raw, mid-sized ones take
    the cheap quantizer, the largest the expensive but tight low-rank one."""
    from hipress_like.cost_model import plan_per_gradient

    pts = [float(4 << e) for e in range(10, 30, 2)]
    fast = CompressorProfile(name="fast", category="quantization", ratio=1 / 8,
                             header_bytes=16, encode=Curve.linear(2e-5, 2e-10, pts),
                             decode=Curve.linear(1e-5, 1e-10, pts))
    tight = CompressorProfile(name="tight", category="lowrank", ratio=1 / 512,
                              header_bytes=64, params={"rank": 4},
                              encode=Curve.linear(4e-3, 1.5e-9, pts),
                              decode=Curve.linear(1e-3, 1e-10, pts))
    prof = Profile(link=Link(latency=1e-4, bandwidth=1.25e8),
                   compressors={"fast": fast, "tight": tight})
    planners = [Planner(prof, c, 4, "ps") for c in ("fast", "tight")]
    grads = {"bias": 1 << 10, "mid": 1 << 20, "huge": 256 << 20}
    plan = plan_per_gradient(planners, grads)
    for name, nbytes in grads.items():
        choices = [p.choose(nbytes) for p in planners]
        best = min(c.t_cpr for c in choices)
        dec = plan.gradients[name]
        if best < choices[0].t_orig:
            i = min(range(2), key=lambda j: choices[j].t_cpr)
            assert dec.compress and dec.compressor == planners[i].cp.name
            assert dec.partitions == choices[i].k_cpr
        else:
            assert not dec.compress and dec.compressor is None
    assert [plan.gradients[n].compressor for n in ("bias", "mid", "huge")] == \
        [None, "fast", "tight"]
    assert plan.gradients["huge"].params == {"rank": 4}
    assert plan.compressor == "tight"  # the most bytes
    assert plan.meta["predicted_total_s"]["plan"] <= min(
        plan.meta["predicted_total_s"]["all_fast"], plan.meta["predicted_total_s"]["all_tight"])
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="at least one"):
        plan_per_gradient([], grads)
    with pytest.raises(ValueError, match="share N"):
        plan_per_gradient([planners[0], Planner(prof, "tight", 2, "ps")], grads)


def _two_compressor_profile():
    pts = [float(4 << e) for e in range(10, 30, 2)]
    prof = make_profile()
    slow_small = CompressorProfile(name="m", category="quantization", ratio=1 / 4, header_bytes=0,
                                   encode=Curve.linear(1e-5, 2e-10, pts),
                                   decode=Curve.linear(1e-5, 2e-10, pts))
    return dataclasses.replace(prof, compressors={**prof.compressors, "m": slow_small})


def test_bidirectional_counts_split_eq2_by_direction():
    """Natural Compression Alg. 1 priced with HiPress's counts: half the transfers
    and one encode and one decode belong to the master compressor; a master
    equal to the worker gives Eq. 2 exactly."""
    from hipress_like.cost_model.model import bidi_counts, t_sync_bidi
    p = sync_params("ps-colocated", "quantization")
    assert bidi_counts(p, 4, 4, False) == ((3, 3), (3, 1), (3, 1))
    # K = 1: HiPress's beta = K folds the worker's encode in; it is counted apart
    assert bidi_counts(p, 4, 1, False) == ((3, 3), (1, 1), (3, 1))
    assert bidi_counts(sync_params("ring", "lowrank"), 4, 1, True) == ((3, 3), (1, 1), (1, 1))
    prof = _two_compressor_profile()
    q, m = prof.compressor("q"), prof.compressor("m")
    link = prof.link
    for size, k in ((1 << 20, 2), (64 << 20, 4), (64 << 20, 8)):
        same = t_sync_bidi(size, k, 4, q.rate(size / k), q.rate(size / k), link, q.encode,
                           q.decode, q.encode, q.decode, p)
        assert same == pytest.approx(t_sync_cpr(size, k, 4, q.rate(size / k), link, q.encode,
                                                q.decode, p))
    # by hand, N = 4, K = 4: 3 pushes at q's rate, 3 pulls at m's, 3 + 1 encodes, 3 + 1 decodes
    size, part = 64 << 20, (64 << 20) / 4
    want = (3 * link(q.rate(part) * part) + 3 * link(m.rate(part) * part)
            + 3 * q.encode(part) + m.encode(part)
            + 3 * q.decode(q.rate(part) * part) + m.decode(m.rate(part) * part))
    got = t_sync_bidi(size, 4, 4, q.rate(part), m.rate(part), link, q.encode, q.decode,
                      m.encode, m.decode, p)
    assert got == pytest.approx(want)


def test_planner_prices_a_master_compressor_and_names_it_in_the_plan():
    prof = _two_compressor_profile()
    one = Planner(prof, "q", 4, "ps", raw_collective=False)
    bidi = Planner(prof, "q", 4, "ps", raw_collective=False, back="m")
    m = 64 << 20
    # the master's pulls carry 8x the bytes of q's: the priced time grows
    assert bidi.choose(m).t_cpr > one.choose(m).t_cpr
    plan = bidi.plan({"w": m, "b": 1024})
    w = plan.gradients["w"]
    assert w.compress and (w.compressor, w.compressor_back) == ("q", "m")
    assert plan.gradients["b"].compressor_back is None or plan.gradients["b"].compress
    with pytest.raises(ProfileError):
        Planner(prof, "q", 4, "ps", back="nope")


def test_a_candidates_own_plan_names_its_compressor_in_every_compressing_entry():
    """A trial-chosen candidate plan must not fall back to the engine's configured
    compressor (compression="auto" starts from onebit): its entries name it."""
    from hipress_like.tuning.auto import name_entries
    plan = Planner(make_profile(), "q", 4, "ps").plan({"big": 64 << 20, "small": 64})
    assert plan.gradients["big"].compress and plan.gradients["big"].compressor is None
    named = name_entries(plan)
    assert named.gradients["big"].compressor == "q"
    assert named.gradients["small"] == plan.gradients["small"]  # uncompressed stays unnamed
    assert named.rule == plan.rule and named.compressor == plan.compressor


def _thc_profile(n_link=1.25e8):
    pts = [float(4 << e) for e in range(10, 30, 2)]
    cp = CompressorProfile(name="thc", category="quantization", aggregatable=True,
                           ratio=1 / 8, header_bytes=96, encode=Curve.linear(2e-5, 1e-9, pts),
                           decode=Curve.linear(1e-5, 5e-10, pts))
    return Profile(link=Link(latency=1e-4, bandwidth=n_link), compressors={"thc": cp})


@pytest.mark.parametrize("strategy, model", [("ps", "ps-colocated"), ("ring", "ring")])
def test_thc_priced_as_aggregatable_with_widened_sums(strategy, model):
    """THC sums without decoding: Table 3's low-rank counts (one encode, one decode), with
    the merged sums' bytes from THC's own merged_nbytes on the way back (THC Sec. 4, 6.2:
    4 ranks x g=30 fit 8 bits, so sums are twice the 4-bit indices)."""
    from hipress_like.cost_model.model import t_sync_homomorphic

    prof = _thc_profile()
    pl = Planner(prof, "thc", 4, strategy, k_tolerance=0.0, raw_collective=False)
    assert pl.homomorphic and pl.params == sync_params(model, "lowrank")
    cp, m = prof.compressor("thc"), 64 << 20
    c4 = 4 if strategy == "ring" else 1  # the engine's Ring: K partitions of N chunks each
    for k in (1, 3, 8):
        part = m / (k * c4)
        down = pl.merged_rate(part)
        assert down == pytest.approx(2 * cp.rate(part), rel=1e-3)
        want = t_sync_homomorphic(m, k * c4, 4, cp.rate(part), down, prof.link, cp.encode,
                                  cp.decode, sync_params(model, "lowrank"), model == "ring")
        assert pl.eq2(m, k) == pytest.approx(want)
    # where the work, not the link, dominates (100 Gbit/s), no decode-merge-encode at the
    # aggregator is cheaper than pricing THC as a quantizer of the same rate; on a slow
    # link its wider sums cost more bytes than that saves, and the model says so
    fast = _thc_profile(1.25e10)
    pf = Planner(fast, "thc", 4, strategy, k_tolerance=0.0, raw_collective=False)
    quant = t_sync_cpr(m, c4, 4, cp.rate(m / c4), fast.link, cp.encode, cp.decode,
                       sync_params(model, "quantization"))
    assert pf.eq2(m, 1) < quant


def test_thc_merged_rate_follows_world_size():
    """Sec. 6.2: 8 ranks x g=30 = 240 still fit 8 bits; 16 ranks need 16-bit sums."""
    prof = _thc_profile()
    r8 = Planner(prof, "thc", 8, "ps").merged_rate(1 << 20)
    r16 = Planner(prof, "thc", 16, "ps").merged_rate(1 << 20)
    assert r16 == pytest.approx(2 * r8, rel=1e-3)


BLOOM_TOPK = {"compressor": "topk", "ratio": 0.01, "index_codec": "bloom", "eps": 0.01}


def test_planner_chooses_a_sparse_codec_per_gradient_from_measured_curves():
    """Issue 25 item 6: codecs are priced by their measured encode/decode curves like
    any compressor. Two configurations of one compressor sit side by side under
    labels (plain and Bloom-coded top-k); on a slow link the Bloom filter's smaller
    payload (about 9.6 bits per index against 32) wins the large gradient, and the
    plan entry names the registry compressor with the codec's parameters."""
    from hipress_like.cost_model import plan_per_gradient
    from hipress_like.tuning.profiler import candidate, profile_compressor

    sizes = [1 << 16, 1 << 18, 1 << 20]
    comps = {label: profile_compressor(*candidate(label, ps), sizes, repeats=1, min_time=0.0)
             for label, ps in {"topk": {"ratio": 0.01}, "topk-bloom": BLOOM_TOPK}.items()}
    assert comps["topk-bloom"].name == "topk"
    assert comps["topk-bloom"].ratio < 0.75 * comps["topk"].ratio  # ~0.013 against 0.02
    prof = Profile(link=Link(latency=1e-4, bandwidth=1e4), compressors=comps)  # 10 KB/s
    back = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert back.compressor("topk-bloom").name == "topk" and back.compressor("topk").name == "topk"
    assert dict(back.compressor("topk-bloom").params) == {k: v for k, v in BLOOM_TOPK.items()
                                                          if k != "compressor"}
    planners = [Planner(back, c, 4, "ps") for c in ("topk", "topk-bloom")]
    plan = plan_per_gradient(planners, {"big": 1 << 20})
    dec = plan.gradients["big"]
    assert dec.compress and dec.compressor == "topk" and dec.params["index_codec"] == "bloom"
    assert set(plan.meta["predicted_total_s"]) >= {"all_topk", "all_topk-bloom"}
    with pytest.raises(ValueError, match="duplicate candidate labels"):
        plan_per_gradient([planners[0], planners[0]], {"big": 1 << 20})


def test_auto_planner_profiles_labelled_candidates_under_their_labels():
    auto = AutoPlanner("topk", candidates={"topk": {"ratio": 0.01}, "topk-bloom": BLOOM_TOPK},
                       strategy="ps", link=Link(1e-4, 1e5), repeats=1,
                       max_profile_bytes=1 << 16)
    auto.observe("w", 1 << 16)
    auto.end_iteration(None)
    assert set(auto.profile.compressors) == {"topk", "topk-bloom"}
    assert auto.profile.compressor("topk-bloom").params["index_codec"] == "bloom"
    with pytest.raises(ValueError, match="unknown compressor 'topk-rle'"):
        bad = AutoPlanner("topk", candidates={"topk-rle": {"ratio": 0.01}}, link=Link(1e-4, 1e5),
                          repeats=1, max_profile_bytes=1 << 16)
        bad.observe("w", 1 << 16)
        bad.end_iteration(None)


def test_auto_records_each_warmup_backward_for_its_trials():
    """The span from an iteration's first gradient to its last is the backward the
    trials run beside each synchronisation."""
    import time

    auto = AutoPlanner("onebit", strategy="ps", warmup_iterations=3)
    for _ in range(2):
        auto.observe("a", 64)
        time.sleep(0.02)
        auto.observe("b", 64)
        assert auto.end_iteration(None) is None
    assert len(auto.backward_s) == 2 and min(auto.backward_s) >= 0.02


def test_compute_load_does_the_work_it_was_sized_to():
    from hipress_like.tuning.compute import ComputeLoad

    assert ComputeLoad(0.0).iterations == 0
    load = ComputeLoad(0.01)
    calls, mm = [], load._mm
    load._mm = lambda *a, **k: (calls.append(1), mm(*a, **k))
    load.run()
    assert load.iterations >= 1 and len(calls) == load.iterations


def test_trial_gradients_keep_their_shape_when_it_matches_their_bytes():
    """The trials register each gradient with its own shape (PowerSGD costs what its
    matrix view costs); the profile's near-square matrix when the shape is unknown or
    disagrees with the bytes (flat when that has one row)."""
    from hipress_like.tuning.engine_timing import _shape_of

    shapes = {"w": (2560, 8192), "b": (2560,), "odd": (3, 3)}
    assert _shape_of("w", 2560 * 8192 * 4, shapes) == (2560, 8192)
    assert _shape_of("b", 2560 * 4, shapes) == (2560,)
    assert _shape_of("odd", 40, shapes) == (2, 5)  # 9 entries are not 40 bytes of float32
    assert _shape_of("new", 40, shapes) == (2, 5)
    assert _shape_of("prime", 44, shapes) == (11,)
    assert _shape_of("tiny", 2, {}) == (1,)


def test_auto_planner_hands_the_shapes_to_its_trials(monkeypatch):
    """finalize(shapes=...) (what the engine's register passes) reaches every trial;
    observe(shape=...) records them too."""
    from hipress_like.tuning import engine_timing

    real, got = engine_timing.time_engine_steps, []

    def spy(*args, **kw):
        got.append(dict(kw.get("shapes") or {}))
        return real(*args, **kw)

    monkeypatch.setattr(engine_timing, "time_engine_steps", spy)
    shapes = {"fc": (256, 128), "b": (8,)}
    sizes = {k: 4 * math.prod(v) for k, v in shapes.items()}

    def body(tr):
        auto = AutoPlanner("onebit", candidates={"onebit": {}, "powersgd": {"rank": 2}},
                           max_profile_bytes=1 << 18, max_link_bytes=1 << 14,
                           engine_timing=False, trial_repeats=1, repeats=1, timeout=120)
        return auto.finalize(tr, sizes, shapes).meta["trials"]

    res = run_threads(body, 2, timeout=300)
    assert res[0] == res[1] and set(res[0]) == {"per-gradient", "all-onebit", "all-powersgd"}
    assert len(got) == 2 * 3 and all(g == shapes for g in got)
    auto = AutoPlanner()
    auto.observe("fc", 4 * 256 * 128, shape=(256, 128))
    assert auto.shapes == {"fc": (256, 128)}


def test_profiles_time_gradients_as_exact_near_square_matrices():
    """The profiler's gradients are the most nearly square exact matrices (PowerSGD's
    fast path, as real weights take it), flat when no factor is near the root; the
    engine-sync probes use the same shape."""
    import doctest

    from hipress_like.tuning import engine_timing
    from hipress_like.tuning.engine_timing import profile_shape

    assert doctest.testmod(engine_timing, optionflags=doctest.ELLIPSIS).failed == 0
    for n in (1, 2, 1024, 4096 * 3, 2560 * 8192, 1031, 2 * 1031):
        shape = profile_shape(n)
        assert math.prod(shape) == n
        if len(shape) == 2:
            assert shape[0] <= shape[1] <= 256 * shape[0]
    assert profile_shape(1024) == (32, 32) and profile_shape(2560 * 8192) == (4096, 5120)
    assert profile_shape(1031) == (1031,) and profile_shape(1) == (1,)


def test_a_negative_per_byte_slope_is_refitted_as_zero():
    import torch

    from hipress_like.cost_model.planner import EngineTerm

    # large fixed costs at small sizes and cheap big ones pull a free fit's slope
    # below zero, which would price a gradient past the largest sample below it
    eq2 = lambda m, k: 3e-9 * m  # noqa: E731
    samples = [(64 << 10, 1, 0.060), (512 << 10, 1, 0.060), (4 << 20, 1, 0.062),
               (32 << 20, 1, 0.113)]
    free = torch.linalg.lstsq(
        torch.tensor([[1 / t, 0.0, m / (32 << 20) / t] for m, _, t in samples],
                     dtype=torch.float64),
        torch.tensor([[(t - eq2(m, k)) / t] for m, k, t in samples], dtype=torch.float64),
        driver="gelsd").solution[:, 0]
    assert float(free[2]) < 0  # the case this pins
    t = EngineTerm.fit(samples, eq2)
    assert t.per_byte == 0.0 and t.fixed > 0
    assert eq2(84 << 20, 1) + t(84 << 20, 1) > 0.113  # not below the 32 MB timing
