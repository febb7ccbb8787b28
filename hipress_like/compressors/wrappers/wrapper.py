"""The base of compressors that wrap another one (error feedback, labels, ...).

Idea: a wrapper changes one thing about the compressor it wraps (error
feedback adds a memory before encoding) and leaves the rest as it is: the
payload, its merge and decode, its rounds, its size, its fast paths. So the
wrapper base forwards every part of both protocols (``base.Compressor``'s
single round and ``rounds.MultiRoundCompressor``'s rounds) to ``self.inner``,
with the wrapper's state holding the inner state under ``"inner"``; a
subclass overrides only what it changes. Composition (``compose.py``) is not
a wrapper: it writes a payload of its own from two parts.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..base import CONTRIBUTORS, STEP_SEED, Compressor, State
from ..kernels import InnerKernels
from ..registry import get

__all__ = ["Wrapper"]


class Wrapper(Compressor):
    """A compressor that forwards to ``inner``: same payload, rounds, size and kernels.

    Args:
        inner: the wrapped compressor, or its registry name.
        **inner_params: parameters for ``inner`` when it is given by name.

    Raises:
        ValueError: an unknown inner name or bad inner parameters, or
            parameters given with a compressor instance.
    """

    name = "wrapper"

    def __init__(self, inner: Any, **inner_params: Any) -> None:
        if isinstance(inner, Compressor) and inner_params:
            raise ValueError(f"{self.name}: inner parameters cannot be given with a "
                             "compressor instance")
        self.inner = get(inner, **inner_params)
        self.algo_id = self.inner.algo_id  # the payload is the inner one, unchanged
        self.kernels_class = InnerKernels  # so are its fast paths (decode-add, ...)
        self.capabilities = self.inner.capabilities

    def params(self) -> Dict[str, Any]:
        """The inner compressor's name and parameters."""
        return {"inner": self.inner.name, "inner_params": self.inner.params()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @staticmethod
    def _inner_state(state: State) -> State:
        """The inner state, with the engine's per-step seed (and partial aggregation's
        contributor count) passed down to it."""
        inner = state.get("inner", {})
        if STEP_SEED in state:
            inner[STEP_SEED] = state[STEP_SEED]
        if CONTRIBUTORS in state:  # partial aggregation's count, this step only
            inner[CONTRIBUTORS] = state[CONTRIBUTORS]
        else:
            inner.pop(CONTRIBUTORS, None)
        return inner

    # -- single round: the inner compressor's --------------------------------
    def init(self, grad: torch.Tensor, seed: int = 0, **run: Any) -> State:
        """``{"inner": inner.init(...)}`` (the run's keywords go to the inner compressor)."""
        return {"inner": self.inner.init(grad, seed, **run)}

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """The inner compressor's encode on the inner state."""
        payload, inner = self.inner.encode(grad, self._inner_state(state))
        return payload, {**state, "inner": inner}

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The inner compressor's decode (into ``out`` when given)."""
        return self.inner.decode(payload, out=out)

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """The inner compressor's merge (when it is aggregatable)."""
        return self.inner.merge(payloads)

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """The inner compressor's payload size."""
        return self.inner.payload_nbytes(numel, ndim)

    # -- rounds: the inner compressor's ----------------------------------------
    def encode_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> Tuple[torch.Tensor, State]:
        """The inner compressor's round ``r`` on the inner state."""
        payload, inner = self.inner.encode_round(r, grad, self._inner_state(state), aggregate)
        return payload, {**state, "inner": inner}

    def merge_round(self, r: int, payloads: List[torch.Tensor]) -> torch.Tensor:
        """The inner compressor's reduction of round ``r``."""
        return self.inner.merge_round(r, payloads)

    def decode_rounds(self, grad: torch.Tensor, state: State, aggregate: torch.Tensor,
                      out: Optional[torch.Tensor] = None,
                      average: bool = False) -> Tuple[torch.Tensor, State]:
        """The inner compressor's decode of the last round, on the inner state."""
        res, inner = self.inner.decode_rounds(grad, state.get("inner", {}), aggregate,
                                              out=out, average=average)
        return res, {**state, "inner": inner}

    def absent_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> State:
        """The inner compressor's ``absent_round`` on the inner state."""
        return {**state, "inner": self.inner.absent_round(r, grad, self._inner_state(state),
                                                          aggregate)}

    def broadcast_nbytes(self, r: int, numel: int, ndim: int = 1) -> Optional[int]:
        """The inner compressor's broadcast payload size."""
        return self.inner.broadcast_nbytes(r, numel, ndim)

    def broadcast_root(self, state: State) -> int:
        """The inner compressor's owner of the broadcast round just encoded."""
        return self.inner.broadcast_root(state.get("inner", {}))

    def reselect(self, grad: torch.Tensor, k: Optional[int] = None) -> torch.Tensor:
        """Stateless re-encode of a merged tensor, if the inner sparsifier offers it."""
        fn = getattr(self.inner, "reselect", None)
        if fn is None:
            raise TypeError(f"{self.name}: inner compressor {self.inner.name!r} has no reselect")
        return fn(grad, k)
