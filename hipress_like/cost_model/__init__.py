"""The cost model, planner and profiler (HiPress Sec. 3.3).

- ``model``: HiPress Eq. 1 and 2 with Table 3 / Sec. 6.1 alpha, beta, gamma;
  measured ``Curve``s and the ``Link`` alpha-beta fit.
- ``collectives``: alpha-beta costs of PS, Ring/Tree allreduce, Broadcast,
  Allgather (flexible-communication paper, Table I).
- ``profile``: ``Profile`` (versioned JSON), the measured inputs.
- ``planner``: ``Planner`` choosing <compress?, K> per gradient, giving a ``Plan``.
- ``presets``: gradient sizes of HiPress Table 6's models.

Everything here is pure (no transport, no engine): measuring profiles,
``plan="auto"`` and the ``hipress-profile`` CLI live above the engine, in
``hipress_like.tuning``.
"""
from . import collectives, presets
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
from .planner import ENGINE_TO_MODEL, Choice, Planner, plan_per_gradient
from .profile import PROFILE_FORMAT, PROFILE_VERSION, CompressorProfile, Profile, ProfileError

__all__ = [
    "PLAN_FORMAT", "PLAN_VERSION", "GradientPlan", "Plan", "PlanError", "SizeRule",
    "SYNC_PARAMS", "Count", "Curve", "Link", "SyncParams", "fit_link", "n_batches",
    "sync_params", "t_sync_cpr", "t_sync_orig", "collectives", "presets",
    "ENGINE_TO_MODEL", "Choice", "Planner", "plan_per_gradient",
    "PROFILE_FORMAT", "PROFILE_VERSION", "CompressorProfile", "Profile", "ProfileError",
]
