"""AR-Topk's adaptive compression ratio inside ``plan="adaptive"``: the search at step
boundaries.

``adaptive_cr.AdaptiveCR`` is the flexible-communication paper's controller (Sec.
3-E, Eq. 6): triggered by a moved link or a drifting compression gain, it runs
every candidate CR for a few iterations from one in-memory checkpoint, restores
it, and keeps the CR on NSGA-II's Pareto set of ``(t_comp, t_sync, 1/gain)``
with the least time per unit of gain. Used alone it needs the training loop's
help (about 50 lines: a step function, the checkpoint, the link measurement).
Here the same controller is driven by the online planner after every step, so
``plan="adaptive"`` with an AR-Topk compressor adapts its ratio with no glue:

1. **Statistics of a step** (``step_stats``): the engine's own timeline gives
   the seconds compressing (encode, decode, merge, write back) and
   communicating (rounds, buckets, allreduces) of the step just done; the
   compressor states give AR-Topk's gain ``sum ||g_c||^2 / sum ||g_e||^2``
   (``adaptive_cr.gain_of_states``).
2. **Triggers**: the controller's own (no CR chosen yet; the mean gain of the
   last ``window`` steps drifted by ``gain_threshold``), checked every
   ``check_every`` steps, and the online planner's agreed link: a check whose
   link moved (``OnlinePlanner``) starts a search with that reason.
3. **The search** (``AdaptiveCR.begin``/``feed``): the face's snapshot of
   the training state (parameters and optimizer state; ``snapshot``) plus the
   engine's compressor states is taken at the step boundary; each candidate
   runs ``explore_iters`` real steps; the ranks agree on each candidate's mean
   statistics (an allreduce mean); the snapshot is restored and the chosen CR
   set on every AR-Topk compressor the layout uses. The engine's step count is
   not rewound (the planner's checks stay on their steps), so the steps of a
   search are spent time, not lost model quality, as in the paper.

A face that cannot rewind its training state gives ``TRAIN_ON`` instead of a
snapshot (the TensorFlow ``DistributedGradientTape``, which never sees the
optimizer): the search then takes and restores nothing, the compressor states
included, and each candidate's steps are ordinary training steps with that
ratio, as a ratio change of the controller would be anyway.

While a search runs the planner does no check and no exploration, and the
other way round: one decision at a time, on every rank at the same step.
Buffers outside the optimizer (BatchNorm's running statistics) are not in the
snapshot and keep the search's steps.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..casync.timeline import COMMUNICATION_KINDS, COMPRESSION_KINDS
from .adaptive_cr import AdaptiveCR, AdaptiveCRConfig, Decision, StepStats, gain_of_states

__all__ = ["RatioSearch", "step_stats", "searchable", "TRAIN_ON"]

_log = logging.getLogger(__name__)


Snapshot = Tuple[Callable[[], Any], Callable[[Any], None]]

#: a face's ``snapshot`` when it cannot rewind: the search's steps train on (module
#: docstring)
TRAIN_ON = "train-on"


def _unwrap(comp: Any) -> Any:
    while not hasattr(comp, "records_gain") and hasattr(comp, "inner"):
        comp = comp.inner
    return comp


def searchable(engine: Any) -> List[Any]:
    """The compressors of ``engine``'s layout whose ratio a search can set and whose
    state can record AR-Topk's gain: the top-k family (``star_topk``,
    ``var_topk``, and ``topk``, which the cost model's collective selection puts
    in their place as an Allgather of top-k), behind error feedback or not; empty
    when there is none."""
    out = []
    for comp in engine.compressors_in_use():
        target = _unwrap(comp)
        if hasattr(target, "ratio") and hasattr(target, "records_gain"):
            out.append(target)
    return out


def step_stats(engine: Any, events: List[Any]) -> StepStats:
    """A step's ``StepStats`` from its timeline ``events`` and the engine's states."""
    def busy(kinds: Tuple[str, ...]) -> float:
        return sum(e.end - e.start for e in events if e.kind in kinds)

    gain = gain_of_states(engine.compressor_states())
    return StepStats(busy(COMPRESSION_KINDS), busy(COMMUNICATION_KINDS),
                     1.0 if gain is None else gain)


class RatioSearch:
    """``AdaptiveCR`` driven at step boundaries for an engine (module docstring).

    Args:
        engine: the registered engine (its transport agrees the means).
        config: the controller's settings.
        snapshot: the face's ``(checkpoint, restore)`` of its training state, or
            ``TRAIN_ON``.
        timeout: seconds for the agreement's allreduce.
    """

    def __init__(self, engine: Any, config: AdaptiveCRConfig, snapshot: Any,
                 timeout: float) -> None:
        self.engine = engine
        self.rewinds = snapshot != TRAIN_ON
        self._face_checkpoint, self._face_restore = snapshot if self.rewinds else (None, None)
        self._mark = 0  # timeline events read so far
        comps = searchable(engine)
        start = comps[0].ratio if comps else None
        for comp in comps:  # the gain the triggers and the decision read
            comp.records_gain = True
        size = engine.size

        def agree(xs: List[float]) -> List[float]:
            t = engine.transport.allreduce(torch.tensor(list(xs), dtype=torch.float64),
                                           "sum", timeout)
            return (t / size).tolist()

        self.ctl = AdaptiveCR(config, set_cr=self.set_cr, checkpoint=self._checkpoint,
                              restore=self._restore, measure_link=None, agree=agree,
                              initial_cr=start)
        self.history: List[Dict[str, Any]] = []

    @classmethod
    def for_engine(cls, engine: Any, config: Any, snapshot: Any,
                   timeout: float) -> Optional["RatioSearch"]:
        """The search for ``engine``, or None (logged) when ``config`` is False, the
        layout has no AR-Topk compressor, or the face gave no snapshot."""
        if config is False:
            return None
        if config is None and not getattr(type(_unwrap(engine.compressor)), "records_gain",
                                          False):
            return None  # by default only for AR-Topk (star_topk, var_topk), as asked for
        if not searchable(engine):
            if config is not None:
                _log.warning("plan='adaptive': Adaptive(ratio=...) was given, but no gradient "
                             "is compressed by an AR-Topk compressor (star_topk, var_topk); "
                             "the ratio stays")
            return None
        if snapshot is None:
            _log.warning("plan='adaptive': this face gives no snapshot of its training state; "
                         "AR-Topk's ratio search needs one, so the ratio stays")
            return None
        cfg = config if isinstance(config, AdaptiveCRConfig) else AdaptiveCRConfig()
        return cls(engine, cfg, snapshot, timeout)

    @property
    def cr(self) -> Optional[float]:
        """The ratio chosen (or the start ratio before any search)."""
        return self.ctl.cr

    @property
    def searching(self) -> bool:
        """Whether a search is running."""
        return self.ctl.searching

    def set_cr(self, cr: float) -> None:
        """Set ``cr`` on every top-k family compressor the layout uses (the next encode
        reads it), and have them record their gain."""
        for comp in searchable(self.engine):
            comp.ratio = float(cr)
            comp.records_gain = True

    def _checkpoint(self) -> Optional[Dict[str, Any]]:
        if not self.rewinds:
            return None
        return {"face": self._face_checkpoint(),
                "states": copy.deepcopy(dict(self.engine.compressor_states()))}

    def _restore(self, snap: Optional[Dict[str, Any]]) -> None:
        if snap is None:  # TRAIN_ON: nothing was taken
            return
        self._face_restore(snap["face"])
        self.engine.load_compressor_states(copy.deepcopy(snap["states"]))

    def skip(self) -> None:
        """Leave the step just done out of the statistics (the planner was trying another
        plan in it): its timeline events are passed over, not read into the next step."""
        _, self._mark = self.engine.timeline.since(self._mark)

    def after_step(self, step: int, link_moved: bool = False) -> Optional[Dict[str, Any]]:
        """The step just done (collective on agreement steps: every rank, same step):
        feed a running search, or check the triggers and maybe begin one.

        Returns:
            A history entry when a search began or ended, else None.
        """
        events, self._mark = self.engine.timeline.since(self._mark)
        stats = step_stats(self.engine, events)
        if self.searching:
            d = self.ctl.feed(stats)
            return None if d is None else self._ended(step, d)
        self.ctl.observe(step, stats)
        reason = self.ctl.should_search(step - 1)
        if link_moved:
            reason = "; ".join(x for x in (reason, "the link moved") if x)
        if not reason:
            return None
        cr = self.ctl.begin(step, reason)
        rec = {"step": step, "ratio_search": reason, "trying_cr": cr,
               "candidates": list(self.ctl.config.candidates), "rewinds": self.rewinds}
        self.history.append(rec)
        _log.warning("plan='adaptive' step %d: AR-Topk ratio search (%s): %d candidate(s), %d "
                     "steps each, %s", step, reason, len(self.ctl.config.candidates),
                     self.ctl.config.explore_iters,
                     "from a snapshot restored after" if self.rewinds else
                     "training on (this face cannot rewind its optimizer)")
        return rec

    def _ended(self, step: int, d: Decision) -> Dict[str, Any]:
        rec = {"step": step, "ratio_chosen": d.cr_after, "ratio_before": d.cr_before,
               "pareto": d.pareto, "trials": [[t.cr, t.t_comp, t.t_sync, t.gain]
                                              for t in d.trials]}
        self.history.append(rec)
        return rec

    def state_dict(self) -> Dict[str, Any]:
        """The controller's ``state_dict`` (the chosen ratio and its references)."""
        return self.ctl.state_dict()

    def load_state_dict(self, d: Dict[str, Any]) -> None:
        """Restore ``state_dict``: its ratio is set on the compressors, and the next
        trigger check goes on from its references."""
        self.ctl.load_state_dict(d)
