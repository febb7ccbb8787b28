"""Plans that differ between ranks are named by the field that differs, on every rank.

Real ranks over gloo: each engine registers with its own fixed plan.
"""
import pytest
import torch

from hipress_like.casync.engine import Engine, EngineConfig
from hipress_like.cost_model.plan import GradientPlan, Plan, SizeRule
from hipress_like.launch.launch import WorkerError, run_workers

pytestmark = pytest.mark.faults


def _plan_differs(ctx, what):
    w = GradientPlan(compress=True, partitions=2)
    plan = Plan(compressor="onebit", rule=SizeRule(min_compress_bytes=1), gradients={"fc.w": w})
    if ctx.rank == 1 and what == "partitions":
        plan = Plan(compressor="onebit", rule=SizeRule(min_compress_bytes=1),
                    gradients={"fc.w": GradientPlan(compress=True, partitions=4)})
    if ctx.rank == 1 and what == "compressor":
        plan = Plan(compressor="terngrad", rule=SizeRule(min_compress_bytes=1),
                    gradients={"fc.w": w})
    Engine(ctx.transport, EngineConfig(plan=plan, timeout=30)).register(
        [("fc.w", (100, 10), torch.float32)])


@pytest.mark.parametrize("what,field,values", [
    ("partitions", "plan.gradients['fc.w'].partitions", ("2 on rank(s) [0]", "4 on rank(s) [1]")),
    ("compressor", "plan.compressor", ("'onebit' on rank(s) [0]", "'terngrad' on rank(s) [1]")),
])
def test_plan_difference_is_named_by_its_field(what, field, values):
    with pytest.raises(WorkerError) as e:
        run_workers(_plan_differs, 2, args=(what,), timeout=120)
    assert set(e.value.failures) == {0, 1}
    for tb in e.value.failures.values():
        assert "ConfigMismatchError" in tb and f"{field}: " in tb, tb
        for v in values:
            assert v in tb, tb
