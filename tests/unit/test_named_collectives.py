"""Named collectives in the engine: AR-Topk over ring, tree or the backend, LWTopk by
allgather, and collective="auto" (the flexible-communication paper's Eq. 5a-5c
selection, made per gradient and executed).

Ranks are threads over the in-process transport; ``tests/multiprocess/
test_artopk_engine.py`` runs the same paths over gloo. Every rank must hold
bitwise-identical averages, and AR-Topk's must be Alg. 1 by hand
(``test_artopk.reference_steps``) to the last bit's tolerance (a ring or a
tree sums in its own order).
"""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hipress_like.casync.choice import Choice
from hipress_like.casync.engine import Engine, EngineConfig
from hipress_like.casync.transport.inproc import run_threads
from hipress_like.compressors.ops import topk_abs
from hipress_like.compressors.sparse.artopk import STARTopk, VARTopk
from hipress_like.compressors.sparse.topk import num_selected
from hipress_like.cost_model.model import Link
from hipress_like.cost_model.plan import GradientPlan, Plan, PlanError, SizeRule
from hipress_like.tuning.link import collective_links

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rounds_compressors as rc  # noqa: E402
from test_artopk import RATIO, check_against_reference  # noqa: E402

CLASSES = {"star": STARTopk, "var": VARTopk}


def _run(n, comp, collective, steps=3):
    return run_threads(lambda tr: rc.run_rounds(tr, comp, "ps", 1, steps, raw_collective=True,
                                                collective=collective), n, timeout=120)


@pytest.mark.parametrize("variant", ["star", "var"])
@pytest.mark.parametrize("collective", ["ring", "tree", "backend"])
def test_artopk_over_a_named_collective_is_alg1(variant, collective):
    """Three ranks (a tree of three is not a power of two), three steps with residuals."""
    n = 3
    res = _run(n, CLASSES[variant](RATIO), collective)
    assert {v["workflow"] for v in res[0][1].values()} == {"rounds-allreduce"}
    assert {v["collective"] for v in res[0][1].values()} == {collective}
    owners = check_against_reference(res, variant, n, 3, exact=False)
    if variant == "star":
        assert owners == {0, 1, 2}


def test_topk_by_allgather_is_lwtopk():
    """Step 1 (no residual yet): the rank-order mean of every rank's own top-k, the same
    bits on every rank; later steps stay identical across ranks (error feedback)."""
    n = 3
    res = _run(n, "topk", "allgather", steps=2)
    assert {v["workflow"] for v in res[0][1].values()} == {"gather"}
    all_g = [rc.grads_of(r) for r in range(n)]
    for name in all_g[0]:
        ref = torch.zeros(all_g[0][name].numel())
        for r in range(n):
            x = all_g[r][name].reshape(-1)
            idx = topk_abs(x, num_selected(0.01, x.numel()))[0]
            ref.index_add_(0, idx.long(), x[idx.long()])
        ref /= n
        for step in range(2):
            for r in range(n):
                assert torch.equal(res[r][0][step][name], res[0][0][step][name])
        torch.testing.assert_close(res[0][0][0][name].reshape(-1), ref, rtol=1e-6, atol=1e-7)


def _auto(tr):
    plan = Plan(compressor="identity", rule=SizeRule(min_compress_bytes=0,
                                                     bytes_per_partition=1 << 30))
    eng = Engine(tr, EngineConfig(compressor="star_topk", params={"ratio": 0.05}, plan=plan,
                                  collective="auto", timeout=60,
                                  link_source=collective_links))
    try:
        gs = rc.grads_of(tr.rank)
        eng.register([(k, tuple(v.shape), v.dtype) for k, v in gs.items()])
        outs = []
        for _ in range(2):
            work = {k: v.clone() for k, v in gs.items()}
            for k, v in work.items():
                eng.submit(k, v)
            eng.synchronize()
            outs.append(work)
        return outs, eng.collectives, dict(eng._choice.selected)
    finally:
        eng.close()


