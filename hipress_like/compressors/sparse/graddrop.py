"""Gradient Dropping (Aji & Heafield, EMNLP 2017) as a CompLL sparsifier.

Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
Alg. 1 (``DROPGRADIENTS``): add the residual of earlier steps, drop the
``R`` fraction of entries with the smallest magnitude, send the rest and
keep what was dropped as the new residual:

    x = g + residual
    threshold: R of |x| lies below it (estimated on a 0.1% sample, Sec. 2)
    send x where |x| >= threshold
    residual = x where it was not sent, 0 where it was

Here ``ratio = 1 - R`` is the fraction kept (0.01 = the paper's R = 99%).

**The residual is part of the algorithm, so GradDrop keeps it in its own
explicit state** ``{"residual": tensor, "step": int, "seed": int}`` instead
of relying on the generic ``ef`` wrapper: the paper defines dropping with
the residual, and a GradDrop without it is a different (and much worse)
method. Do not also wrap it in ``ef``; that would feed the error back twice.

Deviation, for a bounded payload: a sampled threshold can, by chance, pass
far more entries than ``ratio * n``. At most ``max_ratio * n`` entries
(default ``2 * ratio``) are sent; when more pass, the largest of them are
kept exactly and the others stay in the residual, so nothing is lost, and
``payload_nbytes`` is a true upper bound usable by the cost model.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ..base import Capabilities, State, accumulator_dtype, check_gradient
from ..ops import extract
from ..params import ParamError, check_real
from ..registry import register
from . import accumulators
from .dgc import _select
from .topk import Sparsifier, _check_ratio, num_selected

__all__ = ["GradDrop"]



@register("graddrop")
class GradDrop(accumulators.DoubleBuffered, Sparsifier):
    """Drop the smallest ``1 - ratio`` of ``g + residual``; keep the dropped part locally.

    Args:
        ratio: fraction of entries sent, in (0, 1]; default 0.01 (R = 99%).
        sample_ratio: fraction sampled to find the threshold, in (0, 1];
            default 0.001 (the paper's 0.1%); at least max(1024, 32 / ratio)
            entries (see ``sparse.sampled_threshold``).
        max_ratio: cap on the fraction sent, in [ratio, 1]; default
            ``min(1, 2 * ratio)``.
        index_codec, value_codec, **codec_params: how positions and values
            travel (``sparse.TopK`` lists them); the residual keeps what was
            not sent and what a lossy value codec lost.

    Raises:
        ValueError: a parameter outside its range.

    Example:
        >>> c = GradDrop(ratio=0.01)
        >>> st = c.init(torch.zeros(100_000))
        >>> payload, st = c.encode(torch.randn(100_000), st)
    """

    name = "graddrop"
    algo_id = 23
    accumulator_keys = ("residual",)  # double-buffered (accumulators.DoubleBuffered)
    capabilities = Capabilities("sparsification", aggregatable=False, fixed_size=False,
                                stateful=True, keeps_memory=True,
                                checks_finite=True)  # the one pass, else a scan

    def __init__(self, ratio: float = 0.01, sample_ratio: float = 0.001,
                 max_ratio: Optional[float] = None, index_codec: str = "plain",
                 value_codec: str = "plain", **codec_params: Any) -> None:
        self.ratio = _check_ratio("graddrop", ratio)
        self.sample_ratio = _check_ratio("graddrop", sample_ratio, "sample_ratio")
        mr = min(1.0, 2.0 * self.ratio) if max_ratio is None else check_real(
            "graddrop", "max_ratio", max_ratio, example=min(1.0, 2.0 * self.ratio))
        if not (self.ratio <= mr <= 1.0):
            raise ParamError(f"graddrop: max_ratio must be in [ratio={self.ratio}, 1], found "
                             f"{max_ratio!r}")
        self.max_ratio = mr
        self._init_codecs(index_codec, value_codec, **codec_params)

    def _max_density(self) -> float:
        return self.max_ratio

    def init(self, grad: torch.Tensor, seed: int = 0, *, world_size: int = 1,
             shared_seed: int = 0) -> State:
        """A zero residual shaped like ``grad`` (float32 for half-precision gradients)."""
        return {"residual": torch.zeros(grad.shape, dtype=accumulator_dtype(grad.dtype),
                                        device=grad.device),
                "step": 0, "seed": int(seed)}

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Aji & Heafield Alg. 1; the residual buffer is updated in place.

        1. ``x = g + residual``;
        2. threshold from a sample, keep ``|x| >= threshold`` (at most
           ``max_ratio * n``, the largest if more pass);
        3. send ``x`` there; ``residual = x`` with the sent entries zeroed.

        Returns:
            (payload, new state with ``step + 1``).

        Raises:
            TypeError, ValueError: bad gradient or a residual of another shape.
        """
        # checks_finite: NaN/Inf is refused even where the engine vouched for the input,
        # found by the pass that forms x (sparse/accumulators.py), else by a scan
        step, seed = int(state.get("step", 0)), int(state.get("seed", 0))
        res = self.state_tensor(state, "residual", grad)
        acc = accumulator_dtype(grad.dtype)
        n = grad.numel()
        keys = self.accumulator_keys
        (x,) = accumulators.outputs(state, keys)
        k = num_selected(self.max_ratio, n)
        if accumulators.one_pass_usable(grad, state, keys, self.ratio, self.sample_ratio):
            check_gradient(grad)  # scans unless the caller vouched; then the pass checks
            idx = accumulators.one_pass_select(grad, grad.detach().reshape(-1), None,
                                               res.reshape(-1), None, x, 0.0, self.ratio, k,
                                               self.sample_ratio, seed, step)
        else:
            x = accumulators.accumulate_checked(grad, res.reshape(-1), x)  # g + residual
            idx = _select(x, self.ratio, k, self.sample_ratio, seed, step)
        code = self._pack(grad, idx, lambda i: extract(x, i), self._codec_seed(seed, idx))
        # what the wire (dtype, value codec) lost stays in the residual (0 for plain float32)
        x.index_copy_(0, code.idx, code.values - code.wire.to(acc))
        return code.payload, accumulators.settle(state, keys, residual=x.reshape(grad.shape),
                                                 step=step + 1, seed=seed)

    def params(self) -> Dict[str, object]:
        """Constructor parameters (the codecs' only when they are not plain)."""
        return {"ratio": self.ratio, "sample_ratio": self.sample_ratio,
                "max_ratio": self.max_ratio, **self._codec_params()}
