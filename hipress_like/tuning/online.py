"""``plan="adaptive"``: re-plan at step boundaries as the measured link changes.

``plan="auto"`` (``auto.py``) fixes the plan once, from a start-up profile,
as HiPress plans once (Sec. 3.3). Here the plan follows the link while
training runs:

1. Every ``check_every`` steps the ranks measure the link, by default with
   a probe (``Adaptive(measure="probe")``): ``tuning.link.measure_link``'s
   "all" pattern (every rank sends to its ring successor at once, as
   CaSync's bulk rounds do) at two sizes, 4 KB and one whose transfer takes
   about ``probe_s`` at the last measured bandwidth (the profile's at the
   first check; 64 KB to 4 MB; probed once more when the
   large message took under half of that; four times that on a link four or
   more times slower than the reference, where a return to the fast link
   would hide in the host's noise), the median of three timings of
   the slowest rank per size, fitted to ``t = alpha + m beta``; rank 0's fit is
   broadcast, so every rank decides from the same numbers. The probe
   measures the same exchange whatever the plan; its size follows the link
   so that the large message's wire time stands above the host's noise (a
   fixed 256 KB read 10 Gbit/s as anything from 2 to 1000 Gbit/s here)
   without costing a slow link more than a few milliseconds. A check
   probes only when the step time moved (``_should_probe``: the ranks
   agree on the step time; a probe when it moved by more than
   ``margin`` since the last probe, after a switch, and at least every
   ``probe_every`` checks, twice that under a plan that compresses
   nothing), and the step times ride the status words of a replayed
   step (``Engine.share``), so a steady job pays nothing a check but
   the periodic probe (an allgather where steps are not replayed). With
   ``measure="timeline"`` each rank instead reads what its engine measured
   in every step (``casync.timeline``: every bulk round's bytes and
   seconds, every fused allreduce bucket's) into a running estimate
   (``link_estimate.LinkEstimator``: a relative-error least-squares fit per
   step, smoothed by an exponentially weighted moving average, the
   smoothing TCP uses for its round-trip time, RFC 6298 Sec. 2), and the
   ranks agree on the median (``agree``). That costs no extra traffic, but
   what it measures depends on the plan: once gradients travel compressed,
   the rounds are small and CPU-bound, and on a 2-core host their estimate
   fell from the 1 Gbit/s the uncompressed buckets had shown to a third of
   it and stayed there when the link went back to 10 Gbit/s (bench/
   adaptive.py), so the plan never switched back.
2. The first measurement is the *reference* (with probes, the one of median
   bandwidth of three): the network the profile was measured on. Later
   ones move the profile's link fits by their change from it
   (``OnlinePlanner.calibrated``: latency shifted, bandwidth scaled), since
   the profile's fits include costs a bare exchange does not.
3. The cost model (``cost_model.Planner``, per gradient over the
   candidates the profile holds) prices the current plan on the moved
   profile and makes its best plan there. The plan switches only when both
   (a) the current or the best plan's predicted time moved by more than
   ``margin`` since the link the plan was decided on, and (b) the best plan is predicted
   faster than it by more than ``margin`` (hysteresis on the input and on
   the gain: noise does not flap the plan), and fewer than
   ``max_switches`` switches happened (``should_switch``).
4. A switch is ``Engine.set_plan`` on every rank at the same step boundary,
   which carries compressor state where a gradient's compressor and
   partitions stay the same and resets (and logs) it elsewhere. The switch
   is logged with its numbers and added to the engine's timeline as a
   ``plan_switch`` event; ``OnlinePlanner.history`` keeps every check.
5. A switch is a trial, judged by measured step times, not by the model
   that proposed it (``Adaptive(verify=...)``): ``AFTER_STEPS`` steps after
   it the ranks agree (median over ranks) on the median wall time of a step
   before the switch and after it. A plan that measured slower than the one
   it replaced by more than ``margin`` is reverted; the reverted plan is
   measured in turn, and when it is slower still than the plan it left (the
   steps before the switch were taken on a link that has since changed),
   the switch is restored and kept. A revert that stands refuses that plan
   while the link stays within ``margin`` of where it measured slower (the
   refusal is priced as the switch rule is: by how far the link moved the
   refused plan's predicted time). No check runs while a trial is open.
6. A checkpoint holds the active plan and the controller (``state_dict``:
   plan, profile, candidates, reference, the link of the last decision,
   switches, refused plans, estimate, history; the PyTorch optimizer saves it under
   ``"hipress_adaptive"``, the TensorFlow and Gluon faces in their compressor-state
   envelope under ``"adaptive"``, ``adapters/checkpoint.ADAPTIVE``). Loading
   switches to that plan before the compressor state is restored, so a job
   resumed after a switch goes on with the switched plan and its state, as
   if it had not stopped.
7. **Exploration** (``Adaptive(explore=...)``, on by default with measured
   links; ``tuning/explore.py``): a check whose agreed bandwidth moved by 2x
   or more since the link decided on (a probe that reads such a move is
   taken again and the second reading kept, ``_probes_twice``; or by 1.5x
   at two checks in a row: a
   probe on a shaped link read 1.5x apart at one rate; its latency swings
   too much to trigger anything), or whose agreed step time moved from the
   decided plan's by more than three times ``margin`` at two checks in a
   row while the
   link did not (the work changed: a straggling host, a CPU hog), does not
   trust the model's single answer: the model's plan on the link, its plans
   on the link with a hundredth, a quarter and four times the bandwidth,
   that plan with nothing compressed and with one partition per
   gradient, and each candidate compressor laid out by the engine's default
   size rule (distinct, unlike the plan in force, priced within 2x of the
   best) each run ``explore_steps`` real
   steps; the ranks agree on each window's mean step time (its first step,
   the switch's rebuild, left out), and the fastest measured plan is kept
   (the plan in force unless another beat it by more than ``margin``). The
   steps decide, so the plan follows the compute as well as the link, and a
   plan the model priced wrongly is not kept (the model's plan at 10 Gbit/s
   was 1.6x slower than "nothing compressed" on the 2-core test host).
   Explorations are capped (``max_explorations``), a kept change counts as a
   switch, and trials (item 5) have nothing left to judge. At its end the
   link is measured again (``_moved_during``; a probe reading a move is
   taken twice): when it moved by 2x or more since the exploration began,
   the windows timed the plans on two links, so the exploration is void:
   the plan in force before it comes back and a new one starts on the new
   link (``_explore_void``). A link that reads faster while the plan in force
   compresses nothing starts no exploration (``_compresses_nothing``: no plan
   gains more from a faster link). With
   ``explore_start`` (off by default) the first check explores too: the plan
   chosen at start-up, priced on a start-up profile, runs against the
   alternatives on the link measured then, the plan in force timed in a
   window of its own after them (the steps before carry the job's warm-up);
   no later check explores a link that does not move.
8. **AR-Topk's ratio** (``Adaptive(ratio=...)``; ``tuning/ratio_search.py``):
   with AR-Topk (``star_topk``, ``var_topk``; or any top-k family compressor
   given ``Adaptive(ratio=AdaptiveCRConfig(...))``: ``topk`` is what the cost
   model's collective selection puts in AR-Topk's place as an Allgather of
   top-k, and records the gain when searched), the flexible-communication paper's
   ratio controller (``adaptive_cr.AdaptiveCR``, Sec. 3-E, Eq. 6) runs in
   the same mechanism: it observes every step's compression and
   communication seconds (the timeline) and gain (the compressor states),
   and searches the ratio when none was chosen yet, when the gain drifted,
   or when a check saw the link move: each candidate ratio runs a few real
   steps from a snapshot of the training state the face gives
   (``for_engine(..., snapshot=...)``), the snapshot is restored, and the
   ratio on NSGA-II's Pareto set with the least time per unit of gain is set.
   One decision runs at a time: no check or exploration during a search,
   no search during an exploration or a trial. A checkpoint taken during a
   search holds the state being explored and the ratio from before it.

The compressor curves come from a ``Profile``: the one ``plan="auto"``
measured at ``register`` (kept in the plan's ``meta["profile"]``), or one
given as ``Adaptive(profile=...)`` (a ``hipress-profile profile`` file),
which also plans the first plan without profiling.

``Adaptive(estimate=...)`` replaces the timeline's measurement by a
callable ``estimate(step, rank) -> Link | None``: for tests (a link that
changes on a schedule, without root or ``tc``) and what-if runs. The
agreement and the decision run as they do on measured numbers.

Example:
    >>> from hipress_like.tuning.online import Adaptive, should_switch
    >>> Adaptive(check_every=10, margin=0.2).check_every
    10
    >>> should_switch(1.0, 0.85, margin=0.1, switches=0, max_switches=3)
    True
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..cost_model.model import Link
from ..cost_model.plan import Plan
from ..cost_model.planner import Planner
from ..cost_model.profile import Profile
from .explore import Exploration, alternatives, plan_key, size_rule
from .link import measure_link
from .link_estimate import LinkEstimator, agree, agree_values, timeline_samples
from .online_pricing import (  # noqa: F401 - re-exported: this module's public names
    adaptive_plan,
    best_plan,
    compressor_key,
    planners_for,
    price_plan,
    profile_plan,
    source_for,
)
from .online_settings import (  # noqa: F401 - re-exported
    AFTER_STEPS,
    MEASURES,
    PROBE_FAR,
    PROBE_MAX,
    PROBE_MIN,
    PROBE_ROUNDS,
    PROBE_SMALL,
    STATE_FORMAT,
    STATE_VERSION,
    Adaptive,
    should_switch,
)
from .ratio_search import RatioSearch

# a bandwidth ratio the probe reads between two checks at one rate on a shaped link: a move
# beyond it must hold at two checks in a row to start an exploration (2x starts one at once)
LINK_NOISE = 1.5
KEPT = 8  # decisions remembered for recall (``OnlinePlanner.kept``)
REFERENCE_PROBES = 3  # probes the reference link is the median of (``_reference_link``)

__all__ = ["Adaptive", "OnlinePlanner", "should_switch", "price_plan", "profile_plan",
           "source_for", "adaptive_plan", "AFTER_STEPS"]

_log = logging.getLogger(__name__)

class OnlinePlanner:
    """Watches an engine after every step and switches its plan when it pays.

    Args:
        settings: the ``Adaptive`` knobs.
        profile: compressor curves and link fits (moved by each agreed estimate's
            change from the reference, ``calibrated``).
        labels: the profile's compressors to choose from per gradient.
        sizes: {gradient: bytes}, as registered.
        n: world size; strategy, raw_collective: the engine's.
        timeout: seconds for the agreement's allgather.

    Attributes:
        history: one dict per check: step, agreed link, predicted seconds of
            the current and the best plan, the predicted gain, and whether it
            switched (with the gradients whose state was kept or reset, and the
            median wall time of a step before the switch and of the first
            ``AFTER_STEPS`` after it: ``step_s_before``, ``step_s_after``); and
            one per judged trial (``judged``, ``verdict``: kept, reverted,
            restored or revert stands, with the agreed step times).
        switches: switches made (a revert or a restore is not counted).
        reverts: switches reverted because they measured slower.
        rejected: (plan, link, step) of every revert that stood: that plan is
            refused while the link stays within the margin of that link.
        kept: (link, plan, step) of the last ``KEPT`` decisions (the reference
            check's plan, each exploration's choice): an exploration on a link
            within 2x of one of them tries that plan first (recall).
    """

    def __init__(self, settings: Adaptive, profile: Profile, labels: Sequence[str],
                 sizes: Mapping[str, int], n: int, strategy: str, *,
                 raw_collective: bool = True, timeout: float = 300.0) -> None:
        if not labels:
            raise ValueError("plan='adaptive' needs at least one compressor to choose from")
        self.settings = settings
        self.profile = profile
        self.labels = list(labels)
        self.sizes = dict(sizes)
        self.n, self.strategy, self.raw_collective = n, strategy, bool(raw_collective)
        self.timeout = timeout
        self.estimator = LinkEstimator(settings.gain)
        self.history: List[Dict[str, Any]] = []
        self.switches = 0
        self.reference: Optional[Link] = None  # the first agreed estimate
        self._steps_s: List[float] = []  # wall seconds of the last steps (``_time_step``)
        self._last_t: Optional[float] = None
        self._after_switch: Optional[Dict[str, Any]] = None
        self.decided_on: Optional[Link] = None  # the estimate of the last decision
        self._trial: Optional[Dict[str, Any]] = None  # the open switch's trial (verify)
        self.rejected: List[Tuple[str, Link, int]] = []  # (plan key, link, switch step)
        self._mark_events = 0  # the timeline read so far (``Timeline.since``)
        self._probed: Optional[Link] = None  # the last probe's link (sizes the next probe)
        self._probe_step_s: Optional[float] = None  # agreed step time at the last probe
        self._checks_unprobed = 0
        self._planners_cache: Dict[Any, List[Planner]] = {}  # ``planners``, by link
        self.reverts = 0
        self._exploration: Optional[Exploration] = None  # the open one (``explore``)
        self.explorations = 0
        self._settled_s: Optional[float] = None  # agreed step time of the plan decided on
        self._work_moved = 0  # checks in a row whose step time moved from it
        self._link_moves = 0  # checks in a row whose link moved by more than the margin
        self._probe_moves = 0  # checks in a row whose step time moved from the last probe's
        self._blind: Tuple[Any, bool] = (None, False)  # ``_link_blind``'s (key, answer)
        self._agreed_mean: Optional[float] = None  # ``_agree_step_times``'s mean
        self.ratio: Optional[RatioSearch] = None  # AR-Topk's ratio search (``for_engine``)
        self._link_moved = False  # a check saw the link move: the ratio search's trigger
        self._reference_planners = planners_for(profile, self.labels, n, strategy,
                                                self.raw_collective)
        # (link, plan, step) of each decision: the plan kept on that link, recalled as a
        # candidate when an exploration starts on a link like it (``explore.alternatives``)
        self.kept: List[Tuple[Link, Plan, int]] = []

    def _keep(self, link: Link, plan: Optional[Plan], step: int) -> None:
        """Remember that ``plan`` was decided on ``link`` (the newest of each plan, at most
        ``KEPT``)."""
        if plan is None:
            return
        key = plan_key(plan)
        self.kept = [k for k in self.kept if plan_key(k[1]) != key][-(KEPT - 1):]
        self.kept.append((link, plan, step))

    def _recalled(self, link: Link) -> List[Tuple[str, Plan]]:
        """The kept plans decided on a link within 2x of ``link``'s bandwidth, newest
        first."""
        return [(f"kept at step {at}", plan) for x, plan, at in reversed(self.kept)
                if max(x.bandwidth / link.bandwidth, link.bandwidth / x.bandwidth) < 2]

    @classmethod
    def for_engine(cls, engine: Any, settings: Adaptive,
                   snapshot: Any = None) -> Optional["OnlinePlanner"]:
        """The online planner of a registered engine, or None (logged) when there is
        nothing to adapt: one rank, or no plan or profile (nothing is compressed).

        Args:
            engine: the registered engine.
            settings: the ``Adaptive`` knobs.
            snapshot: the face's ``(checkpoint, restore)`` of its training state
                (parameters and optimizer state, in memory), which AR-Topk's ratio
                search restores after trying each ratio; ``ratio_search.TRAIN_ON``:
                the search's steps train on; None: no ratio search.
        """
        plan = engine.plan
        profile = settings.load_profile()
        if profile is None and plan is not None and "profile" in plan.meta:
            profile = Profile.from_dict(plan.meta["profile"])
        if engine.size < 2 or plan is None or profile is None:
            _log.info("plan='adaptive': nothing to adapt (%s); the plan stays fixed",
                      "one rank" if engine.size < 2 else "no profiled plan: nothing to "
                      "compress")
            return None
        labels = list(plan.meta.get("candidates") or [])
        if not labels:
            mine = compressor_key(plan.compressor, plan.params)
            labels = [k for k, c in profile.compressors.items()
                      if compressor_key(c.name, c.params) == mine][:1]
        if not labels:
            raise ValueError(f"plan='adaptive': the profile has no curves for the plan's "
                             f"compressor {plan.compressor!r} (it has "
                             f"{sorted(profile.compressors)}); profile that compressor")
        cfg = engine.config
        sizes = engine.gradient_sizes
        online = cls(settings, profile, labels, sizes, engine.size, cfg.strategy,
                     raw_collective=cfg.raw_collective, timeout=cfg.timeout)
        online.ratio = RatioSearch.for_engine(engine, settings.ratio, snapshot, cfg.timeout)
        return online

    def _time_step(self, step: int) -> None:
        """Record the wall time of the step just done (from the previous call); once
        ``AFTER_STEPS`` steps ran after a switch, report their median beside the one
        before it (the switch's ``history`` entry gets ``step_s_after``)."""
        now = time.perf_counter()
        if self._last_t is not None:
            self._steps_s.append(now - self._last_t)
            s = self.settings
            del self._steps_s[:-max(AFTER_STEPS, s.check_every, s.explore_steps)]
        self._last_t = now
        rec = self._after_switch
        if rec is not None and len(self._steps_s) >= AFTER_STEPS:
            rec["step_s_after"] = self._median_step()
            self._after_switch = None
            _log.info("plan='adaptive': the %d steps after the switch at step %d took %.2f ms "
                      "each (median), %.2f ms before it", AFTER_STEPS, rec["step"],
                      1e3 * rec["step_s_after"], 1e3 * (rec["step_s_before"] or math.nan))

    def _median_step(self, n: int = AFTER_STEPS) -> Optional[float]:
        xs = sorted(self._steps_s[-n:])
        return xs[len(xs) // 2] if xs else None

    def calibrated(self, link: Link) -> Profile:
        """The profile moved to an agreed estimate ``link``, relative to the reference.

        The first agreed estimate is the reference: the network the profile
        was measured on. What the engine's rounds measure includes costs a
        bare link timing does not (coordination, copies), so the estimate
        is used as a change, not as a value: every link fit of the profile
        (all links, one link, the allreduce, the timed lane) gets the
        latency's difference added and its bandwidth scaled by the
        bandwidths' ratio. The compressor curves are CPU work and stay.
        """
        ref = self.reference
        if ref is None:
            raise RuntimeError("no reference estimate yet (the first check sets it)")
        d_lat, r_bw = link.latency - ref.latency, link.bandwidth / ref.bandwidth

        def move(x: Optional[Link]) -> Optional[Link]:
            return None if x is None else Link(max(0.0, x.latency + d_lat), x.bandwidth * r_bw)

        p = self.profile
        return dataclasses.replace(p, link=move(p.link), link_one=move(p.link_one),
                                   allreduce=move(p.allreduce), lane=move(p.lane))

    def planners(self, link: Link) -> List[Planner]:
        """One planner per candidate on the profile moved to ``link``. Each keeps the
        engine's cost beyond Eq. 2 fitted on the reference network (refitting the
        timings taken there against another link would cancel the link's change).
        The planners of the last few links are kept: a check prices the plan on the
        link of the last decision every time."""
        key = (link, self.reference, tuple(self.labels), id(self.profile))
        ps = self._planners_cache.get(key)
        if ps is None:
            ps = planners_for(self.calibrated(link), self.labels, self.n, self.strategy,
                              self.raw_collective)
            for p, r in zip(ps, self._reference_planners):
                p.engine_term = r.engine_term
            self._planners_cache[key] = ps
            while len(self._planners_cache) > 4:
                del self._planners_cache[next(iter(self._planners_cache))]
        return ps

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self, engine: Any) -> Dict[str, Any]:
        """What a resumed job needs to go on as this one would: the active plan, the
        profile and candidates it is priced on, the reference link and the link of the
        last decision, the switches made and the plans refused after a revert, the
        running estimate and the history.

        Plans, profiles and the history travel as JSON strings, so the dict holds
        only strings, numbers and lists (``torch.load(weights_only=True)`` reads it).
        The agreed fields are equal on every rank; the running estimate is this
        rank's (a resumed rank starts from the saving rank's, and the next check's
        median agrees again).
        """
        def link(x: Optional[Link]) -> Optional[List[float]]:
            return None if x is None else [x.latency, x.bandwidth]

        est = self.estimator
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "world_size": self.n,
                "plan": json.dumps(engine.plan.to_dict(), sort_keys=True),
                "profile": json.dumps(self.profile.to_dict(), sort_keys=True),
                "labels": list(self.labels), "switches": self.switches,
                "reverts": self.reverts,
                "rejected": [[k, link(x), at] for k, x, at in self.rejected],
                "reference": link(self.reference), "decided_on": link(self.decided_on),
                "estimate": None if est.alpha is None else [est.alpha, est.beta, est.steps],
                "explorations": self.explorations, "settled_s": self._settled_s,
                "ratio": None if self.ratio is None else self.ratio.state_dict(),
                "kept": [[link(x), json.dumps(p.to_dict(), sort_keys=True), at]
                         for x, p, at in self.kept],
                "history": json.dumps(self.history, sort_keys=True, default=str)}

    def load_state_dict(self, engine: Any, d: Mapping[str, Any]) -> bool:
        """Resume from ``state_dict``: switch ``engine`` to the saved plan (a collective,
        ``Engine.set_plan``, when it differs from the engine's: every rank loads the
        same state) and restore the controller, so checks go on from the saved
        reference, decision link and switch count. Call it before the compressor
        state is restored (the switch resets the state of gradients it re-plans).

        Returns:
            True when restored; False (logged) when the state was saved with another
            world size: the plan and the controller then stay as planned at start.

        Raises:
            ValueError: ``d`` is not an adaptive-plan state of this version, or its
                plan does not fit the registered gradients.
        """
        if not isinstance(d, Mapping) or d.get("format") != STATE_FORMAT \
                or d.get("version") != STATE_VERSION:
            found = (d.get("format"), d.get("version")) if isinstance(d, Mapping) else \
                type(d).__name__
            raise ValueError(f"not a plan='adaptive' state: expected format {STATE_FORMAT!r} "
                             f"version {STATE_VERSION}, found {found!r}; pass what "
                             "optimizer.state_dict() saved under 'hipress_adaptive'")
        if int(d["world_size"]) != self.n:
            _log.warning("plan='adaptive': the checkpoint's plan was made for %d ranks, this "
                         "job has %d; the plan chosen at start stays and re-planning starts "
                         "afresh", int(d["world_size"]), self.n)
            return False
        plan = Plan.from_dict(json.loads(d["plan"]))
        if engine.plan is None or json.dumps(engine.plan.to_dict(), sort_keys=True) != \
                json.dumps(plan.to_dict(), sort_keys=True):
            self._set_plan(engine, plan)

        def link(x: Any) -> Optional[Link]:
            return None if x is None else Link(float(x[0]), float(x[1]))

        self.profile = Profile.from_dict(json.loads(d["profile"]))
        self.labels = [str(x) for x in d["labels"]]
        self._reference_planners = planners_for(self.profile, self.labels, self.n,
                                                self.strategy, self.raw_collective)
        self.switches = int(d["switches"])
        self.reverts = int(d.get("reverts", 0))  # absent in states saved before trials
        self.rejected = [(str(k), link(x), int(at)) for k, x, at in d.get("rejected", [])]
        self._trial = None  # an open trial is not resumed: the saved plan stays
        self._exploration = None  # nor an open exploration
        if self.ratio is not None and d.get("ratio") is not None:  # before compressor states
            self.ratio.load_state_dict(d["ratio"])
        self.explorations = int(d.get("explorations", 0))  # absent before explorations
        self._settled_s = d.get("settled_s")
        self.reference, self.decided_on = link(d["reference"]), link(d["decided_on"])
        self.kept = [(link(x), Plan.from_dict(json.loads(p)), int(at))
                     for x, p, at in d.get("kept", [])]  # absent before recall
        est = d.get("estimate")
        self.estimator = LinkEstimator(self.settings.gain)
        if est is not None:
            self.estimator.alpha, self.estimator.beta = float(est[0]), float(est[1])
            self.estimator.steps = int(est[2])
        self.history = json.loads(d["history"])
        self._steps_s.clear()
        self._last_t, self._after_switch = None, None
        _log.info("plan='adaptive': resumed with the checkpoint's plan (%d switch(es) made, "
                  "reference link %s)", self.switches, self.reference)
        return True

    def after_step(self, engine: Any) -> Optional[Plan]:
        """Update the estimate from the step just synchronised; on a check step, agree
        and maybe switch; on the step that ends a switch's trial, judge it
        (collective on check and judging steps: every rank, same step).

        A check switches when both hold: the current or the best plan's predicted
        time moved by more than ``margin`` since the link the plan was last
        decided on (the first check, or the last switch), and the best plan
        is predicted faster than the current one by more than ``margin``
        (``should_switch``), unless the best plan measured slower near this
        link before (``refused``). The first check only records the reference.
        While a switch's trial is open (``Adaptive.verify``) no check runs.

        Returns:
            The new plan when this call switched (or reverted), else None.
        """
        step = engine.step  # completed steps; the last one's index is step - 1
        self._time_step(step)
        self._share_step_times(engine)
        est = self.settings.estimate
        if est is not None:
            link = est(step - 1, engine.rank)
            if link is not None:
                self.estimator.alpha, self.estimator.beta = link.latency, 1.0 / link.bandwidth
        elif self.settings.measure == "timeline":
            new, self._mark_events = engine.timeline.since(self._mark_events)
            self.estimator.update(timeline_samples(new, step - 1, engine.size))
        if self.ratio is not None and (self._trial is not None or
                                       self._exploration is not None):
            self.ratio.skip()  # one decision at a time: this step is another's trial
        if self._trial is not None:
            return self._judge(engine, step) if step >= self._trial["at"] else None
        if self._exploration is not None:
            return self._explore_step(engine, step) if step >= self._exploration.at else None
        if self.ratio is not None and self._ratio_step(engine, step):
            return None
        if step % self.settings.check_every:
            return None
        return self._check(engine, step)

    def _check(self, engine: Any, step: int) -> Optional[Plan]:
        """One check (collective): measure or agree on the link, price, maybe switch."""
        t0 = time.perf_counter()
        probe, step_s = self._should_probe(engine, step)
        if not probe:
            self._last_t = time.perf_counter()
            return None
        link = self._measure(engine, step_s)
        self._last_t = time.perf_counter()  # the next step's time leaves the check out
        if link is None:
            _log.info("plan='adaptive' step %d: no link estimate on some rank yet", step)
            return None
        rec: Dict[str, Any] = {"step": step, "latency_s": link.latency,
                               "bandwidth_Bps": link.bandwidth, "switched": False}
        if self.reference is None:
            link = self._reference_link(engine, link, step_s)
            rec.update(latency_s=link.latency, bandwidth_Bps=link.bandwidth)
            self.reference = self.decided_on = link
            self._settled_s = step_s
            self._keep(link, engine.plan, step)
            rec["reference"] = True
            self.history.append(rec)
            _log.info("plan='adaptive' step %d: reference link %.3g ms + %.3g Gbit/s (agreed "
                      "across ranks)", step, 1e3 * link.latency, 8e-9 * link.bandwidth)
            if self.settings.explores_start:
                # the plan in force is timed after the candidates: these first steps carry
                # the job's warm-up
                return self._explore_begin(engine, step, link, rec, "start", None, t0,
                                           self.planners(link), self._meta(step, link),
                                           step_s)
            return None
        second = self._read_again(engine, link, self.decided_on, step_s)
        if second is not link:
            link = second
            rec.update(latency_s=link.latency, bandwidth_Bps=link.bandwidth, probed_twice=True)
        planners = self.planners(link)
        current = price_plan(engine.plan, planners, self.sizes, self.n)
        before = price_plan(engine.plan, self.planners(self.decided_on), self.sizes, self.n)
        meta = self._meta(step, link)
        best = best_plan(planners, self.sizes, meta, fit_rule=False)  # priced, not used yet
        best_s = price_plan(best, planners, self.sizes, self.n)
        rec.update(current_s=current, best_s=best_s, before_s=before)
        s = self.settings
        if current is None or best_s is None or before is None:
            _log.warning("plan='adaptive' step %d: the current plan names a compressor the "
                         "profile has no curves for; the plan stays", step)
            self.history.append(rec)
            return None
        rec["gain"] = (current - best_s) / current if current > 0 else 0.0
        # how far the link moved, as the plans priced see it: a compressed plan's time
        # hardly depends on the link, so the best plan's move counts too (without it, a
        # link back from 200 Mbit/s to 10 Gbit/s never "moved" the compressed plan)
        best_before = price_plan(best, self.planners(self.decided_on), self.sizes, self.n)
        rec["moved"] = max(abs(current - before) / before if before > 0 else 0.0,
                           abs(best_s - best_before) / best_before
                           if best_before else 0.0)
        self._link_moved = self._link_moved or rec["moved"] > s.margin
        if s.explores:
            self.history.append(rec)
            return self._explore_start(engine, step, link, rec, planners, meta, step_s, t0)
        wanted = rec["moved"] > s.margin and should_switch(
            current, best_s, margin=s.margin, switches=self.switches,
            max_switches=s.max_switches)
        refused = self.refused(best, link, planners) if wanted else None
        if refused is not None:
            rec["refused_since"] = refused
            _log.info("plan='adaptive' step %d: the best predicted plan measured slower at "
                      "step %d on a link within the margin of this one; the plan stays",
                      step, refused)
        elif wanted:
            old = engine.plan
            best = best_plan(planners, self.sizes, meta, fit_rule=True)  # the same entries
            states = self._set_plan(engine, best)
            self.switches += 1
            self.decided_on = link
            rec.update(switched=True, **states)
            rec["step_s_before"] = self._median_step()
            self._after_switch = rec
            _log.warning("plan='adaptive' switched the plan at step %d (switch %d of at most "
                         "%d): link %.3g ms + %.3g Gbit/s agreed across ranks; predicted "
                         "sync %.2f ms -> %.2f ms (gain %.0f %%, margin %.0f %%); %d of %d "
                         "gradients compressed", step, self.switches, s.max_switches,
                         1e3 * link.latency, 8e-9 * link.bandwidth, 1e3 * current,
                         1e3 * best_s, 100 * rec["gain"], 100 * s.margin,
                         sum(g.compress for g in best.gradients.values()),
                         len(best.gradients))
            if s.verifies:
                self._trial = {"stage": "new", "at": step + AFTER_STEPS, "switch": step,
                               "old": old, "new": best, "link": link,
                               "t_old": rec["step_s_before"]}
            self._mark(engine, "plan_switch", self.switches, t0, step)
        else:
            _log.info("plan='adaptive' step %d: keep the plan (link %.3g ms + %.3g Gbit/s; "
                      "current plan %.2f ms, moved %.0f %%; best %.2f ms, gain %.0f %%; %d "
                      "switch(es) made)", step, 1e3 * link.latency, 8e-9 * link.bandwidth,
                      1e3 * current, 100 * rec["moved"], 1e3 * best_s, 100 * rec["gain"],
                      self.switches)
        self.history.append(rec)
        return best if rec["switched"] else None

    def _should_probe(self, engine: Any, step: int) -> Tuple[bool, Optional[float]]:
        """Whether this check measures the link, and the step time agreed for it
        (collective with ``measure="probe"``).

        A probe costs a few exchanges, so with ``measure="probe"`` a check first
        agrees on the median step time of the last steps (``_agree_step_times``): the
        link is probed only when that moved by more than twice ``margin`` since
        the last probe at two checks in a row (or by four times at once), or
        (``explore``) from the decided plan's at two checks in a row (the link or
        the work changed; a step time on a loaded host moves by 10-20 % on its
        own, and a probe on a shaped link costs a few steps), at the first check,
        and at least every ``probe_every`` checks (a change the step time hides
        is still seen; about half as many while the plan in force hides link
        changes from the step time, ``_link_blind``, and twice as many under a plan
        that compresses nothing, whose step time shows a slower link that matters
        and which no faster link improves on, ``_compresses_nothing``: in
        ``bench/adaptive.py`` at 4 ranks a probe took 30-60 ms of a 70 ms step, and
        every move to a slower link under such a plan was first seen by its step
        time). After a switch the next check's step
        time is the new baseline, without a probe. The timeline and injected estimates cost
        nothing: every check uses them (the step time is agreed only for
        ``explore``'s work trigger).
        """
        s = self.settings
        if not s.probes:
            if not s.explores:
                return True, None
            t = self._agree_step_times(engine)  # for exploration's work trigger
            self._count_work(t)
            return True, t
        t = self._agree_step_times(engine)
        self._count_work(t)
        if self.reference is None:
            return True, t
        if self._probe_step_s is None:  # a decision made the step time new: the baseline
            self._probe_step_s = t
        self._checks_unprobed += 1

        def moved(base: Optional[float], by: float) -> bool:
            return base is not None and t is not None and abs(t - base) > by * base

        # a step time moved by 2 margins at two checks in a row (or by 4 at once) probes
        self._probe_moves = self._probe_moves + 1 if moved(self._probe_step_s,
                                                           2 * s.margin) else 0
        every = s.probe_every
        if self._checks_unprobed < every and self._link_blind(engine):
            # the step time would not tell: look sooner (every other check at the most)
            every = min(every, max(2, (every + 1) // 2))
        elif self._compresses_nothing(engine.plan):
            # a slower link that matters shows in its step time, a faster one changes
            # nothing (``_compresses_nothing``): look half as often
            every = 2 * every
        if t is None or self._checks_unprobed >= every or self._probe_moves >= 2 \
                or moved(self._probe_step_s, 4 * s.margin) or self._work_moved >= 2:
            return True, t
        _log.debug("plan='adaptive' step %d: step time %.2f ms within %.0f %% of the last "
                   "probe's %.2f ms; no probe", step, 1e3 * t, 200 * s.margin,
                   1e3 * self._probe_step_s)
        return False, t

    def _link_blind(self, engine: Any) -> bool:
        """Whether the plan in force hides a link change from the step time: priced on
        the decided link with its bandwidth four times higher and four times lower, its
        sync time moves by less than twice ``margin`` of the step time at the last probe
        (a plan whose compressors, not the link, bound it), so the step-time trigger
        would not fire and only the periodic probe would see the change; such a plan is
        probed about twice as often (``probe_every`` halved, rounded up, and no more
        often than every other check). Decided once per plan and decision link."""
        ref, base_s, plan = self.decided_on, self._probe_step_s, engine.plan
        if ref is None or plan is None or not base_s:
            return False
        key = (plan_key(plan), ref.latency, ref.bandwidth)
        if self._blind[0] != key:
            times = [price_plan(plan, self.planners(Link(ref.latency, ref.bandwidth * f)),
                                self.sizes, self.n) for f in (0.25, 1.0, 4.0)]
            blind = None not in times and \
                max(times) - min(times) < 2 * self.settings.margin * base_s
            self._blind = (key, blind)
        return self._blind[1]

    def _count_work(self, t: Optional[float]) -> None:
        """``explore``'s work trigger: count the checks in a row whose agreed step time
        ``t`` moved from the decided plan's by more than three times ``margin`` (a
        median of five steps moved by 20 % on its own on the 2-core host); the first
        check after a decision with a whole window of steps times the plan kept."""
        s = self.settings
        if not s.explores:
            return
        base = self._settled_s
        if base is None and len(self._steps_s) >= AFTER_STEPS:
            self._settled_s = base = t
        moved = t is not None and base is not None and base > 0 and \
            abs(t - base) > 3 * s.margin * base
        self._work_moved = self._work_moved + 1 if moved else 0

    def _step_times(self) -> List[Optional[float]]:
        """This rank's median step time of the last steps and mean of the last
        ``explore_steps - 1``."""
        n = max(1, self.settings.explore_steps - 1)
        xs = self._steps_s[-n:]
        return [self._median_step(), sum(xs) / len(xs) if xs else None]

    def _share_step_times(self, engine: Any) -> None:
        """Hand ``_step_times`` to the engine, to ride the next step's status words
        (``Engine.share``; ``replay.py``): a check then agrees on them with no
        collective of its own. Engines without it (a test's) share nothing."""
        share = getattr(engine, "share", None)
        if share is not None:
            times = self._step_times()
            share(None if None in times else times)

    def _agree_step_times(self, engine: Any) -> Optional[float]:
        """The agreed median step time of the last steps (returned) and mean of the last
        ``explore_steps - 1`` (kept as ``_agreed_mean``: the plan in force's time an
        exploration compares with). Collective: the means over ranks of the times each
        rank shared after the step before (``_share_step_times``), carried by the step
        just synchronised when it replayed its schedule (the same on every rank, at no
        cost); else the median over ranks of the times now, by an allgather (after a
        switch, the first steps of a plan are coordinated)."""
        shared = getattr(engine, "shared", None)
        got = shared() if shared is not None else None
        if got is None:
            got = agree_values(engine.transport, self._step_times(), self.timeout)
        self._agreed_mean = None if got is None else got[1]
        return None if got is None else got[0]

    def _measure(self, engine: Any, step_s: Optional[float]) -> Optional[Link]:
        """The link every rank holds alike (collective): the probe's fit, or the agreed
        median of the running estimates (timeline, injected); None when some rank has
        no estimate yet. ``step_s``: the step time ``_should_probe`` agreed, kept as the
        probe's (the next checks compare with it)."""
        s = self.settings
        if s.probes:
            link = self._probed or self.profile.link
            big = self._probe_size(link)
            for _ in range(PROBE_ROUNDS):
                # no warm-up: the job's own traffic keeps the links warm
                link, _ = measure_link(engine.transport, [PROBE_SMALL, big], repeats=3,
                                       timeout=self.timeout, warmup=False)
                # too small for this link (its wire time under half of probe_s, after a
                # slow phase): again, sized by what it just measured
                if big >= PROBE_MAX or big / link.bandwidth >= s.probe_s / 2:
                    break
                big = self._probe_size(link)
            self._probed = link  # the same on every rank (rank 0's fit, broadcast)
            self._probe_step_s, self._checks_unprobed = step_s, 0
            return link
        return agree(engine.transport, self.estimator.link, self.timeout)

    def _reference_link(self, engine: Any, first: Link, step_s: Optional[float]) -> Link:
        """The reference link from the first check's probe ``first`` and
        ``REFERENCE_PROBES - 1`` more (collective): the one of median bandwidth. Every
        later link is priced as a change from the reference (``calibrated``) and an
        exploration starts when the bandwidth moved 2x from the decided link, the
        reference at first: on the 2-core test host one 10 Gbit/s link read 1.4 to
        5.3 Gbit/s at first probes, and a first probe at 1.4 followed by one at 2.9 began
        an exploration on an unchanged link. An injected or timeline estimate is
        taken once (a second reading is the same one)."""
        if not self.settings.probes:
            return first
        links = [first] + [self._measure(engine, step_s) for _ in range(REFERENCE_PROBES - 1)]
        return sorted(links, key=lambda x: x.bandwidth)[len(links) // 2]

    def _probe_size(self, link: Link) -> int:
        """The probe's large message on ``link``: ``probe_s`` of wire time at its
        bandwidth, ``PROBE_FAR`` times that on a link ``PROBE_FAR`` or more times slower
        than the reference, kept within ``PROBE_MIN`` .. ``PROBE_MAX``.

        Why the larger message on a slow link: sized for 200 Mbit/s (100 KB), the probe
        carries a return to 10 Gbit/s in 0.1 ms of wire time, below the host's noise; in
        ``bench/adaptive.py`` with 4 ranks on the 2-core test host, 4 of 18 first probes
        after that return read 130-330 Mbit/s, each keeping the slow link's plan 5 to 25
        steps more on the fast link. Four times the message reads such a return as
        several times faster even with milliseconds of noise in it (12 of 12 first
        probes read 2.4 Gbit/s or more in the next three runs), for about 3 x
        ``probe_s`` more wire time a probe on the slow link."""
        ref, t = self.reference, self.settings.probe_s
        if ref is not None and link.bandwidth * PROBE_FAR <= ref.bandwidth:
            t *= PROBE_FAR
        return int(min(max(link.bandwidth * t, PROBE_MIN), PROBE_MAX))

    def _mark(self, engine: Any, kind: str, index: int, t0: float, step: int) -> None:
        """A switch or revert on the engine's timeline; the step timer restarts after
        it (a trial's windows hold steps, not the switch's own collectives)."""
        from ..casync.timeline import Event

        engine.timeline.add(Event(kind, "", index, t0, time.perf_counter(), 0, "compute",
                                  step))
        self._probe_step_s = None  # the plan's step time is new: the next check's is the base
        self._steps_s.clear()
        self._last_t = time.perf_counter()

    def refused(self, plan: Plan, link: Link, planners: Sequence[Planner]) -> Optional[int]:
        """The step at which ``plan`` measured slower and was reverted, when the link
        is still within ``margin`` of the link it was measured on (priced as the
        switch rule prices a move: the refused plan's predicted time there and
        here); else None."""
        key = plan_key(plan)
        for ref_key, ref_link, at in self.rejected:
            if ref_key != key:
                continue
            here = price_plan(plan, planners, self.sizes, self.n)
            there = price_plan(plan, self.planners(ref_link), self.sizes, self.n)
            if here is not None and there and abs(here - there) / there <= \
                    self.settings.margin:
                return at
        return None

    def _judge(self, engine: Any, step: int) -> Optional[Plan]:
        """End a switch's trial (collective): the ranks agree on the median step time
        of the plan before and of the plan after; revert a switch measured slower
        by more than ``margin``, restore one whose revert measured slower still."""
        t0 = time.perf_counter()
        tr, s = self._trial, self.settings
        stage = tr["stage"]
        earlier = tr["t_old"] if stage == "new" else tr["t_new"]
        got = agree_values(engine.transport, [earlier, self._median_step()], self.timeout)
        self._trial = None
        rec: Dict[str, Any] = {"step": step, "judged": stage, "switch_step": tr["switch"],
                               "switched": False}
        if got is None:
            rec["verdict"] = "kept (a rank had no step times)"
            self.history.append(rec)
            return None
        t_then, t_now = got
        if stage == "new":
            rec.update(step_s_old=t_then, step_s_new=t_now)
            if t_now > t_then * (1 + s.margin):
                rec.update(self._set_plan(engine, tr["old"]), switched=True, verdict="reverted")
                self.reverts += 1
                self._trial = {**tr, "stage": "old", "at": step + AFTER_STEPS,
                               "t_new": t_now}
                _log.warning("plan='adaptive' reverted the switch of step %d at step %d: "
                             "%.2f ms a step after it against %.2f ms before it (median over "
                             "ranks of %d steps each; margin %.0f %%)", tr["switch"], step,
                             1e3 * t_now, 1e3 * t_then, AFTER_STEPS, 100 * s.margin)
                self._mark(engine, "plan_revert", self.reverts, t0, step)
                self.history.append(rec)
                return tr["old"]
            rec["verdict"] = "kept"
            _log.info("plan='adaptive' kept the switch of step %d: %.2f ms a step after it, "
                      "%.2f ms before it", tr["switch"], 1e3 * t_now, 1e3 * t_then)
        else:
            rec.update(step_s_new=t_then, step_s_old=t_now)
            if t_now > t_then:  # the steps before the switch were on another link
                rec.update(self._set_plan(engine, tr["new"]), switched=True, verdict="restored")
                _log.warning("plan='adaptive' restored the switch of step %d at step %d: the "
                             "plan it replaced measured %.2f ms a step against its %.2f ms",
                             tr["switch"], step, 1e3 * t_now, 1e3 * t_then)
                self._mark(engine, "plan_restore", self.reverts, t0, step)
                self.history.append(rec)
                return tr["new"]
            rec["verdict"] = "revert stands"
            self.rejected.append((plan_key(tr["new"]), tr["link"], tr["switch"]))
            _log.info("plan='adaptive': the revert stands (%.2f ms a step against %.2f ms); the "
                      "plan of step %d is refused near this link", 1e3 * t_now, 1e3 * t_then,
                      tr["switch"])
        self.history.append(rec)
        return None

    def _set_plan(self, engine: Any, plan: Plan) -> Dict[str, List[str]]:
        """``Engine.set_plan``, then the searched AR-Topk ratio again on the layout's
        compressors (a rebuilt layout builds them with the plan's parameters)."""
        states = engine.set_plan(plan)
        if self.ratio is not None and self.ratio.cr is not None:
            self.ratio.set_cr(self.ratio.running_cr or self.ratio.cr)
        return states

    def _ratio_step(self, engine: Any, step: int) -> bool:
        """AR-Topk's ratio search's turn (``ratio_search.RatioSearch.after_step``): it
        observes the step, or feeds a running search; a history entry and a timeline
        mark when one begins or ends. True while a search runs (no check then)."""
        t0 = time.perf_counter()
        moved, self._link_moved = self._link_moved, False
        rec = self.ratio.after_step(step, link_moved=moved)
        if rec is not None:
            self.history.append(rec)
            self._mark(engine, "ratio_search" if "ratio_search" in rec else "ratio_chosen",
                       len(self.ratio.ctl.decisions), t0, step)
        return self.ratio.searching

    # -- exploration (``Adaptive.explore``, ``tuning/explore.py``) ----------------------
    def _explore_start(self, engine: Any, step: int, link: Link, rec: Dict[str, Any],
                       planners: Sequence[Planner], meta: Mapping[str, Any],
                       step_s: Optional[float], t0: float) -> Optional[Plan]:
        """A check with ``explore``: when the agreed bandwidth moved by 2x or more since
        the link decided on (read by two probes in a row, ``_check``), or by more
        than ``LINK_NOISE`` at two checks in a row, or the agreed step time moved
        from the decided plan's by more than three times ``margin`` at two checks
        in a row (the work changed: a straggler, a busy host; the plan's time is
        taken at the first check after a decision), start
        an exploration of the model's plans (``explore.alternatives``) and switch to
        the first."""
        base = self._settled_s
        # the work trigger needs two checks in a row (``_count_work``: one slow window is
        # noise); so does a bandwidth move under 2x (a probe on a loaded host reads +-30 %)
        work = self._work_moved >= 2
        # the link trigger reads the bandwidth only: the probe's latency fit swings by
        # 10x on a shaped link (1.7 ms, 0.12 ms, 1.7 ms at one 1 Gbit/s rate), and a
        # latency change that matters moves the step time (the work trigger)
        r = _ratio(link, self.decided_on)
        self._link_moves = self._link_moves + 1 if r > LINK_NOISE else 0
        link_moved = r >= 2 or self._link_moves >= 2
        rec["bandwidth_ratio"] = r
        rec["step_s"] = step_s
        if link_moved and not work and link.bandwidth > self.decided_on.bandwidth \
                and self._compresses_nothing(engine.plan):
            # no plan gains more from a faster link than the one sending everything as it
            # is (``_compresses_nothing``): nothing to explore, and the decided link stays
            rec["faster_uncompressed"] = True
            self._link_moves = 0
            _log.info("plan='adaptive' step %d: the link reads faster (%.3g Gbit/s against "
                      "%.3g decided) and the plan in force compresses nothing; it stays",
                      step, 8e-9 * link.bandwidth, 8e-9 * self.decided_on.bandwidth)
            return None
        if not link_moved and not work:
            _log.info("plan='adaptive' step %d: keep the plan (link %.3g ms + %.3g Gbit/s, "
                      "moved %.0f %%; step %s ms against %s ms decided)", step,
                      1e3 * link.latency, 8e-9 * link.bandwidth, 100 * rec["moved"],
                      _ms(step_s), _ms(base))
            return None
        reason = "link moved" if link_moved else "step time moved"
        self._work_moved = self._link_moves = 0
        return self._explore_begin(engine, step, link, rec, reason, self._agreed_mean, t0,
                                   planners, meta, step_s,
                                   f"step {_ms(step_s)} ms against {_ms(base)} ms decided")

    def _compresses_nothing(self, plan: Optional[Plan]) -> bool:
        """Whether ``plan`` sends every gradient of the job as it is (named entries and
        its size rule alike). Such a plan stays the fastest when the link gets faster:
        in the cost model (HiPress Eq. 1 and 2, ``cost_model/model.py``) a send costs
        a latency plus its bytes over the bandwidth ``b`` and the encode and decode
        terms do not depend on the link, so the gap between it and a plan that
        compresses is ``(a_U - a_C) + (S_U - S_C) / b``, with ``S_U > S_C`` the bytes
        each sends; it only falls as ``b`` rises, and what beat every compressed plan
        on the decided link beats them on a faster one. On the 2-core host, a probe on an
        unchanged 10 Gbit/s link read up to 2x above a low reference reading, and each
        such reading began an exploration of compressed plans that cost its steps."""
        if plan is None:
            return False
        return not any(plan.decide(name, nbytes, self.n).compress
                       for name, nbytes in self.sizes.items())

    def _meta(self, step: int, link: Link) -> Dict[str, Any]:
        """The provenance a plan made at this check carries."""
        return {"adaptive": {"step": step, "latency": link.latency,
                             "bandwidth": link.bandwidth},
                "profile": self.profile.to_dict(), "candidates": self.labels}

    def _explore_begin(self, engine: Any, step: int, link: Link, rec: Dict[str, Any],
                       reason: str, t_before: Optional[float], t0: float,
                       planners: Sequence[Planner], meta: Mapping[str, Any],
                       step_s: Optional[float], detail: str = "") -> Optional[Plan]:
        """Start an exploration on ``link`` for ``reason`` (``explore.alternatives``, priced
        by ``planners``; the plan in force timed at ``t_before``, or in a window of its
        own when None) and switch to its first candidate; None when the caps are
        reached or the model proposes no other plan (then the plan in force is decided
        on ``link``, its agreed step time ``step_s``). ``detail``: for the log."""
        s = self.settings
        if self.switches >= s.max_switches or self.explorations >= s.max_explorations:
            rec["capped"] = True
            _log.info("plan='adaptive' step %d: %s, but the caps are reached (%d switch(es), "
                      "%d exploration(s)); the plan stays", step, reason, self.switches,
                      self.explorations)
            return None

        def plan_at(x: Link) -> Plan:
            return best_plan(self.planners(x), self.sizes, meta, fit_rule=True)

        defaults = [(f"{lab} by the engine's size rule",
                     size_rule(engine.plan, p.cp.name, p.cp.params, self.sizes, self.n))
                    for lab, p in zip(self.labels, planners)]
        cands = alternatives(plan_at, lambda p: price_plan(p, planners, self.sizes, self.n),
                             link, engine.plan, recalled=self._recalled(link),
                             defaults=defaults)
        if not cands:
            rec["explored"] = []
            _log.info("plan='adaptive' step %d: %s, and the model proposes no other plan; the "
                      "plan stays", step, reason)
            self.decided_on, self._settled_s = link, step_s
            self._keep(link, engine.plan, step)
            return None
        self.explorations += 1
        self._exploration = Exploration(engine.plan, t_before, cands, steps=s.explore_steps,
                                        start=step, margin=s.margin, reason=reason, link=link)
        rec.update(exploring=reason, candidates=[why for why, _ in cands])
        _log.warning("plan='adaptive' step %d: %s (link %.3g ms + %.3g Gbit/s%s); trying %d "
                     "plan(s) for %d steps each: %s", step, reason, 1e3 * link.latency,
                     8e-9 * link.bandwidth, detail and ", " + detail, len(cands),
                     s.explore_steps, ", ".join(why for why, _ in cands))
        return self._explore_next(engine, step, t0)

    def _explore_next(self, engine: Any, step: int, t0: float) -> Optional[Plan]:
        """Switch to the exploration's next plan, or end it (``_explore_end``)."""
        ex = self._exploration
        nxt = ex.next_plan()
        if nxt is None:
            return self._explore_end(engine, step, t0)
        states = self._set_plan(engine, nxt[1])
        self.history.append({"step": step, "trying": nxt[0], "switched": True, **states})
        self._mark(engine, "plan_explore", self.explorations, t0, step)
        return nxt[1]

    def _explore_step(self, engine: Any, step: int) -> Optional[Plan]:
        """A trial window ended (collective): agree on its median step time, go on."""
        t0 = time.perf_counter()
        # the window's mean without its first step (the switch's rebuild): a plan whose
        # steps are slow now and then costs that (a median would hide it)
        xs = self._steps_s[-self.settings.explore_steps:][1:] or self._steps_s[-1:]
        got = agree_values(engine.transport, [sum(xs) / len(xs) if xs else None],
                           self.timeout)
        self._exploration.record(None if got is None else got[0])
        return self._explore_next(engine, step, t0)

    def _explore_end(self, engine: Any, step: int, t0: float) -> Optional[Plan]:
        """Keep the fastest measured plan (``Exploration.choose``); a switch when it is
        not the plan in force before the exploration. When the link moved during the
        exploration (``_moved_during``), its windows timed the plans on two links: it
        decides nothing (``_explore_void``)."""
        ex, self._exploration = self._exploration, None
        moved = self._moved_during(engine, ex)
        if moved is not None:
            return self._explore_void(engine, step, ex, moved, t0)
        why, plan, t = ex.choose()
        switched = plan is not ex.before
        rec: Dict[str, Any] = {"step": step, "explored": ex.summary(), "chose": why,
                               "step_s": t, "switched": switched}
        states = self._set_plan(engine, plan) if plan is not engine.plan else {}
        rec.update(states)
        # the windows were short and the plan kept may have been timed before: the
        # next check times it again (``_settled_s``)
        self.decided_on, self._settled_s = ex.link, None
        self._keep(ex.link, plan, step)
        if switched:
            self.switches += 1
            self._after_switch = None
        _log.warning("plan='adaptive' step %d: explored %s; %s (%s)", step,
                     ", ".join(f"{r['why']} {_ms(r['step_s'])} ms" for r in ex.summary()),
                     f"switched to the {why} plan" if switched else "the plan in force stays",
                     f"switch {self.switches} of at most {self.settings.max_switches}"
                     if switched else "no switch")
        self.history.append(rec)
        self._mark(engine, "plan_switch" if switched else "plan_explore",
                   self.switches if switched else self.explorations, t0, step)
        return plan if states else None

    def _probes_twice(self) -> bool:
        """Whether a probe reading a move of 2x or more is taken again before anything is
        decided on it (a check's, ``_check``; an exploration's end, ``_moved_during``):
        with ``explore`` and probes. One probe on the fast link of the 2-core test host
        read 1.4 to 29 Gbit/s at one 10 Gbit/s rate; one that read 29 began an
        exploration whose end, probed at 4 Gbit/s, looked like a link moved during it."""
        return self.settings.explores and self.settings.probes

    def _read_again(self, engine: Any, link: Optional[Link], against: Link,
                    step_s: Optional[float]) -> Optional[Link]:
        """``link``, or, when it is a probe's reading 2x or more from ``against`` and
        ``_probes_twice``, a second probe's reading (collective then), which replaces it."""
        if link is not None and self._probes_twice() and _ratio(link, against) >= 2:
            return self._measure(engine, step_s)
        return link

    def _moved_during(self, engine: Any, ex: Exploration) -> Optional[Link]:
        """The link at an exploration's end when it moved from the exploration's by 2x or
        more in bandwidth (the link trigger's immediate move), else None. Collective.
        Measured links only (a probe, or an injected estimate): the timeline's estimate
        follows the plans tried. A probe that reads such a move is taken again and
        both must read it (``_probes_twice``)."""
        s = self.settings
        if ex.link is None or not (s.probes or s.estimate is not None):
            return None

        def far(x: Optional[Link]) -> bool:
            return x is not None and _ratio(x, ex.link) >= 2

        link = self._read_again(engine, self._measure(engine, None), ex.link, None)
        return link if far(link) else None

    def _explore_void(self, engine: Any, step: int, ex: Exploration, link: Link,
                      t0: float) -> Optional[Plan]:
        """The link moved during exploration ``ex`` (to ``link``): the plan in force
        before it comes back, nothing is kept or counted as a switch, and a new
        exploration starts on ``link`` (the plan in force timed in a window of its own,
        after the candidates), within the caps. Without this, an exploration begun a
        few steps before a link change compared plans measured on two links and kept
        the one that ran on the faster (``bench/adaptive.py``: "nothing compressed"
        kept at 200 Mbit/s, measured on the 10 Gbit/s that followed)."""
        rec: Dict[str, Any] = {"step": step, "explored": ex.summary(), "switched": False,
                               "chose": "nothing: the link moved during it", "voided": True,
                               "latency_s": link.latency, "bandwidth_Bps": link.bandwidth}
        states = self._set_plan(engine, ex.before) if ex.before is not engine.plan else {}
        rec.update(states)
        self.history.append(rec)
        _log.warning("plan='adaptive' step %d: the link moved during the exploration begun "
                     "at step %d (%.3g -> %.3g Gbit/s); its times are void, the plan in "
                     "force before it is back", step, ex.start, 8e-9 * ex.link.bandwidth,
                     8e-9 * link.bandwidth)
        start: Dict[str, Any] = {"step": step, "latency_s": link.latency,
                                 "bandwidth_Bps": link.bandwidth, "switched": False}
        self.history.append(start)
        got = self._explore_begin(engine, step, link, start, "link moved during an "
                                  "exploration", None, t0, self.planners(link),
                                  self._meta(step, link), None)
        if self._exploration is None:  # capped, or no other plan: the plan in force stays
            self.decided_on, self._settled_s = link, None
            self._mark(engine, "plan_explore", self.explorations, t0, step)
        return got if got is not None else (ex.before if states else None)


def _ratio(a: Link, b: Link) -> float:
    """How far apart two links' bandwidths are: the larger over the smaller."""
    return max(a.bandwidth / b.bandwidth, b.bandwidth / a.bandwidth)


def _ms(seconds: Optional[float]) -> str:
    return "?" if seconds is None else f"{1e3 * seconds:.1f}"
