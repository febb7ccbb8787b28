"""``DistributedTrainer``: a Gluon ``Trainer`` whose gradients are averaged by CaSync.

A subclass of ``mx.gluon.Trainer`` built with ``kvstore=None`` (no MXNet
kvstore is created) that replaces the trainer's gradient reduction. One
``trainer.step(batch_size)``:

1. ``_allreduce_grads``: for every parameter whose ``grad_req`` is not
   ``"null"``, last parameter first, the gradient NDArray is viewed as a
   torch tensor through DLPack (no copy) and submitted to the engine
   (``engine.submit(name, tensor)``). MXNet runs backward asynchronously and
   taking the view waits only for that gradient, so the gradients of the
   last layers are compressed and sent while MXNet still computes those of
   the first ones. Then ``engine.synchronize()``: the averages are written
   into the gradients' own memory.
2. ``_update``: Gluon's update runs on the averaged gradients (identical
   bits on every rank, so replicas never drift). With ``plan="adaptive"``
   the online planner (``tuning.online.OnlinePlanner.after_step``) runs
   after it, as after the PyTorch optimizer's step: every rank at the same
   step, so every rank switches at the same step boundary to the same plan.
   AR-Topk's ratio search rewinds to a snapshot of the parameters and
   Gluon's optimizer states taken there (``_hp_snapshot``).

Gradients are named by their position in the trainer (Gluon sorts the
parameters by name), as Horovod names them, so ranks whose automatic block
prefixes differ (``dense0_`` against ``dense3_``) still agree; the engine
checks that every rank registers the same shapes and dtypes in the same
order, and the error names the Gluon parameters.

The averages are means, so ``step(batch_size)`` takes the per-rank batch,
as with Horovod. Ordering is checked: ``allreduce_grads()`` twice without
``update()`` in between, or ``update()`` without ``allreduce_grads()``,
raises ``OrderingError``.

Checkpoints: ``save_states(fname)`` writes Gluon's optimizer states to
``fname`` as usual and the compressor state (error-feedback residuals,
PowerSGD's Q, the step count that seeds randomized compressors, and the
engine's recorded allreduce schedule, whose fusion decides how float sums
round on 3 or more ranks) to ``fname + ".hipress"`` (``torch.save``, read back with
``weights_only=True``); ``load_states(fname)`` reads both, so a resumed run
continues exactly. Compressor state is per rank: every rank saves its own
file, or every rank calls ``save_states(fname, all_ranks=True)`` and rank 0
writes one file holding every rank's state. With ``plan="adaptive"`` that
file also holds the active plan and the planner (``checkpoint.ADAPTIVE``);
``load_states`` switches to the saved plan (a collective when it differs:
every rank loads) before restoring the compressor state.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Any, Dict, List, Optional, Tuple

import mxnet as mx
import numpy as np
import torch

from ...casync.errors import EngineError
from ...cost_model.plan import check_collective_name
from .. import checkpoint
from ..collectives import _no_process_set
from ..compression import resolve_compression
from ..engine_builder import (
    STRATEGIES,
    EngineHolder,
    build_engine,
    online_planner,
    resolve_plan,
    wire_dtype,
)
from ..objects import allgather_object
from ..ordering import OrderingError
from ..runtime import _require, _track, barrier
from .optimizer import DistributedOptimizer
from .tensors import as_torch

__all__ = ["DistributedTrainer", "OrderingError", "STATE_SUFFIX"]

log = logging.getLogger(__name__)

STATE_SUFFIX = ".hipress"  # the compressor-state file beside Gluon's states file
_NONFINITE = ("propagate", "skip", "raise")


def _torch_dtype(dtype: Any) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype


class DistributedTrainer(EngineHolder, mx.gluon.Trainer):
    """A Gluon ``Trainer`` whose ``step()`` applies gradients averaged by CaSync.

    A collective call: every rank constructs it at the same point, with the
    same model. Options are checked here, before anything is sent; the
    engine is built (and the ranks' gradient lists compared) as soon as
    every parameter is initialised: here, or at the first ``step()`` when
    Gluon defers initialisation to the first forward pass.

    Args:
        params: ``net.collect_params()``, a dict or a list of Parameters.
        optimizer: an optimizer name (``"sgd"``) or an ``mx.optimizer.Optimizer``.
        optimizer_params: the optimizer's arguments when it is a name.
        compression: ``hvd.Compression.<name>``, a registry name or a CompLL
            ``Compressor``. ``None``/``Compression.none``: no compression.
        gradient_predivide_factor: Horovod option; the engine averages in
            float32, so it does not change the result.
        prefix: prepended to the gradients' names (Horovod's option).
        num_groups: Horovod's fusion option; CaSync batches small gradients
            itself, so it is accepted and ignored.
        process_set: only ``None`` (all ranks).
        strategy: "ps" (co-located parameter servers) or "ring".
        plan: "auto" (the cost model decides per gradient), a ``Plan``, a
            plan file, or ``None`` (the engine's size rule). "adaptive" or
            ``hvd.Adaptive(check_every=20, margin=0.1, ...)``: planned as
            "auto" (or from ``Adaptive.profile``), then re-planned after the
            steps while training runs, every rank switching at the same step
            (``tuning/online.py``; ``trainer.online.history`` lists every check).
        nonfinite: a NaN/Inf gradient on some rank: "propagate" (default,
            as Horovod: every rank's averages are non-finite, compressor
            state is rolled back), "skip" (no rank updates its weights this
            step) or "raise" (an error on every rank naming the gradient).
        timeout: seconds before a stalled or dead peer becomes an error.
        seed: seed of the compressors' random streams (same on all ranks).
        compression_back: the compressor of the aggregates on their way back
            (bidirectional compression), as in the PyTorch face.
        collective: how compressed gradients travel, as in the PyTorch face
            (``DistributedOptimizer(collective=...)``).

    Raises:
        ValueError: an unknown compressor (the message lists the known
            ones), strategy, nonfinite policy or plan; parameters on more
            than one context.
        TypeError: sparse weights or gradients; an integer parameter that
            receives gradients (at engine build).

    Example:
        >>> trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
        ...                                  {"learning_rate": 0.05 * hvd.size()},
        ...                                  compression=hvd.Compression.onebit)
        >>> with autograd.record():
        ...     loss = loss_fn(net(x), y)
        >>> loss.backward()
        >>> trainer.step(batch_size)
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: Any = None,
                 compression: Any = None, gradient_predivide_factor: float = 1.0,
                 prefix: Optional[str] = None, num_groups: int = 0, process_set: Any = None,
                 *, strategy: str = "ps", plan: Any = "auto", nonfinite: str = "propagate",
                 timeout: Optional[float] = None, seed: int = 0,
                 compression_back: Any = None, collective: Optional[str] = None):
        rt = _require()
        _no_process_set(process_set)
        if isinstance(optimizer, DistributedOptimizer):
            warnings.warn("DistributedTrainer takes a plain optimizer; the "
                          "DistributedOptimizer passed in is unwrapped (its per-update "
                          "allreduce would average the gradients a second time)", stacklevel=2)
            optimizer = optimizer.unwrap()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, found {strategy!r}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be 'propagate' (NaN/Inf reach every rank's "
                             f"gradients, as in Horovod), 'skip' or 'raise', found {nonfinite!r}")
        if not (isinstance(compression, str) and compression == "auto"):
            resolve_compression(compression)  # an unknown name lists the known ones
        if compression_back is not None:
            resolve_compression(compression_back)
        resolve_plan(plan)
        if collective is not None:
            check_collective_name(collective)
        if num_groups:
            log.info("num_groups ignored: CaSync batches small gradients itself")
        if gradient_predivide_factor != 1.0:
            log.info("gradient_predivide_factor=%s has no effect: averaging is done in "
                     "float32", gradient_predivide_factor)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        if self._contains_sparse_weight or self._contains_sparse_grad:
            raise TypeError("DistributedTrainer averages dense gradients; build the model "
                            "with dense weights and sparse_grad=False (row_sparse gradients "
                            "would need an allgather of their rows)")
        if self._contexts is not None and len(self._contexts) > 1:
            raise ValueError(f"parameters live on {len(self._contexts)} contexts "
                             f"({self._contexts}); run one process per device (one context "
                             "per rank, mx.cpu() or mx.gpu(hvd.local_rank()))")
        self._hp_kwargs: Dict[str, Any] = dict(
            compression=compression, strategy=strategy, plan=plan, nonfinite=nonfinite,
            timeout=timeout, seed=seed, compression_back=compression_back,
            collective=collective)
        self._hp_prefix = prefix or ""
        self._hp_rank, self._hp_size = rt.rank, rt.size
        self._hp_engine: Any = None
        self._hp_online: Any = None  # plan="adaptive": tuning.online.OnlinePlanner
        self._hp_online_at = -1  # the engine step the planner last ran after
        self._hp_synced: List[Tuple[str, Any, torch.dtype]] = []
        self._hp_wire: Dict[str, torch.Tensor] = {}
        self._hp_reduced = False  # allreduce_grads() ran; update() comes next
        self._hp_ok = True  # the last step's averages may be applied (nonfinite="skip")
        self._hp_pending: Optional[Dict[str, Any]] = None  # state loaded before the engine
        self._hp_pending_adaptive: Optional[Dict[str, Any]] = None  # its plan="adaptive" part
        self._hp_gluon: Dict[str, str] = {}  # gradient name -> Gluon parameter name
        if all(p._data is not None for p in self._params):
            self._hp_build()
        _track(self)

    # -- the engine ---------------------------------------------------------------------
    def _hp_build(self) -> None:
        """Register every parameter that can receive a gradient (collective)."""
        specs = []
        self._hp_synced = []
        names = {}
        for i, p in enumerate(self._params):
            dt = _torch_dtype(p.dtype)
            if p.grad_req == "null" and not dt.is_floating_point:
                continue  # an integer buffer that never gets a gradient
            name = f"{self._hp_prefix}{i}"
            names[name] = p.name
            try:
                wdt = wire_dtype(dt, name)
            except TypeError:
                raise TypeError(
                    f"Gluon parameter {p.name!r} has dtype {np.dtype(p.dtype).name} and "
                    f"grad_req={p.grad_req!r}; DistributedTrainer reduces float16/32/64 "
                    "gradients (float16 in float32). Set its grad_req to 'null' "
                    "(param.grad_req = 'null') or keep it out of the trainer's params"
                ) from None
            specs.append((name, tuple(int(s) for s in p.shape), wdt))
            self._hp_synced.append((name, p, wdt))
        self._hp_gluon = names
        try:
            self._hp_engine = build_engine(specs, online=True, **self._hp_kwargs)
        except (EngineError, ValueError) as e:
            named = self._hp_named(e)
            if named is e:
                raise
            raise named from e
        self._hp_online = online_planner(self._hp_engine, self._hp_kwargs["plan"],
                                         snapshot=(self._hp_snapshot, self._hp_restore))
        if self._hp_pending_adaptive is not None and self._hp_online is not None:
            self._hp_online.load_state_dict(self._hp_engine, self._hp_pending_adaptive)
        self._hp_pending_adaptive = None
        if self._hp_pending is not None:
            self._hp_engine.load_state_dict(self._hp_pending)
            self._hp_pending = None

    def _hp_snapshot(self) -> Dict[str, Any]:
        """The training state in memory (every parameter's data and Gluon's optimizer
        states, the optimizer's update counts with them), for ``plan="adaptive"``'s
        ratio search to put back after trying each ratio; taken after an update."""
        return {"params": [None if p._data is None else p.data().copy() for p in self._params],
                "states": self._updaters[0].get_states(dump_optimizer=True)}

    def _hp_restore(self, snap: Dict[str, Any]) -> None:
        """Put ``_hp_snapshot``'s state back (between steps), as Gluon's ``load_states``
        puts a states file back."""
        for p, data in zip(self._params, snap["params"]):
            if data is not None:
                p.set_data(data)
        for updater in self._updaters:
            updater.set_states(snap["states"])
            updater.optimizer = self._updaters[0].optimizer
        self._optimizer = self._updaters[0].optimizer
        self._optimizer.param_dict = dict(enumerate(self._params))

    def _allreduce_grads(self) -> None:
        """Average every gradient over the ranks in place (called by ``step`` and
        ``allreduce_grads``)."""
        if self._hp_reduced:
            raise OrderingError(
                "allreduce_grads() was called twice without update() in between; the "
                "gradients are already averaged (averaging again would compress them "
                "twice). Call trainer.update(batch_size) after allreduce_grads(), or use "
                "trainer.step(batch_size)")
        if self._hp_engine is None:
            self._hp_build()
        eng = self._hp_engine
        pending = []
        try:
            # last parameters first: MXNet's asynchronous backward finishes them first
            for name, p, wdt in reversed(self._hp_synced):
                if p.grad_req == "null":
                    continue
                grad = as_torch(p.list_grad()[0])  # waits for this gradient only
                wire = grad
                if grad.dtype != wdt:
                    wire = self._hp_wire.get(name)
                    if wire is None:
                        wire = self._hp_wire[name] = torch.empty(grad.shape, dtype=wdt)
                    wire.copy_(grad)
                eng.submit(name, wire)
                pending.append((grad, wire))
            ok = bool(eng.synchronize())
        except (EngineError, ValueError) as e:
            named = self._hp_named(e)
            if named is e:
                raise
            raise named from e
        for grad, wire in pending:
            if wire is not grad:
                grad.copy_(wire)
        self._hp_reduced = True
        self._hp_ok = ok

    def _hp_named(self, e: BaseException) -> BaseException:
        """``e`` with the Gluon names of the gradients it quotes (the engine knows
        only their positions), or ``e`` itself when it quotes none."""
        quoted = dict.fromkeys(re.findall(r"'([^']*)'", str(e)))
        found = [n for n in quoted if n in self._hp_gluon]
        if not found:
            return e
        names = ", ".join(f"{n!r} is {self._hp_gluon[n]!r}" for n in found)
        msg = (f"{e} [gradients are named by their position among the trainer's parameters, "
               f"sorted by name; on rank {self._hp_rank}: {names}]")
        try:
            return type(e)(msg, ranks=e.ranks) if isinstance(e, EngineError) else type(e)(msg)
        except Exception:  # an exception type with another constructor: keep it as it is
            return e

    def _update(self, ignore_stale_grad: bool = False) -> None:
        """Gluon's update, on averaged gradients only; nothing when the step was
        skipped (``nonfinite="skip"`` and a NaN/Inf gradient on some rank)."""
        if not self._hp_reduced:
            raise OrderingError(
                "update() was called without allreduce_grads(): the gradients are this "
                "rank's own, and updating with them makes the replicas drift. Call "
                "trainer.allreduce_grads() first, or use trainer.step(batch_size)")
        self._hp_reduced = False
        if not self._hp_ok:
            log.warning("step skipped on every rank: a gradient was NaN/Inf "
                        "(nonfinite='skip')")
        else:
            super()._update(ignore_stale_grad)
        online, eng = self._hp_online, self._hp_engine
        if online is not None and eng.step != self._hp_online_at:
            self._hp_online_at = eng.step  # once per synchronised step, every rank
            online.after_step(eng)

    @property
    def online(self) -> Any:
        """The ``tuning.online.OnlinePlanner`` of ``plan="adaptive"`` (None otherwise,
        before the engine is built, or when there is nothing to adapt)."""
        return self._hp_online

    # -- checkpoints ----------------------------------------------------------------------
    def save_states(self, fname: str, all_ranks: bool = False) -> None:
        """Save Gluon's optimizer states to ``fname`` and the compressor state beside it.

        Args:
            fname: Gluon's states file; the compressor state goes to
                ``fname + ".hipress"``.
            all_ranks: collective; every rank calls it, every rank's compressor
                state is gathered, and rank 0 alone writes both files (the
                others wait until they are written). Without it, every rank
                writes its own compressor state (give each rank its own
                ``fname``, e.g. ``f"trainer-{hvd.rank()}.states"``).

        Raises:
            OrderingError: called between ``allreduce_grads()`` and ``update()``.
        """
        if self._hp_reduced:
            raise OrderingError("save_states() was called between allreduce_grads() and "
                                "update(); call it after the step")
        # the compressor state and the engine's replay schedule (engine_state)
        local = self._hp_engine.state_dict() if self._hp_engine is not None \
            else self._hp_pending
        engines = allgather_object(local, name="trainer.save_states") if all_ranks else None
        adaptive = self._hp_online.state_dict(self._hp_engine) \
            if self._hp_online is not None else self._hp_pending_adaptive
        hip = checkpoint.pack(local, self._hp_rank, self._hp_size, engines, adaptive=adaptive)
        if not all_ranks or self._hp_rank == 0:
            super().save_states(fname)
            torch.save(hip, fname + STATE_SUFFIX)
        if all_ranks:
            barrier()

    def load_states(self, fname: str) -> None:
        """Load Gluon's optimizer states and, from ``fname + ".hipress"``, the compressor
        state.

        State saved with another world size, or a states file without its
        compressor state, starts the compressor state fresh (with a warning).
        With ``plan="adaptive"`` the plan the state was saved with is switched
        to first (a collective when it differs: every rank loads), so the
        compressor state fits it.

        Raises:
            ValueError: the file holds another rank's compressor state (save
                with ``all_ranks=True``, or each rank its own file), or is not a
                compressor state of a supported version.
        """
        super().load_states(fname)
        side = fname + STATE_SUFFIX
        if not os.path.exists(side):
            warnings.warn(f"{side} not found: the compressor state (error feedback, "
                          "PowerSGD's Q) starts fresh, so the resumed run differs from an "
                          "uninterrupted one", stacklevel=2)
            self._hp_set_state(None)
            return
        hip = torch.load(side, weights_only=True)
        checkpoint.check_format(hip, side)
        adaptive = hip.get(checkpoint.ADAPTIVE)
        if adaptive is not None:
            if self._hp_engine is None:
                self._hp_pending_adaptive = adaptive
            elif self._hp_online is not None:
                self._hp_online.load_state_dict(self._hp_engine, adaptive)
        self._hp_set_state(checkpoint.unpack(
            hip, self._hp_rank, self._hp_size, where=side,
            fix="Save with trainer.save_states(fname, all_ranks=True) (every rank's state in "
                "one file), or give every rank its own fname; to start the compressor state "
                f"fresh, delete {side}"))

    def _hp_set_state(self, state: Optional[Dict[str, Any]]) -> None:
        if self._hp_engine is None:
            self._hp_pending = state
        else:
            checkpoint.restore(self._hp_engine, state)

    # -- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        """Close the engine and its transport (also done by ``hvd.shutdown()``)."""
        self._hp_online = None
        self._hp_close_engine()
