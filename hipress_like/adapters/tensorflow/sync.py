"""``GradientSync``: a list of TensorFlow gradients in, their CaSync averages out.

One ``GradientSync`` owns one engine for one list of variables (the Keras
``DistributedOptimizer`` has one; every ``DistributedGradientTape`` over the
same variables and settings shares one). A step:

1. ``reduce(grads, variables)``: ``None`` gradients become zeros (another
   rank may have one, and every rank must submit the same set, as in the
   PyTorch face); ``IndexedSlices`` are densified.
2. Each gradient is submitted: a zero-copy torch view of the TF tensor is
   copied once into a staging buffer (``bridge.Staging``) that the engine
   owns for the step and overwrites with the average.
3. ``finish``: ``engine.synchronize()``; the staging buffers go back to TF
   as zero-copy tensors (cast back to fp16/bf16 where the gradient was), and
   a boolean says whether the step counts (False only with
   ``nonfinite="skip"`` after some rank saw NaN/Inf; every rank agrees).

How gradients cross into the engine:

- eager: ``submit``/``finish`` run directly on the eager tensors.
- inside ``tf.function`` (``model.fit``, a ``@tf.function`` train step):
  ``reduce`` adds one ``tf.py_function`` per gradient that submits it (in
  reverse variable order, the order backward produces gradients, so TF's
  executor runs each as soon as its gradient exists and compression and
  communication overlap the rest of backward) and one ``tf.py_function``
  that takes their tokens and finishes the step. A ``py_function`` body runs
  eagerly, so DLPack applies there too. The engine itself is built at trace
  time (a collective: every rank traces the same function), so set-up
  errors, such as models that differ between ranks, surface from the
  ``tf.function`` call as the engine raised them. ``py_function`` needs the
  Python interpreter: such functions cannot be XLA-compiled
  (``jit_compile=True``) or exported to a SavedModel.

With ``plan="adaptive"`` (or an ``Adaptive``) the engine is re-planned as
on the PyTorch face: ``finish`` calls the online planner
(``tuning.online.OnlinePlanner.after_step``) once the step's averages are
in, on every rank at the same step, so every rank switches at the same
step boundary to the same plan. That point comes before the optimizer's
update, so AR-Topk's ratio search rewinds with this step's averages in its
snapshot (``rewind.Rewind``), for an owner that names its optimizer's
variables (``optimizer_variables``: the Keras ``DistributedOptimizer``); a
tape's search trains on (``ratio_search.TRAIN_ON``).

Compressor state (error-feedback residuals, PowerSGD's Q, DGC's momentum) is
per rank; ``state_dict``/``load_state_dict`` follow the PyTorch face's rules
(with ``plan="adaptive"`` the envelope also holds the active plan and the
planner, ``checkpoint.ADAPTIVE``, switched to before the compressor state is
restored), and ``to_bytes``/``from_bytes`` carry it in checkpoints
(``torch.save`` bytes, read back with ``torch.load(weights_only=True)``:
never unpickled).
"""
from __future__ import annotations

import io
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf
import torch

from ...cost_model.plan import check_collective_name
from ...tuning.ratio_search import TRAIN_ON
from .. import checkpoint
from ..compression import resolve_compression
from ..engine_builder import (
    STRATEGIES,
    build_engine,
    close_engine,
    online_planner,
    wire_dtype,
)
from ..runtime import _require, _track
from .bridge import Staging, as_tf, as_torch, to_torch_dtype
from .rewind import Rewind

__all__ = ["GradientSync", "variable_names", "var_key", "to_bytes", "from_bytes", "Average", "Sum"]

log = logging.getLogger(__name__)

Average, Sum, Adasum = "average", "sum", "adasum"  # Horovod's op names
_NONFINITE = ("propagate", "skip", "raise")


