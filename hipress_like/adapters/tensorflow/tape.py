"""``DistributedGradientTape``: ``tape.gradient`` returns gradients averaged by CaSync.

Horovod's TensorFlow 2 scripts wrap a fresh tape every step, often inside a
``@tf.function``::

    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.onebit)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))

The engine must outlive the tapes, so tapes over the same sources with the
same settings share one ``GradientSync`` (and so one engine and one
compressor state), found in a per-process registry. The first
``gradient`` call builds it (a collective: every rank reaches it at the same
point, eagerly or while tracing). ``compressor_state()`` /
``load_compressor_state()`` save and restore every tape engine's state for
checkpoints, keyed by the sources' names and the settings. With
``plan="adaptive"`` each shared engine has its online planner
(``GradientSync.online``), and its state (the active plan and the
controller) travels in the same checkpoint.
"""
from __future__ import annotations

import hashlib
import logging
import weakref
from typing import Any, Dict, List, Optional, Tuple

import tensorflow as tf

from ...tuning.online import Adaptive
from ..runtime import size
from .sync import Average, GradientSync, from_bytes, to_bytes, var_key, variable_names

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "compressor_state",
           "load_compressor_state"]

log = logging.getLogger(__name__)

# (ids of the sources, settings) -> (weak refs to the sources, the shared GradientSync)
_syncs: Dict[Tuple[Any, ...], Tuple[List[Any], GradientSync]] = {}
# states loaded before their tape's first gradient() call, by label
_pending: Dict[str, Dict[str, Any]] = {}


def _plan_key(plan: Any) -> Any:
    """The plan's part of a tape's settings: a name or path as it is; ``Adaptive``
    settings by value (a script may build ``hvd.Adaptive(...)`` anew every step, and
    equal settings must find the same engine); a ``Plan`` by identity."""
    if plan is None or isinstance(plan, str):
        return plan
    return repr(plan) if isinstance(plan, Adaptive) else id(plan)


def _settings_key(options: Dict[str, Any], op: str) -> Tuple[Any, ...]:
    return (repr(options["compression"]), options["strategy"], _plan_key(options["plan"]),
            options["nonfinite"], options["seed"], repr(options["compression_back"]), op,
            options["collective"])


def _label(names: List[str], options: Dict[str, Any], op: str) -> str:
    """A label for a tape engine that is the same in every run of the same program
    (``plan="adaptive"`` and any ``Adaptive(...)`` share one: a resumed job may tune the
    settings and still find its state)."""
    plan = options["plan"]
    if isinstance(plan, Adaptive):
        plan = "adaptive"
    stable = [repr(options["compression"]), options["strategy"],
              plan if plan is None or isinstance(plan, str) else "Plan", options["nonfinite"],
              options["seed"], repr(options["compression_back"]), op]
    if options["collective"] is not None:  # the labels of earlier checkpoints stay the same
        stable.append(options["collective"])
    text = "|".join(names) + "||" + "|".join(str(s) for s in stable)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _ref(obj: Any) -> Any:
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda obj=obj: obj


