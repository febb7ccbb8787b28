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

``run``, the scalars, the callbacks and the order of a commit, a restore and
a sync are every face's (``adapters.elastic``); this module says how a torch
model and optimizer are copied, checkpointed and broadcast.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Dict, Optional

from ..checkpoint import CompressorStateReset
from ..elastic import (
    ENV_CHECKPOINT,
    ENV_CHECKPOINT_EVERY,
    RESTART_EXIT_CODE,
    State,
    check_host_updates,
    run,
)
from ..objects import broadcast_parameters
from .checkpoints import load_checkpoint, save_checkpoint
from .objects import broadcast_optimizer_state

__all__ = ["TorchState", "run", "check_host_updates", "RESTART_EXIT_CODE", "ENV_CHECKPOINT",
           "ENV_CHECKPOINT_EVERY"]

log = logging.getLogger(__name__)

_EXTRA_KEY = "hipress_elastic"


class TorchState(State):
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
        self.model = model
        self.optimizer = optimizer
        super().__init__(checkpoint=checkpoint, checkpoint_every=checkpoint_every, **scalars)

    def _capture(self) -> Dict[str, Any]:
        opt = self.optimizer.state_dict() if self.optimizer is not None else None
        return {"model": copy.deepcopy(self.model.state_dict()) if self.model is not None
                else None, "optimizer": copy.deepcopy(opt)}

    def _apply(self, saved: Dict[str, Any], fresh_compressor_state: bool) -> None:
        if self.model is not None:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None:
            opt = saved["optimizer"]
            if fresh_compressor_state and isinstance(opt, dict) and "hipress" in opt:
                # saved by this rank in the world just left: ranks and size changed
                opt = {k: v for k, v in opt.items() if k != "hipress"}
                warnings.warn(CompressorStateReset(
                    "the world re-formed (horovodrun elastic): compressor state (error "
                    "feedback, PowerSGD's Q) starts fresh on every rank"), stacklevel=3)
            self.optimizer.load_state_dict(opt)

    def _write(self, path: str, objects: Dict[str, Any], extra: Dict[str, Any]) -> None:
        """``hpt.save_checkpoint`` of the live model and optimizer (they equal the commit's
        copy ``objects``): every rank's compressor state gathered, rank 0 writes the file
        atomically."""
        save_checkpoint(path, self.model, self.optimizer, **{_EXTRA_KEY: extra})

    def _read(self, path: str) -> Dict[str, Any]:
        """``hpt.load_checkpoint``, which reshards the compressor state to this world
        size (error-feedback memories averaged, PowerSGD's Q carried over)."""
        return load_checkpoint(path, self.model, self.optimizer).get(_EXTRA_KEY, {})

    def _broadcast(self) -> None:
        """Rank 0's model and optimizer state; the optimizer's per-rank compressor state
        is not broadcast: it is each rank's own (``hpt.broadcast_optimizer_state``)."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
