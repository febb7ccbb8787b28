"""AR-Topk (STAR-Topk, VAR-Topk) and MSTopk: top-k that an allreduce can carry.

Top-k payloads of different ranks hold different indices, so they cannot be
summed elementwise; the usual way is an Allgather of every rank's values and
indices (LWTopk). AR-Topk (Tyagi & Sharma, "Flexible Communication for
Optimal Distributed Learning over Unpredictable Networks", Alg. 1) lets ONE
rank choose the indices, broadcasts them, and then every rank contributes
its own values at those indices, which sum like a dense tensor:

    G      = grad + residual                               (Alg. 1 line 5)
    g, ix  = Topk(G, c)                                    (line 6)
    owner  = i mod N                    STAR-Topk          (line 8)
           | argmax_r ||g_r||^2         VAR-Topk           (lines 11-14)
    ix~    = Broadcast(ix, src=owner)                      (line 16)
    g~     = G[ix~];  residual = G - g~ (G with ix~ zeroed) (lines 17-18)
    g~     = AllReduce(g~) / N                             (line 19)

A compressor never communicates (STYLE.md 2): each step of Alg. 1 that
needs the network is a declared round, and the engine runs it (PS, Ring,
never the sum-only lane, because a broadcast round cannot be summed):

    STAR-Topk  rounds ("broadcast", "sum")
        round 0: the owner's sorted top-k indices; other ranks send an empty
                 payload, and ``merge_round`` keeps the one non-empty payload.
        round 1: this rank's G at the owner's indices (summable float values).
    VAR-Topk   rounds ("sum", "broadcast", "sum")
        round 0: a one-hot N-vector holding ||g_r||^2 at position r (Alg. 1
                 lines 11-12). Their sum is the Allgather of line 13, exactly:
                 every other term is +0.0, so any summation order gives the
                 same bits. The owner is the first index of the maximum.
        rounds 1 and 2: as STAR's rounds 0 and 1.

``i`` is the step counter of the state (Alg. 1 counts i = 1, 2, ...), equal
on every rank because every rank decodes every step. Each gradient (or
partition, or Ring chunk) has its own state, so layer-wise compression
rotates all layers in step; compressing fused gradients (the paper's
choice: the whole model or a bucket as one tensor) is ``fuse``/``unfuse``
below around one registered gradient.

The residual is the compressor's own memory (Alg. 1 lines 17-18: each rank
keeps what it did not send at the owner's indices), so it declares
``keeps_memory`` and automatic error feedback does not wrap it. The state
also records ``gain``: ``(||g~||^2, ||G||^2)`` of the last step, the two
terms of the compression gain E||g_c||^2 / E||g_e||^2 (Sec. 3-E, after
GraVAC), read by ``tuning.adaptive_cr``.

MSTopk (Shi et al., MLSys 2021, the paper's other baseline) is a
single-round sparsifier: instead of a sort it searches a magnitude threshold
by ``samplings`` bisection steps between mean|x| and max|x| (keeping the
best threshold with at most k entries above and the best with more), then
fills up to exactly k with entries drawn at random between the two
thresholds. It travels like ``topk`` (the sparse payload of ``topk.py``).

Payloads (header from ``payload.py``; extra = (kind, count) as two uint64):
    indices:   kind 1, count k; body: k sorted indices (int32, int64 past
               2**31), zero-padded to 8 bytes; an empty body from non-owners.
    values:    kind 2, count k; body: k values (float32, float64 for float64).
    variances: kind 3, count N; body: N float64.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..base import (
    Capabilities,
    PayloadError,
    State,
    accumulator_dtype,
    check_gradient,
    decode_output,
    header_nbytes,
    unpack_fields,
)
from ..kernels import Kernels
from ..ops import extract, hash32, topk_abs
from ..params import check_int
from ..payload import pad8
from ..registry import register
from ..rounds import MultiRoundCompressor
from . import accumulators
from .topk import Sparsifier, _check_ratio, index_dtype, num_selected, pack_sparse

__all__ = ["ARTopk", "STARTopk", "VARTopk", "MSTopk", "ms_threshold", "fuse", "unfuse"]

_EXTRA = struct.Struct("<QQ")  # kind, count
_INDICES, _VALUES, _VARIANCES = 1, 2, 3
_KIND_NAMES = {_INDICES: "indices", _VALUES: "values", _VARIANCES: "variances"}


def _data_dtype(kind: int, dtype: torch.dtype) -> torch.dtype:
    """The element type of a values (the accumulator of ``dtype``) or variances
    (float64) payload's body."""
    return torch.float64 if kind == _VARIANCES else accumulator_dtype(dtype)


