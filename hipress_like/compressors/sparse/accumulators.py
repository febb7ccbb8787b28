"""The sparsifiers that keep what they do not send (DGC's velocity and accumulation,
GradDrop's residual): their step in one pass, and their double buffering.

Idea: such a step adds the gradient into its accumulators, estimates a
threshold from a sample of the sum, and sends the entries over it. In torch
that reads the gradient and the accumulators several times (each
accumulation, the filter, and the engine's NaN/Inf scan), and the engine
copies the accumulators every step to undo a step some rank saw NaN/Inf in
(``casync.nonfinite``). Here the sum is first computed at the sampled
positions only, off the old state, which gives the threshold; then one
pass (``accumulate.c``) writes the new accumulators, selects, and reports
NaN/Inf in the gradient (``Capabilities.checks_finite``), into the state's
own arrays or into a second set (``detach_state``, ``double_buffer``), so
that the engine keeps the old state by reference. Same bits as the torch
path (the accumulations round as ``torch.add``; the sample is the same
positions of the same values).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .._build import native as _native
from ..base import State, accumulate_, accumulator_dtype, check_gradient
from ..double_buffer import second_buffer
from ..ops import abs_at_least_indices, extract, topk_among
from . import native as _c
from .topk import sample_count, threshold_of_sample

__all__ = ["DoubleBuffered", "accumulate_checked", "buffer_key", "detach", "one_pass_select",
           "one_pass_usable", "outputs", "settle"]


def buffer_key(key: str) -> str:
    """The state key of ``key``'s second buffer (consumed by the step)."""
    return f"{key}_buffer"


def detach(state: State, spare: Optional[State], keys: Sequence[str]) -> Optional[State]:
    """``state`` with a second buffer for each accumulator ``keys`` (``spare``'s
    arrays when free), or None when an accumulator is missing (the caller
    copies the state instead)."""
    if not all(isinstance(state.get(k), torch.Tensor) for k in keys):
        return None
    out = dict(state)
    for k in keys:
        out[buffer_key(k)] = second_buffer(spare, k, state[k], out, buffer_key(k))
    return out


class DoubleBuffered:
    """``Compressor.detach_state`` for a compressor whose step rewrites the state
    arrays named by ``accumulator_keys`` (DGC's ``u`` and ``v``, GradDrop's and
    AR-Topk's ``residual``): listed before the compressor base, it gives the
    state a second buffer per array (``detach``) that the step writes into.

    Example:
        >>> from hipress_like.compressors.sparse.dgc import DGC
        >>> c = DGC(ratio=0.01); g = torch.randn(10_000)
        >>> st = c.init(g); _, st = c.encode(g, st); v = st["v"].clone()
        >>> _, st2 = c.encode(g, c.detach_state(st, None))
        >>> torch.equal(st["v"], v), st2["v"] is not st["v"]
        (True, True)
    """

    accumulator_keys: Tuple[str, ...] = ()

    def detach_state(self, state: State, spare: Optional[State]) -> Optional[State]:
        """``state`` with a second buffer for each of ``accumulator_keys`` (``spare``'s
        arrays when free), so the step leaves ``state`` as it was; None when an
        array is missing (the caller copies the state instead)."""
        return detach(state, spare, self.accumulator_keys)


def outputs(state: State, keys: Sequence[str]) -> Tuple[torch.Tensor, ...]:
    """Flat views of where the new accumulators go: the second buffers when the
    state has them, else the state's own arrays (in place)."""
    return tuple(state.get(buffer_key(k), state[k]).view(-1) for k in keys)


def settle(state: State, keys: Sequence[str], **new: object) -> State:
    """The step's new state: ``state`` without its second buffers' keys, with ``new``."""
    drop = {buffer_key(k) for k in keys}
    out = {k: v for k, v in state.items() if k not in drop}
    out.update(new)
    return out


