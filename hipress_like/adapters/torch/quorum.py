"""``DistributedOptimizer(stragglers=Quorum(...))``: training on with a straggling rank.

With partial aggregation on (THC Sec. 6.1, 8.3; ``hipress_like.partial`` has the
protocol), a step's gradient closes once a quorum of ranks contributed, and
every rank applies that same aggregate, the late one included, so replicas
stay bitwise identical. ``step()``:

1. flattens this rank's gradients (float32, or float64 when every
   parameter is) and hands them to the quorum lane as step ``opt.steps``;
2. waits for that step's aggregate, writes it into ``p.grad`` and steps the
   wrapped optimizer;
3. if this rank's gradient arrived after its step closed (it was dropped),
   catches up: it applies every step that closed meanwhile and, when some
   rank has already submitted the next one (so it will close), waits for
   that one too, so that its next gradient starts together with the
   others' instead of one step behind. A late rank therefore skips the
   computation of the steps it missed. It never waits for a step nobody
   submitted: at the end of training that step would never come.

The loop contract that makes catching up work: count steps with
``opt.steps`` (it may advance by more than one per ``step()``) and pick
each step's batch by it::

    while opt.steps < total_steps:
        x, y = batch(opt.steps)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

An LR scheduler must advance once per applied step, so hook it to the
optimizer (``opt.register_step_post_hook(lambda *a: sched.step())``) rather
than calling it once per loop iteration. A rank whose gradient holds
NaN/Inf sits the step out (counted in ``opt.stragglers()``) and says so, so
the others need not wait for it; when every rank does, the step is skipped
on every rank (parameters and optimizer state unchanged). ``GradScaler``
cannot see the NaN/Inf of other ranks in this mode, and closures and
``synchronize()`` are not available.
Gradients are exchanged at ``step()``, not during backward (one flat
buffer per step, no overlap with computation).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, List, Optional

import torch

from .. import checkpoint
from ..compression import resolve_compression
from ..engine_builder import wire_dtype
from ..runtime import _require, _track, default_timeout, engine_transport
from .gradients import resolve_names

__all__ = ["QuorumOptimizerMixin"]

log = logging.getLogger(__name__)


class QuorumOptimizerMixin:
    """Methods placed in front of the user's optimizer class when ``stragglers`` is set."""

    def _hpq_setup(self, named_parameters: Any, compression: Any, quorum: Any,
                   timeout: Optional[float], seed: int, joining: Any = None) -> None:
        from ...casync.choice import build_compressor
        from ...partial import QuorumLane, check_compressor

        rt = _require()
        params = [p for g in self.param_groups for p in g["params"]]
        names = resolve_names(params, named_parameters, self.param_groups)
        self._hpq_names = names
        self._hpq_params: List[torch.Tensor] = [
            p for p in {id(p): p for p in params}.values() if p.requires_grad]
        # one flat buffer in the engine's wire dtypes (fp16/bf16 reduced in float32)
        wires = {wire_dtype(p.dtype, names[id(p)]) for p in self._hpq_params}
        self._hpq_dtype = torch.float64 if wires == {torch.float64} else torch.float32
        self._hpq_numel = sum(p.numel() for p in self._hpq_params)
        if not self._hpq_numel:
            raise ValueError("stragglers: the optimizer holds no parameter that requires a "
                             "gradient")
        spec, cparams = resolve_compression(compression)
        comp = build_compressor(spec if spec is not None else "identity", cparams, "auto")
        check_compressor(comp)  # before the transport: a collective every rank would wait in
        timeout = default_timeout() if timeout is None else float(timeout)
        if joining is not None:  # every rank checked out (joining.py): open the transport
            joining.ready()
        self._hpq_rank, self._hpq_size = rt.rank, rt.size
        self._hpq_quorum = quorum
        self._hpq_steps = 0
        self._hpq_nonfinite = 0
        transport = engine_transport(timeout)
        try:
            self._hpq_lane = QuorumLane(comp, self._hpq_numel, self._hpq_dtype, transport,
                                        rt.rank, rt.size, quorum, seed=seed, timeout=timeout)
        except BaseException:
            transport.close()
            raise
        # the lane thread must stop before the interpreter does, even when the
        # optimizer is dropped without close() (its thread would die mid-call)
        weakref.finalize(self, _close_lane, self._hpq_lane)
        log.info("stragglers: %s over %d ranks, a step closes with %d of them (%s)",
                 comp.name, rt.size, self._hpq_lane.needed, quorum)
        _track(self)

    # -- the step ---------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps applied so far (may advance by more than one per ``step()``)."""
        return self._hpq_steps

    def step(self, closure: Any = None) -> Any:
        """Contribute this rank's gradient to step ``steps``, apply its aggregate,
        and catch up if the step closed without this rank (module docstring)."""
        if closure is not None:
            raise ValueError("stragglers: step(closure) is not supported under partial "
                             "aggregation (each evaluation would need its own quorum)")
        lane = self._hpq_lane
        if lane is None:
            raise RuntimeError("this optimizer was closed")
        s = self._hpq_steps
        flat = self._hpq_flatten()
        finite = bool(torch.isfinite(flat).all())
        if finite:
            lane.submit(s, flat)
        else:  # sit the step out, saying so: the others need not wait for this rank
            self._hpq_nonfinite += 1
            lane.abstain(s)
            log.warning("stragglers: rank %d's gradient of step %d holds NaN/Inf; it sits "
                        "the step out", self._hpq_rank, s)
        members = self._hpq_apply(s)
        if finite and self._hpq_rank not in members:  # late: apply what closed meanwhile
            while lane.ready(self._hpq_steps):
                self._hpq_apply(self._hpq_steps)
            if lane.awaited(self._hpq_steps):  # others are past computing it: realign
                self._hpq_apply(self._hpq_steps)
        return None

    def _hpq_flatten(self) -> torch.Tensor:
        flat = torch.empty(self._hpq_numel, dtype=self._hpq_dtype)
        o = 0
        for p in self._hpq_params:
            n = p.numel()
            g = p.grad
            if g is None:
                flat[o:o + n].zero_()
            else:
                flat[o:o + n].copy_((g.to_dense() if g.is_sparse else g).reshape(-1))
            o += n
        return flat

    def _hpq_apply(self, s: int) -> tuple:
        agg, members = self._hpq_lane.result(s)
        if agg is None:  # no rank contributed (NaN/Inf everywhere): skipped on every rank
            log.warning("stragglers: no rank had a finite gradient for step %d; every rank "
                        "skips it", s)
            self._hpq_steps = s + 1
            return members
        o = 0
        with torch.no_grad():
            for p in self._hpq_params:
                n = p.numel()
                v = agg[o:o + n].view(p.shape)
                if p.grad is None or p.grad.is_sparse:
                    p.grad = v.to(p.dtype).clone()
                else:
                    p.grad.copy_(v)
                o += n
        super().step()
        self._hpq_steps = s + 1
        every = self._hpq_quorum.resync_every
        if every and self._hpq_steps % every == 0 and self._hpq_size > 1:
            self._hpq_resync()
        # every rank applies every step, the late one included: it checks at the same steps
        check = getattr(self, "_hp_check_every", 0)
        if check and self._hpq_steps % check == 0:
            self.check_consistency()
        return members

    def check_consistency(self) -> None:
        """Compare every rank's parameters and optimizer state (a collective call).

        Raises:
            ConsistencyError: on every rank, naming the first parameter or
                state entry that differs and the ranks that disagree.
        """
        from ..consistency import check_replicas

        check_replicas([(self._hpq_names[id(p)], p) for p in self._hpq_params], self,
                       step=self._hpq_steps)

    def _hpq_resync(self) -> None:
        """Every rank takes rank 0's parameters (a collective on the default group)."""
        from ..collectives import broadcast_

        for i, p in enumerate(self._hpq_params):
            with torch.no_grad():
                broadcast_(p.data, root_rank=0, name=f"stragglers.resync.{i}")

    def synchronize(self) -> bool:
        """Not available under partial aggregation: ``step()`` exchanges the gradients."""
        raise NotImplementedError("stragglers: synchronize() is not available under partial "
                                  "aggregation; step() exchanges and applies the gradients")

    def stragglers(self) -> Dict[str, int]:
        """Counters: steps done by the lane, steps this rank contributed to, sat out,
        had its late gradient dropped, steps that closed with fewer than N ranks
        (``partial``) and the missing contributions they add up to, NaN/Inf
        gradients kept back."""
        c = dict(self._hpq_lane.counters) if self._hpq_lane is not None else {}
        c["nonfinite"] = self._hpq_nonfinite
        c["applied"] = self._hpq_steps
        return c

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state, plus this rank's compressor state and step
        count under ``"hipress"`` (each rank saves and loads its own)."""
        sd = super().state_dict()
        local = self._hpq_lane.state_dict() if self._hpq_lane is not None else {}
        local["applied"] = self._hpq_steps
        sd["hipress"] = checkpoint.pack(local, self._hpq_rank, self._hpq_size)
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load the wrapped optimizer's state and, when present, the compressor state
        and step count (before the first ``step()``; every rank its own file)."""
        state_dict = dict(state_dict)
        hip = state_dict.pop("hipress", None)
        super().load_state_dict(state_dict)
        if hip is None:
            return
        saved = checkpoint.unpack(hip, self._hpq_rank, self._hpq_size, where="this state dict",
                                  fix="load each rank's own optimizer.state_dict()")
        if saved is not None:
            self._hpq_lane.load_state_dict(saved)
            self._hpq_steps = int(saved.get("applied", 0))

    def close(self) -> None:
        """Stop the lane (also done by ``hpt.shutdown()``)."""
        lane, self._hpq_lane = self._hpq_lane, None
        if lane is not None:
            _close_lane(lane)


def _close_lane(lane: Any) -> None:
    """Stop a quorum lane's thread and close its transport (idempotent)."""
    lane.close()
    lane.transport.close()