def variable_names(variables: Sequence[Any]) -> List[str]:
    """Stable, unique names for ``variables`` (Keras ``path``, else ``name``, else position).

    Names identify gradients in plans, logs and errors, and must be equal on
    every rank (the engine checks): ranks running the same program get the
    same Keras paths. Duplicates get a ``#k`` suffix.
    """
    out, seen = [], {}
    for i, v in enumerate(variables):
        n = getattr(v, "path", None) or getattr(v, "name", None) or f"grad.{i}"
        n = str(n)
        if n.endswith(":0"):
            n = n[:-2]
        if n in seen:
            seen[n] += 1
            n = f"{n}#{seen[n]}"
        else:
            seen[n] = 0
        out.append(n)
    return out


def var_key(v: Any) -> Any:
    """A hashable key of variable ``v``: TensorFlow's ``ref()`` where the variable has it
    (``tf.Variable``), else its identity (Keras 3's variables have no ``ref``)."""
    return v.ref() if hasattr(v, "ref") else id(v)


def to_bytes(obj: Any) -> bytes:
    """Serialise a state dict with ``torch.save`` (read back by ``from_bytes``)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> Any:
    """Read ``to_bytes`` output with ``torch.load(weights_only=True)`` (nothing unpickled)."""
    return torch.load(io.BytesIO(bytes(data)), weights_only=True)


class GradientSync:
    """Averages one list of gradients per step through a CaSync engine.

    Args:
        compression, strategy, plan, nonfinite, timeout, seed, compression_back,
        collective:
            as for ``hipress_like.torch.DistributedOptimizer``; checked here,
            before any engine exists, so a typo fails at once on every rank.
            ``plan="adaptive"`` (or ``Adaptive(...)``) re-plans after each
            step (``online``); ``compression_back`` is refused with it when
            the engine is built.
        op: ``Average`` (default) or ``Sum``.
        what: how errors name the owner ("DistributedOptimizer", ...).

    Raises:
        ValueError: an unknown compressor (the message lists the known
            ones), strategy or ``nonfinite`` policy, or ``op=Adasum``.
    """

    def __init__(self, *, compression: Any = None, strategy: str = "ps", plan: Any = "auto",
                 nonfinite: str = "propagate", timeout: Optional[float] = None, seed: int = 0,
                 compression_back: Any = None, op: str = Average,
                 what: str = "DistributedOptimizer", collective: Optional[str] = None) -> None:
        if op == Adasum:
            raise NotImplementedError("op=Adasum is not implemented by hipress-like; use "
                                      "op=hvd.Average (the default) or hvd.Sum")
        if op not in (Average, Sum):
            raise ValueError(f"op must be hvd.Average or hvd.Sum, found {op!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, found {strategy!r}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be 'propagate' (NaN/Inf reach every rank's "
                             f"gradients, as in Horovod), 'skip' or 'raise', found "
                             f"{nonfinite!r}")
        if not (isinstance(compression, str) and compression == "auto"):
            resolve_compression(compression)  # unknown names list the known ones
        if compression_back is not None:
            resolve_compression(compression_back)
        if collective is not None:
            check_collective_name(collective)
        self.options = dict(compression=compression, strategy=strategy, plan=plan,
                            nonfinite=nonfinite, timeout=timeout, seed=int(seed),
                            compression_back=compression_back, collective=collective)
        self.op = op
        self.what = what
        self.names: List[str] = []
        self._shapes: List[Tuple[int, ...]] = []
        self._dtypes: List[tf.DType] = []
        self._wire: List[torch.dtype] = []
        self._engine: Any = None
        self._online: Any = None  # plan="adaptive": tuning.online.OnlinePlanner
        self._online_at = -1  # the engine step the planner last ran after
        self._rewind: Optional[Rewind] = None  # the ratio search's snapshot (bind)
        #: returns the optimizer's variables (slots, iterations) for the ratio search's
        #: snapshot; set by the Keras DistributedOptimizer before ``bind``; None (a
        #: tape): the search's steps train on
        self.optimizer_variables: Optional[Callable[[], Sequence[Any]]] = None
        self._staging = Staging()
        self._lock = threading.Lock()  # submits from TF's inter-op threads, one at a time
        self._pending: Optional[Dict[str, Any]] = None  # state loaded before the engine exists
        self._submitted = 0
        self._size = 1

    # -- set-up ---------------------------------------------------------------------------
    @property
    def built(self) -> bool:
        """True once the engine exists (``bind`` ran)."""
        return self._engine is not None

    @property
    def engine(self) -> Any:
        """The CaSync engine (None before ``bind``)."""
        return self._engine

    @property
    def online(self) -> Any:
        """The ``tuning.online.OnlinePlanner`` of ``plan="adaptive"`` (None otherwise,
        before ``bind``, or when there is nothing to adapt)."""
        return self._online

    @tf.autograph.experimental.do_not_convert
    def bind(self, variables: Sequence[Any], names: Optional[Sequence[str]] = None) -> None:
        """Build the engine for ``variables`` (collective: every rank, same list).

        Raises:
            TypeError: a variable whose dtype cannot be averaged (integer,
                bool, complex): the same refusal as the PyTorch face.
            hipress_like.casync.errors.GradientMismatchError: the ranks'
                variable lists differ (on every rank, naming the first).
        """
        rt = _require()
        if self._engine is not None:
            raise RuntimeError(f"{self.what}: the engine is already built")
        names = list(names) if names is not None else variable_names(variables)
        shapes = [tuple(int(d) for d in tf.TensorShape(v.shape).as_list()) for v in variables]
        dtypes = [tf.as_dtype(v.dtype) for v in variables]
        wire = [wire_dtype(to_torch_dtype(d, f"variable {n!r}"), n)
                for n, d in zip(names, dtypes)]
        specs = [(n, s, w) for n, s, w in zip(names, shapes, wire)]
        self._engine = build_engine(specs, online=True, **self.options)
        snapshot: Any = TRAIN_ON  # a tape: its optimizer is not this face's to rewind
        if self.optimizer_variables is not None:
            self._rewind = Rewind(variables, self.optimizer_variables)
            snapshot = (self._rewind.checkpoint, self._rewind.restore)
        self._online = online_planner(self._engine, self.options["plan"], snapshot=snapshot)
        self.names, self._shapes, self._dtypes, self._wire = names, shapes, dtypes, wire
        self._size = rt.size
        _track(self)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.load_state_dict(pending)

    def matches(self, variables: Sequence[Any]) -> bool:
        """True when ``variables`` are the list this engine was built for."""
        return (len(variables) == len(self._shapes)
                and all(tuple(tf.TensorShape(v.shape).as_list()) == s
                        for v, s in zip(variables, self._shapes)))

    # -- one step -------------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def reduce(self, grads: Sequence[Any], variables: Sequence[Any]
               ) -> Tuple[List[tf.Tensor], tf.Tensor]:
        """Average ``grads`` (one per variable, ``None`` allowed) over all ranks.

        Works eagerly and inside ``tf.function`` (see the module docstring).

        Returns:
            (averaged gradients, a scalar bool tensor: False when the step must
            be skipped, with ``nonfinite="skip"``).
        """
        if not self.built:
            self.bind(variables)
        elif not self.matches(variables):
            raise ValueError(f"{self.what}: gradients for {len(variables)} variables, but the "
                             f"engine was built for {len(self._shapes)} ({self.names[:4]}...); "
                             "use one DistributedOptimizer per variable list")
        dense = []
        for g, v in zip(grads, variables):
            if g is None:
                g = tf.zeros(v.shape, dtype=v.dtype)
            elif isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)  # sparse gradients are averaged densely
            dense.append(g)
        if tf.executing_eagerly():
            for i in reversed(range(len(dense))):
                self._submit(i, dense[i])
            *outs, ok = self._finish()
            return outs, ok
        tokens = []
        for i in reversed(range(len(dense))):  # backward's order: overlap starts early
            tokens.append(tf.py_function(lambda g, i=i: self._submit(i, g), [dense[i]],
                                         Tout=tf.int32, name="hipress_submit"))
        res = tf.py_function(lambda *_: self._finish(), tokens,
                             Tout=[*self._dtypes, tf.bool], name="hipress_finish")
        outs, ok = list(res[:-1]), res[-1]
        for o, s in zip(outs, self._shapes):
            o.set_shape(s)
        ok.set_shape(())
        return outs, ok

    def _submit(self, i: int, g: tf.Tensor) -> tf.Tensor:
        """Stage gradient ``i`` and hand it to the engine (runs eagerly)."""
        with self._lock:
            name = self.names[i]
            buf = self._staging.stage(name, as_torch(g), self._wire[i])
            self._engine.submit(name, buf)
            self._submitted += 1
        return tf.constant(i, tf.int32)

    def _finish(self) -> List[tf.Tensor]:
        """Wait for every average; the results as TF tensors, plus the step's ok flag."""
        with self._lock:
            if self._submitted != len(self.names):
                raise RuntimeError(f"{self.what}: {self._submitted} of {len(self.names)} "
                                   "gradients were submitted this step")
            self._submitted = 0
            ok = bool(self._engine.synchronize())
            outs = []
            for name, dt in zip(self.names, self._dtypes):
                buf = self._staging.current(name)  # the buffer submitted this step
                if self.op == Sum and self._size > 1:
                    buf.mul_(self._size)
                t = as_tf(buf)
                outs.append(t if t.dtype == dt else tf.cast(t, dt))
            online, eng = self._online, self._engine
            if online is not None and eng.step != self._online_at:
                self._online_at = eng.step  # once per synchronised step, every rank
                # the update comes after: a ratio search's snapshot holds this step's
                # averages, and a restore hands them out again (rewind.py)
                if self._rewind is None:
                    online.after_step(eng)
                else:
                    outs, ok = self._rewind.around(outs, ok, lambda: online.after_step(eng))
        return outs + [tf.constant(ok)]

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self, all_ranks: bool = False) -> Dict[str, Any]:
        """This rank's compressor state (the PyTorch face's ``"hipress"`` entry).

        Args:
            all_ranks: collective; gather every rank's state, so that one
                file (rank 0's) resumes every rank.

        Raises:
            RuntimeError: no engine yet and nothing loaded (nothing to save).
        """
        rt = _require()
        if self._engine is None:
            if self._pending is not None:
                return dict(self._pending)
            raise RuntimeError(f"{self.what}: no engine yet (it is built by the first step, "
                               "or by optimizer.build(variables)); nothing to save")
        local = self._engine.state_dict()
        engines = None
        if all_ranks:
            from ..objects import allgather_object

            engines = allgather_object(local, name=f"{self.what} state")
        adaptive = None if self._online is None else self._online.state_dict(self._engine)
        return checkpoint.pack(local, rt.rank, rt.size, engines, adaptive=adaptive)

    def load_state_dict(self, hip: Dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (deferred until the engine is built).

        With ``plan="adaptive"``, the plan the state was saved with is switched
        to first (a collective when it differs: every rank loads), so the
        compressor state fits it.

        Raises:
            ValueError: an unknown format, or another rank's non-empty
                compressor state (it would resume this rank with another's
                error-feedback residuals); save every rank's own state.
        """
        rt = _require()
        checkpoint.check_format(hip, f"the {self.what} checkpoint")
        if self._engine is None:
            self._pending = dict(hip)
            return
        adaptive = hip.get(checkpoint.ADAPTIVE)
        if adaptive is not None and self._online is not None:
            self._online.load_state_dict(self._engine, adaptive)
        saved = checkpoint.unpack(
            hip, rt.rank, rt.size, where=f"the {self.what} checkpoint",
            fix="Save a checkpoint on every rank (e.g. a file name with hvd.rank() in it), "
                "or gather every rank's state with compressor_state(all_ranks=True)",
            foreign_empty_ok=True)
        checkpoint.restore(self._engine, saved)

    def close(self) -> None:
        """Close the engine and its transport (also done by ``shutdown()``)."""
        eng, self._engine = self._engine, None
        self._online = None
        if eng is not None:
            close_engine(eng)
