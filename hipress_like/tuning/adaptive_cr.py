"""Adaptive compression ratio by multi-objective optimisation (flexible-communication
paper, Sec. 3-E, Eq. 6; after GraVAC's compression gain).

The idea: a lower CR c makes a step cheaper to communicate but loses more of
the gradient; which c is best depends on the network (alpha, beta) and on the
stage of training, so it is searched again whenever either changes:

1. **Compression gain** (Sec. 3-E, after GraVAC): per step
   ``gain = E||g_c||^2 / E||g_e||^2`` with ``g_e`` the error-fed gradient and
   ``g_c`` its compressed part (AR-Topk records both sums in its state:
   ``gain_of_states``). ``GainTracker`` keeps the per-step values and logs them.
2. **Triggers** (Sec. 3-E1): every ``check_every`` steps the link is measured
   again (``measure_link``, a collective); a search starts when alpha or beta
   moved by more than ``link_threshold`` (relative) since the last decision
   (alpha also by more than ``latency_floor``, 1 ms, in absolute terms: on a
   LAN the fitted alpha is a fraction of a millisecond and jumps by 100%
   between two measurements of the same link, while the paper's latencies
   move in milliseconds), or the mean gain of the last window drifted by
   ``gain_threshold`` (10%) or more, or no CR was chosen yet.
3. **Exploration**: the model and optimizer (and whatever ``checkpoint``
   covers: the compressor residuals) are saved in memory; each candidate CR
   (default 0.1, 0.033, 0.011, 0.004, 0.001: c_low = 0.001 scaled by 3 up to
   c_high = 0.1) runs ``explore_iters`` iterations, recording compression
   time, communication time and gain; then the checkpoint is restored, so
   exploring a poor CR costs time but never model quality.
4. **Decision** (Eq. 6, ``choose_cr``): pymoo's NSGA-II minimises
   ``(t_comp, t_sync, 1/gain)`` over the candidates and returns their Pareto
   set; on it the CR with the least time per unit of gain,
   ``(base_time + t_comp + t_sync) / gain``, is taken (``base_time``: the
   step's compute, when known). A uniformly slower network raises every
   ``t_sync``, so this moves to lower CRs, where a normalised knee would not
   move at all.

Every decision is logged at INFO with its reason and kept in
``AdaptiveCR.decisions``. Every number a decision reads is first agreed on by
every rank (``agree``: e.g. an allreduce mean), so every rank switches to the
same CR at the same step.
"""
from __future__ import annotations

import copy
import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["AdaptiveCRConfig", "StepStats", "Trial", "Decision", "GainTracker", "AdaptiveCR",
           "choose_cr", "pareto_indices", "gain_of_states", "set_ratio", "snapshot_torch",
           "CANDIDATES"]

_log = logging.getLogger(__name__)

# Sec. 3-E1: c_low = 0.001 scaled by 3 up to c_high = 0.1.
CANDIDATES = (0.1, 0.033, 0.011, 0.004, 0.001)


