"""The CaSync engine: a facade over layout, step state, task graph and communication.

State, in the manner of dask's ``local.py``. The engine builds one
``context.StepContext`` and hands it, never itself, to its parts (the task
manager, the communicator, rounds, replay, fused buckets), so each part can
be read and tested alone. The context holds:

- ``layout`` (a read-only ``context.LayoutView`` of ``layout.Layout``, fixed
  by ``register``): per gradient its index; the lane's buckets, solo
  collectives, round groups, reductions and named algorithms, by key;
- ``st`` (``step.StepState``): everything the current step owns; replaced
  by a fresh one when ``synchronize`` returns;
- ``graph`` (``tasks.TaskGraph``): the step's tasks in the sets waiting,
  ready, running, done;
- ``life`` (``context.Life``, the one lifecycle enum): ``OPEN`` ->
  ``STEPPING`` (the communication thread is woken) -> ``SEALED``
  (``synchronize`` began) -> ``OPEN``; ``BROKEN`` once communication failed
  (the transport is not used again; ``error`` holds why); ``CLOSING`` /
  ``CLOSED`` by ``close``;
- ``error``/``error_arg``: the first error and the gradient it concerns;
- the lock ``cv``, the config, rank and size, the transport and data
  channel, the timeline, and the callbacks ``fail`` (``Engine._fail``) and
  ``deliver`` (``TaskManager.deliver``).

The engine itself keeps the full ``Layout``, the compressors' explicit
states (``_states``, keyed by gradient, partition and site; saved by
``state_dict``) and their undo copies (``nonfinite.py``).

Transitions of one step:

1. ``submit(name, tensor)`` checks the tensor, then either copies it into its
   lane bucket (``lane.py``; the bucket's last member makes it one collective)
   or has its workflow (``workflows.py``) add tasks through a
   ``builder.StepBuilder``. Ready compute tasks go to the computing executor;
   ready sends to ``st.outbox``; ready collectives to ``st.collective``;
   recvs wait in ``st.expect`` (``TaskManager.on_ready``). The first submit
   moves the life from ``OPEN`` to ``STEPPING`` and wakes the communication
   thread.
2. The communication thread (``comm.Communicator``) runs the step: a
   recorded schedule when there is one (``replay.Replayer``), else
   coordinated rounds (``rounds.Rounds``), which deliver received bytes to
   recv tasks and finish sends and collectives; finishing a task releases
   its dependents.
3. ``synchronize`` seals the step (``SEALED``), waits for the communication
   thread, raises the step's error on every rank, moves the finished tasks
   to the timeline, starts a fresh ``StepState`` and reopens (``OPEN``).

An error anywhere (``_fail``) is reported to every peer in the next round
(or replayed status words), so every rank raises, naming the failing rank;
a dead peer becomes a ``PeerError`` from the transport's timeout.

Between steps (``OPEN``, nothing submitted) ``set_plan`` may replace the
plan: the layout is rebuilt as ``register`` built it, the replay schedule
dropped, and compressor states kept only for gradients whose compressor and
partitions did not change (``plan="adaptive"``, ``tuning/online.py``).

Threads: the caller's (submit, synchronize), the computing executor (passed
in, or built from the config), the communication thread, and the round
executor (with a data channel).
"""
from __future__ import annotations

import json
import logging
import threading
import types
import zlib
from dataclasses import replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import msgpack
import torch

from ..compressors.base import Compressor, all_finite, check_gradient
from ..cost_model.plan import Plan
from .builder import StepBuilder
from .choice import Choice
from .comm import Communicator
from .config import EngineConfig, check_same_config, fingerprint
from .context import LayoutView, Life, StepContext
from .coordinator import ABSENT, COLLECTIVE
from .errors import ConfigMismatchError, EngineError, GradientMismatchError
from .executors import Executor, SyncExecutor, ThreadExecutor
from .lane import LaneBucket
from .layout import (
    KEY_LIMITS,
    GradLayout,
    Layout,
    build_layout,
    check_specs,
    describe_mismatch,
    digest_of,
    numel_of,
)
from .manager import TaskManager
from .nonfinite import StateUndo, finish_step
from .replay import Schedule
from .rounds import tell_peers
from .step import Handle, StepState
from .tasks import Kind, Task, TaskGraph
from .timeline import Event, Timeline
from .transport.base import Transport
from .workflows import add_gradient_tasks

