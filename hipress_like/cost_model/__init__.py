"""The cost model, planner and profiler (HiPress Sec. 3.3)."""
from .plan import PLAN_FORMAT, PLAN_VERSION, GradientPlan, Plan, PlanError, SizeRule

__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "GradientPlan", "Plan", "PlanError", "SizeRule"]
