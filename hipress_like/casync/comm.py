"""The engine's communication thread: one step's communication per wake-up.

Each step it either replays the recorded schedule (``replay.Replayer``, no
metadata round) or runs coordinated rounds (``rounds.Rounds``), recording a
schedule when the layout allows one (every gradient travels by allreduce).
A replay that some rank cannot finish (an error, other gradients) hands the
rest of the step to coordinated rounds. With ``threads=False`` the same
work runs inline inside ``synchronize``.

It sees the engine only through its ``StepContext`` (``context.py``) and
follows the context's ``Life``: it waits for ``started`` (set when a step
leaves ``OPEN``), runs the step, sets ``done``; a failure moves the life to
``BROKEN`` (the transport is not used again); ``CLOSED`` stops the thread,
``CLOSING`` after one last step that tells the peers this rank's error.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

from .context import Life
from .replay import Replayer, Schedule
from .rounds import Rounds, tell_peers

if TYPE_CHECKING:
    from .context import StepContext

__all__ = ["Communicator"]


class Communicator:
    """Runs the steps' communication (see the module docstring).

    Args:
        ctx: the engine's step context (``ctx.data``, the data channel, may be None).
        threaded: run on a thread of its own.
    """

    def __init__(self, ctx: "StepContext", threaded: bool):
        self.ctx = ctx
        self.rounds = Rounds(ctx)
        self.replayer = Replayer(ctx, ctx.data if ctx.data is not None else ctx.transport)
        self.replayable = False  # set by register: the layout has collectives only
        self.schedule: Optional[Schedule] = None  # recorded by the last coordinated step
        self.replayed = 0
        self.started = threading.Event()
        self.done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if threaded:
            self._thread = threading.Thread(target=self._main, daemon=True,
                                            name=f"hipress-comm-{ctx.rank}")
            self._thread.start()

    def _main(self) -> None:
        c = self.ctx
        while True:
            self.started.wait()
            self.started.clear()
            # A rank that failed and is closing (CLOSING) still reports its error
            # first (one round, or one replayed bucket and one round), so its peers
            # fail naming it instead of seeing its transport close under them.
            if c.life is Life.CLOSED:
                return
            self.run_step()
            self.done.set()
            if c.life in (Life.CLOSING, Life.CLOSED):
                with c.cv:
                    c.become(Life.CLOSED)
                return

    def run_step(self) -> None:
        """This step's communication (unless broken); a failure breaks the channel."""
        c = self.ctx
        if c.life in (Life.BROKEN, Life.CLOSED):  # the transport is not used again
            return
        try:
            c.st.skipped = self._sync()
        except BaseException as err:
            tell_peers(c, err)
            with c.cv:
                c.broken()
            c.fail(err, -1)

    def _sync(self) -> bool:
        """Replay or coordinate one step; returns whether the step is skipped."""
        sched = self.schedule
        if sched is not None:
            skipped = self.replayer.step(sched)
            if skipped is not None:
                self.replayed += 1
                return skipped
            self.schedule = None  # the next step records afresh
            return self.rounds.step()
        if not self.replayable:
            return self.rounds.step()
        self.rounds.record = []
        try:
            skipped = self.rounds.step()
            # a step with lane buckets missing members (parameters without gradients)
            # would miss again: keep coordinating such steps
            if self.rounds.record and not self.ctx.layout.lane_partial():
                self.schedule = Schedule.of(self.rounds.record)
        finally:
            self.rounds.record = None
        return skipped

    def close(self) -> None:
        """Stop the thread (once the life is ``CLOSING`` or ``CLOSED``) and the round
        executor."""
        self.started.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.rounds.close()
