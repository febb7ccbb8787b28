"""The settings of ``plan="adaptive"`` (``Adaptive``) and its switch rule.

``tuning/online.py`` is the controller that reads them after every step; its
docstring describes each knob's part (measure, decide, switch, judge,
explore, search AR-Topk's ratio). The rule a check applies to the cost
model's predictions is ``should_switch`` (hysteresis on the predicted gain).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..cost_model.model import Link
from ..cost_model.profile import Profile

__all__ = ["Adaptive", "should_switch", "AFTER_STEPS", "MEASURES"]

EstimateFn = Callable[[int, int], Optional[Link]]
# steps timed after a switch (and before it) for its report
AFTER_STEPS = 5
# how the link is measured (``Adaptive.measure``), and the probe's small message
MEASURES = ("probe", "timeline")
PROBE_SMALL, PROBE_MIN, PROBE_MAX = 4 << 10, 64 << 10, 4 << 20
PROBE_ROUNDS = 2  # probes in one check at most, the second sized by the first
# on a link this many times slower than the reference, the probe's message is this many
# times larger (``OnlinePlanner._probe_size``)
PROBE_FAR = 4
# the controller's entry in a checkpoint (``OnlinePlanner.state_dict``)
STATE_FORMAT, STATE_VERSION = "hipress-like-adaptive", 1


@dataclass(frozen=True)
class Adaptive:
    """What ``plan="adaptive"`` does (``DistributedOptimizer(plan=hpt.Adaptive(...))``).

    Attributes:
        check_every: steps between checks (each measures the link: a probe of a few
            small exchanges, or one small allgather of the running estimates).
        margin: the predicted sync time must improve by more than this
            fraction for a switch (hysteresis).
        max_switches: switches allowed in the whole run.
        gain: the moving average's weight of a new step's estimate (0, 1].
        profile: a ``Profile`` or a path to a profile JSON; None takes the
            profile ``plan="auto"`` measures at start-up.
        estimate: for tests and what-if runs: ``estimate(step, rank) ->
            Link | None`` replaces the measurement (None: no estimate this
            step); every rank's are agreed on as timeline estimates are.
        measure: "probe" (a timed exchange at every check, plan-independent)
            or "timeline" (the engine's own rounds and buckets, no extra
            traffic; what it sees depends on the plan). Item 1 of the
            module's description.
        probe_s: seconds the probe's large message should take at the last
            measured bandwidth (its size is kept within 64 KB .. 4 MB; the
            small one is 4 KB).
        probe_every: a check probes when the step time moved by more than
            ``margin`` since the last probe, and at least every this many
            checks (about half as many under a plan whose step time hides the
            link, twice as many under one that compresses nothing:
            ``OnlinePlanner._should_probe``).
        verify: judge every switch by measured step times and revert one
            that measured slower (item 5 of the module's description). None:
            on, unless ``estimate`` is given (an injected link is not the
            network the wall times are measured on).
        explore: when the link or the step time moved, try the model's plan,
            its plans at a hundredth, a quarter and four times the bandwidth,
            with nothing compressed and with one partition per gradient, on
            real steps, and keep the fastest measured (``tuning/explore.py``;
            item 7 of the module's description); a switch is then its
            exploration's outcome and
            ``verify`` has nothing left to judge. None: on, unless
            ``estimate`` is given (as ``verify``).
        explore_start: with ``explore``, the first check (the reference link)
            also starts an exploration: the plan chosen at start-up, priced on a
            start-up profile, runs against the alternatives the model proposes
            on the link measured then (the plan in force timed in a window of
            its own, after the candidates: the steps before the first check
            carry the job's warm-up). Off by default: in ``bench/adaptive.py``
            on the test host the start plan was already the fastest measured,
            so the exploration only cost its steps (its first phase took
            1.6-2.0x the best fixed plan's time with it); for a job whose
            start-up profile may mislead the model (a host busier at start
            than later) it is a few steps spent once.
        explore_steps: steps each plan tried by an exploration runs.
        max_explorations: explorations allowed in the whole run.
        ratio: AR-Topk's compression ratio search (``tuning/ratio_search.py``;
            item 8 of the module's description): None searches it with
            ``AdaptiveCRConfig()``'s settings when the compressor asked for is
            AR-Topk's (star_topk, var_topk); an ``AdaptiveCRConfig`` searches
            any top-k family compressor's with those; False keeps the ratio.

    Raises:
        ValueError: a knob out of range.
    """

    check_every: int = 20
    margin: float = 0.10
    max_switches: int = 4
    gain: float = 0.25
    profile: Any = None
    estimate: Optional[EstimateFn] = field(default=None, compare=False)
    verify: Optional[bool] = None
    measure: str = "probe"
    probe_s: float = 0.004
    probe_every: int = 5
    explore: Optional[bool] = None
    explore_start: bool = False
    explore_steps: int = 5  # a window's median: one slow step (a switch's rebuild) is ignored
    max_explorations: int = 8
    ratio: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.check_every, bool) or not isinstance(self.check_every, int) \
                or self.check_every < 1:
            raise ValueError(f"check_every must be an int >= 1 (steps between checks), found "
                             f"{self.check_every!r}")
        if not (isinstance(self.margin, (int, float)) and 0 <= self.margin < 1):
            raise ValueError(f"margin must be a fraction in [0, 1) (0.1: a switch needs a "
                             f"predicted gain over 10 %), found {self.margin!r}")
        if isinstance(self.max_switches, bool) or not isinstance(self.max_switches, int) \
                or self.max_switches < 0:
            raise ValueError(f"max_switches must be an int >= 0, found {self.max_switches!r}")
        if not (isinstance(self.gain, (int, float)) and 0 < self.gain <= 1):
            raise ValueError(f"gain must be in (0, 1], found {self.gain!r}")
        if self.estimate is not None and not callable(self.estimate):
            raise ValueError(f"estimate must be a callable (step, rank) -> Link or None, "
                             f"found {self.estimate!r}")
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be one of {', '.join(MEASURES)} (how the link is "
                             f"measured), found {self.measure!r}")
        if isinstance(self.probe_s, bool) or not isinstance(self.probe_s, (int, float)) \
                or not 0 < self.probe_s <= 1:
            raise ValueError(f"probe_s must be seconds in (0, 1] (how long the probe's large "
                             f"message should take), found {self.probe_s!r}")
        if isinstance(self.probe_every, bool) or not isinstance(self.probe_every, int) \
                or self.probe_every < 1:
            raise ValueError(f"probe_every must be an int >= 1 (checks between probes at "
                             f"most), found {self.probe_every!r}")
        if self.verify is not None and not isinstance(self.verify, bool):
            raise ValueError(f"verify must be True, False or None (None: on unless estimate "
                             f"is given), found {self.verify!r}")
        if self.explore is not None and not isinstance(self.explore, bool):
            raise ValueError(f"explore must be True, False or None (None: on unless estimate "
                             f"is given), found {self.explore!r}")
        if not isinstance(self.explore_start, bool):
            raise ValueError(f"explore_start must be True or False, found "
                             f"{self.explore_start!r}")
        from .adaptive_cr import AdaptiveCRConfig

        if self.ratio is not None and self.ratio is not False and \
                not isinstance(self.ratio, AdaptiveCRConfig):
            raise ValueError(f"ratio must be None (search AR-Topk's ratio with the default "
                             f"settings), False (keep it) or an AdaptiveCRConfig, found "
                             f"{self.ratio!r}")
        for knob in ("explore_steps", "max_explorations"):
            v = getattr(self, knob)
            if isinstance(v, bool) or not isinstance(v, int) or v < (knob == "explore_steps"):
                raise ValueError(f"{knob} must be an int >= {int(knob == 'explore_steps')}, "
                                 f"found {v!r}")

    @property
    def verifies(self) -> bool:
        """Whether switches are judged by measured step times (``verify``)."""
        return self.estimate is None if self.verify is None else self.verify

    @property
    def explores(self) -> bool:
        """Whether a moved link or step time starts an exploration (``explore``)."""
        return self.estimate is None if self.explore is None else self.explore

    @property
    def probes(self) -> bool:
        """Whether checks measure the link by a probe (``measure="probe"``, no injected
        ``estimate``): a second reading is then a new measurement."""
        return self.estimate is None and self.measure == "probe"

    @property
    def explores_start(self) -> bool:
        """Whether the first check explores too (``explore_start``; needs ``explore``)."""
        return self.explores and self.explore_start

    def load_profile(self) -> Optional[Profile]:
        """The given profile (loaded from its path), or None."""
        if self.profile is None or isinstance(self.profile, Profile):
            return self.profile
        if isinstance(self.profile, (str, os.PathLike)):
            return Profile.load(self.profile)
        raise TypeError(f"Adaptive(profile=...) takes a Profile or a path to a profile JSON, "
                        f"found {type(self.profile).__name__}")


def should_switch(current_s: float, best_s: float, *, margin: float, switches: int,
                  max_switches: int) -> bool:
    """The decision rule: switch when the best plan is predicted faster by more than
    ``margin`` (relative to the current plan's time) and the cap is not reached.

    Example:
        >>> should_switch(1.0, 0.95, margin=0.1, switches=0, max_switches=3)
        False
        >>> should_switch(1.0, 0.5, margin=0.1, switches=3, max_switches=3)
        False
    """
    if switches >= max_switches or not (current_s > 0 and math.isfinite(current_s)):
        return False
    return (current_s - best_s) / current_s > margin