class _ARKernels(Kernels):
    """The summable view of value and variance payloads: the body as floats."""

    def summable_view(self, payload: torch.Tensor) -> Optional[torch.Tensor]:
        """The body of a values/variances payload as float32/float64 (None for indices)."""
        comp = self.comp
        h, (kind, count) = unpack_fields(payload, comp.algo_id, _EXTRA, comp.name)
        if kind == _VARIANCES:
            return h.body.view(torch.float64)
        if kind == _VALUES:
            return h.body.view(accumulator_dtype(h.dtype))
        return None


class ARTopk(accumulators.DoubleBuffered, MultiRoundCompressor):
    """Common rounds of STAR-Topk and VAR-Topk (module docstring); subclasses name the owner.

    Args:
        ratio: the compression ratio c, fraction of entries kept, in (0, 1].
    """

    name = "artopk"
    _owner_rounds = 0  # rounds before the index broadcast (VAR: 1)
    accumulator_keys = ("residual",)  # double-buffered (accumulators.DoubleBuffered)
    kernels_class = _ARKernels
    # its state records the step's gain terms (``"gain"``), and ``ratio`` may be set
    # between steps: plan="adaptive" searches it (tuning/ratio_search.py)
    records_gain = True

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = _check_ratio(self.name, ratio)

    def params(self) -> Dict[str, Any]:
        """Constructor parameters."""
        return {"ratio": self.ratio}

    # -- state -------------------------------------------------------------------
    def init(self, grad: torch.Tensor, seed: int = 0, *, world_size: int = 1,
             shared_seed: int = 0, rank: int = 0) -> State:
        """A zero residual shaped like ``grad`` (float32 for half types), the step
        counter ``i``, this rank and the world size (the owner needs both)."""
        world_size = check_int(self.name, "world_size", world_size, low=1, example=4)
        rank = check_int(self.name, "rank", rank, low=0, example=0)
        if rank >= world_size:
            raise ValueError(f"{self.name}: rank {rank} outside a world of {world_size}")
        return {"residual": torch.zeros(grad.shape, dtype=accumulator_dtype(grad.dtype),
                                        device=grad.device),
                "step": 0, "rank": rank, "world_size": world_size, "seed": int(seed)}

    def k_of(self, numel: int) -> int:
        """Entries kept out of ``numel``: ``ceil(ratio * numel)`` in [1, numel]."""
        return num_selected(self.ratio, numel)

    # -- payloads ----------------------------------------------------------------
    def _pack(self, grad: torch.Tensor, kind: int, data: torch.Tensor) -> torch.Tensor:
        raw = data.reshape(-1).contiguous().view(torch.uint8)
        nbytes = pad8(raw.numel()) if kind == _INDICES else raw.numel()
        payload, body = self.frame_payload(grad, _EXTRA.pack(kind, data.numel()), nbytes)
        body[: raw.numel()].copy_(raw)
        body[raw.numel():].zero_()
        return payload

    def _unpack(self, payload: torch.Tensor, want: int) -> Tuple[Any, torch.Tensor]:
        """(header, data) of a payload of kind ``want``; validates sizes and indices."""
        def body_nbytes(h: Any, kind: int, count: int) -> int:
            if kind != want:
                raise PayloadError(f"{self.name}: expected a {_KIND_NAMES[want]} payload, "
                                   f"found kind {kind} ({_KIND_NAMES.get(kind, 'unknown')})")
            if kind == _INDICES:
                return pad8(count * index_dtype(h.numel).itemsize)
            return count * _data_dtype(kind, h.dtype).itemsize

        h, (kind, count) = self.check_payload(
            payload, _EXTRA, body_nbytes,
            lambda kind, count: f" with k={count}" if kind == _INDICES
            else f" with {count} {_KIND_NAMES[kind]}")
        if kind == _INDICES:
            idt = index_dtype(h.numel)
            idx = h.body[: count * idt.itemsize].view(idt).to(torch.int64)
            if count and (int(idx[0]) < 0 or int(idx[-1]) >= h.numel
                          or (count > 1 and not bool((idx[1:] > idx[:-1]).all()))):
                raise PayloadError(f"{self.name}: indices must be strictly increasing in "
                                   f"[0, {h.numel})")
            return h, idx
        dt = _data_dtype(kind, h.dtype)
        return h, h.body.view(dt) if count else torch.empty(0, dtype=dt)

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Bytes the owner sends per step for float32: indices plus values (VAR adds its
        variance vector, whose size depends on N: counted for N = 1 here)."""
        k = self.k_of(numel)
        isz = torch.empty((), dtype=index_dtype(numel)).element_size()
        hdr = header_nbytes(ndim, _EXTRA.size)
        own = (hdr + 8) * self._owner_rounds
        return own + hdr + pad8(k * isz) + hdr + 4 * k

    def broadcast_nbytes(self, r: int, numel: int, ndim: int = 1) -> Optional[int]:
        """The owner's index payload: the header and k sorted indices, 8-byte padded
        (fixed by ``ratio`` and the shape, so every rank knows it)."""
        if self.capabilities.round_reductions[r] != "broadcast":
            raise ValueError(f"{self.name}: round {r} is not a broadcast round")
        isz = torch.empty((), dtype=index_dtype(numel)).element_size()
        return header_nbytes(ndim, _EXTRA.size) + pad8(self.k_of(numel) * isz)

    # -- rounds ------------------------------------------------------------------
    def owner(self, state: State, aggregate: Optional[torch.Tensor]) -> int:
        """The rank whose indices are broadcast this step (subclasses)."""
        raise NotImplementedError

    def _form(self, grad: torch.Tensor, state: State) -> State:
        """``G = grad + residual`` (Alg. 1 line 5) in the residual buffer, or in its
        second buffer (``detach_state``), checking ``grad`` for NaN/Inf in the same
        pass for float32 on the CPU (``accumulators.accumulate_checked``; the
        engine then skips its scan, ``checks_finite``), else after a scan."""
        res = self.state_tensor(state, "residual", grad)
        (out,) = accumulators.outputs(state, self.accumulator_keys)
        g = accumulators.accumulate_checked(grad, res.view(-1), out)
        return accumulators.settle(state, self.accumulator_keys, residual=g.view(grad.shape),
                                   formed=True)

    def _topk(self, state: State) -> torch.Tensor:
        """This rank's sorted top-k indices of G (Alg. 1 line 6)."""
        g = state["residual"].view(-1)
        return torch.sort(topk_abs(g, self.k_of(g.numel()))[0]).values

    def encode_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> Tuple[torch.Tensor, State]:
        """Round ``r`` (module docstring): [variances], owner's indices, values.

        Args:
            r: the round, 0 .. rounds-1.
            grad: this rank's gradient (the same tensor every round; not modified).
            state: from ``init``; the rounds of one step carry G in it.
            aggregate: the merged payload of round r-1 (None in round 0).

        Raises:
            ValueError: a round out of order, or a bad gradient.
            PayloadError: a malformed aggregate.
        """
        rounds = self.capabilities.rounds
        if not 0 <= r < rounds:
            raise ValueError(f"{self.name}: round {r} outside 0..{rounds - 1}")
        if r == 0:
            state = self._form(grad, state)
        elif not state.get("formed"):
            raise ValueError(f"{self.name}: round {r} before round 0 of this step")
        bcast = self._owner_rounds
        if r < bcast:  # VAR-Topk: the one-hot statistic
            return self._variance_payload(grad, state)
        if r == bcast:  # the owner's indices (Alg. 1 line 16)
            owner = self.owner(state, aggregate)
            state = {**state, "owner": owner}
            if owner != state["rank"]:
                return self._pack(grad, _INDICES, torch.empty(0, dtype=index_dtype(
                    grad.numel()), device=grad.device)), state
            idx = state.pop("own_idx", None)
            idx = self._topk(state) if idx is None else idx
            return self._pack(grad, _INDICES, idx.to(index_dtype(grad.numel()))), state
        _, idx = self._unpack(aggregate, _INDICES)
        if idx.numel() == 0:
            raise PayloadError(f"{self.name}: the merged index round holds no indices "
                               "(no rank was the owner)")
        g = state["residual"].view(-1)
        vals = extract(g, idx)  # Alg. 1 line 17: this rank's G at the owner's indices
        total = torch.dot(g, g)
        sent = torch.dot(vals, vals)
        g.index_fill_(0, idx, 0.0)  # line 18: residual = G - g~
        state = {**state, "idx": idx, "gain": (float(sent), float(total))}
        return self._pack(grad, _VALUES, vals), state

    def _variance_payload(self, grad: torch.Tensor, state: State
                          ) -> Tuple[torch.Tensor, State]:
        idx = self._topk(state)
        vals = extract(state["residual"].view(-1), idx)
        onehot = torch.zeros(state["world_size"], dtype=torch.float64, device=grad.device)
        onehot[state["rank"]] = torch.dot(vals, vals).to(torch.float64)  # Alg. 1 line 12
        return self._pack(grad, _VARIANCES, onehot), {**state, "own_idx": idx}

    def merge_round(self, r: int, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Reduce round ``r``: the one owner's indices, or the elementwise sum (rank order).

        Raises:
            ValueError: two owners' indices in one broadcast round.
        """
        if not payloads:
            raise ValueError(f"{self.name}: merge_round needs at least one payload")
        if self.capabilities.round_reductions[r] == "broadcast":
            full = [p for p in payloads if self._unpack(p, _INDICES)[1].numel()]
            if len(full) > 1:
                raise ValueError(f"{self.name}: {len(full)} owners sent indices in one "
                                 "broadcast round; the ranks disagree on the owner")
            return full[0] if full else payloads[0]
        kind = _VARIANCES if r < self._owner_rounds else _VALUES
        out = payloads[0].clone()
        _, acc = self._unpack(out, kind)
        for p in payloads[1:]:
            _, v = self._unpack(p, kind)
            if v.numel() != acc.numel():
                raise PayloadError(f"{self.name}: round {r} payloads of {acc.numel()} and "
                                   f"{v.numel()} entries cannot be summed")
            acc.add_(v)
        return out

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """The sum of value payloads (the last round)."""
        return self.merge_round(self.capabilities.rounds - 1, payloads)

    def decode_rounds(self, grad: torch.Tensor, state: State, aggregate: torch.Tensor,
                      out: Optional[torch.Tensor] = None,
                      average: bool = False) -> Tuple[torch.Tensor, State]:
        """Scatter the summed values (divided by N when ``average``) at the owner's
        indices into zeros; the step counter ``i`` advances.

        Raises:
            ValueError: called before the value round of this step.
        """
        idx = state.get("idx")
        if idx is None:
            raise ValueError(f"{self.name}: decode_rounds before the value round of this step")
        h, vals = self._unpack(aggregate, _VALUES)
        if vals.numel() != idx.numel():
            raise PayloadError(f"{self.name}: {vals.numel()} summed values for "
                               f"{idx.numel()} indices")
        res = decode_output(h, out, grad.device)
        flat = res.view(-1)
        flat.zero_()
        v = vals / int(state["world_size"]) if average else vals
        flat.index_copy_(0, idx, v.to(res.dtype))
        new = {k: v for k, v in state.items() if k not in ("idx", "formed", "own_idx")}
        new["step"] = int(state["step"]) + 1
        return res, new

    @staticmethod
    def memory(state: State) -> torch.Tensor:
        """The residual of Alg. 1 line 18 (G between rounds of one step)."""
        return state["residual"]


@register("star_topk")
class STARTopk(ARTopk):
    """STAR-Topk: the owner is ``i mod N`` (round robin; Alg. 1 line 8).

    Example (one rank, the engine's role played by hand):
        >>> c = STARTopk(ratio=0.25)
        >>> g = torch.arange(8.0)
        >>> st = c.init(g, world_size=1, rank=0)
        >>> p0, st = c.encode_round(0, g, st, None)
        >>> p1, st = c.encode_round(1, g, st, c.merge_round(0, [p0]))
        >>> c.decode_rounds(g, st, c.merge_round(1, [p1]))[0].tolist()
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 7.0]
    """

    name = "star_topk"
    algo_id = 60
    capabilities = Capabilities("sparsification", aggregatable=True, fixed_size=False,
                                rounds=2, stateful=True, keeps_memory=True,
                                round_reductions=("broadcast", "sum"), summable=(False, True),
                                checks_finite=True)  # round 0's pass (_form)

    def owner(self, state: State, aggregate: Optional[torch.Tensor]) -> int:
        """``i mod N`` with ``i = step + 1`` (Alg. 1 counts steps from 1)."""
        return (int(state["step"]) + 1) % int(state["world_size"])


@register("var_topk")
class VARTopk(ARTopk):
    """VAR-Topk: the owner has the largest ``||g_r||^2`` of its top-k values (lines 11-14).

    Example (one rank):
        >>> c = VARTopk(ratio=0.25)
        >>> g = torch.arange(8.0)
        >>> st = c.init(g, world_size=1, rank=0)
        >>> p, agg = None, None
        >>> for r in range(3):
        ...     p, st = c.encode_round(r, g, st, agg)
        ...     agg = c.merge_round(r, [p])
        >>> c.decode_rounds(g, st, agg)[0].tolist()
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, 7.0]
    """

    name = "var_topk"
    algo_id = 61
    _owner_rounds = 1
    capabilities = Capabilities("sparsification", aggregatable=True, fixed_size=False,
                                rounds=3, stateful=True, keeps_memory=True,
                                round_reductions=("sum", "broadcast", "sum"),
                                summable=(True, False, True),
                                checks_finite=True)  # round 0's pass (_form)

    def owner(self, state: State, aggregate: Optional[torch.Tensor]) -> int:
        """The first rank with the largest statistic in the summed one-hot vectors."""
        _, var = self._unpack(aggregate, _VARIANCES)
        if var.numel() != int(state["world_size"]):
            raise PayloadError(f"{self.name}: {var.numel()} variances for a world of "
                               f"{state['world_size']}")
        return int(torch.argmax(var))


# -- MSTopk -------------------------------------------------------------------------

def ms_threshold(x: torch.Tensor, k: int, samplings: int = 30
                 ) -> Tuple[float, int, float, int]:
    """MSTopk's threshold search (Shi et al. 2021, Alg. 2) over magnitudes ``|x|``.

    1. ``a = mean|x|``, ``u = max|x|``, ratio bounds ``l, r = 0, 1``;
    2. ``samplings`` times: ``t = a + m (u - a)`` with ``m = (l + r) / 2``;
       count ``nnz = #{|x| >= t}``; if ``nnz <= k`` keep the largest such
       count as (t1, k1) and move ``r = m``, else keep the smallest larger
       count as (t2, k2) and move ``l = m``.

    Args:
        x: 1-D values.
        k: target count.
        samplings: bisection steps.

    Returns:
        (t1, k1, t2, k2): ``k1 <= k`` entries are ``>= t1``; ``k2 > k`` are
        ``>= t2`` (``t2 = 0`` and ``k2 = n`` when no sample had more than k).
    """
    mag = x.abs()
    n = x.numel()
    a, u = float(mag.mean()), float(mag.max())
    lo, hi = 0.0, 1.0
    t1, k1, t2, k2 = math.inf, 0, 0.0, n
    for _ in range(samplings):
        m = lo + (hi - lo) / 2
        t = a + m * (u - a)
        nnz = int((mag >= t).sum())
        if nnz <= k:
            hi = m
            if nnz > k1 or t1 == math.inf:
                t1, k1 = t, nnz
        else:
            lo = m
            if nnz < k2:
                t2, k2 = t, nnz
    return t1, k1, t2, k2


@register("mstopk")
class MSTopk(Sparsifier):
    """MSTopk: exactly ``k`` entries chosen by a multi-sample threshold search.

    The ``k1`` entries above the strict threshold ``t1`` are kept; the other
    ``k - k1`` are drawn uniformly from those between ``t2`` and ``t1`` by
    the counter RNG keyed by (seed, step), so it is reproducible. Biased:
    the engine wraps it in error feedback by default, as ``topk``.

    Args:
        ratio: fraction of entries kept, in (0, 1]; default 0.01.
        samplings: bisection steps of the threshold search (default 30, as
            the MSTopk paper).

    Example:
        >>> c = MSTopk(ratio=0.1)
        >>> p, st = c.encode(torch.randn(1000), c.init(torch.zeros(1000)))
        >>> int((c.decode(p) != 0).sum())
        100
    """

    name = "mstopk"
    algo_id = 26

    def __init__(self, ratio: float = 0.01, samplings: int = 30) -> None:
        self.ratio = _check_ratio("mstopk", ratio)
        self.samplings = check_int("mstopk", "samplings", samplings, low=1, example=30)
        self.capabilities = Capabilities("sparsification", aggregatable=False, fixed_size=True,
                                         stateful=True)

    def select(self, x: torch.Tensor, seed: int, step: int) -> torch.Tensor:
        """The sorted int64 positions MSTopk keeps of 1-D ``x`` (exactly ``k``)."""
        n = x.numel()
        k = num_selected(self.ratio, n)
        t1, k1, t2, _ = ms_threshold(x, k, self.samplings)
        mag = x.abs()
        top = mag >= t1 if k1 else torch.zeros(n, dtype=torch.bool, device=x.device)
        chosen = torch.nonzero(top).reshape(-1)
        need = k - chosen.numel()
        if need > 0:
            band = torch.nonzero((mag >= t2) & ~top).reshape(-1)
            if band.numel() < need:  # degenerate magnitudes (ties): take from the rest
                band = torch.nonzero(~top).reshape(-1)
            keys = hash32(band + step * n, seed)
            pick = band[torch.topk(keys, need, sorted=False).indices]
            chosen = torch.cat([chosen, pick])
        return torch.sort(chosen).values

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Threshold search, random fill to ``k``, pack; advance ``step``.

        Raises:
            TypeError, ValueError: bad gradient (see ``check_gradient``).
        """
        check_gradient(grad)
        x = grad.detach().reshape(-1)
        seed, step = int(state.get("seed", 0)), int(state.get("step", 0))
        idx = self.select(x, seed, step)
        payload = pack_sparse(self.algo_id, grad, idx, extract(x, idx))
        return payload, dict(state, seed=seed, step=step + 1)

    def params(self) -> Dict[str, object]:
        """Constructor parameters."""
        return {"ratio": self.ratio, "samplings": self.samplings}


