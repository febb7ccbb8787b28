"""Plans: per gradient, whether to compress, with what, and into how many partitions.

A ``Plan`` is what the cost model produces (HiPress Sec. 3.3, Table 7) and
what the engine and ``DistributedOptimizer(plan=...)`` consume. It holds
explicit per-gradient entries plus a size rule for gradients it does not
name, so a plan written for one model still gives sensible answers for
another. Each entry may name its own compressor and parameters (format
version 2): HiPress chooses per gradient, and the best choice differs by
layer (PowerSGD for large matrices, a quantizer elsewhere, nothing for
small ones). An entry that compresses without naming a compressor, and the
size rule, use the plan's ``compressor``. Plans are versioned JSON,
validated on load; version 1 files (no per-entry compressor) still load:

    {"format": "hipress-like-plan", "version": 2,
     "strategy": "ps", "world_size": 4,
     "compressor": "onebit", "params": {},
     "rule": {"min_compress_bytes": 4194304, "bytes_per_partition": 4194304,
              "max_partitions": 8},
     "gradients": {"fc1.weight": {"compress": true, "partitions": 4,
                                  "compressor": "powersgd", "params": {"rank": 4}},
                   "conv1.weight": {"compress": true, "partitions": 1},
                   "fc2.weight": {"compress": true, "partitions": 2,
                                  "compressor": "onebit", "params": {},
                                  "compressor_back": "natural", "params_back": {}},
                   "fc1.bias": {"compress": false, "partitions": 1}}}

An entry may also name the *collective* its payloads travel by
(``collective``; an optional key of version 2, see ``COLLECTIVES``): the
sum rounds of a multi-round compressor by "backend" (the transport's own
allreduce), "ring" or "tree" (``casync.collectives``), with broadcast rounds
by a binomial tree; "allgather" gathers a single-round compressor's
payloads (LWTopk); "auto" lets the alpha-beta model of the flexible-
communication paper choose (Eq. 5a-5c; ``casync.choice``).

An entry may also name a *master* compressor (``compressor_back`` and
``params_back``; optional keys of version 2): bidirectional compression
(Natural Compression, Alg. 1) encodes the aggregate with it before it goes
back to the workers; without one, the aggregate is encoded with the
entry's own compressor, as HiPress does.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..errors import HipressError
from ._files import check_envelope, load_json

__all__ = ["GradientPlan", "SizeRule", "Plan", "PLAN_FORMAT", "PLAN_VERSION", "PlanError",
           "canonical_params", "COLLECTIVES", "check_collective_name"]

PLAN_FORMAT = "hipress-like-plan"
PLAN_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: one compressor per plan, no per-entry names
STRATEGIES = ("ps", "ring")
# how a compressed gradient's payloads may travel (GradientPlan.collective)
COLLECTIVES = ("backend", "ring", "tree", "allgather", "auto")
_SCALARS = (bool, int, float, str, type(None))


def canonical_params(params: Any, where: str = "params") -> Dict[str, Any]:
    """Compressor parameters as a plain dict with sorted keys and JSON-safe values, so
    two ranks (and two runs) compare them equal exactly when they are.

    Raises:
        PlanError: not a mapping, a non-string key, or a value that is not a
            number, string, bool, None or a list of those.
    """
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise PlanError(f"{where} must be a mapping of parameter names to values, found "
                        f"{type(params).__name__}")
    out = {}
    for k in sorted(params):
        v = params[k]
        if not isinstance(k, str):
            raise PlanError(f"{where}: parameter names must be strings, found {k!r}")
        if isinstance(v, (list, tuple)) and all(isinstance(x, _SCALARS) for x in v):
            v = list(v)
        elif not isinstance(v, _SCALARS):
            raise PlanError(f"{where}.{k} must be a number, string, bool, null or a list of "
                            f"those, found {type(v).__name__}")
        out[k] = v
    return out


class PlanError(HipressError, ValueError):
    """A plan file or object is invalid."""


@dataclass(frozen=True)
class GradientPlan:
    """The decision for one gradient: compress or not, with what, into K partitions.

    Attributes:
        compress: whether the gradient is compressed.
        partitions: K (HiPress Sec. 3.3).
        compressor: the registry name to compress it with; None takes the
            plan's compressor (and must be None when not compressing).
        params: that compressor's parameters (with ``compressor`` only).
        compressor_back: the master compressor that encodes the aggregate on
            its way back (Natural Compression Alg. 1's C_M); None: the
            worker's compressor (or the engine's ``compressor_back``).
        params_back: its parameters (with ``compressor_back`` only).
        collective: how the payloads travel (``COLLECTIVES``), or None: the
            engine's default (``EngineConfig.collective``, else PS/Ring).
    """

    compress: bool
    partitions: int = 1
    compressor: Optional[str] = None
    params: Mapping[str, Any] = field(default_factory=dict)
    compressor_back: Optional[str] = None
    params_back: Mapping[str, Any] = field(default_factory=dict)
    collective: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.compress, bool):
            raise PlanError(f"compress must be true/false, found {self.compress!r}")
        if not isinstance(self.partitions, int) or isinstance(self.partitions, bool) \
                or self.partitions < 1:
            raise PlanError(f"partitions must be an integer >= 1, found {self.partitions!r}")
        if self.compressor is not None:
            if not isinstance(self.compressor, str) or not self.compressor:
                raise PlanError(f"compressor must be a registry name or null, found "
                                f"{self.compressor!r}")
            if not self.compress:
                raise PlanError(f"an entry that does not compress names compressor "
                                f"{self.compressor!r}; drop it or set compress to true")
        elif self.params:
            raise PlanError(f"params {dict(self.params)} given without a compressor")
        if self.compressor_back is not None:
            if not isinstance(self.compressor_back, str) or not self.compressor_back:
                raise PlanError(f"compressor_back must be a registry name or null, found "
                                f"{self.compressor_back!r}")
            if not self.compress:
                raise PlanError(f"an entry that does not compress names compressor_back "
                                f"{self.compressor_back!r}; drop it or set compress to true")
        elif self.params_back:
            raise PlanError(f"params_back {dict(self.params_back)} given without a "
                            "compressor_back")
        if self.collective is not None:
            check_collective_name(self.collective, PlanError)
            if not self.compress:
                raise PlanError(f"an entry that does not compress names collective "
                                f"{self.collective!r}; uncompressed gradients take the "
                                "allreduce lane; drop it or set compress to true")
        object.__setattr__(self, "params", canonical_params(self.params))
        object.__setattr__(self, "params_back", canonical_params(self.params_back,
                                                                 "params_back"))

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form; the compressor and its params only where named."""
        d: Dict[str, Any] = {"compress": self.compress, "partitions": self.partitions}
        if self.compressor is not None:
            d.update(compressor=self.compressor, params=dict(self.params))
        if self.compressor_back is not None:
            d.update(compressor_back=self.compressor_back, params_back=dict(self.params_back))
        if self.collective is not None:
            d["collective"] = self.collective
        return d


