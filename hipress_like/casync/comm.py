"""The engine's communication thread: one step's communication per wake-up.

Each step it either replays the recorded schedule (``replay.Replayer``, no
metadata round) or runs coordinated rounds (``rounds.Rounds``), recording a
schedule when the layout allows one (every gradient travels by allreduce).
A replay that some rank cannot finish (an error, other gradients) hands the
rest of the step to coordinated rounds. With ``threads=False`` the same
work runs inline inside ``synchronize``.

States: idle (waiting for ``wake``), running a step, *broken* (a transport
or protocol failure: the transport is not used again), stopped.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

from .replay import Replayer, Schedule
from .rounds import Rounds
from .transport.base import Transport

__all__ = ["Communicator"]


class Communicator:
    """Runs an engine's steps' communication (see the module docstring).

    Args:
        eng: the engine.
        data: the engine's own data channel (``transport.split()``), or None.
        threaded: run on a thread of its own.
    """

    def __init__(self, eng: Any, data: Optional[Transport], threaded: bool):
        self.eng = eng
        self.data = data
        self.rounds = Rounds(eng, data)
        self.replayer = Replayer(eng, data if data is not None else eng.transport)
        self.replayable = False  # set by register: the layout has collectives only
        self.schedule: Optional[Schedule] = None  # recorded by the last coordinated step
        self.replayed = 0
        self.broken = False
        self.started = threading.Event()
        self.done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if threaded:
            self._thread = threading.Thread(target=self._main, daemon=True,
                                            name=f"hipress-comm-{eng.rank}")
            self._thread.start()

    def _main(self) -> None:
        e = self.eng
        while True:
            self.started.wait()
            self.started.clear()
            # A rank that failed and is closing still reports its error first (one
            # round, or one replayed bucket and one round), so its peers fail naming
            # it instead of seeing its transport close under them.
            if e._closed and (e._error is None or self.broken):
                return
            self.run_step()
            self.done.set()
            if e._closed:
                return

    def run_step(self) -> None:
        """This step's communication (unless broken); a failure breaks the channel."""
        e = self.eng
        if self.broken:  # after a failure the transport is not used again
            return
        try:
            e._st.skipped = self._sync()
        except BaseException as err:
            self.broken = True
            e._fail(err, -1)

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
            if self.rounds.record and not self.eng._lane_partial():
                self.schedule = Schedule.of(self.rounds.record)
        finally:
            self.rounds.record = None
        return skipped

    def close(self) -> None:
        """Stop the thread (after ``eng._closed`` is set) and the round executor."""
        self.started.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.rounds.close()
