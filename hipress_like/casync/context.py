"""What the engine's parts may see: a narrow, typed ``StepContext`` and the one ``Life`` enum.

The engine's parts (the task manager, the communicator, coordinated rounds,
replay, fused buckets) never receive the engine. Each gets one
``StepContext``, the way dask's local scheduler hands a task only what it
needs (``dask/local.py``): so each part can be read, and unit-tested with a
small context of its own, without an engine or its threads.

What a context holds:

- fixed for the engine's life: ``cv`` (the lock and condition that guard
  the step state), ``graph`` (the task graph), ``config``, ``rank``/``size``,
  ``transport`` (metadata rounds), ``data`` (the data channel from
  ``transport.split()``, or None), ``timeline``, and two callbacks a part
  calls back with: ``fail(err, grad_idx)`` (record the first error; the next
  round reports it to every peer) and ``deliver(key, buf)`` (a message
  arrived for recv task ``key``);
- replaced by the engine, under ``cv``: ``st`` (the current ``StepState``,
  a fresh one each step), ``layout`` (a read-only ``LayoutView``, fixed by
  ``register``), ``life`` (a ``Life``), ``error``/``error_arg`` (the first
  error and its gradient), ``told`` (that error was told to the peers by an
  abort, ``rounds.tell_peers``: no metadata round reports it), ``device``
  (of the gradients: a replay's stand-in zeros go there).

Life, the one lifecycle state (it replaces the engine's ``_closed``, the
communicator's ``broken`` and a step's ``closed`` and ``active`` flags)::

    OPEN --first submit / an error--> STEPPING --synchronize--> SEALED
      ^--------------------synchronize returns----------------------'
    OPEN, STEPPING, SEALED --communication failed--> BROKEN
    any --close, an error not yet told to the peers--> CLOSING --one step--> CLOSED
    any --close--> CLOSED

``STEPPING``: the communication thread was woken for this step and
submissions are still accepted; ``SEALED``: ``synchronize`` began, nothing
more is submitted this step. ``BROKEN``: the transport is not used again
(``error`` says why). A step still in flight when the engine closes counts
as sealed: this rank submits nothing more, and its rounds say so.

Whether a step is *skipped* (some rank saw NaN/Inf with
``nonfinite="skip"``) is not lifecycle: it is the step's result, which
the communication writes to ``StepState.skipped`` (``nonfinite.py``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Callable, Dict, FrozenSet, Mapping, Optional, Tuple

import torch

from .config import EngineConfig
from .lane import LaneBucket
from .layout import Layout
from .step import StepState
from .tasks import TaskGraph
from .timeline import Timeline
from .transport.base import Transport

__all__ = ["Life", "LayoutView", "StepContext"]


class Life(str, Enum):
    """The engine's lifecycle (the module docstring draws the transitions)."""

    OPEN = "open"  # between steps, or a step whose communication is not woken yet
    STEPPING = "stepping"  # the communication thread runs this step; submissions open
    SEALED = "sealed"  # synchronize began: no more submissions this step
    BROKEN = "broken"  # the communication failed: the transport is not used again
    CLOSING = "closing"  # closed with an error the peers were not told: one last step
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


# Allowed transitions: anything else is a bug in the engine, raised at once.
_NEXT: Dict[Life, FrozenSet[Life]] = {
    Life.OPEN: frozenset({Life.STEPPING, Life.SEALED, Life.BROKEN, Life.CLOSING, Life.CLOSED}),
    Life.STEPPING: frozenset({Life.SEALED, Life.BROKEN, Life.CLOSING, Life.CLOSED}),
    Life.SEALED: frozenset({Life.OPEN, Life.BROKEN, Life.CLOSING, Life.CLOSED}),
    Life.BROKEN: frozenset({Life.CLOSED}),
    Life.CLOSING: frozenset({Life.CLOSED}),
    Life.CLOSED: frozenset(),
}


