"""``DistributedOptimizer`` for Keras 2 (``tf.keras`` of TensorFlow 2.15 and older).

Horovod's own TensorFlow ops build against these TensorFlows, not against
TensorFlow 2.16+ (Keras 3), so a Horovod user's script is most often a
Keras 2 script. Keras 2 optimizers (the 2.11+ ``tf.keras.optimizers.*`` and
``tf.keras.optimizers.legacy.*``) have no wrapper protocol like Keras 3's
``LossScaleOptimizer``; as ``horovod.tensorflow.keras`` does, the wrapper is
a subclass of the user's optimizer class made at run time, built from the
optimizer's config (same hyperparameters, fresh slots), whose
``apply_gradients`` first averages the gradients over all ranks
(``sync.GradientSync``: the engine is built at the first call, a collective,
on the variables it is given) and then applies the averages. With
``nonfinite="skip"`` no rank applies a step in which some rank saw NaN/Inf
(a ``tf.cond`` inside ``model.fit``'s traced step).

``isinstance(opt, type(user_optimizer))`` holds, and ``get_config`` is the
user optimizer's, so a model saved with it loads as that optimizer
(Horovod's rule; ``hvd.load_model`` wraps it again).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from ..runtime import size
from .sync import Average, GradientSync

__all__ = ["DistributedOptimizer"]

log = logging.getLogger(__name__)

_classes: Dict[type, type] = {}


def _variables_of(ref: "weakref.ref[Any]") -> Callable[[], List[Any]]:
    """The optimizer's variables when called: the 2.11+ optimizer's ``variables`` is a
    callable list, the legacy one's a method; none once the optimizer is gone."""
    def variables() -> List[Any]:
        opt = ref()
        if opt is None:
            return []
        v = opt.variables
        return list(v() if callable(v) and not isinstance(v, (list, tuple)) else v)
    return variables


class _Passes:
    """The local sums of ``backward_passes_per_step`` passes and the passes since the last
    apply (``counter``, as Horovod's aggregation helper names it), created once."""

    def __init__(self, variables: List[Any]) -> None:
        with tf.init_scope():  # outside any traced function
            self.sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                         for v in variables]
            self.counter = tf.Variable(0, dtype=tf.int64, trainable=False)


