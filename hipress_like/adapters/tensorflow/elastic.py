"""Elastic training for TensorFlow: ``hvd.elastic.TensorFlowState``, ``TensorFlowKerasState``
(``KerasState``) and ``run``, in the shape of ``horovod.tensorflow.elastic``.

A Horovod TensorFlow script::

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...steps...
            state.commit()

    train(state)

``run``, the scalars and the order of a commit, a restore and a sync are
every face's (``adapters.elastic``: torchrun's restarts, horovodrun's elastic
mode). Here the objects are TensorFlow variables: a commit keeps their values
(numpy copies) in memory; ``sync`` gives every rank rank 0's values
(``broadcast_variables``) and, as Horovod's TensorFlow states do, becomes the
point a ``restore`` without a commit goes back to, as construction is.
With ``checkpoint=PATH`` (or ``$HIPRESS_ELASTIC_CHECKPOINT``) every
``checkpoint_every``-th commit also writes rank 0's values and the scalars to
an ``.npz`` file atomically (the scalars as msgpack: numbers, strings, lists
and dicts of them), which a process torchrun starts after a failure reads.

The compressor state of the engines that ``DistributedGradientTape`` and
``DistributedOptimizer`` build (error feedback, PowerSGD's Q) is not in the
state: a re-formed world builds new engines, whose state starts fresh on
every rank (the ranks and the world size changed), so the replicas stay
identical.
"""
from __future__ import annotations

import io
import os
from typing import Any, Dict, List, Optional

import keras
import msgpack
import numpy as np

from ..checkpoint_io import CheckpointError
from ..elastic import (
    ENV_CHECKPOINT,
    ENV_CHECKPOINT_EVERY,
    RESTART_EXIT_CODE,
    State,
    check_host_updates,
    run,
)
from ..runtime import is_initialized, rank
from .collectives import broadcast_variables

__all__ = ["TensorFlowState", "TensorFlowKerasState", "KerasState", "run",
           "check_host_updates", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "RESTART_EXIT_CODE", "ENV_CHECKPOINT",
           "ENV_CHECKPOINT_EVERY"]


class _VariablesState(State):
    """Variables (``_variables()``: the model's, then the optimizer's) and named scalars;
    Horovod's baseline semantics (construction and ``sync`` are points ``restore``
    can go back to)."""

    baseline = True

    def _variables(self) -> List[Any]:
        return []

    def _optimizer_variables(self) -> List[Any]:
        return []

    def _capture(self) -> Dict[str, Any]:
        def values(vs: List[Any]) -> List[np.ndarray]:
            return [np.array(v.numpy(), copy=True) for v in vs]
        return {"values": values(self._variables()), "opt": values(self._optimizer_variables())}

    def _apply(self, saved: Dict[str, Any], fresh_compressor_state: bool) -> None:
        variables, values = self._variables(), saved["values"]
        if len(values) != len(variables):
            raise ValueError(f"{type(self).__name__}: {len(values)} saved values for "
                             f"{len(variables)} variables (the model changed its variables "
                             "since the commit)")
        for v, x in zip(variables, values):
            v.assign(x)
        opt_vars, opt_values = self._optimizer_variables(), saved.get("opt", [])
        if len(opt_values) == len(opt_vars):
            for v, x in zip(opt_vars, opt_values):
                v.assign(x)
        elif opt_values:  # an optimizer built since has more slots: they cannot be matched
            raise ValueError(f"{type(self).__name__}: {len(opt_values)} saved optimizer "
                             f"values for {len(opt_vars)} optimizer variables")
        # else: saved before Keras built the optimizer's slots; they stay as they are

    def _broadcast(self) -> None:
        broadcast_variables(self._variables() + self._optimizer_variables(), root_rank=0)

    def _write(self, path: str, objects: Dict[str, Any], extra: Dict[str, Any]) -> None:
        """Rank 0 writes the commit's copy ``objects`` to ``path`` atomically (a temporary
        file, then a rename)."""
        if is_initialized() and rank() != 0:
            return
        try:
            meta = msgpack.packb(extra)
        except TypeError as e:
            raise TypeError(f"{type(self).__name__}: a scalar cannot be written to the "
                            f"checkpoint ({e}); keep numbers, strings, lists and dicts") from e
        arrays = {f"v{i}": x for i, x in enumerate(objects["values"])}
        arrays.update({f"o{i}": x for i, x in enumerate(objects["opt"])})
        buf = io.BytesIO()
        np.savez(buf, meta=np.frombuffer(meta, dtype=np.uint8), **arrays)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _read(self, path: str) -> Dict[str, Any]:
        try:
            with np.load(path, allow_pickle=False) as data:
                extra = msgpack.unpackb(data["meta"].tobytes())
                names = set(data.files)
                values = [data[f"v{i}"] for i in range(sum(n[0] == "v" for n in names))]
                opt = [data[f"o{i}"] for i in range(sum(n[0] == "o" for n in names))]
        except (OSError, ValueError, KeyError, msgpack.UnpackException) as e:
            raise CheckpointError(f"{path} is not a readable {type(self).__name__} "
                                  f"checkpoint ({type(e).__name__}: {e})") from e
        self._apply({"values": values, "opt": opt}, False)
        return extra


