"""The training state AR-Topk's ratio search rewinds to, on the TensorFlow face.

The ratio search (``tuning/ratio_search.py``) runs each candidate ratio for a few
real steps from one in-memory snapshot and puts the snapshot back before the
next candidate and at the end. On the PyTorch and Gluon faces the planner runs
after the optimizer's update, so the snapshot is the parameters and the
optimizer state. On this face the planner runs where the step's averages come in
(``GradientSync._finish``, the end of the ``tf.py_function`` that ends the
reduction inside a traced step), which is *before* the optimizer applies them:
the update of step s follows the planner's call of step s, and TensorFlow gives
no later point inside the same traced function. So the snapshot taken there
holds what produces the state after step s rather than that state:

- the variables' values before update s, and the optimizer's variables (its
  slots and ``iterations``) before it;
- the averaged gradients of step s, and whether step s counts (``ok``).

Restoring it at the end of step s + k puts those values back and hands the
optimizer step s's averages in place of step s + k's; the update that follows
is update s again, the same operation on the same inputs, so training goes on
from bitwise the state the first update of s produced, as on the PyTorch face.
Inside a traced step that holds only if every op of the update runs after the
averaging: TensorFlow orders the ops that consume the averages, but an
update's reads of its slots (momentum) or its ``iterations`` increment depend
on no gradient and may run before the rewind's assignments. So the Keras
``DistributedOptimizer`` (Keras 3 and 2) builds its update under a control
dependency on the averages, and gives its optimizer's variables
(``GradientSync.optimizer_variables``; Keras 2 creates its slots before the
averaging for them to exist at the first snapshot).

A ``DistributedGradientTape`` never sees the optimizer that applies its
gradients, and cannot order that optimizer's ops either (decoupled weight
decay writes the variables without reading a gradient), so a rewind there
could restore half a state and race with the update: the tape gives
``ratio_search.TRAIN_ON`` instead, and its search's steps train on. Non-
trainable variables such as BatchNorm's moving statistics are outside the
snapshot on every face.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["Rewind"]


def _assignable(v: Any) -> bool:
    """A variable (``tf.Variable`` or a Keras 3 variable), not a plain tensor source."""
    return hasattr(v, "assign") and hasattr(v, "numpy")


def _copy(v: Any) -> np.ndarray:
    return np.array(v.numpy(), copy=True)


class Rewind:
    """The ratio search's ``(checkpoint, restore)`` for one ``GradientSync`` (module
    docstring).

    Args:
        variables: the variables whose gradients the engine averages (sources
            that are tensors, not variables, are skipped).
        optimizer_variables: returns the optimizer's variables at the moment of the
            checkpoint (the Keras ``DistributedOptimizer`` gives its own).
    """

    def __init__(self, variables: Sequence[Any],
                 optimizer_variables: Callable[[], Sequence[Any]]) -> None:
        self._vars = [v for v in variables if _assignable(v)]
        self._optimizer_variables = optimizer_variables
        self._step: Optional[Tuple[List[tf.Tensor], bool]] = None
        self._replacement: Optional[Tuple[List[tf.Tensor], bool]] = None

    def around(self, outs: List[tf.Tensor], ok: bool,
               planner: Callable[[], Any]) -> Tuple[List[tf.Tensor], bool]:
        """Run ``planner`` (the online planner's call after this step's averaging) with
        this step's ``outs``/``ok`` at hand for a checkpoint; return what the optimizer
        gets: these, or the checkpoint's when the planner restored one."""
        self._step, self._replacement = (outs, ok), None
        try:
            planner()
        finally:
            self._step = None
        rep, self._replacement = self._replacement, None
        return (outs, ok) if rep is None else rep

    def checkpoint(self) -> Dict[str, Any]:
        """The state before this step's update, and this step's averages."""
        if self._step is None:
            raise RuntimeError("a TensorFlow face's snapshot is taken inside the planner's "
                               "call after a step's averaging (Rewind.around)")
        outs, ok = self._step
        opt = list(self._optimizer_variables())
        return {"vars": [_copy(v) for v in self._vars],
                "opt": [(v, _copy(v)) for v in opt if _assignable(v)],
                "outs": [(np.array(o.numpy(), copy=True), o.dtype) for o in outs],
                "ok": bool(ok)}

    def restore(self, snap: Dict[str, Any]) -> None:
        """Put the checkpoint's variables back; this step hands out its averages."""
        for v, x in zip(self._vars, snap["vars"]):
            v.assign(x)
        for v, x in snap["opt"]:
            v.assign(x)
        self._replacement = ([tf.constant(x, dtype=dt) for x, dt in snap["outs"]], snap["ok"])