class _Keras2Mixin:
    """Placed before the user's optimizer class in the MRO (``DistributedOptimizer``)."""

    _hp_sync: GradientSync
    _hp_passes: int = 1  # backward_passes_per_step
    _hp_average_passes: bool = False  # average_aggregated_gradients
    _hp_acc: Any = None  # _Passes, at the first call with backward_passes_per_step > 1
    _hp_local: frozenset = frozenset()  # refs of register_local_var's variables
    _hp_scale_local: bool = True

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """Average the gradients over all ranks, then apply them (the user class's
        ``apply_gradients``; its other arguments pass through). With
        ``backward_passes_per_step=N`` the gradients are summed locally and every N-th
        call averages and applies the sum (divided by N with
        ``average_aggregated_gradients``), as Horovod's Keras optimizer does."""
        pairs: List[Tuple[Any, Any]] = [(g, v) for g, v in grads_and_vars if g is not None]
        if self._hp_passes > 1:
            return self._hp_aggregate(pairs, args, kwargs)
        return self._hp_apply(pairs, args, kwargs)

    def _hp_aggregate(self, pairs: List[Tuple[Any, Any]], args: Any, kwargs: Any) -> Any:
        """Sum this call's gradients locally; every ``_hp_passes``-th call apply the sum."""
        tvs = [v for _, v in pairs]
        if self._hp_acc is None:
            object.__setattr__(self, "_hp_acc", _Passes(tvs))
        sums, count = self._hp_acc.sums, self._hp_acc.counter
        for acc, (g, _) in zip(sums, pairs):
            acc.assign_add(tf.convert_to_tensor(g))  # IndexedSlices summed densely
        count.assign_add(1)
        n = self._hp_passes

        def flush() -> Any:
            grads = [a.read_value() / n if self._hp_average_passes else a.read_value()
                     for a in sums]
            self._hp_apply(list(zip(grads, tvs)), args, kwargs)
            for a in sums:
                a.assign(tf.zeros_like(a))
            count.assign(0)
            return tf.constant(1, dtype=tf.int64)

        def hold() -> Any:  # a pass without an update still counts as a step (Horovod)
            self.iterations.assign_add(1)
            return tf.constant(0, dtype=tf.int64)

        if tf.executing_eagerly():
            return flush() if int(count.numpy()) == n else hold()
        return tf.cond(tf.equal(count, n), flush, hold)

    @property
    def _agg_helper(self) -> Any:
        """The passes' local sums and ``counter`` (Horovod's attribute name), or None
        before the first call with ``backward_passes_per_step`` > 1."""
        return self._hp_acc

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> List[Tuple[Any, Any]]:
        """This rank's gradients of ``loss`` (Horovod's hook, which Keras 2 calls from
        ``minimize``); ``apply_gradients`` averages them over the ranks."""
        tape = tf.GradientTape() if tape is None else tape
        base = super()
        if hasattr(base, "_compute_gradients"):
            return base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        return base.compute_gradients(loss, var_list, tape=tape)

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient on this rank, as Horovod's optimizer does: not
        averaged (model parallelism), divided by the world size unless
        ``scale_local_gradients=False``."""
        object.__setattr__(self, "_hp_local", self._hp_local | {var.ref()})

    def _hp_build_slots(self, tvs: List[Any]) -> None:
        """Create the optimizer's variables (slots, ``iterations``) now rather than in
        ``apply_gradients`` right after the averaging, where the planner of
        ``plan="adaptive"`` runs and AR-Topk's ratio search takes its snapshot of them
        (``rewind.py``). Both Keras 2 kinds create them idempotently, as their
        ``apply_gradients`` does."""
        with tf.init_scope():
            if hasattr(self, "_create_all_weights"):  # legacy OptimizerV2
                self._create_all_weights(tvs)
            else:
                self.build(tvs)

    def _hp_apply(self, pairs: List[Tuple[Any, Any]], args: Any, kwargs: Any) -> Any:
        """Average ``pairs``' gradients over all ranks and apply them (the policy for
        NaN/Inf: ``nonfinite``)."""
        local = [(g, v) for g, v in pairs if v.ref() in self._hp_local]
        pairs = [(g, v) for g, v in pairs if v.ref() not in self._hp_local]
        grads, tvs = [g for g, _ in pairs], [v for _, v in pairs]
        if not self._hp_sync.built:
            self._hp_sync.bind(tvs)  # collective: every rank, at its first step
        online = self._hp_sync.online
        if online is not None and online.ratio is not None:
            self._hp_build_slots(tvs)  # before the step's averaging: the search's snapshot
        averaged, ok = self._hp_sync.reduce(grads, tvs)
        if local and self._hp_scale_local:
            n = float(size())
            local = [(tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                      if isinstance(g, tf.IndexedSlices) else g / n, v) for g, v in local]
        apply = super().apply_gradients  # type: ignore[misc]

        def step() -> Any:
            # every op of the update after the averaging, where a ratio search's rewind
            # assigns the variables (rewind.py)
            with tf.control_dependencies([*averaged, ok]):
                return apply(list(zip(averaged, tvs)) + local, *args, **kwargs)

        if self._hp_sync.options["nonfinite"] != "skip":
            return step()
        if tf.executing_eagerly():
            if bool(ok):
                return step()
            log.warning("step skipped on every rank: a gradient was NaN/Inf "
                        "(nonfinite='skip')")
            return None

        def skipped() -> Any:
            return tf.constant(0, dtype=tf.int64)

        def applied() -> Any:
            step()
            return tf.constant(1, dtype=tf.int64)

        return tf.cond(ok, applied, skipped)

    @property
    def engine(self) -> Any:
        """The CaSync engine (None until the first ``apply_gradients``)."""
        return self._hp_sync.engine

    @property
    def online(self) -> Any:
        """The ``tuning.online.OnlinePlanner`` of ``plan="adaptive"`` (None otherwise)."""
        return self._hp_sync.online

    def compressor_state(self, all_ranks: bool = False) -> Dict[str, Any]:
        """This rank's compressor state (``all_ranks=True``: every rank's; collective)."""
        return self._hp_sync.state_dict(all_ranks=all_ranks)

    def load_compressor_state(self, state: Dict[str, Any]) -> None:
        """Restore ``compressor_state()`` output (deferred until the engine is built)."""
        self._hp_sync.load_state_dict(state)

    def close(self) -> None:
        """Close the engine (also done by ``hvd.shutdown()``)."""
        self._hp_sync.close()


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = None,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: str = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: Any = None, *, strategy: str = "ps",
                         plan: Any = "auto", nonfinite: str = "propagate",
                         timeout: Optional[float] = None, seed: int = 0,
                         compression_back: Any = None, collective: Optional[str] = None,
                         scale_local_gradients: bool = True, **kwargs: Any) -> Any:
    """Wrap a Keras 2 optimizer so that it applies gradients averaged over all ranks.

    Shaped like ``horovod.tensorflow.keras.DistributedOptimizer`` (TensorFlow
    2.15 and older); the options after ``*`` are hipress-like's, as on the
    Keras 3 face (``optimizer.py``), whose docstring describes each.

    ``backward_passes_per_step=N`` sums N calls' gradients locally and averages
    and applies every N-th call's sum (divided by N with
    ``average_aggregated_gradients``), as Horovod's Keras optimizer does.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: ``backward_passes_per_step`` not an int >= 1, a process set,
            unknown keywords, or a bad compressor, strategy or policy.

    Example:
        >>> opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01 * hvd.size()),
        ...                                compression=hvd.Compression.onebit)
    """
    keras_optimizers = (tf.keras.optimizers.Optimizer,)
    legacy = getattr(tf.keras.optimizers, "legacy", None)
    if legacy is not None:
        keras_optimizers += (legacy.Optimizer,)
    if not isinstance(optimizer, keras_optimizers):
        raise TypeError(f"expected a Keras optimizer (tf.keras.optimizers.*), found "
                        f"{type(optimizer).__name__}; for a tf.compat.v1 optimizer or a "
                        "custom loop use hvd.DistributedGradientTape")
    if isinstance(optimizer, _Keras2Mixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, found "
                         f"{backward_passes_per_step!r}")
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise ValueError("process sets are not supported; every rank trains together")
    if kwargs:
        raise ValueError(f"DistributedOptimizer does not take {sorted(kwargs)}; set them on "
                         "the wrapped optimizer")
    if gradient_predivide_factor != 1.0:
        log.info("gradient_predivide_factor=%s has no effect: averaging is done in float32",
                 gradient_predivide_factor)
    sync = GradientSync(compression=compression, strategy=strategy, plan=plan,
                        nonfinite=nonfinite, timeout=timeout, seed=seed,
                        compression_back=compression_back, op=op, collective=collective)
    base = type(optimizer)
    cls = _classes.get(base)
    if cls is None:
        cls = _classes[base] = type(base.__name__, (_Keras2Mixin, base),
                                    {"__module__": base.__module__,
                                     "__doc__": f"{base.__name__} averaged by hipress-like."})
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    opt = cls.from_config(config)
    opt._hp_sync = sync
    sync.optimizer_variables = _variables_of(weakref.ref(opt))  # the ratio search's rewind
    opt._hp_passes = backward_passes_per_step
    opt._hp_average_passes = bool(average_aggregated_gradients)
    opt._hp_scale_local = bool(scale_local_gradients)
    return opt