def test_auto_measures_selects_and_runs_the_pick():
    res = run_threads(_auto, 3, timeout=120)
    picks = res[0][2]
    assert set(picks) == set(rc.grads_of(0))
    assert set(picks.values()) <= {"allgather", "art_ring", "art_tree"}
    for r in range(3):
        assert res[r][1] == res[0][1] and res[r][2] == picks  # every rank picked alike
        for step in range(2):
            for k in picks:
                assert torch.equal(res[r][0][step][k], res[0][0][step][k])
    want = {"allgather": "allgather", "art_ring": "ring", "art_tree": "tree"}
    assert res[0][1] == {k: want[v] for k, v in picks.items()}


def _choice(collective="auto", compressor="star_topk", n=4):
    return Choice(EngineConfig(compressor=compressor, params={"ratio": 0.01},
                               collective=collective,
                               plan=Plan(compressor=compressor, params={"ratio": 0.01},
                                         rule=SizeRule(min_compress_bytes=0))), n)


def test_auto_pick_becomes_the_decision():
    """Eq. 5a-5c on a measured link: latency-bound small gradients take the Allgather
    of top-k (compressor topk), bandwidth-bound large ones AR-Topk by ring."""
    c = _choice()
    c.link = Link(latency=5e-3, bandwidth=1.25e8)  # 5 ms, 1 Gbit/s
    small = c.decide("b", 4 << 10)
    assert (small.compressor, small.collective, dict(small.params)) == \
        ("topk", "allgather", {"ratio": 0.01})
    c.link = Link(latency=1e-6, bandwidth=1.25e7)  # 100 Mbit/s, no latency
    big = c.decide("w", 400 << 20)
    assert (big.compressor, big.collective) == ("star_topk", "ring")
    assert c.selected == {"b": "allgather", "w": "art_ring"}
    v = _choice(compressor="var_topk")
    v.link = c.link
    assert v.decide("w", 400 << 20).compressor == "var_topk"


def test_auto_as_a_default_leaves_other_compressors_alone_and_one_rank_untouched(caplog):
    c = Choice(EngineConfig(compressor="onebit", collective="auto"), 4)
    c.link = Link(latency=1e-3, bandwidth=1.25e8)
    with caplog.at_level("INFO", logger="hipress_like.casync.choice"):
        assert c.decide("w", 1 << 30).collective is None
        assert c.decide("v", 1 << 30).collective is None
    said = [r.message for r in caplog.records if "leaves" in r.message]
    assert len(said) == 1 and "OneBit" in said[0]  # said once, naming the compressor
    assert _choice(n=1).decide("w", 1 << 30).collective is None  # nothing travels


def test_an_explicit_auto_entry_on_another_compressor_is_refused():
    plan = Plan(compressor="onebit", gradients={
        "w": GradientPlan(compress=True, compressor="onebit", collective="auto")})
    c = Choice(EngineConfig(plan=plan), 2)
    c.link = Link(latency=1e-3, bandwidth=1.25e8)
    with pytest.raises(ValueError, match="collective='auto' chooses how top-k travels"):
        c.decide("w", 1 << 20)


def _register(tr, comp, collective):
    eng = Engine(tr, EngineConfig(compressor=comp, collective=collective, timeout=30,
                                  plan=Plan(compressor="identity",
                                            rule=SizeRule(min_compress_bytes=0))))
    try:
        eng.register([("w", (64, 8), torch.float32)])
    finally:
        eng.close()


@pytest.mark.parametrize("comp,collective,match", [
    ("onebit", "tree", "collective='tree' reduces each round on the collective lane"),
    ("star_topk", "allgather", "AR-Topk's Allgather counterpart is 'topk'"),
])
def test_a_compressor_that_cannot_travel_that_way_is_named(comp, collective, match):
    with pytest.raises(Exception, match=match):
        run_threads(lambda tr: _register(tr, comp, collective), 2, timeout=60)


def test_unknown_collective_names_are_refused_everywhere():
    with pytest.raises(ValueError, match="unknown collective 'butterfly'; available: backend"):
        EngineConfig(collective="butterfly")
    with pytest.raises(PlanError, match="unknown collective"):
        GradientPlan(compress=True, collective="butterfly")
    with pytest.raises(PlanError, match="does not compress names collective"):
        GradientPlan(compress=False, collective="ring")