__all__ = ["EngineConfig", "Engine", "Handle", "EngineError", "GradientMismatchError",
           "ConfigMismatchError"]

_log = logging.getLogger(__name__)

class Engine:
    """One rank's CaSync engine over a ``Transport``.

    Args:
        transport: the collectives (all ranks build an engine over theirs).
        config: an ``EngineConfig``; keyword overrides are applied on top.
        executor: the computing executor (``executors.py``); None builds the
            config's: a ``ThreadExecutor`` with ``threads=True``, else a
            ``SyncExecutor``. The engine shuts it down on ``close``.

    Example:
        eng = Engine(transport, EngineConfig(compressor="onebit"))
        eng.register([(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()])
        for n, p in model.named_parameters():
            eng.submit(n, p.grad)
        eng.synchronize()   # every p.grad now holds the average over ranks
    """

    def __init__(self, transport: Transport, config: Optional[EngineConfig] = None,
                 executor: Optional[Executor] = None, **overrides: Any):
        config = EngineConfig(**overrides) if config is None else replace(config, **overrides)
        self.config = config
        self.transport = transport
        self.rank, self.size = transport.rank, transport.size
        if self.size > KEY_LIMITS["ranks"]:
            raise ValueError(f"at most {KEY_LIMITS['ranks']} ranks are supported")
        self._choice = Choice(config, self.size)
        self.timeline = Timeline(self.rank)
        self.timeline.enabled = config.timeline
        self._states: Dict[str, Dict[str, Any]] = {}
        self._undo = StateUndo() if config.nonfinite in ("propagate", "skip") else None
        self._layout = Layout()
        self._specs: List[Tuple[str, Tuple[int, ...], torch.dtype]] = []
        self._lane_of: Dict[int, LaneBucket] = {}
        self._step = 0
        data = None
        if config.threads and config.pipeline:
            try:
                data = transport.split()
            except NotImplementedError:
                _log.info("transport %s has no split(); rounds are planned and executed "
                          "back to back", type(transport).__name__)
        if executor is None:
            executor = ThreadExecutor() if config.threads else SyncExecutor()
        # the graph routes ready tasks to the manager, which needs the context
        # (holding the graph): the callback closes the circle once both exist
        graph = TaskGraph(lambda task: self._tasks.on_ready(task))
        self._ctx = ctx = StepContext(config=config, rank=self.rank, size=self.size,
                                      transport=transport, graph=graph, data=data,
                                      timeline=self.timeline, fail=self._fail,
                                      deliver=lambda key, buf: self._tasks.deliver(key, buf))
        self._tasks = TaskManager(ctx, executor)
        self._comm = Communicator(ctx, threaded=config.threads)

    @property
    def plan(self) -> Optional[Plan]:
        """The fixed plan (None: the size rule, or not yet fixed by ``register``)."""
        return self._choice.plan

    @property
    def compressor(self) -> Compressor:
        """The compressor gradients get when the plan does not name one."""
        return self._choice.default

    def register(self, specs: Sequence[Tuple[str, Sequence[int], torch.dtype]]) -> None:
        """Declare the gradients (collective; every rank, same list and settings).

        Raises:
            GradientMismatchError: on every rank, if the ranks' lists differ
                (the message names the first differing gradient and ranks).
            ConfigMismatchError: on every rank, if the ranks' settings differ
                (the message names the setting and the ranks).
            ValueError: duplicate names, non-float dtypes, empty tensors.
        """
        self._raise_if_failed()
        specs = [(str(n), tuple(int(s) for s in shape), dt) for n, shape, dt in specs]
        check_specs(specs)
        fp = fingerprint(self.config, self.compressor, self.plan)
        mine = msgpack.packb([[[n, list(s), str(d)] for n, s, d in specs], fp])
        theirs = [msgpack.unpackb(t) for t in
                  self.transport.allgather_bytes(mine, self.config.timeout)]
        if any(t[0] != theirs[0][0] for t in theirs):
            raise GradientMismatchError(describe_mismatch([t[0] for t in theirs]))
        check_same_config([t[1] for t in theirs])
        sizes = {n: numel_of(s) * d.itemsize for n, s, d in specs}
        self._choice.fix_plan(self.transport, sizes, {n: s for n, s, _ in specs})
        self._choice.measure(self.transport)
        self._specs = specs
        self._build_layout()

    def _build_layout(self) -> None:
        """Lay out the registered gradients under the current plan (``register``,
        ``set_plan``); a recorded replay schedule is dropped (it was the old layout's)."""
        specs = self._specs
        if self.plan is not None:  # the same plan on every rank (fingerprint): same error
            sizes = {n: numel_of(s) * d.itemsize for n, s, d in specs}
            self.plan.check(sizes, strategy=self.config.strategy, world_size=self.size)
        layout = build_layout(specs, self._choice.decide, self._choice.compressor_for,
                              size=self.size, strategy=self.config.strategy,
                              raw_collective=self.config.raw_collective,
                              fusion_bytes=self.config.fusion_bytes,
                              fuse=self.config.coordinator,
                              back_for=self._choice.back_for)
        self._layout = layout
        self._lane_of = layout.lane_of()
        with self._ctx.cv:
            self._ctx.layout = LayoutView.of(layout)
        cfg = self.config
        self._comm.replayable = cfg.replay and cfg.coordinator and self.size > 1 \
            and layout.replayable()
        self._comm.schedule = None
        _log.debug("rank %d: layout for %d gradients", self.rank, len(layout.grads))

    def set_plan(self, plan: Plan) -> Dict[str, List[str]]:
        """Switch to ``plan`` at a step boundary (collective; every rank, same plan).

        Called between ``synchronize`` and the next ``submit`` (``plan="adaptive"``,
        ``tuning/online.py``). The layout is rebuilt under ``plan`` and the
        recorded replay schedule dropped. A gradient whose compressor (with its
        master compressor), workflow and partitions are unchanged keeps its
        compressor states (error feedback, PowerSGD's Q, DGC's momentum: they
        mean the same thing); every other gradient's states are reset, and the
        reset ones are logged by name.

        Returns:
            {"kept": gradients whose states were carried, "reset": gradients whose
            states were dropped}.

        Raises:
            RuntimeError: called inside a step (gradients submitted, not synchronised).
            ConfigMismatchError: on every rank, if the ranks passed different plans.
            ValueError: the plan does not fit the registered gradients.
        """
        self._raise_if_failed()
        with self._ctx.cv:
            if self._ctx.life is not Life.OPEN or self._ctx.st.submitted:
                raise RuntimeError("set_plan() inside a step: call it after synchronize() "
                                   "and before the next submit()")
        mine = zlib.crc32(json.dumps(plan.to_dict(), sort_keys=True).encode())
        theirs = [msgpack.unpackb(t) for t in self.transport.allgather_bytes(
            msgpack.packb(mine), self.config.timeout)]
        if len(set(theirs)) > 1:
            odd = [r for r, h in enumerate(theirs) if h != theirs[0]]
            raise ConfigMismatchError(f"set_plan: ranks {odd} passed another plan than rank "
                                      "0; every rank must switch to the same plan (decide "
                                      "from numbers agreed across ranks)")
        old, old_plan = self._layout, self._choice.plan
        self._choice.plan = plan
        try:
            self._build_layout()
        except BaseException:
            self._choice.plan = old_plan
            self._build_layout()
            raise
        kept, reset = [], []
        for name, g in self._layout.grads.items():
            o = old.grads[name]
            same = (repr(o.compressor), repr(o.back), o.workflow, o.parts, o.collective) == \
                (repr(g.compressor), repr(g.back), g.workflow, g.parts, g.collective)
            mine_keys = [k for k in self._states if k.startswith(f"{name}|")]
            if not mine_keys:
                continue
            if same:
                kept.append(name)
            else:
                reset.append(name)
                for k in mine_keys:
                    del self._states[k]
        if reset:
            _log.warning("rank %d: plan switch at step %d reset the compressor state of %d "
                         "gradient(s) whose compressor or partitions changed: %s", self.rank,
                         self._step, len(reset), ", ".join(reset))
        _log.info("rank %d: plan switched at step %d; compressor state carried for %d "
                  "gradient(s), reset for %d", self.rank, self._step, len(kept), len(reset))
        return {"kept": kept, "reset": reset}

    # -- submission ----------------------------------------------------------
    def submit(self, name: str, tensor: torch.Tensor) -> Handle:
        """Start synchronising gradient ``name``; the average is written into ``tensor``.

        Raises:
            KeyError: ``name`` was not registered.
            ValueError / TypeError: wrong shape or dtype, empty, NaN/Inf
                (with ``nonfinite="raise"``), submitted twice in one step.
        """
        self._raise_if_failed()
        g = self._layout.grads.get(name)
        if g is None:
            known = list(self._layout.grads)
            raise KeyError(f"gradient {name!r} was not registered; registered: "
                           f"{known[:10]}{' ...' if len(known) > 10 else ''}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"gradient {name!r}: expected a tensor, found {type(tensor).__name__}")
        if tuple(tensor.shape) != g.shape or tensor.dtype != g.dtype:
            raise ValueError(f"gradient {name!r}: registered as {g.shape} {g.dtype}, "
                             f"submitted {tuple(tensor.shape)} {tensor.dtype}")
        ctx = self._ctx
        ctx.device = tensor.device
        with ctx.cv:
            if ctx.sealed:
                raise RuntimeError("submit() after synchronize() began; call it in the next step")
            if name in ctx.st.submitted:
                raise ValueError(f"gradient {name!r} submitted twice in one step")
        lane = self._lane_of.get(g.idx)
        if lane is not None:
            return self._submit_to_lane(lane, g, tensor)
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        # a compressor that finds NaN/Inf in its own first pass spares the scan; "raise"
        # keeps it, so that this call raises as before
        fused = self.config.nonfinite in ("propagate", "skip") and g.compressor is not None \
            and g.compressor.capabilities.checks_finite
        if self.config.nonfinite != "ignore" and not fused and not all_finite(work) \
                and self._on_nonfinite(g.idx, name, g.compressor is not None):
            work.zero_()  # no compressor sees NaN; the step is undone (nonfinite.py)
        check_gradient(work, nonfinite="ignore", name=name)
        handle = Handle(name, tensor, work, self.config.timeout, self._raise_if_failed)
        st = self._admit(g, handle)
        b = StepBuilder(ctx.graph, st, g, handle, self.rank, self.size)
        # submit() scanned the gradient for NaN/Inf (or zeroed it), or the compressor
        # does in its first pass: the compressors' separate scans are skipped
        add_gradient_tasks(b, work, self._states, self._seed_of, undo=self._undo,
                           vouched=self.config.nonfinite != "ignore", step=st.index,
                           on_nonfinite=self._flagger(st) if fused else None,
                           own_push=self.config.own_push)
        b.seal()
        self._start_step()
        handle.release()
        return handle

    def _admit(self, g: GradLayout, handle: Handle) -> StepState:
        """Count ``g`` as submitted in the current step; return the step."""
        ctx = self._ctx
        with ctx.cv:
            st = ctx.st
            st.submitted.add(g.name)
            st.digest ^= digest_of(g.idx)
            st.handles.append(handle)
        return st

    def _on_nonfinite(self, idx: int, name: str, compressed: bool) -> bool:
        """Gradient ``name`` holds NaN/Inf: with ``nonfinite="raise"`` fail the step on
        every rank (the next report tells the peers) and raise here; else flag the
        step, which every rank then undoes (``nonfinite.py``). Returns whether to
        zero the gradient: for "skip", and before a compressor."""
        if self.config.nonfinite == "raise":
            err = ValueError(f"gradient {name!r} contains NaN or Inf (rank {self.rank}); lower "
                             "the learning rate, or pass nonfinite='propagate' (NaN reaches "
                             "every rank's gradients, as in DDP) or 'skip'")
            self._fail(err, idx)
            self._flush_error()
            raise err
        self._ctx.st.nonfinite = True
        return compressed or self.config.nonfinite == "skip"

    def _flagger(self, st: StepState) -> Callable[[], None]:
        """What an encode task calls when its compressor found NaN/Inf (``checks_finite``):
        flag step ``st``, which every rank then undoes (``nonfinite.py``)."""
        def flag() -> None:
            with self._ctx.cv:
                st.nonfinite = True
        return flag

    def _submit_to_lane(self, lane: LaneBucket, g: GradLayout, tensor: torch.Tensor) -> Handle:
        """``submit`` for a gradient of the collective lane: copy it into its bucket's
        slot; the bucket's last member checks it and reports it (``lane.py``)."""
        lane.slot(g.idx, tensor).view(g.shape).copy_(tensor)
        handle = Handle(g.name, tensor, tensor, self.config.timeout, self._raise_if_failed)
        handle.hold()  # released by the bucket's write_mean
        self._admit(g, handle)
        with self._ctx.cv:
            lane.arrived.append((g.idx, g.name, tensor, handle))
            full = lane.complete()
        if full:
            self._flush_lane(lane)
        self._start_step()
        handle.release()
        return handle

    def _flush_lane(self, lane: LaneBucket) -> None:
        """Check a bucket for NaN/Inf (per ``nonfinite``) and report it as one
        collective (a sum; the bucket's ``write_mean`` then writes the means)."""
        if self.config.nonfinite != "ignore":
            bad = lane.first_nonfinite()  # "propagate" lets Inf/NaN reach the sums, as DDP
            if bad is not None and self._on_nonfinite(*bad, compressed=False):
                lane.buf.zero_()
        lane.flushed = True
        t = Task(Kind.ALLREDUCE, f"bucket{lane.index}", 0, lambda: lane.buf, info="sum",
                 msg=(lane.key, COLLECTIVE))
        self._ctx.st.coll_keys.add(lane.key)
        self._ctx.graph.add(t, ())

    def _seed_of(self, key: str) -> int:
        return zlib.crc32(f"{self.config.seed}|{self.rank}|{key}".encode()) & 0x7FFFFFFF

    def _start_step(self) -> None:
        """``OPEN`` -> ``STEPPING``: wake the communication thread for this step."""
        ctx = self._ctx
        with ctx.cv:
            if ctx.life is Life.OPEN:
                ctx.become(Life.STEPPING)
                self._comm.started.set()

    # -- errors --------------------------------------------------------------
    def _fail(self, err: BaseException, grad_idx: int) -> None:
        """Record the first error and tell the peers at once (``rounds.tell_peers``: a
        peer already blocked in this step's exchange, e.g. a replayed one with no
        report round, would otherwise learn of it only at its timeout); the context's
        ``fail`` callback."""
        with self._ctx.cv:
            self._ctx.record_error(err, grad_idx)
            tell = self._ctx.error is err and not self._ctx.told
        if tell:
            tell_peers(self._ctx, err)
        self._start_step()

    def _flush_error(self) -> None:
        """Run (or wait for) the round that reports this rank's error to its peers."""
        if self.config.threads:
            self._comm.done.wait(self.config.timeout)
        else:
            self._comm.run_step()
            with self._ctx.cv:
                self._ctx.broken()

    def _raise_if_failed(self) -> None:
        err = self._ctx.error
        if err is not None:
            if isinstance(err, EngineError) or not isinstance(err, Exception):
                raise err
            raise EngineError(f"synchronisation failed on rank {self.rank}: {err}",
                              ranks=getattr(err, "ranks", ())) from err
        if self._ctx.life in (Life.CLOSING, Life.CLOSED):
            raise EngineError("the engine is closed")

    # -- step boundary -------------------------------------------------------
    def synchronize(self, timeout: Optional[float] = None) -> bool:
        """Close this step's submissions and wait until every gradient is averaged.

        Returns:
            True, or False when some rank saw NaN/Inf with ``nonfinite="skip"``
            (every rank returns False; "propagate" writes NaN: ``nonfinite.py``).

        Raises:
            EngineError, PeerError, GradientMismatchError: on every rank.
        """
        self._raise_if_failed()
        for lane in self._layout.lane:  # buckets some of whose gradients were not submitted
            if lane.arrived and not lane.flushed:
                self._flush_lane(lane)
        ctx = self._ctx
        with ctx.cv:
            if ctx.life is Life.OPEN:  # nothing submitted: wake the thread for the step
                self._comm.started.set()
            if ctx.life in (Life.OPEN, Life.STEPPING):  # (else a failure came meanwhile)
                ctx.become(Life.SEALED)
            ctx.st.unreported.extend((k, ABSENT, 0) for k in
                                     self._layout.grouped_round_keys(ctx.st.submitted))
            ctx.cv.notify_all()
        if self.config.threads:
            t = self.config.timeout if timeout is None else timeout
            if not self._comm.done.wait(t + 5.0):
                self._fail(TimeoutError(f"step {self._step} not done within {t:.0f} s"), -1)
        else:
            self._comm.started.clear()
            self._comm.run_step()
        self._raise_if_failed()
        st = ctx.st
        for h in st.handles:  # complete once the step is: a bounded check, no wait
            h.wait()
        done = ctx.graph.clear_done()
        if self.timeline.enabled:
            self.timeline.extend(Event(t.kind.value, t.grad, t.part, t.start, t.end, t.nbytes,
                                       t.queue, self._step) for t in done)
        ok = finish_step(self._undo, self._states, st.skipped, st.handles,
                         self._layout.grads, self.config.nonfinite)
        self._step += 1
        with ctx.cv:
            ctx.st = StepState(self._step)
            for lane in self._layout.lane:
                lane.reset()
            if ctx.life is Life.SEALED:
                ctx.become(Life.OPEN)
        self._comm.done.clear()
        return ok

    @property
    def collectives(self) -> Dict[str, str]:
        """``Layout.collectives``: gradient -> its named collective ("auto" resolved)."""
        return self._layout.collectives()

    @property
    def gradient_sizes(self) -> Dict[str, int]:
        """Registered gradient -> its bytes, in registration order."""
        return {n: numel_of(s) * d.itemsize for n, s, d in self._specs}

    @property
    def step(self) -> int:
        """Number of completed synchronisation steps."""
        return self._step

    def share(self, values: Optional[Sequence[float]]) -> None:
        """Share up to ``replay.SHARE_VALUES`` numbers (each in 0 .. ``replay.SHARE_MAX``,
        kept to ``replay.SHARE_UNIT``) with every rank in the next replayed step's status
        words, at no collective of their own (``replay.py``'s module docstring); None
        shares nothing. ``shared`` then returns their means over ranks."""
        with self._ctx.cv:
            self._ctx.share = None if values is None else tuple(float(v) for v in values)

    def shared(self) -> Optional[Tuple[float, ...]]:
        """The means over ranks of the values ``share``d, carried by the step just
        synchronised; the same on every rank. None when that step was not replayed to
        its end (coordinated, or stopped by a rank's error or miss), or some rank
        shared nothing, or the last bucket's first group could not carry them (not
        summed, or narrower than float32)."""
        with self._ctx.cv:
            got = self._ctx.shared
        return got[1] if got is not None and got[0] == self._step - 1 else None

    @property
    def replayed_steps(self) -> int:
        """Steps whose communication replayed a recorded schedule, with no metadata
        round (``EngineConfig.replay``); the others were coordinated."""
        return self._comm.replayed

    def layout(self) -> Dict[str, Dict[str, Any]]:
        """``Layout.describe``: per gradient, compress?, compressor, master compressor,
        workflow, named collective, partitions and aggregators."""
        return self._layout.describe()

    # -- state -----------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Compressor states (error feedback, warm starts, momenta), the step count, and
        the recorded replay schedule (``replay.Schedule.to_list`` says why)."""
        sched = self._comm.schedule
        return {"format": "hipress-like-engine", "version": 1, "step": self._step,
                "compressor": repr(self.compressor), "compressors": self._layout.compressors(),
                "states": {k: dict(v) for k, v in self._states.items()},
                "replay_schedule": sched.to_list() if sched is not None else None}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (same compressor and gradients).

        Raises:
            ValueError: not an engine state, or saved with another compressor or,
                per gradient, another plan.
        """
        self._layout.check_saved(d, self.compressor)
        self._states.clear()
        self._states.update({k: dict(v) for k, v in d["states"].items()})
        self._step = int(d.get("step", 0))
        self._ctx.st.index = self._step
        if d.get("replay_schedule") is not None and self._comm.replayable:
            self._comm.schedule = Schedule.from_list(d["replay_schedule"])

    def compressors_in_use(self) -> List[Compressor]:
        """The distinct compressor instances the current layout encodes with (one per
        plan entry's compressor and parameters); ``plan="adaptive"``'s ratio search
        sets their ``ratio`` between steps (``tuning/ratio_search.py``)."""
        return self._layout.compressor_instances()

    def compressor_states(self) -> Mapping[str, Mapping[str, Any]]:
        """The live compressor states by key, read-only (copy what is kept: the next
        encode updates them)."""
        return types.MappingProxyType(self._states)

    def load_compressor_states(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the compressor states by ``states`` (a copy taken from
        ``compressor_states``, of this layout) between steps; the step count and the
        replay schedule stay."""
        with self._ctx.cv:
            if self._ctx.st.submitted:
                raise RuntimeError("load_compressor_states() inside a step: call it after "
                                   "synchronize()")
        self._states.clear()
        self._states.update({k: dict(v) for k, v in states.items()})

    def reset_state(self) -> None:
        """Forget every compressor state (they start fresh at the next encode)."""
        self._states.clear()

    def close(self) -> None:
        """Stop the threads; free the data channel from ``transport.split()`` once every
        rank has closed it (up to 10 s). A failed engine, one closed at interpreter
        exit, or one whose peers wait in a collective it left (closed mid-step by an
        exception) does not wait for peers that may never close: they learn of this
        rank's exit from the transport at once. The transport passed in stays open.
        """
        ctx = self._ctx
        with ctx.cv:
            if ctx.life in (Life.CLOSING, Life.CLOSED):
                return
            # an error the peers were not told yet (BROKEN: they were) gets one last step
            told = (ctx.error is None or ctx.life is Life.BROKEN or ctx.told
                    or not self.config.threads)
            ctx.become(Life.CLOSED if told else Life.CLOSING)
        self._comm.close()
        self._tasks.executor.shutdown()
        if ctx.data is not None:
            self._free(ctx.data, "the data channel", watch=[self.transport])

    def _free(self, channel: Transport, what: str, watch: Sequence[Transport] = ()) -> None:
        """``channel.free`` after ``close``: wait up to 10 s for the peers to close theirs,
        not at all after a failure or at interpreter exit (``close``'s rule)."""
        exiting = not threading.main_thread().is_alive()
        wait = 0.0 if self._ctx.error is not None or exiting else min(self.config.timeout,
                                                                        10.0)
        try:
            if not channel.free(wait, watch=watch):
                _log.debug("rank %d: peers did not close their engines within %.0f s; "
                           "%s is left to process exit", self.rank, wait, what)
        except Exception as e:  # closing must not mask the caller's error
            _log.debug("rank %d: closing %s failed: %s", self.rank, what, e)

    def free_transport(self) -> None:
        """Close the engine, then free the transport it was given (its process group,
        threads and sockets) by ``close``'s rule: for the owner that opened that
        transport for this engine alone (``adapters.engine_builder.close_engine``)."""
        self.close()
        self._free(self.transport, "the transport")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