class TensorFlowState(_VariablesState):
    """A list of ``tf.Variable`` objects and named scalars (Horovod's ``TensorFlowState``).

    Args:
        variables: the variables to keep in step (eager TensorFlow 2).
        session: accepted for Horovod's signature; TensorFlow 1 sessions are not
            supported (None only).
        checkpoint, checkpoint_every: as ``adapters.elastic.State``.
        **scalars: the named values (``batch=0, epoch=0``).

    Raises:
        ValueError: no variables, or a session given.

    Example:
        >>> import tensorflow as tf
        >>> v = tf.Variable([1.0, 2.0])
        >>> s = TensorFlowState([v], step=0)
        >>> v.assign([5.0, 5.0]); s.step = 3
        >>> s.restore(), v.numpy().tolist(), s.step
        (True, [1.0, 2.0], 0)
    """

    def __init__(self, variables: Optional[List[Any]] = None, session: Any = None, *,
                 checkpoint: Optional[str] = None, checkpoint_every: Optional[int] = None,
                 **scalars: Any):
        if session is not None:
            raise ValueError("TensorFlowState: TensorFlow 1 sessions are not supported; "
                             "pass the variables of an eager TensorFlow 2 program")
        if not variables:
            raise ValueError("TensorFlowState needs the variables to keep (TensorFlow 2 has "
                             "no global variables): TensorFlowState(model.variables, ...)")
        self.variables = list(variables)
        super().__init__(checkpoint=checkpoint, checkpoint_every=checkpoint_every, **scalars)

    def _variables(self) -> List[Any]:
        return self.variables


class TensorFlowKerasState(_VariablesState):
    """A built Keras model, its optimizer and named scalars (Horovod's
    ``TensorFlowKerasState``, ``hvd.elastic.KerasState`` in the Keras face).

    The optimizer's variables (slots, iterations) are kept once it has them
    (Keras builds them at the first step).

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        backend: accepted for Horovod's signature (TensorFlow 1 only; ignored).
        checkpoint, checkpoint_every: as ``adapters.elastic.State``.
        **scalars: the named values (``batch=0, epoch=0``).

    Raises:
        ValueError: the model is not built.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, *,
                 checkpoint: Optional[str] = None, checkpoint_every: Optional[int] = None,
                 **scalars: Any):
        if not getattr(model, "built", False):
            raise ValueError("TensorFlowKerasState: the model must be built first; run "
                             "model.build(input_shape) or call it on a batch")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        self.backend = backend
        super().__init__(checkpoint=checkpoint, checkpoint_every=checkpoint_every, **scalars)

    def _variables(self) -> List[Any]:
        return list(self.model.variables)

    def _optimizer_variables(self) -> List[Any]:
        opt = self.optimizer
        if opt is None:
            return []
        return list(opt.variables() if callable(opt.variables) else opt.variables)


KerasState = TensorFlowKerasState


class CommitStateCallback(keras.callbacks.Callback):
    """``model.fit`` commits ``state`` every ``batches_per_commit`` batches and at every
    epoch's end (Horovod's Keras ``CommitStateCallback``); the count restarts with every
    ``fit``, so every rank commits at the same batches."""

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ValueError(f"batches_per_commit must be >= 1, found {batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self._left = self.batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self._left = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._left -= 1
        if self._left == 0:
            self.state.commit()
            self._left = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the last batch ``fit`` finished (0 after an epoch), and
    start a resumed epoch with the batches it had left (Horovod's Keras callback)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self._steps: Optional[int] = None

    def on_train_begin(self, logs: Any = None) -> None:
        self._steps = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        steps = (self.params or {}).get("steps")
        if steps:
            if self._steps is None:
                self._steps = steps
            self.params["steps"] = self._steps - self.state.batch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` as the number of epochs finished over every restart: Keras
    counts each ``fit`` from 0, so the epoch the state had when ``fit`` began is added
    (Horovod's Keras callback)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self._first = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self._first = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self._first + epoch + 1