def _sync_for(sources: List[Any], options: Dict[str, Any], op: str) -> GradientSync:
    """The registry's GradientSync for these sources and settings (created on first use)."""
    settings = _settings_key(options, op)
    key = (tuple(id(s) for s in sources), settings)
    hit = _syncs.get(key)
    if hit is not None:
        refs, sync = hit
        if all(r() is s for r, s in zip(refs, sources)):
            return sync
        sync.close()  # the ids were reused by other objects: the old sources are gone
    sync = GradientSync(**options, op=op, what="DistributedGradientTape")
    sync.label = _label(variable_names(sources), options, op)
    if sync.label in _pending:
        sync.load_state_dict(_pending.pop(sync.label))
    _syncs[key] = ([_ref(s) for s in sources], sync)
    return sync


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape``: ``gradient`` averages over ranks through CaSync.

    Everything but ``gradient`` is the wrapped tape's (``watch``,
    ``jacobian``, the context manager, ...).

    Attributes:
        step_ok: after ``gradient``, a scalar bool tensor: False when every
            rank must skip this step (``nonfinite="skip"`` and some rank saw
            NaN/Inf); always True otherwise. Usable inside ``tf.function``.
        sync: after ``gradient``, the ``GradientSync`` shared by the tapes over
            these sources and settings (its ``engine``, and its ``online``
            planner with ``plan="adaptive"``); None before.
    """

    def __init__(self, tape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression: Any = None, sparse_as_dense: bool = False, op: str = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Any = None, process_set: Any = None,
                 scale_local_gradients: bool = True, *, strategy: str = "ps",
                 plan: Any = "auto", nonfinite: str = "propagate",
                 timeout: Optional[float] = None, seed: int = 0,
                 compression_back: Any = None, collective: Optional[str] = None) -> None:
        if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
            raise ValueError("process sets are not supported; every rank trains together")
        # checked now (a typo fails at once); the engine is built by the first gradient()
        probe = GradientSync(compression=compression, strategy=strategy, plan=plan,
                             nonfinite=nonfinite, timeout=timeout, seed=seed,
                             compression_back=compression_back, op=op,
                             what="DistributedGradientTape", collective=collective)
        self._options = probe.options
        self._op = op
        self._tape = tape
        self._scale_local = bool(scale_local_gradients)
        self._local: set = set()  # refs of register_local_source's variables
        self.step_ok: Any = None
        self.sync: Any = None
        if num_groups or groups:
            log.info("num_groups/groups ignored: CaSync batches small gradients itself")

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The wrapped tape's gradients, averaged over all ranks (same structure).

        Unconnected sources (``None`` gradients) are submitted as zeros, as in
        the PyTorch face: another rank may have a gradient for them, and
        every rank must submit the same set; the average comes back.
        """
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat_src = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads, expand_composites=False)
        shared = [i for i, s in enumerate(flat_src) if var_key(s) not in self._local]
        outs = list(flat)
        if shared:
            src = [flat_src[i] for i in shared]
            sync = self.sync = _sync_for(src, self._options, self._op)
            reduced, self.step_ok = sync.reduce([flat[i] for i in shared], src)
            for i, g in zip(shared, reduced):
                outs[i] = g
        else:
            self.step_ok = tf.constant(True)
        if self._scale_local and len(shared) < len(flat_src):
            n = float(size())  # Horovod's rule (its pull 3695): local gradients / size
            for i, s in enumerate(flat_src):
                g = outs[i]
                if var_key(s) in self._local and g is not None:
                    outs[i] = (tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                               if isinstance(g, tf.IndexedSlices) else g / n)
        return tf.nest.pack_sequence_as(grads, outs)

    def register_local_source(self, source: Any) -> None:
        """Mark ``source`` (a variable) as this worker's own, as Horovod's tape does: its
        gradient is not averaged over ranks (model parallelism) but returned as
        computed, divided by the world size when ``scale_local_gradients`` (the
        default). Every rank must register the same number of sources, since the
        others' gradients are averaged by one engine over the same list."""
        self._local.add(var_key(source))

    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None) -> Tuple[list, list]:
        """``gradient``'s result split as Horovod's tape splits it: ``([(source, grad)]``
        of the sources registered as local, ``[(source, grad)]`` of the rest)``, each in
        the order of ``sources``."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if var_key(s) in self._local else shared).append((s, g))
        return local, shared

    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)


def PartialDistributedGradientTape(tape: tf.GradientTape, *args: Any,  # noqa: N802
                                   local_layers: Any = None, **kwargs: Any
                                   ) -> DistributedGradientTape:
    """A ``DistributedGradientTape`` whose ``local_layers``' trainable weights are this
    rank's own (``register_local_source``): their gradients are not averaged, only
    divided by the world size unless ``scale_local_gradients=False`` (Horovod's
    ``PartialDistributedGradientTape``, for model parallelism). The other arguments
    are ``DistributedGradientTape``'s.

    Raises:
        ValueError: an entry of ``local_layers`` that is not a Keras layer.
    """
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    if not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("local_layers must be Keras layers (keras.layers.Layer), found "
                         f"{[type(x).__name__ for x in local_layers]}")
    wrapped = DistributedGradientTape(tape, *args, **kwargs)
    for layer in local_layers:
        for var in layer.trainable_weights:
            wrapped.register_local_source(var)
    return wrapped


def compressor_state(all_ranks: bool = False) -> bytes:
    """Every ``DistributedGradientTape`` engine's compressor state, as bytes.

    Save them beside a ``tf.train.Checkpoint`` (e.g. ``open(path, "wb")``);
    ``load_compressor_state`` restores them so that a resumed run continues
    exactly. Per rank, as in the PyTorch face: every rank saves its own, or
    rank 0 saves ``compressor_state(all_ranks=True)`` (a collective call).
    """
    states = {sync.label: sync.state_dict(all_ranks=all_ranks)
              for _, sync in _syncs.values() if sync.built}
    return to_bytes({"format": "hipress-like-tf-tapes", "version": 1, "tapes": states})


def load_compressor_state(data: bytes) -> None:
    """Restore ``compressor_state()`` output; tapes not built yet get theirs at their
    first ``gradient`` call.

    Raises:
        ValueError: not a tape state, or another rank's compressor state.
    """
    d = from_bytes(data)
    if not isinstance(d, dict) or d.get("format") != "hipress-like-tf-tapes":
        raise ValueError("not a hipress-like tape state (from compressor_state())")
    by_label = {sync.label: sync for _, sync in _syncs.values()}
    for label, hip in d["tapes"].items():
        if label in by_label:
            by_label[label].load_state_dict(hip)
        else:
            _pending[label] = hip