def check_collective_name(name: Any, error: type = ValueError) -> str:
    """``name`` if it is one of ``COLLECTIVES``; else ``error`` listing them."""
    if name not in COLLECTIVES:
        raise error(f"unknown collective {name!r}; available: {', '.join(COLLECTIVES)}")
    return name


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
        compressor: registry name for compressed gradients whose entry names
            none, and for the size rule.
        params: the compressor's constructor parameters.
        strategy: "ps" or "ring" the plan was computed for (None: any).
        world_size: N the plan was computed for (0: any).
        rule: size rule for gradients not listed in ``gradients``.
        gradients: explicit decisions by gradient name.
        meta: free-form provenance (profile used, predicted times).
    """

    compressor: str = "onebit"
    params: Mapping[str, Any] = field(default_factory=dict)
    strategy: Optional[str] = None
    world_size: int = 0
    rule: SizeRule = field(default_factory=SizeRule)
    gradients: Mapping[str, GradientPlan] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise PlanError(f"strategy must be one of {STRATEGIES} or null, found "
                            f"{self.strategy!r}")
        if not isinstance(self.world_size, int) or self.world_size < 0:
            raise PlanError(f"world_size must be an integer >= 0, found {self.world_size!r}")
        if not isinstance(self.compressor, str) or not self.compressor:
            raise PlanError(f"compressor must be a registry name, found {self.compressor!r}")
        object.__setattr__(self, "params", canonical_params(self.params))
        for name, g in self.gradients.items():
            if not isinstance(g, GradientPlan):
                raise PlanError(f"gradient {name!r}: expected a GradientPlan, found "
                                f"{type(g).__name__}")

    def decide(self, name: str, nbytes: int, world_size: Optional[int] = None) -> GradientPlan:
        """The decision for gradient ``name`` of ``nbytes`` bytes."""
        if name in self.gradients:
            return self.gradients[name]
        return self.rule.decide(nbytes, world_size or self.world_size or 1)

    def compressor_of(self, dec: GradientPlan) -> Tuple[str, Dict[str, Any]]:
        """(name, params) a compressing decision uses: its own, else the plan's."""
        if dec.compressor is not None:
            return dec.compressor, dict(dec.params)
        return self.compressor, dict(self.params)

    def compressors(self) -> List[Tuple[str, Dict[str, Any]]]:
        """The distinct (name, params) the plan's entries and rule may use, sorted."""
        seen = {(self.compressor, json.dumps(dict(self.params), sort_keys=True))}
        for g in self.gradients.values():
            if g.compress:
                name, params = self.compressor_of(g)
                seen.add((name, json.dumps(params, sort_keys=True)))
                if g.compressor_back is not None:
                    seen.add((g.compressor_back, json.dumps(dict(g.params_back),
                                                            sort_keys=True)))
        return [(n, json.loads(p)) for n, p in sorted(seen)]

    def check(self, sizes: Mapping[str, int], *, strategy: str, world_size: int) -> None:
        """Refuse a plan that does not fit the run, naming what differs.

        Args:
            sizes: the model's gradients (name -> bytes).
            strategy: the run's strategy; world_size: its N.

        Raises:
            PlanError: the plan was made for another strategy or world size,
                or names gradients the model does not have.
        """
        if self.strategy is not None and self.strategy != strategy:
            raise PlanError(f"the plan was made for strategy {self.strategy!r}, this run uses "
                            f"{strategy!r}; pass strategy={self.strategy!r} or regenerate the "
                            "plan (hipress-profile plan --strategy ...)")
        if self.world_size and self.world_size != world_size:
            raise PlanError(f"the plan was made for {self.world_size} ranks, this run has "
                            f"{world_size}; regenerate it (hipress-profile plan -n "
                            f"{world_size}) or set its world_size to 0 to use it anyway")
        unknown = sorted(set(self.gradients) - set(sizes))
        if unknown:
            known = list(sizes)
            raise PlanError(f"the plan names {len(unknown)} gradient(s) the model does not "
                            f"have: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; the "
                            f"model's are {known[:5]}{' ...' if len(known) > 5 else ''} "
                            "(was the plan made for another model, or are names prefixed "
                            "differently, e.g. 'module.'?)")

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
            "gradients": {k: v.to_dict() for k, v in self.gradients.items()},
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        """Validate and build a plan from a dict (as read from JSON).

        Raises:
            PlanError: wrong format tag or version, unknown keys, bad values.
        """
        version = check_envelope(
            d, "plan", PLAN_FORMAT, READABLE_VERSIONS,
            {"format", "version", "compressor", "params", "strategy", "world_size", "rule",
             "gradients", "meta"}, PlanError, "regenerate it with hipress-profile plan")
        entry_keys = {"compress", "partitions"} | (
            {"compressor", "params", "compressor_back", "params_back", "collective"}
            if version >= 2 else set())
        grads = {}
        try:
            rule = SizeRule(**d.get("rule", {}))
            for k, v in d.get("gradients", {}).items():
                if not isinstance(v, Mapping) or set(v) - entry_keys:
                    raise PlanError(f"invalid plan entry: gradient {k!r}: an entry is an "
                                    f"object with keys "
                                    f"{sorted(entry_keys)} (plan version {version}), found "
                                    f"{sorted(v) if isinstance(v, Mapping) else v!r}")
                grads[str(k)] = GradientPlan(**v)
        except TypeError as e:
            raise PlanError(f"invalid plan entry: {e}") from e
        return cls(
            compressor=d.get("compressor", "onebit"),
            params=dict(d.get("params", {})),
            strategy=d.get("strategy"),
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
        return load_json(path, cls.from_dict, PlanError, "plan")
