"""Plans: per gradient, whether to compress, with what, and into how many partitions.

A ``Plan`` is what the cost model produces (HiPress Sec. 3.3, Table 7) and
what the engine and ``DistributedOptimizer(plan=...)`` consume. It holds
explicit per-gradient entries plus a size rule for gradients it does not
name, so a plan written for one model still gives sensible answers for
another. Plans are versioned JSON, validated on load:

    {"format": "hipress-like-plan", "version": 1,
     "strategy": "ps", "world_size": 4,
     "compressor": "onebit", "params": {},
     "rule": {"min_compress_bytes": 4194304, "bytes_per_partition": 4194304,
              "max_partitions": 8},
     "gradients": {"fc1.weight": {"compress": true, "partitions": 4}}}
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

__all__ = ["GradientPlan", "SizeRule", "Plan", "PLAN_FORMAT", "PLAN_VERSION", "PlanError"]

PLAN_FORMAT = "hipress-like-plan"
PLAN_VERSION = 1
STRATEGIES = ("ps", "ring")


class PlanError(ValueError):
    """A plan file or object is invalid."""


@dataclass(frozen=True)
class GradientPlan:
    """The decision for one gradient: compress or not, into K partitions."""

    compress: bool
    partitions: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.compress, bool):
            raise PlanError(f"compress must be true/false, found {self.compress!r}")
        if not isinstance(self.partitions, int) or self.partitions < 1:
            raise PlanError(f"partitions must be an integer >= 1, found {self.partitions!r}")


@dataclass(frozen=True)
class SizeRule:
    """Fallback for gradients a plan does not name (HiPress's shape of plan).

    Gradients smaller than ``min_compress_bytes`` are sent uncompressed
    (compression cost is not hidden for them, HiPress Sec. 3.3); K grows with
    size, one partition per ``bytes_per_partition`` rounded up to a multiple
    of the world size once it exceeds one, capped at ``max_partitions`` (0
    means 2 * world size).
    """

    # 1 MB: below this, onebit's encode+decode on a CPU costs more than the
    # transfer it saves on a 1-10 Gbit/s link (refined by the profiler).
    min_compress_bytes: int = 1 << 20
    # 16 MB per partition keeps each task long enough to amortise its launch.
    bytes_per_partition: int = 16 << 20
    max_partitions: int = 0

    def __post_init__(self) -> None:
        for k in ("min_compress_bytes", "bytes_per_partition", "max_partitions"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 0:
                raise PlanError(f"rule.{k} must be an integer >= 0, found {v!r}")
        if self.bytes_per_partition == 0:
            raise PlanError("rule.bytes_per_partition must be > 0")

    def decide(self, nbytes: int, world_size: int) -> GradientPlan:
        """Apply the rule to a gradient of ``nbytes``."""
        n = max(1, world_size)
        cap = self.max_partitions or 2 * n
        k = math.ceil(nbytes / self.bytes_per_partition)
        if 1 < k and n > 1 and cap >= n:
            # a multiple of N: one huge gradient then loads every PS aggregator
            # equally (7 partitions on 4 aggregators would give one of them 2/7)
            k = n * math.ceil(k / n)
        k = max(1, min(cap, k))
        return GradientPlan(compress=nbytes >= self.min_compress_bytes, partitions=k)


@dataclass(frozen=True)
class Plan:
    """A synchronisation plan for one model, strategy and world size.

    Args:
        compressor: registry name used for compressed gradients.
        params: the compressor's constructor parameters.
        strategy: "ps" or "ring".
        world_size: N the plan was computed for (0: any).
        rule: size rule for gradients not listed in ``gradients``.
        gradients: explicit decisions by gradient name.
        meta: free-form provenance (profile used, predicted times).
    """

    compressor: str = "onebit"
    params: Mapping[str, Any] = field(default_factory=dict)
    strategy: str = "ps"
    world_size: int = 0
    rule: SizeRule = field(default_factory=SizeRule)
    gradients: Mapping[str, GradientPlan] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise PlanError(f"strategy must be one of {STRATEGIES}, found {self.strategy!r}")
        if not isinstance(self.world_size, int) or self.world_size < 0:
            raise PlanError(f"world_size must be an integer >= 0, found {self.world_size!r}")
        if not isinstance(self.compressor, str) or not self.compressor:
            raise PlanError(f"compressor must be a registry name, found {self.compressor!r}")

    def decide(self, name: str, nbytes: int, world_size: Optional[int] = None) -> GradientPlan:
        """The decision for gradient ``name`` of ``nbytes`` bytes."""
        if name in self.gradients:
            return self.gradients[name]
        return self.rule.decide(nbytes, world_size or self.world_size or 1)

    # -- (de)serialisation -------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict with format and version tags."""
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "compressor": self.compressor,
            "params": dict(self.params),
            "strategy": self.strategy,
            "world_size": self.world_size,
            "rule": asdict(self.rule),
            "gradients": {k: asdict(v) for k, v in self.gradients.items()},
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        """Validate and build a plan from a dict (as read from JSON).

        Raises:
            PlanError: wrong format tag or version, unknown keys, bad values.
        """
        if not isinstance(d, Mapping):
            raise PlanError(f"a plan must be a JSON object, found {type(d).__name__}")
        if d.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a plan file: format is {d.get('format')!r}, "
                            f"expected {PLAN_FORMAT!r}")
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"plan version {d.get('version')!r} is not supported "
                            f"(expected {PLAN_VERSION}); regenerate it with hipress-profile plan")
        known = {"format", "version", "compressor", "params", "strategy", "world_size", "rule",
                 "gradients", "meta"}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"unknown plan keys: {sorted(unknown)}; known: {sorted(known)}")
        try:
            rule = SizeRule(**d.get("rule", {}))
            grads = {str(k): GradientPlan(**v) for k, v in d.get("gradients", {}).items()}
        except TypeError as e:
            raise PlanError(f"invalid plan entry: {e}") from e
        return cls(
            compressor=d.get("compressor", "onebit"),
            params=dict(d.get("params", {})),
            strategy=d.get("strategy", "ps"),
            world_size=d.get("world_size", 0),
            rule=rule,
            gradients=grads,
            meta=dict(d.get("meta", {})),
        )

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the plan as indented JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "Plan":
        """Read and validate a plan file.

        Raises:
            PlanError: unreadable JSON or an invalid plan (the message names the file).
        """
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"cannot read plan {os.fspath(path)!r}: {e}") from e
        try:
            return cls.from_dict(d)
        except PlanError as e:
            raise PlanError(f"{os.fspath(path)}: {e}") from e
