"""Deep Gradient Compression (Lin et al., ICLR 2018) as a CompLL sparsifier.

DGC sends only the largest ~0.1% of the accumulated update and keeps the
rest locally, with four corrections that keep accuracy (paper Sec. 3):

1. **Local gradient clipping** (Sec. 3.2): clip the local gradient's L2 norm
   before accumulating it. The paper scales the global threshold by
   ``N ** -0.5`` for N workers; ``clip_norm`` is that *local* threshold.
2. **Momentum correction** (Sec. 3.2, Eq. 6-7): accumulate the velocity,
   not the gradient: ``u <- m * u + g``; ``v <- v + u``.
3. **Sampled threshold selection** (Sec. 3 / Appendix; the reference
   implementation): estimate the top-k threshold from a ~1% random sample,
   select ``|v| >= threshold``, and if more than ``k`` entries pass, keep
   the exact top-k among the selected ones. Fewer than ``k`` may pass: the
   payload size is data-dependent (``capabilities.fixed_size`` False).
4. **Momentum factor masking** (Sec. 3.3): zero ``u`` and ``v`` where
   values were sent, so stale momentum does not push sent coordinates again.
5. **Warm-up** (Sec. 3.4): the sparsity rises exponentially over the first
   ``warmup_steps`` encodes. Step ``t < W`` keeps the density
   ``ratio ** ((t + 1) / W)``; with ``ratio=0.001, W=5`` that is sparsity
   74.9%, 93.7%, 98.4%, 99.6%, 99.9% -- the paper's 75%, 93.75%, 98.4375%,
   99.6%, 99.9% schedule (there one stage per epoch; set ``W`` to the
   number of encodes you want the ramp to last).

Because momentum lives in the compressor, the wrapped optimizer must be
plain SGD without momentum (as in the paper). State is explicit:
``{"u": tensor, "v": tensor, "step": int, "seed": int}``; ``u`` and ``v``
are float32 for half-precision gradients so small updates accumulate.

Speed: for float32 on the CPU, steps 2-3 and the NaN/Inf check are one pass
(``sparse/accumulators.py``): the threshold is estimated from the new ``v``
at the sampled positions, computed from the old state before the pass, so
the pass that writes ``u`` and ``v`` also selects. Double buffering
(``detach_state``): a state given ``"u_buffer"`` and ``"v_buffer"`` has the
new accumulators written there, and the state it was given stays valid (the
engine keeps it to undo a step instead of copying it). Same bits every way.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ..base import Capabilities, State, accumulate_, accumulator_dtype, check_gradient
from ..ops import abs_at_least_indices, extract, topk_among
from ..params import check_int, check_real
from ..registry import register
from . import accumulators
from .topk import (
    Sparsifier,
    _check_ratio,
    num_selected,
    sampled_threshold,
)

__all__ = ["DGC"]



def _select(v: torch.Tensor, density: float, k: int, sample_ratio: float, seed: int,
            step: int) -> torch.Tensor:
    """Sorted indices of at most ``k`` large entries of ``v`` by a sampled threshold."""
    thr = sampled_threshold(v, density, sample_ratio, seed, step)
    # An all-zero accumulator would pass a zero threshold everywhere; sending
    # zeros carries no information.
    if float(thr) == 0.0:
        idx = torch.nonzero(v != 0).reshape(-1)
    else:
        idx = abs_at_least_indices(v, thr, k)
    if idx.numel() > k:  # too many passed: exact top-k among the selected (DGC Appendix)
        idx = torch.sort(topk_among(v, idx, k)).values
    return idx


@register("dgc")
class DGC(accumulators.DoubleBuffered, Sparsifier):
    """Deep Gradient Compression: sampled top-k of momentum-corrected accumulations.

    Args:
        ratio: final density (fraction of entries sent), in (0, 1]; default 0.001.
        momentum: momentum factor ``m`` in [0, 1); default 0.9.
        sample_ratio: fraction of entries sampled to estimate the threshold,
            in (0, 1]; default 0.01. At least max(1024, 32 / density) entries
            are sampled (see ``sparse.sampled_threshold``); a tensor that
            small is thresholded exactly.
        warmup_steps: encodes over which the sparsity rises exponentially to
            ``1 - ratio``; 0 (default) starts at the final ratio.
        clip_norm: local L2 clipping threshold (the paper's global threshold
            times ``N ** -0.5``), or None (default) for no clipping.
        index_codec, value_codec, **codec_params: how positions and values
            travel (``sparse.TopK`` lists them); masking applies where values
            were sent, and what a lossy value codec loses stays in ``v``.

    Raises:
        ValueError: a parameter outside its range.

    Example:
        >>> c = DGC(ratio=0.01, warmup_steps=4)
        >>> st = c.init(torch.zeros(10_000), seed=1)
        >>> payload, st = c.encode(torch.randn(10_000), st)
    """

    name = "dgc"
    algo_id = 22
    accumulator_keys = ("u", "v")  # double-buffered (accumulators.DoubleBuffered)
    capabilities = Capabilities("sparsification", aggregatable=False, fixed_size=False,
                                stateful=True, keeps_memory=True,
                                checks_finite=True)  # the one pass, else a scan

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9, sample_ratio: float = 0.01,
                 warmup_steps: int = 0, clip_norm: Optional[float] = None,
                 index_codec: str = "plain", value_codec: str = "plain",
                 **codec_params: Any) -> None:
        self.ratio = _check_ratio("dgc", ratio)
        self.momentum = check_real("dgc", "momentum", momentum, low=0.0, high=1.0,
                                   high_open=True, example=0.9)
        self.sample_ratio = _check_ratio("dgc", sample_ratio, "sample_ratio")
        self.warmup_steps = check_int("dgc", "warmup_steps", warmup_steps, low=0, example=0)
        self.clip_norm = None if clip_norm is None else check_real(
            "dgc", "clip_norm", clip_norm, low=0.0, low_open=True, example=1.0)
        self._init_codecs(index_codec, value_codec, **codec_params)

    def density(self, step: int) -> float:
        """Fraction of entries sent at ``step`` (DGC Sec. 3.4 exponential warm-up).

        ``ratio ** ((step + 1) / warmup_steps)`` during warm-up, ``ratio`` after.
        """
        if step < self.warmup_steps:
            return self.ratio ** ((step + 1) / self.warmup_steps)
        return self.ratio

    def _max_density(self) -> float:
        return self.density(0)

    def init(self, grad: torch.Tensor, seed: int = 0, *, world_size: int = 1,
             shared_seed: int = 0) -> State:
        """Zero velocity ``u`` and accumulation ``v`` shaped like ``grad``."""
        acc = accumulator_dtype(grad.dtype)
        return {"u": torch.zeros(grad.shape, dtype=acc, device=grad.device),
                "v": torch.zeros(grad.shape, dtype=acc, device=grad.device),
                "step": 0, "seed": int(seed)}

    def _check_state(self, grad: torch.Tensor, state: State) -> None:
        for key in ("u", "v"):
            self.state_tensor(state, key, grad)

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """One DGC step; ``u`` and ``v`` are updated in place (the new state holds them).

        1. clip ``g`` to ``clip_norm`` (if set);
        2. ``u = m * u + g``; ``v = v + u`` (momentum correction);
        3. select at most ``k = ceil(density(step) * n)`` entries of ``v``
           by a sampled threshold (exact top-k among them if too many);
        4. send ``v`` at those entries; zero ``u`` and ``v`` there (masking).

        Returns:
            (payload, new state with ``step + 1``).

        Raises:
            TypeError, ValueError: bad gradient or a state of another shape.
        """
        # checks_finite: NaN/Inf is refused even where the engine vouched for the input;
        # the fused pass notices it itself, every other path scans first
        step, seed = int(state.get("step", 0)), int(state.get("seed", 0))
        density = self.density(step)
        fused = accumulators.one_pass_usable(grad, state, self.accumulator_keys, density,
                                             self.sample_ratio)
        check_gradient(grad, nonfinite="raise" if fused else "always")
        self._check_state(grad, state)
        acc = accumulator_dtype(grad.dtype)
        g = grad.detach().reshape(-1)
        if self.clip_norm is not None:
            norm = float(torch.linalg.vector_norm(g.to(acc)))
            if norm > self.clip_norm:
                g = g.to(acc) * (self.clip_norm / norm)
        k = num_selected(density, g.numel())
        if fused:
            u, v = accumulators.outputs(state, self.accumulator_keys)
            idx = accumulators.one_pass_select(
                grad, g, state["u"].reshape(-1), state["v"].reshape(-1), u, v, self.momentum,
                density, k, self.sample_ratio, seed, step)
        else:
            u, v = self._accumulate(g, state)
            idx = _select(v, density, k, self.sample_ratio, seed, step)
        code = self._pack(grad, idx, lambda i: extract(v, i), self._codec_seed(seed, idx))
        u.index_fill_(0, code.idx, 0)
        # masking zeroes v where sent; only what the wire (dtype, value codec) lost stays
        v.index_copy_(0, code.idx, code.values - code.wire.to(acc))
        return code.payload, accumulators.settle(
            state, self.accumulator_keys, u=u.reshape(grad.shape), v=v.reshape(grad.shape),
            step=step + 1, seed=seed)

    def _accumulate(self, g: torch.Tensor, state: State) -> Tuple[torch.Tensor, torch.Tensor]:
        """Step 2 of the module docstring in torch: ``u = m u + g``, ``v = v + u``, in
        the state's tensors, or into its second buffers when it has them."""
        if accumulators.buffer_key("u") not in state:
            u = accumulate_(state["u"], g, self.momentum)      # u = m u + g (in place)
            return u, accumulate_(state["v"], u)               # v = v + u  (in place)
        acc = accumulator_dtype(g.dtype)
        uo, vo = accumulators.outputs(state, self.accumulator_keys)
        if uo.dtype != acc or vo.dtype != acc:  # a state loaded with another dtype: new ones
            uo, vo = torch.empty_like(g, dtype=acc), torch.empty_like(g, dtype=acc)
        u = torch.add(g, state["u"].reshape(-1), alpha=self.momentum, out=uo)
        return u, torch.add(state["v"].reshape(-1), u, out=vo)

    def params(self) -> Dict[str, object]:
        """Constructor parameters (the codecs' only when they are not plain)."""
        return {"ratio": self.ratio, "momentum": self.momentum,
                "sample_ratio": self.sample_ratio, "warmup_steps": self.warmup_steps,
                "clip_norm": self.clip_norm, **self._codec_params()}
