"""Error feedback (memory compensation) as a wrapper around any compressor.

A biased compressor ``C`` (top-k, onebit, ...) loses ``p - decode(C(p))``
every step; error feedback keeps that loss in a local memory ``m`` and adds
it to the next gradient, so nothing is lost for good (Seide et al. 2014;
Stich et al. 2018, "Sparsified SGD with memory"; Karimireddy et al. 2019,
EF-SGD). With the decay factors of the thesis ("Sparse communication for
deep learning", Sec. 2.2.2, Memory Compensation, after the GRACE survey of
Xu et al. 2020, its ref. [15]):

    p_t     = beta * m_t + gamma * g_t          (compensate; thesis: g_t := beta m_t + gamma g_t)
    payload = C(p_t)
    m_{t+1} = p_t - decode(payload)             (memorise what was not sent)

The thesis writes the memory update as ``m_{t+1} = m_t + g_t - C(g_t)``
with ``g_t`` already compensated; read literally that would count ``m_t``
twice, so we follow GRACE's ``ResidualMemory`` (the implementation the
thesis evaluates), which stores ``compensated - decompressed``. With
``beta = gamma = 1`` this is standard error feedback, and
``g_t + m_t == decode(payload) + m_{t+1}`` holds up to rounding.

Wrapping is the house style (STYLE.md 1: like optax ``chain`` or PyTorch's
``fp16_compress_wrapper``), so compressors stay free of EF flags. The
wrapper passes the inner payload through unchanged (same ``algo_id``,
same ``decode`` and ``merge``). Algorithms that define their own memory
(GradDrop's residual, DGC's accumulation, PowerSGD's error) should not be
wrapped (they declare ``keeps_memory``; wrapping them warns). Multi-round
compressors are wrapped round by round: the memory is added before round 0
and the residual is taken against the rank's own decoded payload where the
compressor declares ``own_decode`` (THC Alg. 3 l. 22), else against the
decoded average (``decode_rounds``).

State is explicit: ``{"error": tensor, "inner": inner_state}``; the memory
is float32 for half-precision gradients (tiny residuals would vanish in
fp16), and the inner compressor always sees the gradient's own dtype.

**The residual may be deferred.** ``m_{t+1} = p_t - decode(payload)`` costs
one read and one write of the memory. When the inner compressor can redo it
from a small token (``inner.kernels.deferred_residual``: onebit's two values,
since its decode is a function of ``p_t``'s signs), the state keeps
``"error": p_t`` plus ``"pending": token``, and the next encode subtracts
it inside the sweep that adds the next gradient (``encode_accumulated_``),
with the same bits: a memory-bound step saves a third of its traffic (as
PowerSGD keeps its error factored). ``ErrorFeedback.error(state)`` gives the
memory itself; ``settle_(state)`` applies the token in place. A state with a
token is complete as it is, so checkpoints carry it unchanged.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from ..base import (
    Compressor,
    State,
    accumulate_,
    accumulator_dtype,
    check_gradient,
)
from ..params import check_real
from ..registry import register
from .wrapper import Wrapper

__all__ = ["ErrorFeedback", "needs_error_feedback", "with_error_feedback"]

_log = logging.getLogger(__name__)


def _check_factor(name: str, x: Any) -> float:
    # thesis Sec. 2.2.2: beta, gamma > 0
    return check_real("ef", name, x, low=0.0, low_open=True, example=1.0)


@register("ef", "error_feedback")
class ErrorFeedback(Wrapper):
    """Error feedback around ``inner``: send ``C(beta*m + gamma*g)``, keep the rest in ``m``.

    Args:
        inner: the wrapped compressor, or its registry name.
        beta: memory decay factor, > 0 (default 1.0).
        gamma: weight of the new gradient, > 0 (default 1.0).
        inner_params: parameters for ``inner`` when it is given by name, as
            one mapping (what ``params()`` returns, so
            ``get("ef", **c.params())`` rebuilds ``c``).
        **kwargs: the same parameters given flat (``ratio=0.01``).

    Raises:
        ValueError: a bad factor, an unknown inner name or bad inner
            parameters, or a multi-round inner compressor.

    Example:
        >>> c = ErrorFeedback("topk", ratio=0.01)          # or get("ef", inner="topk", ratio=0.01)
        >>> st = c.init(torch.zeros(1000))
        >>> payload, st = c.encode(torch.randn(1000), st)
        >>> out = c.decode(payload)
    """

    name = "ef"

    def __init__(self, inner: Any = "identity", beta: float = 1.0, gamma: float = 1.0,
                 inner_params: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> None:
        both = sorted(set(inner_params or {}) & set(kwargs))
        if both:
            raise ValueError(f"ef: inner parameter(s) {both} given both in inner_params and "
                             "as keywords; give each once")
        inner_params = {**dict(inner_params or {}), **kwargs}
        super().__init__(inner, **inner_params)
        if isinstance(self.inner, ErrorFeedback):
            raise ValueError("ef: wrapping error feedback in error feedback feeds the error "
                             "back twice; wrap the inner compressor once")
        if self.inner.capabilities.keeps_memory:
            _log.warning("ef: %s keeps its own residual; wrapping it adds a second memory",
                         self.inner.name)
        self.beta = _check_factor("beta", beta)
        self.gamma = _check_factor("gamma", gamma)
        self.capabilities = self._capabilities()

    def _capabilities(self) -> Any:
        # the payload is the inner one (Wrapper: same merge, rounds, size and kernels);
        # the memory is ours
        return dataclasses.replace(self.inner.capabilities, stateful=True, keeps_memory=True)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Unpickle, then derive the capabilities from the inner compressor again: a
        pickle from an older version holds them without the fields added since (e.g.
        ``checks_finite``), which would read as their defaults."""
        self.__dict__.update(state)
        self.capabilities = self._capabilities()

    def params(self) -> Dict[str, Any]:
        """Constructor parameters (the inner compressor's under ``inner_params``)."""
        return {"inner": self.inner.name, "beta": self.beta, "gamma": self.gamma,
                "inner_params": self.inner.params()}

    def init(self, grad: torch.Tensor, seed: int = 0, *, world_size: int = 1,
             shared_seed: int = 0, rank: Optional[int] = None) -> State:
        """A zero memory shaped like ``grad`` (float32 for half types) plus the inner state
        (``world_size``, ``shared_seed`` and ``rank`` go to the inner compressor)."""
        kw: Dict[str, Any] = {"world_size": world_size}
        if self.inner.capabilities.shared_randomness:
            kw["shared_seed"] = shared_seed
        if rank is not None:
            kw["rank"] = rank
        st = {"error": torch.zeros(grad.shape, dtype=accumulator_dtype(grad.dtype),
                                   device=grad.device),
              "inner": self.inner.init(grad, seed, **kw)}
        if self.inner.capabilities.rounds > 1:
            st["world_size"] = int(world_size)  # the residual is taken from the average
        return st

    def error(self, state: State) -> torch.Tensor:
        """The memory ``m`` of ``state`` (a new tensor when a residual is still
        deferred; ``state`` is left as it is)."""
        pending = state.get("pending")
        if pending is None:
            return state["error"]
        return self.inner.kernels.apply_residual_(state["error"].clone(), pending)

    def settle_(self, state: State) -> State:
        """Apply a deferred residual to ``state["error"]`` in place and drop the
        token; returns ``state``, whose ``"error"`` is then the memory itself."""
        pending = state.pop("pending", None)
        if pending is not None:
            self.inner.kernels.apply_residual_(state["error"], pending)
        return state

    def _memory(self, grad: torch.Tensor, state: State) -> torch.Tensor:
        return self.state_tensor(state, "error", grad)

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Compensate, compress with the inner compressor, memorise the loss.

        1. ``p = beta * m + gamma * g`` (in the memory buffer);
        2. ``payload, inner_state = inner.encode(p, inner_state)``;
        3. ``m = p - inner.decode(payload)`` (in the same buffer), or, when
           the inner compressor gives a ``deferred_residual`` token, at the
           start of the next encode (the module docstring says why).

        The memory tensor of ``state`` is updated in place and returned in
        the new state (read it with ``error(state)``).

        Returns:
            (the inner payload, {"error": new memory, "inner": new inner state}
            plus ``"pending": token`` when the residual is deferred).

        Raises:
            TypeError, ValueError: bad gradient or a memory of another shape.
        """
        check_gradient(grad)
        mem = self._memory(grad, state)
        pending = state.get("pending")
        if self.beta == 1.0 and self.gamma == 1.0:
            # p = m + g added in the inner encode's own sweep where it can (onebit),
            # with last step's deferred residual taken out in the same sweep
            kw = {} if pending is None else {"residual": pending}
            fused = self.inner.kernels.encode_accumulated_(mem, grad, self._inner_state(state),
                                                           **kw)
            if fused is not None:
                payload, inner_state = fused
                token = self.inner.kernels.deferred_residual(payload, mem)
                if token is not None:
                    return payload, {"error": mem, "pending": token, "inner": inner_state}
                return payload, {"error": self.inner.kernels.subtract_decoded_(mem, payload),
                                 "inner": inner_state}
        if pending is not None:
            self.inner.kernels.apply_residual_(mem, pending)
        # p = beta m + gamma g, in the memory buffer (accumulate_) when it can be
        p = accumulate_(mem, grad, self.beta, self.gamma).view(grad.shape)
        # the inner compressor sees the gradient's dtype; what that cast
        # rounds away stays in the (float32 for half types) memory
        x = p if p.dtype == grad.dtype else p.to(grad.dtype)
        payload, inner_state = self.inner.encode(x, self._inner_state(state))
        if x is p:  # m = p - decode(payload), in place (fused where the inner can)
            err = self.inner.kernels.subtract_decoded_(p, payload)
        else:
            dec = self.inner.decode(payload)
            err = p.sub_(dec.to(p.dtype))
        return payload, {"error": err, "inner": inner_state}

    # -- multi round ---------------------------------------------------------
    def encode_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> Tuple[torch.Tensor, State]:
        """Round ``r`` of the inner compressor on the compensated gradient.

        1. Round 0: ``p = beta * m + gamma * g`` (in the memory buffer), then
           the inner round 0 of ``p``.
        2. Rounds r > 0: the inner round r of the same ``p``.

        A single-round inner compressor is plain ``encode``.
        """
        if self.inner.capabilities.rounds == 1:
            if r != 0:
                raise ValueError(f"ef: {self.inner.name!r} has one round, asked for round {r}")
            return self.encode(grad, state)
        if r == 0:
            check_gradient(grad)
            mem = self._memory(grad, state)
            self.settle_(state)
            p = accumulate_(mem, grad, self.beta, self.gamma).view(grad.shape)
            x = p if p.dtype == grad.dtype else p.to(grad.dtype)
            state = {**state, "error": p, "x": x}
        elif "x" not in state:
            raise ValueError(f"ef: round {r} before round 0 of this step; call encode_round(0, "
                             "...) first")
        payload, inner_state = self.inner.encode_round(r, state["x"], self._inner_state(state),
                                                       aggregate)
        new = {**state, "inner": inner_state}
        if self.inner.capabilities.own_decode and r == self.inner.capabilities.rounds - 1:
            new["own"] = payload  # decoded alone in decode_rounds: this rank's C(p)
        return payload, new

    def absent_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> State:
        """Sit a step out (partial aggregation): the inner compressor's ``absent_round``;
        the memory is left as it is, since this rank sent nothing to lose."""
        if not self.inner.capabilities.absent_rounds:
            raise NotImplementedError(f"ef: {self.inner.name} cannot sit a step out (it does "
                                      "not declare capabilities.absent_rounds)")
        inner = self.inner.absent_round(r, grad, self._inner_state(state), aggregate)
        return {**{k: v for k, v in state.items() if k not in ("x", "own")},
                "inner": inner, "absent": True}

    def decode_rounds(self, grad: torch.Tensor, state: State, aggregate: torch.Tensor,
                      out: Optional[torch.Tensor] = None,
                      average: bool = False) -> Tuple[torch.Tensor, State]:
        """The inner decode of the last round; the memory keeps what compression lost.

        An inner compressor declaring ``own_decode`` (THC) decodes this rank's
        own last-round payload alone, ``C(p)``, and keeps ``m = p - C(p)``:
        THC Alg. 3 l. 22, ``e_i = x_i - RHT^-1(X_i)``. Other multi-round
        payloads have no per-rank decode (PowerSGD's result is
        ``P^ sum(Q)^T``), so the residual is taken against the decoded
        average ``d``: ``m = p - d``. Summed over ranks this is exactly the
        global compression error ``sum(p) - N d``, which is what an update by
        the average needs (each rank's share also holds its deviation from
        the mean, and those cancel in the sum). For PowerSGD, whose own error
        is the per-rank ``M - P^ Q^T``, wrapping adds this second memory; the
        constructor warns (``keeps_memory``).
        """
        if self.inner.capabilities.rounds == 1:
            return super().decode_rounds(grad, state, aggregate, out=out, average=average)
        if state.get("absent"):  # sat out (``absent_round``): decode; the memory stays
            res, inner_state = self.inner.decode_rounds(grad, state["inner"], aggregate,
                                                        out=out, average=average)
            return res, {**{k: v for k, v in state.items() if k != "absent"},
                         "inner": inner_state}
        if "x" not in state:
            raise ValueError("ef: decode_rounds before the rounds of this step")
        x, p, own = state["x"], state["error"], state.get("own")
        if own is not None:  # this rank's C(p), with the step's state (before the decode)
            mine, _ = self.inner.decode_rounds(
                x, state["inner"], self.inner.merge_round(self.inner.capabilities.rounds - 1,
                                                          [own]))
            p.sub_(mine.reshape(p.shape).to(p.dtype))
        res, inner_state = self.inner.decode_rounds(x, state["inner"], aggregate, out=out,
                                                    average=average)
        if own is None:
            d = res.reshape(p.shape)
            if average:
                p.sub_(d.to(p.dtype))
            else:
                p.sub_(d.to(p.dtype), alpha=1.0 / int(state.get("world_size") or 1))
        new = {k: v for k, v in state.items() if k not in ("x", "own")}
        new["inner"] = inner_state
        return res, new

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r}, beta={self.beta!r}, gamma={self.gamma!r})"


def needs_error_feedback(comp: Compressor) -> bool:
    """True when automatic error feedback should wrap ``comp``.

    It should when ``comp`` loses information for good (a biased compressor
    that saves bytes) and keeps no memory of its own (``keeps_memory``: an
    ``ErrorFeedback`` instance, DGC, GradDrop, PowerSGD). Other state (an
    RNG step, as in a biased random-k or a sparsifier composed with a
    quantizer) does not keep the lost part, so it does not exempt them;
    unbiased ones such as TernGrad need none.
    """
    caps = comp.capabilities
    return (caps.category != "none" and not caps.unbiased and not caps.keeps_memory
            and (caps.rounds == 1 or caps.own_decode))


def with_error_feedback(comp: Compressor) -> Compressor:
    """``comp`` wrapped in ``ErrorFeedback``, or ``comp`` itself when it keeps memory.

    Never double-wraps: an ``ErrorFeedback`` instance (or any compressor
    declaring ``keeps_memory``) is returned unchanged.
    """
    if comp.capabilities.keeps_memory:
        return comp
    return ErrorFeedback(comp)