@dataclass(frozen=True)
class LayoutView:
    """What the parts read of the layout (``layout.Layout``), by message key.

    Attributes:
        lane: the collective lane's static buckets (``lane.py``).
        lane_by_key: a lane bucket's collective key -> the bucket.
        solo: keys of collectives that run alone (a named algorithm).
        groups: static round groups (``Coordinator``'s ``groups``).
        ops: collective key -> its reduction ("sum" when absent).
        algos: collective key -> its named algorithm.
        names: gradient index -> name (errors name gradients).
        index: gradient name -> index.
    """

    lane: Tuple[LaneBucket, ...] = ()
    lane_by_key: Mapping[int, LaneBucket] = field(default_factory=dict)
    solo: FrozenSet[int] = frozenset()
    groups: Mapping[int, Tuple[int, ...]] = field(default_factory=dict)
    ops: Mapping[int, str] = field(default_factory=dict)
    algos: Mapping[int, str] = field(default_factory=dict)
    names: Mapping[int, str] = field(default_factory=dict)
    index: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, layout: Layout) -> "LayoutView":
        """The view of ``layout`` (read-only mappings over its tables).

        Example:
            >>> LayoutView.of(Layout()).lane_partial()
            False
        """
        return cls(lane=tuple(layout.lane),
                   lane_by_key=MappingProxyType({b.key: b for b in layout.lane}),
                   solo=frozenset(layout.solo), groups=MappingProxyType(layout.groups),
                   ops=MappingProxyType(layout.ops), algos=MappingProxyType(layout.algos),
                   names=MappingProxyType({g.idx: g.name for g in layout.grads.values()}),
                   index=MappingProxyType({g.name: g.idx for g in layout.grads.values()}))

    def lane_partial(self) -> bool:
        """Some lane bucket got only part of its gradients this step (frozen parameters)."""
        return any(b.arrived and not b.complete() for b in self.lane)

    def grad_index(self, name: str) -> int:
        """The registration index of gradient ``name`` (-1 for a lane bucket's task)."""
        return self.index.get(name, -1)


def _no_fail(err: BaseException, grad_idx: int) -> None:
    raise err


def _no_deliver(key: int, buf: torch.Tensor) -> None:
    raise RuntimeError(f"message {key} arrived, but this context delivers nowhere; "
                       "pass deliver= (the task manager's) to StepContext")


@dataclass(eq=False)
class StepContext:
    """The engine's shared state, as its parts see it (see the module docstring).

    Fields after ``graph`` have defaults so a test builds a context with the
    few it needs. ``st``, ``layout``, ``life``, ``error``, ``error_arg`` and
    ``device`` change while the engine runs: read and write them with ``cv``
    held (``error`` is also read without it, as a hint that is re-checked).

    Args:
        config: the engine's settings.
        rank, size: this rank and the world size.
        transport: the metadata rounds' collectives (and a step's without ``data``).
        graph: the task graph.
        cv: the lock and condition of the step state.
        data: the data channel of the round executor (``transport.split()``).
        timeline: where rounds and buckets log their events.
        fail: ``fail(err, grad_idx)`` records the first error.
        deliver: ``deliver(key, buf)`` hands a received message to its recv task.
    """

    config: EngineConfig
    rank: int
    size: int
    transport: Transport
    graph: TaskGraph
    cv: threading.Condition = field(default_factory=threading.Condition)
    data: Optional[Transport] = None
    timeline: Timeline = field(default_factory=lambda: Timeline(0))
    fail: Callable[[BaseException, int], None] = _no_fail
    deliver: Callable[[int, torch.Tensor], None] = _no_deliver
    st: StepState = field(default_factory=lambda: StepState(0))
    layout: LayoutView = field(default_factory=LayoutView)
    life: Life = Life.OPEN
    error: Optional[BaseException] = None
    error_arg: int = -1
    told: bool = False  # this rank's error was told to the peers (``rounds.tell_peers``)
    # values this rank shares in the next replayed step's status words (``Engine.share``),
    # and (step index, their means over ranks or None) from the last replayed step
    share: Optional[Tuple[float, ...]] = None
    shared: Optional[Tuple[int, Optional[Tuple[float, ...]]]] = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def become(self, life: Life) -> None:
        """Move to ``life`` (call with ``cv`` held).

        Raises:
            RuntimeError: the transition is not one of the module docstring's.
        """
        if life is not self.life and life not in _NEXT[self.life]:
            raise RuntimeError(f"engine lifecycle: expected a move from {self.life} to one "
                               f"of {sorted(str(x) for x in _NEXT[self.life])}, found one to "
                               f"{life}; this is a bug in the engine, please report it")
        self.life = life

    @property
    def sealed(self) -> bool:
        """Nothing more is submitted this step (``synchronize`` began, or the engine
        stopped)."""
        return self.life not in (Life.OPEN, Life.STEPPING)

    def record_error(self, err: BaseException, grad_idx: int) -> bool:
        """Keep ``err`` if it is the first error (call with ``cv`` held); wake the
        waiters. Returns whether it was the first."""
        first = self.error is None
        if first:
            self.error = err
            self.error_arg = grad_idx
        self.cv.notify_all()
        return first

    def broken(self) -> None:
        """The communication failed (call with ``cv`` held): the transport is not
        used again. A closing engine that just told its peers is closed."""
        if self.life is Life.CLOSING:
            self.become(Life.CLOSED)
        elif self.life in (Life.OPEN, Life.STEPPING, Life.SEALED):
            self.become(Life.BROKEN)

