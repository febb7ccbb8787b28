"""``DistributedOptimizer`` for Keras 3: ``model.fit`` with gradients averaged by CaSync.

A wrapper in the manner of Keras's own ``LossScaleOptimizer`` (composition,
not a runtime subclass of the user's optimizer class): it holds the user's
optimizer as ``inner_optimizer`` and, in ``apply``, first averages the
gradients over all ranks (``sync.GradientSync``), then lets the inner
optimizer apply them. One step in ``model.fit``:

1. Keras's ``train_step`` computes the gradients under a tape and calls
   ``apply_gradients``.
2. ``apply`` hands them to the engine (inside the traced train function:
   ``tf.py_function`` ops, one per gradient, so the engine starts on the
   last layers while TensorFlow still computes the first ones).
3. The inner optimizer applies the averages; with ``nonfinite="skip"`` it
   is skipped on every rank (a ``tf.cond``) when any rank saw NaN/Inf.

The engine is built in ``build`` (``model.fit`` builds the optimizer before
the first step; a collective: every rank builds at the same point). With
``plan="adaptive"`` the online planner runs after every step's averaging
(``sync.GradientSync``), as on the PyTorch face; ``opt.online`` is it. The
train function cannot be XLA-compiled (``compile(jit_compile=True)``):
``tf.py_function`` needs the interpreter. Keras's default ("auto") does not
compile on CPU-only hosts.

Checkpoints: ``save_own_variables`` adds this rank's compressor state
(error-feedback residuals, PowerSGD's Q, ...) under the key ``"hipress"``
beside the optimizer's variables, so ``model.save_weights`` /
``model.load_weights`` (and ``ModelCheckpoint``) resume exactly. The state
is per rank: every rank saves its own file (with ``hvd.rank()`` in its
name); a file holding another rank's non-empty state is refused. With
``plan="adaptive"`` that entry also holds the active plan and the planner, so
``load_weights`` switches to the saved plan before restoring the compressor
state.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf
from keras.src.utils import tracking

from ..compression import CompressionSpec
from .sync import Average, GradientSync, from_bytes, to_bytes

__all__ = ["DistributedOptimizer"]

log = logging.getLogger(__name__)

_STATE_KEY = "hipress"


def _spec_config(c: Any) -> Any:
    """A JSON-able form of a ``compression=`` argument (for ``get_config``)."""
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, CompressionSpec):
        return {"name": c.name, "params": dict(c.params)}
    raise ValueError(f"compression {c!r} cannot be saved in a Keras config; pass a name or "
                     "hvd.Compression.<name>(...) to save the model with its optimizer")


def _spec_from_config(c: Any) -> Any:
    return CompressionSpec(c["name"], c.get("params")) if isinstance(c, dict) else c


@keras.saving.register_keras_serializable(package="hipress_like")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wrap a Keras 3 optimizer so that it applies gradients averaged over all ranks.

    Shaped like ``horovod.tensorflow.keras.DistributedOptimizer``; the
    options after ``*`` are hipress-like's (as in the PyTorch face).

    Args:
        optimizer: any ``keras.optimizers.Optimizer`` (SGD, Adam, ...).
        name: this wrapper's name (default ``Distributed<inner name>``).
        device_dense, device_sparse: accepted for Horovod compatibility.
        compression: ``hvd.Compression.<name>`` (or a registry name).
            Default: none.
        sparse_as_dense: accepted; sparse gradients are always averaged densely.
        gradient_predivide_factor: accepted; averaging is done in float32.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        backward_passes_per_step: only 1; accumulate with the inner
            optimizer's ``gradient_accumulation_steps`` instead.
        average_aggregated_gradients, num_groups, groups: accepted for
            compatibility (CaSync batches small gradients itself).
        process_set: only ``None`` (all ranks).
        strategy: "ps" (co-located parameter servers) or "ring".
        plan: "auto" (the cost model decides per gradient), a ``Plan``, a
            plan file path, or ``None`` (the engine's size rule).
            "adaptive" or ``hvd.Adaptive(check_every=20, margin=0.1, ...)``:
            planned as "auto" (or from ``Adaptive.profile``), then re-planned
            while training runs, every rank switching at the same step
            (``tuning/online.py``; ``opt.online.history`` lists every check).
            ``get_config`` keeps "adaptive" but not an ``Adaptive`` (its profile
            and ``estimate`` are not JSON; saved as ``None``, like a ``Plan``).
        nonfinite: "propagate" (default), "skip" (no rank steps when any
            rank's gradient holds NaN/Inf) or "raise".
        timeout: seconds before a stalled or dead peer becomes an error.
        seed: seed of the compressors' random streams (same on all ranks).
        compression_back: the master compressor for the aggregates
            (bidirectional compression).
        collective: how compressed gradients travel
            (``hipress_like.torch.DistributedOptimizer``'s ``collective``).

    Raises:
        TypeError: ``optimizer`` is not a Keras 3 optimizer.
        ValueError: an unknown compressor, strategy or ``nonfinite`` policy.

    Example:
        >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()),
        ...                                compression=hvd.Compression.onebit)
        >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """

    def __init__(self, optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                 device_sparse: str = "", compression: Any = None, sparse_as_dense: bool = False,
                 gradient_predivide_factor: float = 1.0, op: str = Average,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                 num_groups: int = 0, groups: Any = None, process_set: Any = None, *,
                 strategy: str = "ps", plan: Any = "auto", nonfinite: str = "propagate",
                 timeout: Optional[float] = None, seed: int = 0,
                 compression_back: Any = None, collective: Optional[str] = None,
                 **kwargs: Any) -> None:
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"expected a Keras 3 optimizer (keras.optimizers.*), found "
                            f"{type(optimizer).__name__}; a Keras 2 (tf.keras of TensorFlow "
                            "2.15 and older) optimizer is wrapped under that TensorFlow "
                            "(optimizer_keras2.py)")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("this optimizer is already a DistributedOptimizer")
        if backward_passes_per_step != 1:
            raise ValueError(
                f"backward_passes_per_step={backward_passes_per_step} is not supported; "
                "accumulate locally with the inner optimizer's gradient_accumulation_steps "
                "(keras.optimizers.SGD(..., gradient_accumulation_steps=k))")
        if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
            raise ValueError("process sets are not supported; every rank trains together")
        if kwargs:
            raise ValueError(f"DistributedOptimizer does not take {sorted(kwargs)}; set them "
                             "on the wrapped optimizer")
        sync = GradientSync(compression=compression, strategy=strategy, plan=plan,
                            nonfinite=nonfinite, timeout=timeout, seed=seed,
                            compression_back=compression_back, op=op,
                            collective=collective)
        super().__init__(learning_rate=0.0, name=name or f"Distributed{optimizer.name}")
        self.inner_optimizer = optimizer
        self._hp_sync = sync
        # AR-Topk's ratio search (plan="adaptive") rewinds the inner optimizer too
        sync.optimizer_variables = lambda: list(optimizer.variables)
        self._hp_config = dict(compression=_spec_config(compression), strategy=strategy,
                               plan=plan if plan is None or isinstance(plan, str) else None,
                               nonfinite=nonfinite, timeout=timeout, seed=int(seed),
                               compression_back=_spec_config(compression_back), op=op,
                               collective=collective)
        if gradient_predivide_factor != 1.0:
            log.info("gradient_predivide_factor=%s has no effect: averaging is done in "
                     "float32", gradient_predivide_factor)

    # -- the step -----------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list: List[Any]) -> None:
        """Build the inner optimizer and the engine (collective: every rank)."""
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        if not self._hp_sync.built:
            self._hp_sync.bind(var_list)

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads: List[Any], trainable_variables: Optional[List[Any]] = None) -> None:
        """Average ``grads`` over all ranks, then apply them with the inner optimizer."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        tvs = (list(trainable_variables) if trainable_variables is not None
               else self._trainable_variables)
        averaged, ok = self._hp_sync.reduce(list(grads), tvs)

        def step() -> None:
            # every op of the update, its reads of slots included, after the averaging:
            # a ratio search's rewind assigns the variables there (rewind.py)
            with tf.control_dependencies([*averaged, ok]):
                self.inner_optimizer.apply(averaged, trainable_variables)

        if self._hp_sync.options["nonfinite"] != "skip":
            step()
        elif tf.executing_eagerly():
            if bool(ok):
                step()
            else:
                log.warning("step skipped on every rank: a gradient was NaN/Inf "
                            "(nonfinite='skip')")
        else:
            tf.cond(ok, step, lambda: None)

    def scale_loss(self, loss: Any) -> Any:
        """The inner optimizer's loss scaling (``keras.mixed_precision``)."""
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: List[Any]) -> None:
        """Forwarded to the inner optimizer (EMA weights)."""
        self.inner_optimizer.finalize_variable_values(var_list)

    @property
    def variables(self) -> List[Any]:
        """This wrapper's variables, then the inner optimizer's."""
        return self._variables + self.inner_optimizer.variables

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's learning rate (settable: callbacks change it)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        """The inner optimizer's step counter."""
        return self.inner_optimizer.iterations

    @property
    def engine(self) -> Any:
        """The CaSync engine (None until ``build``)."""
        return self._hp_sync.engine

    @property
    def online(self) -> Any:
        """The ``tuning.online.OnlinePlanner`` of ``plan="adaptive"`` (None otherwise,
        until ``build``, or when there is nothing to adapt)."""
        return self._hp_sync.online

    # -- checkpoints --------------------------------------------------------------------
    def compressor_state(self, all_ranks: bool = False) -> Dict[str, Any]:
        """This rank's compressor state (``all_ranks=True``: every rank's; collective)."""
        return self._hp_sync.state_dict(all_ranks=all_ranks)

    def load_compressor_state(self, state: Dict[str, Any]) -> None:
        """Restore ``compressor_state()`` output (deferred until the engine is built)."""
        self._hp_sync.load_state_dict(state)

    def save_own_variables(self, store: Any) -> None:
        """Keras saving: the variables, plus this rank's compressor state as uint8 bytes."""
        super().save_own_variables(store)
        if self._hp_sync.built:
            store[_STATE_KEY] = np.frombuffer(to_bytes(self.compressor_state()), dtype=np.uint8)

    def load_own_variables(self, store: Any) -> None:
        """Keras loading: the variables, then the compressor state if the file has one."""
        keys = list(store.keys())
        super().load_own_variables({k: store[k] for k in keys if k != _STATE_KEY})
        if _STATE_KEY in keys:
            self.load_compressor_state(from_bytes(np.asarray(store[_STATE_KEY]).tobytes()))

    # -- config and teardown ------------------------------------------------------------
    def get_config(self) -> Dict[str, Any]:
        """The inner optimizer's config and this wrapper's options."""
        return {"name": self.name,
                "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                **self._hp_config}

    @classmethod
    def from_config(cls, config: Dict[str, Any], custom_objects: Any = None
                    ) -> "DistributedOptimizer":
        """Rebuild from ``get_config`` (the engine is built again by ``build``)."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"),
                                                      custom_objects=custom_objects)
        for k in ("compression", "compression_back"):
            config[k] = _spec_from_config(config.get(k))
        return cls(inner, **config)

    def close(self) -> None:
        """Close the engine (also done by ``hvd.shutdown()``)."""
        self._hp_sync.close()