@dataclass(frozen=True)
class AdaptiveCRConfig:
    """Settings of the adaptive CR search (Sec. 3-E1).

    Attributes:
        candidates: CRs to explore, each in (0, 1].
        explore_iters: iterations per candidate (the paper uses 10).
        check_every: steps between link measurements and trigger checks.
        link_threshold: relative change of alpha or beta that triggers a search.
        latency_floor: seconds; a change of alpha smaller than this never
            triggers one (measurement noise on a fast network).
        gain_threshold: relative drift of the mean gain that triggers one (10%).
        window: steps whose mean gain is compared.
        base_time: seconds of a step's compute, added to the time per gain.
        seed: NSGA-II's seed (the same on every rank: the same decision).
    """

    candidates: Tuple[float, ...] = CANDIDATES
    explore_iters: int = 10
    check_every: int = 20
    link_threshold: float = 0.25
    latency_floor: float = 1e-3
    gain_threshold: float = 0.10
    window: int = 5
    base_time: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        cands = tuple(float(c) for c in self.candidates)
        if not cands:
            raise ValueError("candidates must hold at least one CR")
        bad = [c for c in cands if not (0.0 < c <= 1.0) or math.isnan(c)]
        if bad:
            raise ValueError(f"every candidate CR must be in (0, 1], found {bad}; e.g. "
                             f"{list(CANDIDATES)}")
        object.__setattr__(self, "candidates", cands)
        for name in ("explore_iters", "check_every", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, found {v!r}")
        for name in ("link_threshold", "latency_floor", "gain_threshold", "base_time"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, found {v!r}")


@dataclass(frozen=True)
class StepStats:
    """What one training step measured: seconds compressing (encode, decode, merge,
    write back), seconds communicating, and the compression gain."""

    t_comp: float
    t_sync: float
    gain: float


@dataclass(frozen=True)
class Trial:
    """A candidate CR's mean measurements over its exploration iterations."""

    cr: float
    t_comp: float
    t_sync: float
    gain: float

    def objectives(self) -> Tuple[float, float, float]:
        """Eq. 6's objectives, all minimised: (t_comp, t_sync, 1/gain)."""
        return self.t_comp, self.t_sync, 1.0 / max(self.gain, 1e-12)


@dataclass
class Decision:
    """One adaptive-CR decision: when, why, from which CR to which, on what evidence."""

    step: int
    reason: str
    cr_before: Optional[float]
    cr_after: float
    trials: List[Trial] = field(default_factory=list)
    pareto: List[float] = field(default_factory=list)


def pareto_indices(objs: Sequence[Sequence[float]], seed: int = 0) -> List[int]:
    """Indices of the non-dominated candidates of ``objs`` found by NSGA-II (pymoo).

    The decision variable is the candidate's index (an integer), the
    objectives its measured values; NSGA-II (Deb et al. 2002) keeps the
    non-dominated ones. With a few candidates the population covers them all.

    Raises:
        ImportError: pymoo is not installed (``pip install pymoo``).
    """
    import numpy as np
    from pymoo.algorithms.moo.nsga2 import NSGA2
    from pymoo.core.problem import ElementwiseProblem
    from pymoo.operators.crossover.sbx import SBX
    from pymoo.operators.mutation.pm import PM
    from pymoo.operators.repair.rounding import RoundingRepair
    from pymoo.operators.sampling.rnd import IntegerRandomSampling
    from pymoo.optimize import minimize

    table = np.asarray(objs, dtype=float)
    k = len(table)
    if k == 1:
        return [0]

    class _Candidates(ElementwiseProblem):
        def __init__(self):
            super().__init__(n_var=1, n_obj=table.shape[1], xl=0, xu=k - 1, vtype=int)

        def _evaluate(self, x, out, *args, **kwargs):
            out["F"] = table[int(round(float(x[0])))]

    algo = NSGA2(pop_size=max(8, 2 * k), sampling=IntegerRandomSampling(),
                 crossover=SBX(prob=0.9, eta=3.0, vtype=float, repair=RoundingRepair()),
                 mutation=PM(prob=1.0, eta=3.0, vtype=float, repair=RoundingRepair()),
                 eliminate_duplicates=True)
    res = minimize(_Candidates(), algo, ("n_gen", 30), seed=seed, verbose=False)
    xs = np.atleast_2d(res.X).reshape(-1)
    return sorted({int(round(float(x))) for x in xs})


def choose_cr(trials: Sequence[Trial], base_time: float = 0.0, seed: int = 0
              ) -> Tuple[float, List[float]]:
    """Eq. 6: the Pareto set of ``(t_comp, t_sync, 1/gain)`` by NSGA-II, then on it the
    CR with the least ``(base_time + t_comp + t_sync) / gain`` (ties: the larger CR).

    Returns:
        (the chosen CR, the CRs of the Pareto set).

    Example:
        >>> ts = [Trial(0.1, 0.01, 0.50, 0.9), Trial(0.01, 0.01, 0.06, 0.6),
        ...       Trial(0.001, 0.01, 0.02, 0.1)]
        >>> choose_cr(ts)[0]
        0.01
    """
    if not trials:
        raise ValueError("choose_cr needs at least one trial")
    front = pareto_indices([t.objectives() for t in trials], seed=seed)
    score = {i: (base_time + trials[i].t_comp + trials[i].t_sync) / max(trials[i].gain, 1e-12)
             for i in front}
    best = min(front, key=lambda i: (score[i], -trials[i].cr))
    return trials[best].cr, [trials[i].cr for i in front]


class GainTracker:
    """Per-step compression gain ``E||g_c||^2 / E||g_e||^2``, logged at DEBUG.

    Example:
        >>> g = GainTracker()
        >>> g.add(0, 0.5); g.add(1, 0.7)
        >>> g.mean(2)
        0.6
    """

    def __init__(self) -> None:
        self.history: List[Tuple[int, float]] = []

    def add(self, step: int, gain: float) -> None:
        """Record ``gain`` of ``step``."""
        self.history.append((int(step), float(gain)))
        _log.debug("step %d: compression gain %.4f", step, gain)

    def mean(self, window: int) -> Optional[float]:
        """Mean gain of the last ``window`` steps (None before any)."""
        if not self.history:
            return None
        return statistics.fmean(g for _, g in self.history[-window:])


def gain_of_states(states: Mapping[str, Mapping[str, Any]]) -> Optional[float]:
    """The step's gain over every gradient whose state records ``"gain"``:
    ``sum ||g_c||^2 / sum ||g_e||^2`` (AR-Topk writes both terms each step).
    None when no state records it."""
    sent = total = 0.0
    seen = False
    for st in states.values():
        g = st.get("gain") if isinstance(st, Mapping) else None
        if g is None and isinstance(st, Mapping) and isinstance(st.get("inner"), Mapping):
            g = st["inner"].get("gain")
        if g is not None:
            sent, total, seen = sent + float(g[0]), total + float(g[1]), True
    if not seen:
        return None
    return sent / total if total > 0 else 1.0


def set_ratio(compressor: Any, cr: float) -> None:
    """Set the compression ratio of a live compressor (or the one error feedback wraps).

    The engine reads ``ratio`` at every encode and sparse payloads may change
    size between steps, so the next step uses ``cr``.

    Raises:
        ValueError: ``cr`` outside (0, 1], or a compressor without a ratio.
    """
    if not (isinstance(cr, (int, float)) and 0.0 < cr <= 1.0):
        raise ValueError(f"a compression ratio must be in (0, 1], found {cr!r}")
    target = compressor
    while not hasattr(target, "ratio") and hasattr(target, "inner"):
        target = target.inner
    if not hasattr(target, "ratio"):
        raise ValueError(f"compressor {getattr(compressor, 'name', compressor)!r} has no "
                         "compression ratio to adapt")
    target.ratio = float(cr)


def _rel(new: float, old: float) -> float:
    return abs(new - old) / old if old > 0 else (0.0 if new == old else math.inf)


class AdaptiveCR:
    """The adaptive CR controller (module docstring); the training loop drives it.

    Args:
        config: ``AdaptiveCRConfig``.
        set_cr: switch the run to a CR (e.g. ``lambda c: set_ratio(engine.compressor, c)``).
        checkpoint: return an in-memory snapshot of the training state;
            ``restore`` puts one back (``snapshot_torch`` builds both for a model
            and optimizer).
        measure_link: a collective returning the link's ``(alpha, beta)``
            (e.g. from ``tuning.link.measure_link``), or None to trigger
            on the gain alone.
        agree: make a list of floats equal on every rank (an allreduce mean);
            the identity for one process.
        initial_cr: the CR the run starts with.

    Example (the loop):
        >>> ctl = AdaptiveCR(AdaptiveCRConfig(), set_cr=..., checkpoint=...,
        ...                  restore=...)  # doctest: +SKIP
        >>> for step in range(steps):  # doctest: +SKIP
        ...     ctl.observe(step, train_step())
        ...     reason = ctl.should_search(step)
        ...     if reason:
        ...         ctl.search(step, reason, lambda n: [train_step() for _ in range(n)])
    """

    def __init__(self, config: AdaptiveCRConfig, *, set_cr: Callable[[float], None],
                 checkpoint: Callable[[], Any], restore: Callable[[Any], None],
                 measure_link: Optional[Callable[[], Tuple[float, float]]] = None,
                 agree: Callable[[List[float]], List[float]] = lambda xs: list(xs),
                 initial_cr: Optional[float] = None) -> None:
        self.config = config
        self._set_cr = set_cr
        self._checkpoint = checkpoint
        self._restore = restore
        self._measure_link = measure_link
        self._agree = agree
        self.cr = initial_cr
        self.gains = GainTracker()
        self.decisions: List[Decision] = []
        self._ref_link: Optional[Tuple[float, float]] = None
        self._ref_gain: Optional[float] = None
        self._pending_link: Optional[Tuple[float, float]] = None
        self._search: Optional[Dict[str, Any]] = None  # a search begun at a step boundary

    def observe(self, step: int, stats: StepStats) -> None:
        """Record a training step's gain (exploration steps are not observed)."""
        self.gains.add(step, stats.gain)

    def should_search(self, step: int) -> Optional[str]:
        """Every ``check_every`` steps (collective then: every rank calls it at the same
        steps): the reason to search for a CR now, or None.

        Reasons: no CR chosen yet; alpha or beta moved by more than
        ``link_threshold`` (alpha also by more than ``latency_floor``); the mean
        gain drifted by ``gain_threshold`` or more.
        """
        cfg = self.config
        if self.cr is not None and self.decisions and (step + 1) % cfg.check_every:
            return None
        link = self._measure_link() if self._measure_link is not None else None
        g = self.gains.mean(cfg.window)
        agreed = self._agree([g if g is not None else -1.0])[0]
        gain = None if agreed < 0 else agreed
        reasons = []
        if not self.decisions:
            reasons.append("no CR chosen yet")
        if link is not None and self._ref_link is not None:
            (a, b), (a0, b0) = link, self._ref_link
            if _rel(a, a0) > cfg.link_threshold and abs(a - a0) > cfg.latency_floor:
                reasons.append(f"latency changed {a0 * 1e3:.3g} -> {a * 1e3:.3g} ms "
                               f"({_rel(a, a0):+.0%} > {cfg.link_threshold:.0%})")
            if _rel(b, b0) > cfg.link_threshold:
                reasons.append(f"bandwidth changed {8e-6 / b0:.4g} -> {8e-6 / b:.4g} Mbit/s "
                               f"({_rel(b, b0):.0%} > {cfg.link_threshold:.0%})")
        if gain is not None and self._ref_gain is not None and \
                _rel(gain, self._ref_gain) >= cfg.gain_threshold:
            reasons.append(f"compression gain drifted {self._ref_gain:.3g} -> {gain:.3g} "
                           f"({_rel(gain, self._ref_gain):.0%} >= {cfg.gain_threshold:.0%})")
        if link is not None and self._ref_link is None:
            self._ref_link = link
        if not reasons:
            _log.debug("step %d: CR %s kept (link %s, gain %s)", step, self.cr, link, gain)
            return None
        self._pending_link = link
        return "; ".join(reasons)

    def state_dict(self) -> Dict[str, Any]:
        """The CR chosen and the references the triggers compare with (a running
        search is not saved: the CR in force when it began is)."""
        cr = self._search["before"] if self._search is not None else self.cr
        return {"cr": cr, "ref_gain": self._ref_gain,
                "ref_link": None if self._ref_link is None else list(self._ref_link),
                "decisions": len(self.decisions)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore ``state_dict``: the CR (set through ``set_cr``) and the references."""
        if d.get("cr") is not None:
            self.cr = float(d["cr"])
            self._set_cr(self.cr)
        self._ref_gain = d.get("ref_gain")
        link = d.get("ref_link")
        self._ref_link = None if link is None else (float(link[0]), float(link[1]))
        if d.get("decisions"):  # a CR was chosen before: no search for "no CR chosen yet"
            self.decisions.append(Decision(-1, "restored from a checkpoint", None,
                                           float(d["cr"]) if d.get("cr") else 0.0))

    # -- the search, driven by the loop (``search``) or at step boundaries (``begin``) --
    @property
    def searching(self) -> bool:
        """Whether a search begun with ``begin`` is running (``feed`` its steps)."""
        return self._search is not None

    @property
    def running_cr(self) -> Optional[float]:
        """The candidate CR a running search is trying (None when none runs)."""
        return None if self._search is None else self._search["cr"]

    def begin(self, step: int, reason: str) -> float:
        """Start a search at a step boundary: checkpoint the training state and set the
        first candidate CR (returned); ``feed`` then takes each step's statistics.
        This is ``search`` turned inside out, for a caller that cannot run training
        iterations itself (``plan="adaptive"``, ``tuning/online.py``)."""
        if self._search is not None:
            raise RuntimeError("a search is already running: feed() it to its end")
        self._search = {"snap": self._checkpoint(), "before": self.cr, "step": step,
                        "reason": reason, "queue": list(self.config.candidates),
                        "trials": [], "stats": [], "cr": None}
        return self._next_candidate()

    def _next_candidate(self) -> float:
        sr = self._search
        self._restore(sr["snap"])
        sr["cr"], sr["stats"] = sr["queue"].pop(0), []
        self._set_cr(sr["cr"])
        return sr["cr"]

    def feed(self, stats: StepStats) -> Optional[Decision]:
        """One step's statistics under the running candidate (collective after every
        ``explore_iters``-th: the means are agreed). Returns the ``Decision`` when
        the last candidate's steps are in (the checkpoint restored, the chosen CR
        set), else None."""
        sr = self._search
        if sr is None:
            raise RuntimeError("no search is running (begin() first)")
        sr["stats"].append(stats)
        if len(sr["stats"]) < self.config.explore_iters:
            return None
        self._trial(sr["stats"])
        if sr["queue"]:
            self._next_candidate()
            return None
        return self._finish()

    def _trial(self, stats: Sequence[StepStats]) -> None:
        sr = self._search
        if not stats:
            raise ValueError("run_iters returned no step statistics")
        mean = [statistics.fmean(getattr(s, f) for s in stats)
                for f in ("t_comp", "t_sync", "gain")]
        t_comp, t_sync, gain = self._agree(mean)
        sr["trials"].append(Trial(sr["cr"], t_comp, t_sync, gain))
        _log.info("adaptive CR: explored %g: t_comp %.3g s, t_sync %.3g s, gain %.3g",
                  sr["cr"], t_comp, t_sync, gain)

    def _finish(self) -> Decision:
        sr, self._search = self._search, None
        cfg, trials = self.config, sr["trials"]
        self._restore(sr["snap"])
        chosen, front = choose_cr(trials, cfg.base_time, cfg.seed)
        self._set_cr(chosen)
        self.cr = chosen
        self._ref_gain = next(t.gain for t in trials if t.cr == chosen)
        if self._pending_link is not None:
            self._ref_link = self._pending_link
        d = Decision(sr["step"], sr["reason"], sr["before"], chosen, trials, front)
        self.decisions.append(d)
        _log.info("adaptive CR at step %d: %s -> %g because %s (Pareto set %s)", sr["step"],
                  "none" if sr["before"] is None else f"{sr['before']:g}", chosen,
                  sr["reason"], front)
        return d

    def search(self, step: int, reason: str,
               run_iters: Callable[[int], Sequence[StepStats]]) -> Decision:
        """Explore every candidate from one in-memory checkpoint, restore it, choose (Eq. 6).

        Args:
            step: the training step (for the log).
            reason: why (``should_search``'s answer).
            run_iters: run n training iterations at the current CR and return
                their ``StepStats``.

        Returns:
            The ``Decision`` (also appended to ``decisions`` and logged at INFO).
        """
        self.begin(step, reason)
        while True:
            self._trial(list(run_iters(self.config.explore_iters)))
            if not self._search["queue"]:
                return self._finish()
            self._next_candidate()


def snapshot_torch(model: Any, optimizer: Any, extra: Optional[Callable[[], Any]] = None,
                   load_extra: Optional[Callable[[Any], None]] = None
                   ) -> Tuple[Callable[[], Any], Callable[[Any], None]]:
    """``(checkpoint, restore)`` for a torch model and optimizer, in memory (deep copies),
    plus ``extra``/``load_extra`` for other state. ``load_extra`` runs first on restore,
    so it can put back settings the optimizer's state was saved under (the CR: an
    engine refuses compressor state saved with other parameters)."""
    def checkpoint() -> Dict[str, Any]:
        return {"model": copy.deepcopy(model.state_dict()),
                "opt": copy.deepcopy(optimizer.state_dict()),
                "extra": copy.deepcopy(extra()) if extra is not None else None}

    def restore(snap: Mapping[str, Any]) -> None:
        if load_extra is not None:
            load_extra(copy.deepcopy(snap["extra"]))
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(copy.deepcopy(snap["opt"]))

    return checkpoint, restore