# -- fused gradients ----------------------------------------------------------------

def fuse(tensors: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Concatenate gradients into one flat buffer (the paper compresses the whole model,
    or a bucket of it, as one tensor: Sec. 3-A "tensor fusion prior compression").

    Args:
        tensors: same dtype and device.
        out: a flat buffer of the total size to reuse.

    Returns:
        The flat buffer; register it with the engine as one gradient.
    """
    if not tensors:
        raise ValueError("fuse needs at least one tensor")
    total = sum(t.numel() for t in tensors)
    if out is None:
        out = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    elif out.numel() != total:
        raise ValueError(f"fuse: out has {out.numel()} elements, the tensors {total}")
    off = 0
    for t in tensors:
        out[off: off + t.numel()].copy_(t.reshape(-1))
        off += t.numel()
    return out


def unfuse(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy a fused buffer back into ``tensors`` (the inverse of ``fuse``).

    Raises:
        ValueError: the tensors do not hold as many elements as ``flat``.
    """
    total = sum(t.numel() for t in tensors)
    if total != flat.numel():
        raise ValueError(f"unfuse: the tensors hold {total} elements, the buffer {flat.numel()}")
    off = 0
    for t in tensors:
        t.copy_(flat[off: off + t.numel()].view(t.shape))
        off += t.numel()
