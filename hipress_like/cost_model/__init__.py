"""The cost model, planner and profiler (HiPress Sec. 3.3).

- ``model``: HiPress Eq. 1 and 2 with Table 3 / Sec. 6.1 alpha, beta, gamma;
  measured ``Curve``s and the ``Link`` alpha-beta fit.
- ``collectives``: alpha-beta costs of PS, Ring/Tree allreduce, Broadcast,
  Allgather (flexible-communication paper, Table I).
- ``profiler``: ``Profile`` (versioned JSON) and how to measure it.
- ``planner``: ``Planner`` choosing <compress?, K> per gradient, giving a ``Plan``.
- ``auto``: ``AutoPlanner`` behind ``plan="auto"``.
- ``presets``: gradient sizes of HiPress Table 6's models.
"""
from . import collectives, presets
from .auto import AutoPlanner
from .model import (
    SYNC_PARAMS,
    Count,
    Curve,
    Link,
    SyncParams,
    fit_link,
    n_batches,
    sync_params,
    t_sync_cpr,
    t_sync_orig,
)
from .plan import PLAN_FORMAT, PLAN_VERSION, GradientPlan, Plan, PlanError, SizeRule
from .planner import ENGINE_TO_MODEL, Choice, Planner
from .profiler import (
    PROFILE_FORMAT,
    PROFILE_VERSION,
    CompressorProfile,
    Profile,
    ProfileError,
    measure_link,
    profile_compressor,
    profile_transport,
)

__all__ = [
    "PLAN_FORMAT", "PLAN_VERSION", "GradientPlan", "Plan", "PlanError", "SizeRule",
    "SYNC_PARAMS", "Count", "Curve", "Link", "SyncParams", "fit_link", "n_batches",
    "sync_params", "t_sync_cpr", "t_sync_orig", "collectives", "presets",
    "ENGINE_TO_MODEL", "Choice", "Planner",
    "PROFILE_FORMAT", "PROFILE_VERSION", "CompressorProfile", "Profile", "ProfileError",
    "measure_link", "profile_compressor", "profile_transport", "AutoPlanner",
]
