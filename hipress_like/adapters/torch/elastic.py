"""Elastic training under torchrun's restarts and horovodrun's elastic driver, in the
shape of ``horovod.torch.elastic``.

A Horovod user writes::

    state = hpt.elastic.TorchState(model, optimizer, epoch=0, step=0)

    @hpt.elastic.run
    def train(state):
        while state.step < steps:
            ...one step...
            state.step += 1
            if state.step % 10 == 0:
                state.commit()

    train(state)

and launches with torchrun's elastic agent, e.g. ``torchrun --nnodes 1:3
--nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d ...`` on every
host. What happens when a rank dies:

1. The survivors' engine raises a peer failure naming the dead rank
   (``EngineError``/``TransportError``, or torch.distributed's own
   ``DistError`` from a user collective); ``run`` catches it and the worker
   exits with ``RESTART_EXIT_CODE`` (75, ``EX_TEMPFAIL``) at once, without
   waiting in the teardown for peers that are gone. (torchrun's agent may
   also stop the survivors itself as soon as it sees the dead worker.)
2. torchrun's agents re-run the rendezvous: the world re-forms with the
   hosts still alive (``--nnodes MIN:MAX``), or with the same hosts
   (``--max-restarts``), and start fresh worker processes.
3. In each new worker ``run`` calls ``state.restore()``: with no commit in
   memory (a fresh process) it loads the last checkpoint that ``commit()``
   wrote through ``hpt.save_checkpoint``/``hpt.load_checkpoint``, which
   reshard the compressor state to the new world size
   (``adapters.checkpoint``: error-feedback memories averaged, PowerSGD's Q
   carried over, the rest reset with a ``CompressorStateReset`` warning);
   the reset callbacks run (rescale a learning rate), ``state.sync()`` makes
   every rank equal rank 0, and the training function runs again from the
   committed step.

So at most the steps since the last *checkpointed* commit are lost. A new
host joins the same way: its agent's arrival makes torchrun restart the
group, which resumes from the last checkpoint on the larger world.

Under torchrun membership is the agent's business, not the worker's: the
worker cannot re-form a world in-process (the agent assigns ranks and world
size to the processes it starts), so ``run`` leaves the process instead of
retrying in it, and ``check_host_updates`` does nothing (see its docstring).

Under ``horovodrun`` in elastic mode (``--min-np``, ``--max-np``, a host
discovery script; ``HOROVOD_ELASTIC=1``) the surviving processes stay, as
with Horovod: ``run`` registers the state with Horovod's worker notification
service, and

1. a peer failure (the engine's or Horovod's ``HorovodInternalError``)
   re-forms the world in the process (``runtime.reform``: engines dropped,
   ``hvd.shutdown()``/``hvd.init()`` at the driver's next rendezvous, a new
   store and group, new engines), then ``state.restore()`` goes back to the
   last commit *in memory* and the reset callbacks run;
2. a host the driver adds or removes is seen at the next ``commit()``
   (``TorchState.check_host_updates``: every rank agrees on the newest
   notification through a broadcast and raises ``HostsUpdatedInterrupt``
   together), which re-forms the world the same way from the commit just
   made;
3. ``state.sync()`` gives every rank, new ones included, rank 0's model,
   optimizer state and scalars, and the training function runs again.

Compressor state (error feedback, PowerSGD's Q) starts fresh on every rank
of a re-formed world (ranks and world size change; a ``CompressorStateReset``
warning says so), so the replicas stay bitwise identical. Outside both
launchers' elastic modes (no restarts left, or another launcher) a peer
failure is raised as it is.

The checkpoint path comes from ``TorchState(..., checkpoint=PATH)`` or the
``HIPRESS_ELASTIC_CHECKPOINT`` environment variable; it must be on a file
system every host sees (rank 0 writes it).
"""
from __future__ import annotations

