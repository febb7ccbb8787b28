"""``DistributedOptimizer``: any ``torch.optim`` optimizer, synchronised by CaSync.

The wrapper is an instance of a class derived from the user's optimizer
class (``isinstance(opt, torch.optim.SGD)`` still holds), sharing its param
groups and state. One training step:

1. ``loss.backward()``: a post-accumulate-grad hook on every parameter
   hands the gradient to the engine as soon as it is final
   (``engine.submit(name, p.grad)``), so compression and communication of
   late layers overlap the backward pass of early ones (HiPress Fig. 8b).
   With ``backward_passes_per_step = k`` the k-th hook call submits.
2. ``step()`` calls ``synchronize()``: parameters that require a gradient
   but produced none on this rank are submitted as zeros (another rank may
   have one; every rank must submit the same set), then the engine finishes
   the step and the averaged gradients are in ``p.grad``.
3. The wrapped optimizer's ``step`` runs.

Ordering is checked like Horovod: ``zero_grad()`` with gradients in flight
raises; a gradient computed more than ``backward_passes_per_step`` times
before ``step()`` raises; ``step()`` right after an explicit
``synchronize()`` warns unless inside ``skip_synchronize()``.

Parameters whose ``requires_grad`` is off (a frozen or alternating
sub-network, GAN-style) are not synchronised in that step; the set per step
is every parameter with ``requires_grad`` on, evaluated at ``synchronize``
time, which is the same on every rank when ranks run the same program.
Sparse gradients (``nn.Embedding(sparse=True)``) are allgathered at
``synchronize`` time, or densified with ``sparse_as_dense=True``.

``state_dict()`` adds the compressor state (error-feedback residuals,
PowerSGD's Q, DGC's momentum) under ``"hipress"``; it is this rank's own,
so for an exact resume every rank saves and loads its own state dict (or
rank 0 saves ``state_dict(all_ranks=True)``, a collective call, which another
world size can also reshard; ``hpt.save_checkpoint`` does that atomically).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .. import checkpoint
from ..collectives import Average, Sum
from ..engine_builder import (
    EngineHolder,
    build_engine,
    device_type_of,
    online_planner,
    resolve_plan,
    specs_of,
)
from ..joining import Joining
from ..ordering import OrderingError
from ..runtime import _require, _track, check_timeout
from . import fused_update
from .gradients import resolve_names, sparse_average

__all__ = ["DistributedOptimizer", "OrderingError"]

log = logging.getLogger(__name__)


class _Step:
    """Per-step bookkeeping (what is in flight, what was synchronised)."""

    def __init__(self) -> None:
        # id(p) -> (p, handle, wire buffer or None when p.grad itself was submitted)
        self.handles: Dict[int, Tuple[torch.Tensor, Any, Optional[torch.Tensor]]] = {}
        self.sparse: Dict[int, torch.Tensor] = {}
        self.synchronized = False  # synchronize() ran and nothing was submitted since
        self.last_ok = True


class _DistributedOptimizerMixin(EngineHolder):
    """Methods placed in front of the user's optimizer class in the MRO."""

    @property
    def _parameter_names(self) -> Dict[torch.Tensor, str]:
        """Parameter -> the name it is synchronised under: Horovod's attribute of the
        same name and layout (``allreduce.noname.<group>.<index>`` when no
        ``named_parameters`` were given), which Horovod's users and tests read."""
        return {p: self._hp_names[id(p)] for g in self.param_groups for p in g["params"]}

    # -- set-up -----------------------------------------------------------------------
    def _hp_setup(self, named_parameters: Any, compression: Any, strategy: str, plan: Any,
                  backward_passes_per_step: int, op: str, sparse_as_dense: bool,
                  nonfinite: str, timeout: Optional[float], seed: int,
                  compression_back: Any = None, collective: Optional[str] = None,
                  joining: Any = None, *, own_push: bool = False) -> None:
        rt = _require()
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, found "
                             f"{backward_passes_per_step!r}")
        if op == "adasum":
            raise NotImplementedError("op=Adasum is not implemented by hipress-like; "
                                      "use op=hpt.Average (the default) or hpt.Sum")
        if op not in (Average, Sum):
            raise ValueError(f"op must be hpt.Average or hpt.Sum, found {op!r}")
        params = [p for g in self.param_groups for p in g["params"]]
        self._hp_names = resolve_names(params, named_parameters, self.param_groups)
        # Only parameters that can receive a gradient are synchronised, so only they
        # are checked for a reducible dtype: a frozen integer parameter (requires_grad
        # False; torch lets no integer tensor require grad) never gets one. Frozen
        # float parameters stay registered: they may be unfrozen later.
        self._hp_params = [p for p in {id(p): p for p in params}.values()
                           if p.requires_grad or p.is_floating_point()]
        self._hp_bpps = backward_passes_per_step
        self._hp_op = op
        # a factor applied to every averaged gradient (BytePS's pre_scale_factor *
        # post_scale_factor: hipress_like.byteps.torch sets it); 1.0 for Horovod's face
        self._hp_scale = 1.0
        self._hp_size = rt.size
        self._hp_rank = rt.rank
        self._hp_sparse_as_dense = bool(sparse_as_dense)
        self._hp_delay = {id(p): backward_passes_per_step for p in self._hp_params}
        self._hp_wire: Dict[int, torch.Tensor] = {}
        self._hp_step = _Step()
        self._hp_should_sync = True
        self._hp_hooks: Dict[int, Any] = {}
        self._hp_engine = None
        # what builds the engine, kept for an elastic re-formation (_hp_reattach)
        self._hp_build = dict(compression=compression, strategy=strategy, plan=plan,
                              nonfinite=nonfinite, timeout=timeout, seed=seed,
                              compression_back=compression_back, collective=collective,
                              joining=joining, own_push=own_push)
        self._hp_build_engine()
        self._hp_ensure_hooks()
        _track(self)

    def _hp_build_engine(self) -> None:
        b = self._hp_build
        specs = specs_of([(self._hp_names[id(p)], p) for p in self._hp_params])
        self._hp_engine = build_engine(specs, online=True, device_type=device_type_of(
            self._hp_params), **b)
        # plan="adaptive": re-plans at step boundaries (tuning/online); None otherwise
        self._hp_online = online_planner(self._hp_engine, resolve_plan(b["plan"]),
                                         snapshot=(self._hp_snapshot, self._hp_restore))

    def _hp_snapshot(self) -> Dict[str, Any]:
        """The training state in memory (parameters, the wrapped optimizer's state), for
        ``plan="adaptive"``'s ratio search to put back after trying each ratio."""
        return {"params": [p.detach().clone() for p in self._hp_params],
                "opt": copy.deepcopy(super().state_dict())}

    def _hp_restore(self, snap: Dict[str, Any]) -> None:
        """Put ``_hp_snapshot``'s state back (between steps)."""
        with torch.no_grad():
            for p, x in zip(self._hp_params, snap["params"]):
                p.copy_(x)
        super().load_state_dict(copy.deepcopy(snap["opt"]))

    # -- elastic re-formation (runtime.reform, horovodrun's elastic mode) ----------------
    def _hp_detach(self) -> None:
        """Drop the engine of the world being left (a failed one waits for no peer) and
        what is in flight; the hooks stay."""
        self._hp_close_engine()
        self._hp_step = _Step()
        self._hp_wire = {}

    def _hp_reattach(self) -> None:
        """Build a new engine on the re-formed world (its rank and size); compressor
        state starts fresh."""
        rt = _require()
        self._hp_size, self._hp_rank = rt.size, rt.rank
        self._hp_delay = {id(p): self._hp_bpps for p in self._hp_params}
        self._hp_step = _Step()
        self._hp_build_engine()

    def _hp_ensure_hooks(self) -> None:
        """Hook every parameter that requires a gradient now (and was not hooked yet).

        Hooks can only be registered on tensors that require grad, so a
        parameter switched on later (GAN-style alternation) is hooked at the
        next ``synchronize``; until then it is submitted there.
        """
        ref = weakref.ref(self)
        for p in self._hp_params:
            if p.requires_grad and id(p) not in self._hp_hooks:
                def hook(t: torch.Tensor, _ref: Any = ref) -> None:
                    opt = _ref()
                    if opt is not None and opt._hp_engine is not None:
                        opt._hp_on_grad(t)
                self._hp_hooks[id(p)] = p.register_post_accumulate_grad_hook(hook)

    # -- gradient path -------------------------------------------------------------------
    def _hp_on_grad(self, p: torch.Tensor) -> None:
        st = self._hp_step
        key = id(p)
        if key not in self._hp_delay:
            return
        if key in st.handles or key in st.sparse:
            raise OrderingError(
                f"the gradient of {self._hp_names[key]!r} was computed more than "
                f"backward_passes_per_step={self._hp_bpps} time(s) before step(); increase "
                "backward_passes_per_step to accumulate gradients locally, or call "
                "optimizer.step() (or synchronize()) after each backward pass")
        self._hp_delay[key] -= 1
        if self._hp_delay[key] == 0:
            self._hp_submit(p)

    def _hp_submit(self, p: torch.Tensor) -> None:
        st = self._hp_step
        key = id(p)
        name = self._hp_names[key]
        if p.grad is None:
            # Horovod's rule: other ranks may have computed this gradient (dynamic
            # graphs), and every rank must submit the same set, so send zeros.
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        grad = p.grad
        if grad.is_sparse:
            if not self._hp_sparse_as_dense:
                st.sparse[key] = p
                st.synchronized = False
                return
            grad = p.grad = grad.to_dense()
        wire = None
        if grad.dtype != self._hp_wire_dtype(p) or not grad.is_contiguous():
            wire = self._hp_wire.get(key)
            if wire is None:
                wire = self._hp_wire[key] = torch.empty(grad.shape, dtype=self._hp_wire_dtype(p),
                                                        device=grad.device)
            wire.copy_(grad)
        handle = self._hp_engine.submit(name, grad if wire is None else wire)
        st.handles[key] = (p, handle, wire)
        st.synchronized = False

    def _hp_wire_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype

    def synchronize(self) -> bool:
        """Finish this step's gradient averaging; ``p.grad`` then holds the average.

        Returns:
            False when the engine skipped the step (``nonfinite="skip"`` and a
            NaN/Inf gradient on some rank; all ranks agree), else True.
        """
        st = self._hp_step
        if st.synchronized and not st.handles and not st.sparse:
            return st.last_ok  # already averaged; averaging again would re-compress
        self._hp_ensure_hooks()
        try:
            for p in self._hp_params:
                key = id(p)
                if p.requires_grad and key not in st.handles and key not in st.sparse:
                    self._hp_submit(p)
            ok = bool(self._hp_engine.synchronize())  # every handle is complete after it
            scale = self._hp_grad_scale()
            for p, _, wire in st.handles.values():
                with torch.no_grad():
                    if wire is not None:
                        p.grad.copy_(wire)
                    if scale != 1:
                        p.grad.mul_(scale)
            for p in st.sparse.values():
                p.grad = sparse_average(p.grad, self._hp_names[id(p)],
                                         self._hp_op == Average)
                if self._hp_scale != 1:
                    p.grad = p.grad * self._hp_scale
        finally:
            st.handles.clear()
            st.sparse.clear()
            for k in self._hp_delay:
                self._hp_delay[k] = self._hp_bpps
        st.synchronized = True
        st.last_ok = ok
        return ok

    def _hp_grad_scale(self) -> float:
        """What ``synchronize`` multiplies the engine's averages by (``op=Sum``: the
        world size; times the user's scale)."""
        return self._hp_scale * (self._hp_size if self._hp_op == Sum else 1)

    def _hp_in_place(self) -> List[torch.nn.Parameter]:
        """The parameters submitted this step whose gradient the engine averages in
        place: no wire buffer and no scale (``fused_update`` may step them)."""
        if self._hp_grad_scale() != 1:
            return []
        return [p for p, _, wire in self._hp_step.handles.values() if wire is None]

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not synchronize (you already did).

        Example:
            >>> loss.backward()
            >>> optimizer.synchronize()
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            >>> with optimizer.skip_synchronize():
            ...     optimizer.step()
        """
        self._hp_should_sync = False
        try:
            yield
        finally:
            self._hp_should_sync = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless skipped), then step the wrapped optimizer.

        With a ``closure`` (LBFGS and friends), every evaluation of it is
        synchronised too, and its loss is averaged over ranks, so line
        searches take the same branches on every rank. Without one, where the
        wrapped optimizer is plain ``torch.optim.SGD``, PowerSGD layers' decodes
        and updates run as one sweep with the same bits (``fused_update.py``).
        """
        st = self._hp_step
        if closure is not None:
            closure = self._hp_wrap_closure(closure)
        ok = st.last_ok
        candidates: fused_update.Candidates = {}
        taken: Dict[int, Any] = {}
        if self._hp_should_sync:
            if st.synchronized and not st.handles and not st.sparse:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context "
                    "after optimizer.synchronize(). The gradients are already averaged, so "
                    "this step does not synchronize again; wrap step() in "
                    "`with optimizer.skip_synchronize():` to say so", stacklevel=2)
            elif closure is None:  # nothing reads the gradients before the update
                candidates = fused_update.eligible(self, self._hp_in_place())
                ok, taken = fused_update.synchronize(self.synchronize, candidates)
            elif st.handles or st.sparse:
                ok = self.synchronize()
        st.synchronized = False
        loss = None
        if not ok:
            fused_update.write(taken)  # the gradients as a skipped step leaves them
            log.warning("step skipped on every rank: a gradient was NaN/Inf "
                        "(nonfinite='skip')")
        elif taken:
            loss = fused_update.step(self, candidates, taken,
                                     lambda: super(_DistributedOptimizerMixin, self).step())
        else:
            loss = super().step(closure)
        self._hp_steps_taken += 1
        online = self._hp_online
        if online is not None and self._hp_engine.step != getattr(self, "_hp_online_at", -1):
            self._hp_online_at = self._hp_engine.step  # once per synchronised step
            online.after_step(self._hp_engine)
        if self._hp_check_every and self._hp_steps_taken % self._hp_check_every == 0:
            self.check_consistency()
        return loss

    def check_consistency(self) -> None:
        """Compare every rank's parameters and optimizer state (a collective call).

        Raises:
            ConsistencyError: on every rank, naming the first parameter or
                state entry that differs and the ranks that disagree.
        """
        from ..consistency import check_replicas

        check_replicas([(self._hp_names[id(p)], p) for p in self._hp_params], self,
                       step=self._hp_steps_taken)

    def _hp_wrap_closure(self, closure: Any) -> Any:
        def synced_closure() -> Any:
            loss = closure()
            self.synchronize()
            self._hp_step.synchronized = False
            if isinstance(loss, torch.Tensor) and self._hp_size > 1:
                from ..collectives import allreduce

                avg = allreduce(loss.detach().reshape(1).float(), name="closure loss")
                loss = avg.reshape(loss.shape).to(loss.dtype)
            return loss
        return synced_closure

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like the wrapped optimizer's, but refuses while gradients are in flight.

        Raises:
            OrderingError: called between ``backward()`` and ``step()`` /
                ``synchronize()`` (the engine is still writing into ``p.grad``).
        """
        st = self._hp_step
        if st.handles or st.sparse:
            raise OrderingError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited: the "
                "gradients are still being averaged in the background. Call zero_grad() "
                "before backward() or after step()")
        for k in self._hp_delay:  # accumulated gradients are discarded: start counting anew
            self._hp_delay[k] = self._hp_bpps
        return super().zero_grad(set_to_none=set_to_none)

    @property
    def online(self) -> Any:
        """The ``tuning.online.OnlinePlanner`` of ``plan="adaptive"`` (None otherwise, or
        when there is nothing to adapt)."""
        return getattr(self, "_hp_online", None)

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self, all_ranks: bool = False) -> Dict[str, Any]:
        """The wrapped optimizer's state dict plus the compressor state.

        Args:
            all_ranks: collective; gather every rank's compressor state so
                that rank 0 alone can save one file that resumes every rank.

        Raises:
            OrderingError: gradients are in flight (call after ``step()``).
        """
        st = self._hp_step
        if st.handles or st.sparse:
            raise OrderingError("state_dict() was called while gradients are being averaged; "
                                "call it after optimizer.step()")
        sd = super().state_dict()
        local = self._hp_engine.state_dict() if self._hp_engine is not None else {}
        engines = None
        if all_ranks:
            from ..objects import allgather_object

            engines = allgather_object(local, name="optimizer.state_dict")
        layout = checkpoint.layout_of(self._hp_engine) if self._hp_engine is not None \
            else None
        hip = checkpoint.pack(local, self._hp_rank, self._hp_size, engines, layout)
        sd["hipress"] = hip
        if self.online is not None:  # plan="adaptive": the active plan and its controller
            sd["hipress_adaptive"] = self.online.state_dict(self._hp_engine)
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load the wrapped optimizer's state and, when it is ours, the compressor state.

        Compressor state is per rank (error-feedback residuals, PowerSGD's Q).
        State saved with another world size by ``state_dict(all_ranks=True)``
        is resharded (``adapters.checkpoint.reshard``: error-feedback memories
        averaged, PowerSGD's Q carried over), what cannot be is reset with a
        ``CompressorStateReset`` warning naming it; one rank's state saved
        with another world size starts fresh, with that warning. State saved
        by one rank and loaded on another is refused (it would resume with the
        wrong residuals). With ``plan="adaptive"``, the plan active when the state
        was saved (``"hipress_adaptive"``) is switched to first (a collective when it
        differs: every rank loads), so the compressor state fits it.

        Raises:
            ValueError: the state dict holds another rank's compressor state;
                save ``optimizer.state_dict(all_ranks=True)`` on every rank,
                or each rank's own state dict.
        """
        state_dict = dict(state_dict)
        hip = state_dict.pop("hipress", None)
        adaptive = state_dict.pop("hipress_adaptive", None)
        super().load_state_dict(state_dict)
        if adaptive is not None and self.online is not None:  # the plan the state was saved with
            self.online.load_state_dict(self._hp_engine, adaptive)
        if hip is None or self._hp_engine is None:
            return
        saved = checkpoint.unpack(
            hip, self._hp_rank, self._hp_size, where="this state dict",
            layout=checkpoint.layout_of(self._hp_engine),
            fix="Save optimizer.state_dict(all_ranks=True) on every rank (every rank's state "
                "in one dict), or each rank's own optimizer.state_dict(); to start the "
                "compressor state fresh, delete the 'hipress' key before loading")
        checkpoint.restore(self._hp_engine, saved)

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the hooks and close the engine (also done by ``hpt.shutdown()``)."""
        for h in self._hp_hooks.values():
            h.remove()
        self._hp_hooks.clear()
        self._hp_close_engine()


_classes: Dict[Any, type] = {}


def _wrapped(optimizer: torch.optim.Optimizer, mixin: type, what: str) -> Any:
    """A new instance of ``(mixin, type(optimizer))`` (one class per pair) sharing
    ``optimizer``'s param groups and state."""
    base = type(optimizer)
    cls = _classes.get((mixin, base))
    if cls is None:
        cls = _classes[(mixin, base)] = type(
            base.__name__, (mixin, base),
            {"__module__": base.__module__, "__doc__": f"{base.__name__} {what}."})
    opt = cls.__new__(cls)
    # Share everything but per-instance callables (an LR scheduler patches
    # ``optimizer.step`` on the instance; copying it would bypass our step).
    opt.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                         if not callable(getattr(base, k, None))})
    return opt


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = None, backward_passes_per_step: int = 1,
                         op: str = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = None, *, strategy: str = "ps", plan: Any = "auto",
                         nonfinite: str = "propagate", timeout: Optional[float] = None,
                         seed: int = 0, compression_back: Any = None,
                         collective: Optional[str] = None,
                         stragglers: Any = None,
                         check_consistency_every: int = 0,
                         own_push: bool = False) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged by CaSync.

    A collective call: every rank constructs it at the same point, with the
    same parameters (the engine checks the gradient sets match).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (SGD, Adam, LBFGS, ...).
            The wrapper shares its param groups and state; use the wrapper.
        named_parameters: ``model.named_parameters()``; names identify
            gradients in plans, logs and errors. ``None``: positional names.
        compression: ``hpt.Compression.<name>`` (or a registry name or a
            ``Compressor``). ``None``: no compression, or the plan's
            compressor when ``plan`` is a ``Plan``. ``"auto"`` (with
            ``plan="auto"``): the cost model picks a compressor per gradient
            (onebit, TernGrad, DGC, PowerSGD or none) from a profile taken
            when the optimizer is built.
        backward_passes_per_step: backward passes accumulated locally
            before the gradients are averaged.
        op: ``hpt.Average`` (default) or ``hpt.Sum``.
        gradient_predivide_factor: Horovod option for fp16 overflow; the
            engine averages in float32, so it does not change the result.
        num_groups, groups: Horovod's fusion options; CaSync batches small
            gradients itself, so they are accepted and ignored.
        sparse_as_dense: densify sparse gradients and send them through the
            engine instead of allgathering them.
        process_set: only ``None`` (all ranks).
        strategy: "ps" (co-located parameter servers) or "ring".
        plan: "auto" (the cost model decides per gradient), a ``Plan``, a
            plan file path, or ``None`` (the engine's default size rule:
            gradients from 1 MB up are compressed, partitioned by size).
            With ``Compression.none`` (the default) there is nothing to
            decide: every gradient takes the engine's allreduce lane and
            "auto" profiles nothing. "adaptive" or ``hpt.Adaptive(check_every=20,
            margin=0.1, max_switches=4, profile=None)``: planned as "auto"
            (or from the given profile), then re-planned while training runs:
            every ``check_every`` steps the ranks agree on the link the engine
            measured and switch, all at the same step, to the cost model's
            best plan when it is predicted faster by more than ``margin``
            (``tuning/online.py``; ``opt.online.history`` lists every check).
        nonfinite: what a step does when some rank's gradient holds NaN/Inf.
            "propagate" (default, as DDP and Horovod): the averaged
            gradients are non-finite on every rank (compressed ones NaN,
            uncompressed ones the exact sums) and every compressor state
            (error feedback, PowerSGD's Q, DGC's momentum) is rolled back to
            before the step, so ``torch.amp.GradScaler`` skips the step and
            lowers its scale; call ``optimizer.synchronize()`` before
            ``scaler.unscale_(optimizer)`` and step inside
            ``skip_synchronize()``, as with Horovod. "skip": the same
            roll-back, and ``step()`` does not step the wrapped optimizer on
            any rank. "raise": an error on every rank naming the gradient.
        timeout: seconds before a stalled or dead peer becomes an error.
        seed: seed of the compressors' random streams (same on all ranks).
        compression_back: bidirectional compression (Natural Compression,
            Alg. 1): the master compressor that encodes each aggregate on its
            way back to the workers (PS aggregators re-encode with it, Ring's
            gather forwards its payloads), e.g. ``compression=
            hpt.Compression.natural, compression_back=hpt.Compression.natural``.
            ``None``: the aggregate goes back encoded by ``compression``.
            Single-round compressors only; a plan entry's
            ``compressor_back`` overrides it per gradient.
        collective: how compressed gradients travel (``EngineConfig.
            collective``). None: PS or Ring (``strategy``). "auto" with a
            top-k compressor (``Compression.topk``, ``star_topk``,
            ``var_topk``): per gradient, the flexible-communication paper's
            alpha-beta selection between an Allgather of top-k (LWTopk) and
            AR-Topk with a ring or tree allreduce, from the link measured
            when the optimizer is built. "ring", "tree", "backend": AR-Topk's
            (or PowerSGD's, THC's) rounds on that allreduce; "allgather": a
            single-round compressor's payloads gathered by every rank.
        stragglers: ``hpt.Quorum(fraction=0.75, deadline=None, missing=
            "rescale", resync_every=0)`` turns partial aggregation on (THC
            Sec. 6.1, 8.3): a step closes once that fraction of ranks
            contributed, late gradients are dropped and counted, and every
            rank applies the same aggregate (``adapters/torch/quorum`` gives
            the loop contract: count steps with ``opt.steps``). Takes THC or
            any single-round compressor; ``strategy``, ``plan`` and
            ``nonfinite`` (a NaN/Inf gradient sits its step out) do not
            apply and must keep their defaults (anything else raises at
            construction); the fusion options are ignored. None (default): off.
        check_consistency_every: the consistency guard (``adapters/consistency``):
            every K steps, after the step, the ranks compare a hash of their
            parameters and optimizer state (one 256-byte allgather when they
            agree) and every rank raises ``ConsistencyError`` naming the first
            parameter or state entry that differs and the ranks that disagree.
            ``opt.check_consistency()`` runs one check by hand. 0 (default): off.
        own_push: the CaSync-PS aggregator compresses its own partition too,
            as a BytePS server sees every push compressed
            (``EngineConfig.own_push``; ``hipress_like.byteps.torch`` turns it
            on). False (default): the aggregator adds its own partition as it
            is, which costs less and loses nothing to the compressor.

    Returns:
        The distributed optimizer (an instance of a subclass of
        ``type(optimizer)``).

    Raises:
        ValueError: duplicate or partial ``named_parameters``, bad options
            (a ``timeout`` that is not seconds, an option ``stragglers``
            would ignore).
        TypeError: a parameter with a dtype that cannot be reduced.

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.01 * hpt.size())
        >>> opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
        ...                                compression=hpt.Compression.onebit)
    """
    mode = None if stragglers is None else repr(stragglers)
    # one meeting of the ranks before the transport opens: a rank failing in here
    # is named to its peers at once (joining.py), as are modes chosen on some ranks
    with Joining("DistributedOptimizer", stragglers=mode) as joining:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, found "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, _DistributedOptimizerMixin) or hasattr(optimizer,
                                                                         "_hpq_lane"):
            raise ValueError("this optimizer is already a DistributedOptimizer")
        if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
            raise ValueError("process sets are not supported; every rank trains together")
        if num_groups or groups:
            log.info("num_groups/groups ignored: CaSync batches small gradients itself")
        if gradient_predivide_factor != 1.0:
            log.info("gradient_predivide_factor=%s has no effect: averaging is done in "
                     "float32", gradient_predivide_factor)
        timeout = check_timeout(timeout)  # names the parameter, before any collective
        if isinstance(check_consistency_every, bool) or not isinstance(
                check_consistency_every, int) or check_consistency_every < 0:
            raise ValueError(f"check_consistency_every must be an int >= 0 (0: off), found "
                             f"{check_consistency_every!r}")
        if stragglers is not None:
            _quorum_ignores(strategy, plan, nonfinite, own_push)
            opt = _quorum_optimizer(optimizer, named_parameters, compression, stragglers,
                                    timeout, seed, compression_back, collective,
                                    backward_passes_per_step, op, joining)
            opt._hp_check_every = check_consistency_every
            return opt
        opt = _wrapped(optimizer, _DistributedOptimizerMixin,
                       "synchronised by hipress-like CaSync")
        opt._hp_engine = None
        opt._hp_check_every, opt._hp_steps_taken = check_consistency_every, 0
        opt._hp_setup(named_parameters, compression, strategy, plan, backward_passes_per_step,
                      op, sparse_as_dense, nonfinite, timeout, seed, compression_back,
                      collective, joining, own_push=own_push)
        return opt


def _quorum_ignores(strategy: str, plan: Any, nonfinite: str, own_push: bool = False) -> None:
    """Refuse the options partial aggregation would silently ignore (at construction).

    The quorum lane allgathers one flat buffer per step with its own compressor
    (no PS/Ring strategy, no plan), and a rank whose gradient holds NaN/Inf sits
    its step out; only the defaults, which say nothing, are accepted.
    """
    if strategy != "ps":
        raise ValueError(f"stragglers: strategy={strategy!r} does not apply under partial "
                         "aggregation (its lane allgathers each step's payloads); drop "
                         "strategy=, or drop stragglers= to train with that strategy")
    if plan not in ("auto", None):
        raise ValueError(f"stragglers: a plan ({type(plan).__name__}) does not apply under "
                         "partial aggregation (one compressor for one flat buffer per step); "
                         "drop plan= and pass compression=, or drop stragglers= to use the plan")
    if nonfinite != "propagate":
        raise ValueError(f"stragglers: nonfinite={nonfinite!r} does not apply under partial "
                         "aggregation: a rank whose gradient holds NaN/Inf sits its step out "
                         "and the others close it without that rank (counted in "
                         "opt.stragglers()); drop nonfinite=, or drop stragglers= to have "
                         f"nonfinite={nonfinite!r}")
    if own_push:
        raise ValueError("stragglers: own_push=True does not apply under partial aggregation "
                         "(no aggregator: each rank decodes every payload it gathers); drop "
                         "own_push=, or drop stragglers= to use CaSync-PS")


def _quorum_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Any, compression: Any,
                      stragglers: Any, timeout: Optional[float], seed: int,
                      compression_back: Any, collective: Optional[str],
                      backward_passes_per_step: int, op: str,
                      joining: Any = None) -> torch.optim.Optimizer:
    """``DistributedOptimizer(stragglers=...)``: the partial-aggregation wrapper."""
    from ...partial import Quorum
    from .quorum import QuorumOptimizerMixin

    if stragglers is True:
        stragglers = Quorum()
    if not isinstance(stragglers, Quorum):
        raise TypeError(f"stragglers must be None, True or hpt.Quorum(...), found "
                        f"{stragglers!r}")
    if compression_back is not None or collective is not None:
        raise ValueError("stragglers: compression_back and collective do not apply under "
                         "partial aggregation (its lane allgathers each round's payloads)")
    if op != Average:
        raise ValueError("stragglers: only op=hpt.Average (a partial sum is rescaled)")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, found "
                         f"{backward_passes_per_step!r}")
    opt = _wrapped(optimizer, QuorumOptimizerMixin, "with partial aggregation (hipress-like)")
    opt._hpq_lane = None
    opt._hpq_setup(named_parameters, compression, stragglers, timeout, seed, joining)
    return opt
