"""Elastic training, framework-neutral: the state that survives a re-formed world, and
``run``, which re-forms it.

Horovod's elastic API (``horovod.common.elastic``) in this project's terms,
shared by every face: ``State`` keeps named scalars (``state.epoch``), reset
callbacks and the driver's host notifications, and defines what ``commit``,
``restore`` and ``sync`` do in order; a face's state class (``TorchState``
in ``adapters.torch.elastic``, ``TensorFlowState``/``TensorFlowKerasState``
in ``adapters.tensorflow.elastic``) says how its objects are copied, put
back, written to a checkpoint file, read from one and broadcast.

``run(func)`` runs ``func(state, ...)`` so that a peer failure resumes from
the last commit:

- under torchrun's elastic agent (``--max-restarts``, ``--nnodes MIN:MAX``)
  a peer failure makes the worker leave with ``RESTART_EXIT_CODE`` at once;
  the agent starts fresh workers, whose ``restore`` reads the last checkpoint
  a commit wrote;
- under ``horovodrun``'s elastic mode (``HOROVOD_ELASTIC=1``) the survivors
  stay: the world re-forms in the process (``runtime.reform``), ``restore``
  goes back to the last commit in memory, and a host the driver adds or
  removes is seen at the next ``commit`` (``State.check_host_updates``);
- elsewhere a peer failure is raised as it is.

``adapters.torch.elastic``'s docstring tells the whole story for PyTorch.
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import queue
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..casync.errors import ConfigMismatchError, EngineError, GradientMismatchError
from ..casync.transport.base import TransportError
from .objects import broadcast_object
from .runtime import horovod_elastic, is_initialized, rank, reform, size

__all__ = ["State", "run", "check_host_updates", "RESTART_EXIT_CODE", "ENV_CHECKPOINT",
           "ENV_CHECKPOINT_EVERY"]

log = logging.getLogger(__name__)

# EX_TEMPFAIL (sysexits.h): "try again later", which is what torchrun's agent does.
RESTART_EXIT_CODE = 75
ENV_CHECKPOINT = "HIPRESS_ELASTIC_CHECKPOINT"
ENV_CHECKPOINT_EVERY = "HIPRESS_ELASTIC_CHECKPOINT_EVERY"
# horovodrun's elastic mode: the same commit failing again this often is raised (a
# failure that re-forming the world does not cure, e.g. the script's own bug)
_MAX_FAILURES_PER_COMMIT = 3


def _peer_failures() -> Tuple[type, ...]:
    """The exceptions that mean "a peer is gone": the engine's and the transports',
    and torch.distributed's own (a user collective over gloo or NCCL)."""
    kinds: List[type] = [EngineError, TransportError, ConnectionError]
    try:
        import torch.distributed as dist

        kinds.append(dist.DistError)
    except (ImportError, AttributeError):  # a torch built without distributed
        pass
    return tuple(kinds)


def _is_peer_failure(e: BaseException) -> bool:
    # ranks that disagree on gradients or settings would fail the same way after a
    # restart: those are the user's to fix, never retried
    if isinstance(e, (GradientMismatchError, ConfigMismatchError)):
        return False
    return isinstance(e, _peer_failures())


def _restarts_left() -> int:
    """How many more times torchrun's agent will restart this worker group (0 when
    this process was not started by torchrun's elastic agent)."""
    try:
        most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0
    return max(0, most - done)


def check_host_updates() -> None:
    """Nothing to do under torchrun: its agent owns the membership.

    Horovod's ``check_host_updates`` asks the driver whether hosts were
    added or removed and raises ``HostsUpdatedInterrupt`` on every rank at
    the same commit. Under torchrun there is no driver to ask: a host that
    arrives (or leaves) is seen by the agents' rendezvous, which stops this
    worker group and starts a new one; the new workers resume from the last
    checkpoint (``run``). Kept so that Horovod scripts calling it run
    unchanged.

    Example:
        >>> check_host_updates()   # returns None
    """
    return None