import copy
import functools
import logging
import os
import queue
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from ...casync.errors import ConfigMismatchError, EngineError, GradientMismatchError
from ...casync.transport.base import TransportError
from ..checkpoint import CompressorStateReset
from ..objects import broadcast_object, broadcast_parameters
from ..runtime import horovod_elastic, is_initialized, rank, reform, size
from .checkpoints import load_checkpoint, save_checkpoint
from .objects import broadcast_optimizer_state

__all__ = ["TorchState", "run", "check_host_updates", "RESTART_EXIT_CODE", "ENV_CHECKPOINT",
           "ENV_CHECKPOINT_EVERY"]

log = logging.getLogger(__name__)

# EX_TEMPFAIL (sysexits.h): "try again later", which is what torchrun's agent does.
RESTART_EXIT_CODE = 75
ENV_CHECKPOINT = "HIPRESS_ELASTIC_CHECKPOINT"
ENV_CHECKPOINT_EVERY = "HIPRESS_ELASTIC_CHECKPOINT_EVERY"
_EXTRA_KEY = "hipress_elastic"
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


class TorchState:
    """A model, an optimizer and named scalars that survive a re-formed world.

    ``commit()`` keeps a copy in memory and, every ``checkpoint_every``
    commits, writes an atomic checkpoint with ``hpt.save_checkpoint`` (a
    collective: every rank calls ``commit()`` at the same step);
    ``restore()`` goes back to the last commit (from memory, or, in a
    process torchrun has just started, from the checkpoint); ``sync()``
    makes every rank hold rank 0's values. Scalars are attributes:
    ``state.epoch += 1``.

    Args:
        model: a ``torch.nn.Module`` (or None).
        optimizer: a ``DistributedOptimizer``, a plain optimizer or None.
        checkpoint: the checkpoint file (a directory every host sees);
            default ``$HIPRESS_ELASTIC_CHECKPOINT``; None keeps commits in
            memory only, which no restarted process can read.
        checkpoint_every: write the file every this many commits (default
            ``$HIPRESS_ELASTIC_CHECKPOINT_EVERY`` or 1). A restart loses
            the steps since the last *written* commit.
        **scalars: numbers, strings, tensors and containers of them
            (``epoch=0, step=0``).

    Raises:
        ValueError: ``checkpoint_every`` is not a positive integer.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 1)
        >>> s = TorchState(m, None, step=0)
        >>> s.step = 5; s.commit(); s.step = 7
        >>> s.restore(), s.step
        (True, 5)
    """

    def __init__(self, model: Any = None, optimizer: Any = None, *,
                 checkpoint: Optional[str] = None, checkpoint_every: Optional[int] = None,
                 **scalars: Any):
        every = checkpoint_every if checkpoint_every is not None else \
            os.environ.get(ENV_CHECKPOINT_EVERY, "1")
        try:
            every = int(every)
        except ValueError:
            every = 0
        if every < 1:
            raise ValueError(f"TorchState: checkpoint_every (or ${ENV_CHECKPOINT_EVERY}) must "
                             f"be a positive integer, found {checkpoint_every!r}; pass e.g. "
                             "checkpoint_every=1 to write every commit")
        self.model = model
        self.optimizer = optimizer
        self.checkpoint = checkpoint if checkpoint is not None else \
            os.environ.get(ENV_CHECKPOINT) or None
        self.checkpoint_every = every
        self.commits = 0
        self.restored_from: Optional[str] = None  # the file a restore read, if any
        self.restored_world_size: Optional[int] = None  # its world size
        self._names = list(scalars)
        self._saved: Optional[Dict[str, Any]] = None
        self._reset_callbacks: List[Callable[[], None]] = []
        # horovodrun's elastic mode: the driver's host notifications (on_hosts_updated)
        self._host_messages: "queue.Queue[Tuple[float, int]]" = queue.Queue()
        self._last_updated_timestamp = 0.0
        for k, v in scalars.items():
            setattr(self, k, v)

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
        """Keep a copy of the model, the optimizer and the scalars in memory."""
        opt = self.optimizer.state_dict() if self.optimizer is not None else None
        self._saved = {
            "model": copy.deepcopy(self.model.state_dict()) if self.model is not None else None,
            "optimizer": copy.deepcopy(opt),
            "scalars": copy.deepcopy(self.scalars()),
        }

    def commit(self) -> None:
        """Save in memory, write the checkpoint when it is due, check for new hosts.

        A collective when the checkpoint is written (every rank commits at
        the same step): ``hpt.save_checkpoint`` gathers every rank's
        compressor state and rank 0 writes the file atomically.
        """
        self.save()
        self.commits += 1
        if self.checkpoint is not None and self.commits % self.checkpoint_every == 0:
            save_checkpoint(self.checkpoint, self.model, self.optimizer,
                            **{_EXTRA_KEY: {"scalars": self._saved["scalars"],
                                            "commits": self.commits,
                                            "world_size": size() if is_initialized() else 1}})
        self.check_host_updates()

    def restore(self, *, fresh_compressor_state: bool = False) -> bool:
        """Go back to the last commit.

        From memory when this process committed; otherwise from the
        checkpoint file when there is one (a process torchrun started after
        a failure), resharding the compressor state to the current world
        size (``hpt.load_checkpoint``); otherwise nothing changes (a first
        start).

        Args:
            fresh_compressor_state: leave the optimizer's compressor state out of
                an in-memory restore, with a ``CompressorStateReset`` warning (``run``
                after horovodrun re-formed the world: it was this rank's in the
                world just left).

        Returns:
            True when something was restored.

        Raises:
            CheckpointError: the checkpoint file is incomplete or corrupted.
        """
        if self._saved is not None:
            saved = copy.deepcopy(self._saved)
            if self.model is not None:
                self.model.load_state_dict(saved["model"])
            if self.optimizer is not None:
                opt = saved["optimizer"]
                if fresh_compressor_state and isinstance(opt, dict) and "hipress" in opt:
                    # saved by this rank in the world just left: ranks and size changed
                    opt = {k: v for k, v in opt.items() if k != "hipress"}
                    warnings.warn(CompressorStateReset(
                        "the world re-formed (horovodrun elastic): compressor state (error "
                        "feedback, PowerSGD's Q) starts fresh on every rank"), stacklevel=2)
                self.optimizer.load_state_dict(opt)
            self._set(saved["scalars"])
            return True
        if self.checkpoint is None or not os.path.exists(self.checkpoint):
            return False
        extra = load_checkpoint(self.checkpoint, self.model, self.optimizer)
        mine = extra.get(_EXTRA_KEY, {})
        self._set(mine.get("scalars", {}))
        self.commits = int(mine.get("commits", 0))
        self.restored_from = self.checkpoint
        self.restored_world_size = mine.get("world_size")
        log.info("restored commit %d from %s (saved by %s ranks, now %s)", self.commits,
                 self.checkpoint, self.restored_world_size, size() if is_initialized() else 1)
        self.save()
        return True

    def sync(self) -> None:
        """Make every rank hold rank 0's model, optimizer state and scalars (a collective).

        The optimizer's per-rank compressor state is not broadcast: it is
        each rank's own (``hpt.broadcast_optimizer_state``).
        """
        if not is_initialized() or size() == 1:
            return
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        self._set(broadcast_object(self.scalars() if rank() == 0 else None, 0,
                                   "elastic.TorchState.sync"))

    def _set(self, scalars: Dict[str, Any]) -> None:
        for k, v in scalars.items():
            if k not in self._names:
                self._names.append(k)
            setattr(self, k, v)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)`` so that a peer failure re-forms the world and resumes.

    Algorithm (module docstring):

    1. ``state.restore()``: in a process torchrun started after a failure,
       the last checkpoint (resharded to this world size); then the reset
       callbacks when a checkpoint was read, and ``state.sync()``.
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
        >>> train(TorchState(None, None, step=3))
        3
    """
    @functools.wraps(func)
    def wrapper(state: TorchState, *args: Any, **kwargs: Any) -> Any:
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


def _run_horovod_elastic(func: Callable[..., Any], state: TorchState, args: tuple,
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