def test_a_plan_keeps_its_collectives(tmp_path):
    plan = Plan(compressor="star_topk", gradients={
        "w": GradientPlan(compress=True, collective="tree"),
        "b": GradientPlan(compress=False)})
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["gradients"]["w"]["collective"] == "tree"
    back = Plan.load(path)
    assert back.gradients["w"].collective == "tree" and back.gradients["b"].collective is None


def _topk_profile(name="topk"):
    from hipress_like.cost_model.model import Curve
    from hipress_like.cost_model.profile import CompressorProfile, Profile

    pts = [float(4 << e) for e in range(10, 30, 2)]
    cp = CompressorProfile(name=name, category="sparsification", ratio=0.02, header_bytes=32,
                           encode=Curve.linear(2e-5, 1e-10, pts),
                           decode=Curve.linear(1e-5, 5e-11, pts), params={"ratio": 0.01})
    # 5 ms per message at 1 Gbit/s: small gradients latency-bound, large ones not
    return Profile(link=Link(latency=5e-3, bandwidth=1.25e8), compressors={name: cp})


def test_the_planner_names_the_selected_collective_per_top_k_gradient():
    """Planner.plan: compressed top-k entries become the Eq. 5a-5c pick on the profile's
    link: the 400 MB gradient AR-Topk by ring, the 8 MB one an Allgather of top-k."""
    from hipress_like.cost_model.collectives import select_collective
    from hipress_like.cost_model.planner import Planner

    prof = _topk_profile()
    sizes = {"fc": 400 << 20, "conv": 8 << 20, "bias": 4 << 10}
    plan = Planner(prof, "topk", n=4).plan(sizes)
    picks = plan.meta["collectives"]
    for name, pick in picks.items():
        assert pick == select_collective(float(sizes[name]), 4, 5e-3, 8e-9, 0.01)
    assert picks == {"fc": "art_ring", "conv": "allgather"}
    fc, conv = plan.gradients["fc"], plan.gradients["conv"]
    assert (fc.compressor, fc.collective, dict(fc.params)) == ("star_topk", "ring",
                                                             {"ratio": 0.01})
    assert (conv.compressor, conv.collective) == ("topk", "allgather")
    assert not plan.gradients["bias"].compress and plan.gradients["bias"].collective is None
    off = Planner(prof, "topk", n=4, collectives=False).plan(sizes)
    assert "collectives" not in off.meta and off.gradients["fc"].collective is None
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).gradients["fc"] == fc


def test_the_selection_default_ratio_is_the_compressors_default():
    from hipress_like import compressors
    from hipress_like.cost_model.collectives import DEFAULT_RATIO, TOPK_FAMILY

    for name in TOPK_FAMILY:
        assert compressors.get(name).ratio == DEFAULT_RATIO


def test_hipress_profile_plan_shows_the_selected_collectives(tmp_path, capsys):
    from hipress_like.tuning.cli import main

    prof = tmp_path / "profile.json"
    _topk_profile().save(prof)
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(prof), "--model", "vgg19", "-N", "4",
                 "--compressor", "topk", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "<star_topk@ring, 1>" in text
    assert "top-k gradients by the selected collective" in text
    plan = Plan.load(out)
    assert {g.collective for g in plan.gradients.values() if g.compress} <= {
        "ring", "tree", "allgather"}


def test_auto_without_a_link_source_says_how_to_fix():
    """casync never imports the measurement (tuning/link.py): without the link source the
    front ends inject, collective='auto' refuses at register, naming the fix."""
    with pytest.raises(ValueError, match="link_source=hipress_like.tuning.collective_links"):
        _choice().measure(None)
    seen = []
    c = Choice(EngineConfig(compressor="star_topk", params={"ratio": 0.01}, collective="auto",
                            link_source=lambda tr, t: seen.append((tr, t)) or
                            (Link(1e-3, 1e9), Link(1e-3, 2e9))), 4)
    tr = SimpleNamespace(rank=0)  # the source receives it untouched
    c.measure(tr)
    assert seen == [(tr, c.config.timeout)]
    assert (c.link.bandwidth, c.link_one_way.bandwidth) == (1e9, 2e9)