def accumulate_checked(grad: torch.Tensor, acc: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """``out = acc + grad`` (flat; ``out`` may be ``acc``), refusing NaN/Inf in
    ``grad`` even where the engine vouched for it: in the same pass for float32
    on the CPU (``accumulate.c`` with nothing to select), else after a scan, and
    into a new tensor when ``out`` is not of the accumulator's dtype. Outside
    ``assume_finite`` the gradient is scanned first, so a caller's state is
    never written with NaN.

    Raises:
        NonFiniteError: ``grad`` holds NaN/Inf (inside ``assume_finite``, ``out``
            may have been written: the engine gives a second buffer).
    """
    g = grad.detach().reshape(-1)
    if _native.usable(g, acc, out, dtypes=(torch.float32,)) and out.numel() == g.numel():
        check_gradient(grad)  # scans unless the caller vouched; then the pass checks
        _, _, nonfinite = _c.accumulate_select(g, None, acc, 0.0, None, out, float("inf"), 0)
        if nonfinite:
            check_gradient(grad, nonfinite="always")  # raises NonFiniteError
        return out
    check_gradient(grad, nonfinite="always")
    if out.dtype != accumulator_dtype(grad.dtype):  # a residual loaded with another dtype
        return accumulate_(acc.clone(), grad)
    return torch.add(acc, g, out=out)  # out may be acc (in place): elementwise


def one_pass_usable(grad: torch.Tensor, state: State, keys: Sequence[str], density: float,
                    sample_ratio: float) -> bool:
    """The one-pass step applies: float32 CPU tensors of one size, the
    accumulators and their buffers alike, and a tensor large enough that the
    threshold is sampled (``sampled_threshold``'s exact branch stays in torch)."""
    tensors = [grad] + [state.get(k) for k in keys]
    tensors += [state[buffer_key(k)] for k in keys if buffer_key(k) in state]
    return (all(isinstance(t, torch.Tensor) and t.numel() == grad.numel() for t in tensors)
            and _native.usable(*tensors, dtypes=(torch.float32,))
            and sample_count(grad.numel(), density, sample_ratio) < grad.numel())


def one_pass_select(grad: torch.Tensor, g: torch.Tensor, u: Optional[torch.Tensor],
                    v: torch.Tensor, uo: Optional[torch.Tensor], vo: torch.Tensor,
                    momentum: float, density: float, k: int, sample_ratio: float, seed: int,
                    step: int) -> torch.Tensor:
    """Write ``uo = fma(momentum, u, g)`` and ``vo = v + uo`` (``u`` None: ``vo = v +
    g``) in one pass and return the sorted positions DGC's ``_select`` would
    pick from ``vo``: at most ``k`` by a threshold sampled at ``density``.

    Raises:
        NonFiniteError: ``grad`` holds NaN/Inf (the pass noticed; the
            accumulators it wrote are then not to be used).
    """
    if u is None:
        def at(pos: torch.Tensor) -> torch.Tensor:
            return extract(v, pos) + extract(g, pos)
    else:
        def at(pos: torch.Tensor) -> torch.Tensor:  # torch.add(alpha=) rounds as fma
            return extract(v, pos) + torch.add(extract(g, pos), extract(u, pos),
                                               alpha=momentum)
    thr = float(threshold_of_sample(at, g.numel(), density, sample_ratio, seed, step,
                                    g.device))
    # an all-zero accumulator would pass a zero threshold everywhere (dgc._select)
    t = thr if thr != 0.0 else float("inf")
    idx, total, nonfinite = _c.accumulate_select(g, u, v, momentum, uo, vo, t, 2 * k + 1024)
    if nonfinite:
        check_gradient(grad, nonfinite="always")  # raises NonFiniteError
    if thr == 0.0:
        idx = torch.nonzero(vo != 0).reshape(-1)
    elif total > idx.numel():
        idx = abs_at_least_indices(vo, thr, total)
    if idx.numel() > k:  # too many passed: exact top-k among the selected
        idx = torch.sort(topk_among(vo, idx, k)).values
    return idx
