"""Plan format version 2: a compressor per gradient; version 1 still loads; a plan
that does not fit the run is refused with what differs."""
import json

import pytest

from hipress_like.cost_model.plan import GradientPlan, Plan, PlanError, SizeRule

V1 = {"format": "hipress-like-plan", "version": 1, "strategy": "ps", "world_size": 4,
      "compressor": "terngrad", "params": {"bitwidth": 2},
      "rule": {"min_compress_bytes": 1024, "bytes_per_partition": 4096, "max_partitions": 8},
      "gradients": {"fc.weight": {"compress": True, "partitions": 4},
                    "fc.bias": {"compress": False, "partitions": 1}}, "meta": {}}


def test_a_version_1_file_loads_with_the_plans_compressor_for_its_entries(tmp_path):
    p = tmp_path / "v1.json"
    p.write_text(json.dumps(V1))
    plan = Plan.load(p)
    dec = plan.decide("fc.weight", 1 << 20)
    assert dec == GradientPlan(compress=True, partitions=4)
    assert plan.compressor_of(dec) == ("terngrad", {"bitwidth": 2})
    assert not plan.decide("fc.bias", 40).compress
    assert plan.compressors() == [("terngrad", {"bitwidth": 2})]


def test_version_2_round_trips_a_compressor_per_gradient(tmp_path):
    plan = Plan(compressor="onebit", strategy="ring", world_size=4, gradients={
        "fc.weight": GradientPlan(True, 4, "powersgd", {"rank": 4}),
        "conv.weight": GradientPlan(True, 1),
        "fc.bias": GradientPlan(False)})
    p = tmp_path / "v2.json"
    plan.save(p)
    d = json.loads(p.read_text())
    assert d["version"] == 2
    assert d["gradients"]["fc.weight"] == {"compress": True, "partitions": 4,
                                           "compressor": "powersgd", "params": {"rank": 4}}
    assert d["gradients"]["conv.weight"] == {"compress": True, "partitions": 1}
    again = Plan.load(p)
    assert again == plan
    assert again.compressor_of(again.decide("fc.weight", 1)) == ("powersgd", {"rank": 4})
    assert again.compressor_of(again.decide("conv.weight", 1)) == ("onebit", {})
    assert again.compressors() == [("onebit", {}), ("powersgd", {"rank": 4})]


def test_params_are_canonical_so_ranks_compare_them_equal():
    a = GradientPlan(True, 1, "topk", {"ratio": 0.01, "a": [1, 2]})
    b = GradientPlan(True, 1, "topk", {"a": (1, 2), "ratio": 0.01})
    assert a == b and list(a.params) == ["a", "ratio"]
    with pytest.raises(PlanError, match="params.ratio"):
        GradientPlan(True, 1, "topk", {"ratio": object()})


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "ring", "world_size": 4}, "made for strategy 'ps'"),
    ({"strategy": "ps", "world_size": 2}, "made for 4 ranks"),
])
def test_a_plan_for_another_run_is_refused(kwargs, message):
    plan = Plan(strategy="ps", world_size=4)
    with pytest.raises(PlanError, match=message):
        plan.check({"w": 4}, **kwargs)


def test_a_plan_naming_a_missing_gradient_is_refused_with_the_names():
    plan = Plan(gradients={"module.fc.weight": GradientPlan(True, 2)})
    with pytest.raises(PlanError, match=r"module\.fc\.weight.*fc\.weight.*'module\.'"):
        plan.check({"fc.weight": 400}, strategy="ps", world_size=2)


def test_an_unspecified_strategy_and_world_size_fit_any_run():
    Plan(rule=SizeRule()).check({"w": 4}, strategy="ring", world_size=3)
