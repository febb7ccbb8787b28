"""``plan="auto"``: profile during the first iterations, then fix the plan (as HiPress does).

HiPress profiles its cost curves on the target cluster before planning
(Sec. 3.3). With ``plan="auto"`` the front end does this at the start of
training instead of asking for a profile file:

1. While the plan is not fixed, the engine synchronises with the
   *provisional* plan (by default nothing is compressed; partitions follow
   the default ``SizeRule``) and reports every gradient it sees with ``observe(name, nbytes)``.
2. At the end of each iteration every rank calls ``end_iteration(transport)``
   at the same point (the transport idle). After ``warmup_iterations`` it
   runs, collectively: a check that every rank saw the same gradients, a
   quick profile of the compressor's encode/decode at a few sizes spanning
   the observed ones (all ranks at once, so CPU contention is real), a few
   link timings over the transport (unless a ``Link`` was given), a few
   whole synchronisations timed through the engine (``engine_timing``: the
   uncompressed lane, and the compressor at three sizes up to the largest
   profiled one x K = 1, 2, N, 3N, so the planner charges the engine's own
   cost beyond HiPress Eq. 2, ``planner.EngineTerm``), then the planner on
   rank 0, whose plan is broadcast as JSON. Every rank returns the
   identical ``Plan``; from then on the plan is fixed.

Example (what an engine or ``DistributedOptimizer(plan="auto")`` does):

    auto = AutoPlanner("onebit", strategy="ps")
    plan = auto.provisional_plan
    for it in range(steps):
        for name, grad in produced_gradients():
            if not auto.ready:
                auto.observe(name, grad.numel() * grad.element_size())
            engine.submit(name, grad)              # decided by ``plan``
        engine.synchronize()
        fixed = auto.end_iteration(transport)      # collective; None until fixed
        if fixed is not None:
            plan = fixed
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import statistics
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..cost_model.model import Link
from ..cost_model.plan import Plan, SizeRule
from ..cost_model.planner import NEVER, Planner, plan_per_gradient
from ..cost_model.profile import Profile, log_sizes
from .engine_timing import top_points
from .profiler import broadcast_bytes, profile_transport

__all__ = ["auto_plan", "AutoPlanner", "DEFAULT_CANDIDATES", "default_candidates"]

# What ``compression="auto"`` chooses from per gradient (and "none"): a 1-bit and
# a 2-bit quantizer, a 0.1% sparsifier and rank-2 PowerSGD, the families of
# HiPress Table 1 that CaSync runs here. PowerSGD's rank is the lowest that kept
# DDP's accuracy on digits after 300 steps (bench/train.py --acc-steps 300;
# docs/design.md has the runs): rank 1 (PyTorch's powerSGD_hook default), although
# the fastest fixed row, lost more than the 1-point budget; rank 2 did not. Its
# kernels cost within a tenth of rank 1's (they are bound by memory, and the
# rank adds arithmetic only), rank 4's about a quarter more. Its error memory is
# bfloat16, which its C kernels read and write directly: a third fewer bytes per
# step for passes bound by memory, and on digits (4 ranks, 300 steps, four seeds)
# as accurate on average as float32 (docs/design.md has the runs).
# ``default_candidates`` keeps float32 off the CPU.
DEFAULT_CANDIDATES: Dict[str, Dict[str, Any]] = {
    "onebit": {}, "terngrad": {"bitwidth": 2}, "dgc": {"ratio": 0.001},
    "powersgd": {"rank": 2, "error_dtype": "bfloat16"}}


def default_candidates(device_type: str = "cpu") -> Dict[str, Dict[str, Any]]:
    """``compression="auto"``'s candidates for gradients on ``device_type`` (a copy).

    ``DEFAULT_CANDIDATES`` on the CPU. Elsewhere PowerSGD keeps its float32
    error memory: a bfloat16 one has C kernels only, and on a GPU would go
    through torch's, with float32 temporaries the size of the gradient, where
    the float32 one has fused kernels.

    Example:
        >>> default_candidates("cuda")["powersgd"]
        {'rank': 2}
    """
    cands = {k: dict(v) for k, v in DEFAULT_CANDIDATES.items()}
    if device_type != "cpu":
        cands["powersgd"].pop("error_dtype", None)
    return cands


_log = logging.getLogger(__name__)


class AutoPlanner:
    """Collects gradient sizes, profiles in-process, and fixes a ``Plan``.

    Args:
        compressor: registry name of the compressor to plan for.
        params: its constructor parameters.
        strategy: the engine's strategy, "ps" or "ring".
        link: a given ``Link``; ``None`` measures it over the transport.
        warmup_iterations: iterations observed before the plan is fixed (>= 1).
        max_partitions: the planner's largest K (default 4 * N).
        repeats: timed calls per size while profiling (few: it is training time).
        max_profile_bytes: largest size profiled (larger ones extrapolate).
        max_link_bytes: largest message timed on the link.
        timeout: seconds for each collective.
        provisional: plan used until the plan is fixed (default: no compression).
        round_meta_bytes: bytes the engine allgathers before each bulk round
            (its coordinator reports), timed with the link; 0 times bare links.
        raw_collective: the engine's setting: uncompressed gradients are
            modelled as a ring allreduce (True) or HiPress Eq. 1 (False).
        candidates: {name: params} of compressors to choose from per gradient
            (``cost_model.plan_per_gradient``; "none" is always a candidate);
            a name may be a label whose params name the compressor
            (``profiler.candidate``: plain and Bloom-coded top-k side by side);
            default: only ``compressor``. ``default_candidates`` is the set
            ``compression="auto"`` uses (``DEFAULT_CANDIDATES`` on the CPU).
        engine_timing: also time whole synchronisations through the engine
            (default True; see the module docstring). False plans with
            HiPress Eq. 1/2 alone, which under-predicts the engine's
            compressed times (docs/design.md); it saves the engine timing's
            share of profiling.
        trials: with several candidates on several ranks, also time the
            per-gradient plan and each candidate's own plan through the
            engine on the model's gradient sizes (``trial_repeats`` steps
            each, after a warm-up step) and keep the fastest (default True).
            The cost model ranks compressors within a few percent at best;
            the trials catch its misses for a few seconds more of start-up.
        trial_repeats: timed steps per trial plan.
        nonfinite: the trial engines' NaN/Inf policy: the run's
            (``auto_plan`` passes ``EngineConfig.nonfinite``), so a stateful
            compressor pays in its trial the per-step state snapshot it will
            pay in training under "propagate" or "skip" (DGC's momentum and
            residual, PowerSGD's error and Q).
        back: (name, params) of a master compressor (bidirectional
            compression, Natural Compression Alg. 1), profiled with the
            candidates and priced in both directions by every candidate's
            planner (``model.t_sync_bidi``); the plan's compressing entries
            name it. None: each compressor both ways.

    Raises:
        ValueError: bad strategy or warmup_iterations.
    """

    def __init__(self, compressor: str = "onebit", params: Optional[Mapping[str, Any]] = None,
                 strategy: str = "ps", *, link: Optional[Link] = None,
                 warmup_iterations: int = 1, max_partitions: Optional[int] = None,
                 repeats: int = 3, max_profile_bytes: int = 64 << 20,
                 max_link_bytes: int = 16 << 20, timeout: float = 300.0,
                 provisional: Optional[Plan] = None, round_meta_bytes: int = 0,
                 raw_collective: bool = True, engine_timing: bool = True,
                 candidates: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 trials: bool = True, trial_repeats: int = 3,
                 back: Optional[Sequence[Any]] = None, nonfinite: str = "raise") -> None:
        if strategy not in ("ps", "ring"):
            raise ValueError(f"unknown strategy {strategy!r}; expected 'ps' or 'ring'")
        if not isinstance(warmup_iterations, int) or warmup_iterations < 1:
            raise ValueError(f"warmup_iterations must be an integer >= 1, found "
                             f"{warmup_iterations!r}")
        self.compressor = compressor
        self.raw_collective = bool(raw_collective)
        self.engine_timing = bool(engine_timing)
        self.trials = bool(trials)
        if not isinstance(trial_repeats, int) or trial_repeats < 1:
            raise ValueError(f"trial_repeats must be an integer >= 1, found {trial_repeats!r}")
        self.trial_repeats = trial_repeats
        if nonfinite not in ("propagate", "skip", "raise", "ignore"):
            raise ValueError(f"nonfinite must be 'propagate', 'skip', 'raise' or 'ignore', "
                             f"found {nonfinite!r}")
        self.nonfinite = nonfinite
        self.params = dict(params or {})
        self.candidates = {str(k): dict(v or {}) for k, v in
                           (candidates or {compressor: self.params}).items()}
        if not self.candidates:
            raise ValueError("candidates must name at least one compressor")
        self.back = None if back is None else (str(back[0]), dict(back[1] or {}))
        if self.back is not None and self.candidates.get(self.back[0], self.back[1]) \
                != self.back[1]:
            raise ValueError(f"the master compressor {self.back[0]!r} is also a candidate with "
                             f"other parameters ({self.candidates[self.back[0]]} against "
                             f"{self.back[1]}); give both the same parameters")
        self.strategy = strategy
        self.link = link
        self.warmup_iterations = warmup_iterations
        self.max_partitions = max_partitions
        self.repeats = repeats
        self.max_profile_bytes = max_profile_bytes
        self.max_link_bytes = max_link_bytes
        self.timeout = timeout
        self.round_meta_bytes = round_meta_bytes
        self.provisional_plan = provisional or Plan(
            compressor=compressor, params=self.params, strategy=strategy,
            rule=SizeRule(min_compress_bytes=NEVER), meta={"auto": "provisional"})
        self.iterations = 0
        self.sizes: Dict[str, int] = {}
        self.shapes: Dict[str, Tuple[int, ...]] = {}  # when known (``observe``, ``finalize``)
        # per warm-up iteration, seconds from its first gradient to its last: the
        # backward the trials run beside each synchronisation (``_best_of``)
        self.backward_s: List[float] = []
        self._span: List[float] = []
        self.profile: Optional[Profile] = None
        self._plan: Optional[Plan] = None

    @property
    def ready(self) -> bool:
        """Whether the plan is fixed."""
        return self._plan is not None

    @property
    def plan(self) -> Plan:
        """The fixed plan if ready, else the provisional one."""
        return self._plan or self.provisional_plan

    def observe(self, name: str, nbytes: int, shape: Optional[Sequence[int]] = None) -> None:
        """Record a gradient seen in a warm-up iteration (and its shape, if given).

        Raises:
            ValueError: a size < 1, or a name seen before with another size.
        """
        if not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"gradient {name!r}: size must be an integer >= 1 byte, found "
                             f"{nbytes!r}")
        now = time.perf_counter()
        self._span = [self._span[0] if self._span else now, now]
        old = self.sizes.setdefault(str(name), nbytes)
        if shape is not None:
            self.shapes[str(name)] = tuple(int(d) for d in shape)
        if old != nbytes:
            raise ValueError(f"gradient {name!r} changed size from {old} to {nbytes} bytes "
                             "between iterations")

    def end_iteration(self, transport: Any) -> Optional[Plan]:
        """Count an iteration; after the warm-up, fix the plan. Collective.

        Every rank must call this at the same point of the same iteration.

        Returns:
            The fixed plan (identical on every rank) on the iteration that
            fixes it, else ``None``.

        Raises:
            ValueError: no gradient was observed, or ranks observed different
                gradient sets.
        """
        if self.ready:
            return None
        if self._span:
            self.backward_s.append(self._span[1] - self._span[0])
            self._span = []
        self.iterations += 1
        if self.iterations < self.warmup_iterations:
            return None
        self._plan = self.finalize(transport)
        return self._plan

    def finalize(self, transport: Any, gradients: Optional[Mapping[str, int]] = None,
                 shapes: Optional[Mapping[str, Sequence[int]]] = None) -> Plan:
        """Profile, plan, and agree on the plan across ranks. Collective.

        Args:
            transport: the engine's transport (``rank``, ``size``, collectives);
                ``None`` plans for a single process.
            gradients: {name: nbytes}; default: the observed ones.
            shapes: {name: shape} of the gradients, for the trials (default:
                the observed ones, else ``engine_timing.profile_shape``'s
                near-square matrices): PowerSGD's cost depends on
                its matrix view, and a flat gradient takes it about twice as
                long to synchronise as the matrix it stands for, which made
                the trials drop it for onebit.

        Returns:
            The plan, identical on every rank.
        """
        sizes = dict(gradients or self.sizes)
        if shapes is not None:
            self.shapes.update({str(k): tuple(int(d) for d in v) for k, v in shapes.items()})
        if not sizes:
            raise ValueError("plan='auto' observed no gradient; call observe(name, nbytes) for "
                             "each gradient of the first iteration")
        n = 1 if transport is None else transport.size
        if transport is not None and n > 1:
            _check_same_gradients(transport, sizes, self.timeout)
        t0 = time.perf_counter()
        big = max(sizes.values())
        prof_sizes = log_sizes(4096, max(4096, min(big, self.max_profile_bytes)), 0.5)
        # A single process never communicates: the link is irrelevant (alpha = 0).
        link = self.link or (Link(0.0, 1.0) if n == 1 else None)
        profiled = dict(self.candidates)
        if self.back is not None:
            profiled.setdefault(*self.back)
        if transport is None or n == 1:
            from .profiler import candidate, profile_compressor
            comps = {c: profile_compressor(*candidate(c, ps), prof_sizes, repeats=self.repeats,
                                           min_time=0.0) for c, ps in profiled.items()}
            self.profile = Profile(link=link, compressors=comps,
                                   meta={"ranks": n, "link_source": "given"})
        else:
            link_sizes = log_sizes(4096, max(8192, min(big, self.max_link_bytes)), 0.5)
            # engine timings up to the largest profiled size, 8x apart
            grid = top_points(prof_sizes[-1], n)
            self.profile = profile_transport(
                transport, profiled, sizes=prof_sizes,
                link_sizes=link_sizes, link=link, repeats=self.repeats, timeout=self.timeout,
                round_meta_bytes=self.round_meta_bytes, raw_collective=self.raw_collective,
                engine_overhead=self.strategy if self.engine_timing else None,
                engine_grid=grid, nonfinite=self.nonfinite)
        rank = 0 if transport is None else transport.rank
        data = b""
        if rank == 0:
            planners = [Planner(self.profile, c, n, self.strategy,
                                max_partitions=self.max_partitions,
                                raw_collective=self.raw_collective,
                                # a multi-round candidate's rounds are reduced, not
                                # re-encoded: it keeps its own compressor both ways
                                back=self.back[0] if self.back and _rounds(
                                    c, self.candidates[c]) == 1 else None)
                        for c in self.candidates]
            meta = {"auto": "fixed", "profile": self.profile.to_dict(),
                    "profiling_s": time.perf_counter() - t0}
            plans = [planners[0].plan(sizes, meta=meta) if len(planners) == 1
                     else plan_per_gradient(planners, sizes, meta=meta)]
            if self.trials and len(planners) > 1 and n > 1:
                plans += [name_entries(p.plan(sizes, meta={"auto": "trial"}))
                          for p in planners]
            data = json.dumps([p.to_dict() for p in plans]).encode()
        if transport is not None and n > 1:
            data = broadcast_bytes(transport, data, self.timeout)
        plans = [Plan.from_dict(d) for d in json.loads(data)]
        plan = plans[0] if len(plans) == 1 else self._best_of(transport, plans, sizes)
        # The profile's and the trials' closed engines sit in reference cycles (an
        # engine is alive after its last reference goes, until a collection) with
        # their compressors' state, error memories the size of the model. Collect
        # them here, at start-up, for both ways in (``auto_plan`` and
        # ``end_iteration``), rather than leave them to a full collection that a
        # training loop's few container allocations may trigger mid-step or never.
        gc.collect()
        _log.info("plan='auto' fixed after %d iteration(s): threshold %s bytes, %d of %d "
                  "gradients compressed", self.iterations, plan.rule.min_compress_bytes,
                  sum(g.compress for g in plan.gradients.values()), len(plan.gradients))
        return plan


    def _best_of(self, transport: Any, plans: List[Plan], sizes: Mapping[str, int]) -> Plan:
        """Time each plan through the engine (collective) and return the fastest,
        the per-gradient one (``plans[0]``) on a tie within 2 %; the timings go
        into its ``meta["trials"]``. Each gradient keeps its shape (``shapes``).
        When warm-up iterations were observed (``observe``/``end_iteration``),
        each timed step runs beside a compute load as long as their backward
        (``backward_s``), so a plan whose compression steals CPU from backward
        is charged for it; ``auto_plan`` plans inside ``register``, before any
        backward, and times the synchronisations alone."""
        from .compute import ComputeLoad
        from .engine_timing import time_engine_steps

        labels = ["per-gradient"] + [f"all-{c}" for c in self.candidates]
        backward = statistics.median(self.backward_s[1:] or self.backward_s or [0.0])
        load = None
        if backward > 0:  # sized once, while every rank sizes its own
            transport.barrier(self.timeout)
            load = ComputeLoad(backward)
        times = []
        for label, p in zip(labels, plans):
            times.append(time_engine_steps(transport, p, sizes, self.strategy,
                                           shapes=self.shapes,
                                           repeats=self.trial_repeats, timeout=self.timeout,
                                           engine_config={"raw_collective": self.raw_collective,
                                                          "nonfinite": self.nonfinite},
                                           load=load))
            _log.info("plan='auto' trial %s: %.1f ms per synchronisation", label,
                      1e3 * times[-1])
        # every rank holds the same figures: each step's time is the slowest rank's
        best = min(range(len(plans)), key=lambda i: (times[i], i))
        if times[0] <= times[best] * 1.02:
            best = 0
        meta = dict(plans[0].meta)  # the profile and predictions, whichever plan wins
        meta["trials"] = {lab: round(t, 6) for lab, t in zip(labels, times)}
        meta["trial_chosen"] = labels[best]
        chosen = dataclasses.replace(plans[best], meta=meta)
        _log.info("plan='auto' keeps %s (%s)", labels[best],
                  ", ".join(f"{lab} {1e3 * t:.0f} ms" for lab, t in zip(labels, times)))
        return chosen


def name_entries(plan: Plan) -> Plan:
    """``plan`` with every compressing entry naming its compressor (format 2).

    A one-compressor plan leaves its entries unnamed, meaning "the plan's
    compressor"; an engine whose config names a compressor (the front ends'
    ``compression="auto"`` starts from onebit until the plan is fixed) would
    give those entries its own. A candidate's plan kept by the trials must
    run with the compressor it was timed with, so its entries say it.
    """
    grads = {n: (dataclasses.replace(g, compressor=plan.compressor, params=dict(plan.params))
                 if g.compress and g.compressor is None else g)
             for n, g in plan.gradients.items()}
    return dataclasses.replace(plan, gradients=grads)


def _check_same_gradients(transport: Any, sizes: Mapping[str, int], timeout: float) -> None:
    """Raise on every rank if the ranks observed different gradient sets."""
    digest = hashlib.sha256(json.dumps(sorted(sizes.items())).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    all_ = [int(t.item()) for t in transport.allgather(mine, timeout)]
    if len(set(all_)) > 1:
        odd: Sequence[int] = [r for r, h in enumerate(all_) if h != all_[0]]
        raise ValueError(f"plan='auto': ranks observed different gradients (ranks {list(odd)} "
                         f"differ from rank 0); every rank must register the same "
                         "names and sizes")


def _rounds(name: str, params: Mapping[str, Any]) -> int:
    """A candidate's number of rounds (a master compressor cannot follow a
    multi-round one: its rounds are reduced, not re-encoded)."""
    from .. import compressors
    from .profiler import candidate

    name, params = candidate(name, params)
    return compressors.get(name, **params).capabilities.rounds


class auto_plan:  # noqa: N801 - a callable used like a function: plan=auto_plan()
    """A plan source for ``EngineConfig(plan=...)``: profile at ``register``, then plan.

    The engine calls it once, collectively, inside ``register`` with its
    transport (idle then), the gradients' sizes in bytes in registration
    order, and its ``EngineConfig``; it profiles the compressor and the link
    on every rank and returns the ``Plan`` rank 0 computed (HiPress Sec. 3.3
    profiles on the target cluster before planning). The front ends turn
    ``plan="auto"`` into one of these.

    Args:
        compressor: the compressor to profile (a registry name, or an
            instance: an error-feedback wrapper is profiled by its inner
            algorithm); None takes the engine's ``config.compressor``.
        params: its parameters (with a name).
        candidates: {name: params} to choose from per gradient (plan format
            2; ``default_candidates`` for the front ends' ``compression="auto"``);
            default: only ``compressor``.
        **options: ``AutoPlanner`` options overriding the quick defaults.

    Example:
        >>> from hipress_like.casync.engine import EngineConfig
        >>> cfg = EngineConfig(compressor="onebit", plan=auto_plan())
    """

    def __init__(self, compressor: Any = None, params: Optional[Mapping[str, Any]] = None,
                 candidates: Optional[Mapping[str, Mapping[str, Any]]] = None, **options: Any):
        self.compressor = compressor
        self.params = dict(params or {})
        self.candidates = None if candidates is None else {k: dict(v or {})
                                                            for k, v in candidates.items()}
        self.options = options

    def __call__(self, transport: Any, sizes: Mapping[str, int], config: Any,
                 shapes: Optional[Mapping[str, Sequence[int]]] = None) -> Plan:
        t0 = time.perf_counter()
        plan = self.planner(config).finalize(transport, dict(sizes), shapes)
        _log.info("rank %d: plan='auto' fixed in %.1f s", transport.rank,
                  time.perf_counter() - t0)
        return plan

    def planner(self, config: Any) -> "AutoPlanner":
        """The ``AutoPlanner`` this source runs for an engine's ``config``: its compressor
        (or this source's), strategy, timeouts and NaN/Inf policy."""
        from .. import compressors
        from ..casync.coordinator import report_len

        comp = self.compressor if self.compressor is not None else config.compressor
        params = self.params or dict(config.params)
        if comp is None:
            comp = "onebit"
        if not isinstance(comp, compressors.Compressor):
            comp = compressors.get(comp, **params)
        inner = getattr(comp, "inner", comp)  # profile the algorithm, not the EF wrapper
        opts = dict(strategy=config.strategy,
                    round_meta_bytes=8 * report_len(config.report_capacity),
                    raw_collective=config.raw_collective, timeout=config.timeout, repeats=2,
                    nonfinite=config.nonfinite,
                    # a quick profile: curves are interpolated beyond these sizes
                    max_profile_bytes=16 << 20, max_link_bytes=4 << 20)
        if config.compressor_back is not None:
            back = config.compressor_back
            if isinstance(back, compressors.Compressor):
                back = getattr(back, "inner", back)
                opts["back"] = (back.name, back.params())
            else:
                opts["back"] = (back, dict(config.params_back))
        opts.update(self.options)
        if self.candidates is not None:
            opts["candidates"] = self.candidates
        return AutoPlanner(inner.name, params=inner.params(), **opts)

    def __repr__(self) -> str:
        return f"auto_plan({self.compressor!r}, candidates={self.candidates!r})"