class State:
    """Named scalars, reset callbacks and host notifications; the order of a commit, a
    restore and a sync. A face's subclass supplies its objects' copy (``_capture``),
    restoration (``_apply``), checkpoint file (``_write``/``_read``) and broadcast
    (``_broadcast``).

    Args:
        checkpoint: the checkpoint file (a directory every host sees);
            default ``$HIPRESS_ELASTIC_CHECKPOINT``; None keeps commits in
            memory only, which no restarted process can read.
        checkpoint_every: write the file every this many commits (default
            ``$HIPRESS_ELASTIC_CHECKPOINT_EVERY`` or 1).
        **scalars: the named values, exposed as attributes (``epoch=0``).

    Raises:
        ValueError: ``checkpoint_every`` is not a positive integer.
    """

    #: keep the objects as they are at construction and after each ``sync`` for a
    #: ``restore`` with no commit and no checkpoint (Horovod's TensorFlow states do;
    #: such a subclass sets its objects before calling ``State.__init__``)
    baseline = False

    def __init__(self, *, checkpoint: Optional[str] = None,
                 checkpoint_every: Optional[int] = None, **scalars: Any):
        every = checkpoint_every if checkpoint_every is not None else \
            os.environ.get(ENV_CHECKPOINT_EVERY, "1")
        try:
            every = int(every)
        except ValueError:
            every = 0
        if every < 1:
            raise ValueError(f"{type(self).__name__}: checkpoint_every (or "
                             f"${ENV_CHECKPOINT_EVERY}) must be a positive integer, found "
                             f"{checkpoint_every!r}; pass e.g. checkpoint_every=1 to write "
                             "every commit")
        self.checkpoint = checkpoint if checkpoint is not None else \
            os.environ.get(ENV_CHECKPOINT) or None
        self.checkpoint_every = every
        self.commits = 0
        self.restored_from: Optional[str] = None  # the file a restore read, if any
        self.restored_world_size: Optional[int] = None  # its world size
        self._names = list(scalars)
        self._saved: Optional[Dict[str, Any]] = None
        self._baseline: Optional[Dict[str, Any]] = None
        self._reset_callbacks: List[Callable[[], None]] = []
        # horovodrun's elastic mode: the driver's host notifications (on_hosts_updated)
        self._host_messages: "queue.Queue[Tuple[float, int]]" = queue.Queue()
        self._last_updated_timestamp = 0.0
        for k, v in scalars.items():
            setattr(self, k, v)
        if self.baseline:  # a subclass sets its objects before calling this
            self._keep_baseline()

    # -- what a face's state supplies --------------------------------------------------------
    def _capture(self) -> Dict[str, Any]:
        """A copy of the framework objects (kept in memory by ``save``)."""
        return {}

    def _apply(self, saved: Dict[str, Any], fresh_compressor_state: bool) -> None:
        """Put ``_capture``'s copy back into the objects."""

    def _write(self, path: str, objects: Dict[str, Any], extra: Dict[str, Any]) -> None:
        """Write the objects (``objects``: the commit's ``_capture``, for a face that
        writes that copy) and ``extra`` (scalars, commits, world size) to ``path`` (a
        collective: every rank calls it at the same commit)."""
        raise NotImplementedError(f"{type(self).__name__} writes no checkpoint")

    def _read(self, path: str) -> Dict[str, Any]:
        """Load the objects from ``path``; return the ``extra`` written with them."""
        raise NotImplementedError(f"{type(self).__name__} reads no checkpoint")

    def _broadcast(self) -> None:
        """Give every rank rank 0's objects (a collective)."""

    # -- Horovod's State surface ------------------------------------------------------------
    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` after the world re-formed (e.g. rescale the lr)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (``run`` does, after restoring a checkpoint)."""
        self._host_messages = queue.Queue()
        for cb in self._reset_callbacks:
            cb()

    def on_hosts_updated(self, timestamp: float, update_res: int) -> None:
        """Horovod's driver added or removed hosts (called by its worker notification
        service, horovodrun's elastic mode); ``check_host_updates`` acts on it."""
        self._host_messages.put((timestamp, update_res))

    def check_host_updates(self) -> None:
        """Under horovodrun's elastic mode, raise ``HostsUpdatedInterrupt`` on every rank
        at once when the driver announced a host change (Horovod's ``State`` logic: the
        ranks agree on the newest notification through a broadcast from rank 0);
        elsewhere nothing (``check_host_updates``, the module function).

        Raises:
            horovod.common.exceptions.HostsUpdatedInterrupt: hosts changed; ``run``
                re-forms the world (its ``skip_sync`` is set when hosts were only
                removed).
        """
        if not horovod_elastic():
            return check_host_updates()
        from horovod.common.exceptions import HostsUpdatedInterrupt
        from horovod.runner.elastic.worker import HostUpdateResult

        last = prev = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            ts, res = self._host_messages.get()
            if ts > last:
                last = ts
                update |= res
        prev, self._last_updated_timestamp, update = broadcast_object(
            (float(prev), float(last), int(update)) if rank() == 0 else None, 0,
            "elastic.host_updates")
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(update == int(HostUpdateResult.removed))

    def scalars(self) -> Dict[str, Any]:
        """The named scalars' current values."""
        return {k: getattr(self, k) for k in self._names}

    def save(self) -> None:
        """Keep a copy of the objects and the scalars in memory."""
        self._saved = {"objects": self._capture(), "scalars": copy.deepcopy(self.scalars())}

    def commit(self) -> None:
        """Save in memory, write the checkpoint when it is due, check for new hosts.

        A collective when the checkpoint is written (every rank commits at
        the same step).
        """
        self.save()
        self.commits += 1
        if self.checkpoint is not None and self.commits % self.checkpoint_every == 0:
            self._write(self.checkpoint, self._saved["objects"],
                        {"scalars": self._saved["scalars"], "commits": self.commits,
                         "world_size": size() if is_initialized() else 1})
        self.check_host_updates()

    def restore(self, *, fresh_compressor_state: bool = False) -> bool:
        """Go back to the last commit.

        From memory when this process committed; otherwise from the
        checkpoint file when there is one (a process torchrun started after
        a failure); otherwise, for a state that keeps a baseline, to the
        objects as they were built or last synced; otherwise nothing changes.

        Args:
            fresh_compressor_state: leave the compressor state out of an
                in-memory restore (``run`` after horovodrun re-formed the world:
                it was this rank's in the world just left).

        Returns:
            True when something was restored.

        Raises:
            CheckpointError: the checkpoint file is incomplete or corrupted.
        """
        if self._saved is not None:
            saved = copy.deepcopy(self._saved)
            self._apply(saved["objects"], fresh_compressor_state)
            self._set(saved["scalars"])
            return True
        if self.checkpoint is not None and os.path.exists(self.checkpoint):
            extra = self._read(self.checkpoint)
            self._set(extra.get("scalars", {}))
            self.commits = int(extra.get("commits", 0))
            self.restored_from = self.checkpoint
            self.restored_world_size = extra.get("world_size")
            log.info("restored commit %d from %s (saved by %s ranks, now %s)", self.commits,
                     self.checkpoint, self.restored_world_size,
                     size() if is_initialized() else 1)
            self.save()
            return True
        if self._baseline is not None:
            saved = copy.deepcopy(self._baseline)
            self._apply(saved["objects"], fresh_compressor_state)
            self._set(saved["scalars"])
            return True
        return False

    def sync(self) -> None:
        """Make every rank hold rank 0's objects and scalars (a collective)."""
        if is_initialized() and size() > 1:
            self._broadcast()
            self._set(broadcast_object(self.scalars() if rank() == 0 else None, 0,
                                       f"elastic.{type(self).__name__}.sync"))
        if self.baseline:
            self._keep_baseline()

    def _keep_baseline(self) -> None:
        self._baseline = {"objects": self._capture(), "scalars": copy.deepcopy(self.scalars())}

    def _set(self, scalars: Dict[str, Any]) -> None:
        for k, v in scalars.items():
            if k not in self._names:
                self._names.append(k)
            setattr(self, k, v)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` so that a peer failure re-forms the world and resumes.

    Algorithm (module docstring):

    1. ``state.restore()``: in a process torchrun started after a failure,
       the last checkpoint; then the reset callbacks when a checkpoint was
       read, and ``state.sync()``.
    2. ``func(state, *args, **kwargs)``.
    3. A peer failure (``EngineError``, ``TransportError``, torch's
       ``DistError``, a closed connection) while torchrun has restarts
       left: log it and leave the process with ``RESTART_EXIT_CODE`` at
       once (``os._exit``: the teardown would wait for dead peers), so that
       torchrun re-forms the world. Anything else, or no restarts left:
       raised as it is.

    Args:
        func: the training function; its first argument is the state.

    Returns:
        The wrapped function, returning what ``func`` returns.

    Example:
        >>> @run
        ... def train(state):
        ...     return state.step
        >>> train(State(step=3))
        3
    """
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if horovod_elastic():
            return _run_horovod_elastic(func, state, args, kwargs)
        if state.restore() and state.restored_from is not None:
            state.on_reset()
        state.sync()
        try:
            return func(state, *args, **kwargs)
        except BaseException as e:
            if not _is_peer_failure(e) or _restarts_left() == 0:
                raise
            who = rank() if is_initialized() else 0
            log.error("rank %s: a peer failed (%s: %s); leaving with exit code %d so that "
                      "torchrun re-forms the world (%d restart(s) left), which resumes from "
                      "commit %d", who, type(e).__name__, e, RESTART_EXIT_CODE,
                      _restarts_left(), state.commits)
            for h in logging.getLogger().handlers + log.handlers:
                h.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(RESTART_EXIT_CODE)
    return wrapper


def _run_horovod_elastic(func: Callable[..., Any], state: State, args: tuple,
                         kwargs: dict) -> Any:
    """``run`` under horovodrun's elastic driver: re-form in process (module docstring)."""
    from horovod.common.elastic import notification_manager
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

    notification_manager.init()
    notification_manager.register_listener(state)
    skip_sync = False
    failures, at_commit = 0, -1  # consecutive failures at one commit (a bounded retry)
    try:
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:  # every rank, at the same commit
                skip_sync, failed = e.skip_sync, False
                log.warning("rank %d: the elastic driver changed the hosts; re-forming the "
                            "world from commit %d", rank(), state.commits)
            except BaseException as e:
                if not (isinstance(e, HorovodInternalError) or _is_peer_failure(e)):
                    raise
                failures = failures + 1 if state.commits == at_commit else 1
                at_commit = state.commits
                if failures > _MAX_FAILURES_PER_COMMIT:  # it is not a peer that comes and goes
                    raise
                skip_sync, failed = False, True
                log.error("rank %d: a peer failed (%s: %s); re-forming the world and resuming "
                          "from commit %d", rank(), type(e).__name__, str(e)[:500],
                          state.commits)
            reform()
            if failed:  # a host update comes at a commit: the state is that commit already
                state.restore(fresh_compressor_state=True)
            state.on_reset()
    finally:
        notification_manager.remove_listener(state)
