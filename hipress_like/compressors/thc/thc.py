"""THC, tensor homomorphic compression (Li et al., NSDI 2024): sums of compressed gradients.

Idea: every worker quantizes onto the *same* grid, so the aggregator adds
compressed values as integers, without decoding or re-encoding (THC Sec. 4).
Workers send b-bit indices z; the aggregator looks up integer table values
T[z] in {0, ..., g} (g, the granularity, >= 2^b - 1) and sums them exactly;
each worker decodes the sum once. Alg. 1 is the uniform table (T = identity,
g = 2^b - 1); Alg. 2 the optimal non-uniform tables T_{b,g,p} of ``tables.py``.

Two rounds, declared (``capabilities``; the engine runs them, STYLE.md 2):

    round 0  encode_round(0): ||x_j|| per block j (with the transform, Sec. 5.2
             opt. 1), or (max x, -min x) (without: Alg. 1 l. 6-7)
    engine   merge_round(0): elementwise max -> max_i ||x_ij||, or the global range
    round 1  encode_round(1, aggregate=merged round 0), per coordinate (Alg. 3):
             1. R = H D x_j / sqrt(B), randomized Hadamard with D drawn from the
                shared step seed (``step_seed``): the same on every rank, so it
                commutes with the sum (Sec. 5.1); without the transform R = x
             2. [m, M] = +-t_p max_i ||x_ij|| / sqrt(B), t_p = Phi^-1(1 - p/2)
                (Alg. 3 l. 11), or the global [min, max] (Alg. 1)
             3. a = g (clamp(R, m, M) - m) / (M - m) in [0, g]      (l. 12, 15)
             4. z = j with T[j] <= a < T[j+1], + 1 with probability
                (a - T[j]) / (T[j+1] - T[j]): unbiased SQ onto the table values
                (l. 14, 16), u from (state["seed"], step) as TernGrad draws it
    engine   merge_round(1): Y = sum_i T[z_i] as integers (l. 18), widened
    decode   decode_rounds, for c summed payloads (l. 19-21): with the transform
             x = D H (2Y - c g) t_p max_i ||x_ij|| / (g B); without, x = c m +
             Y (M - m) / g; ``average`` divides by N.

Blocks: the transform works on blocks of B = 2^12 elements (``BLOCK``) and
the tail's binary expansion (2048 + 512 + 8 + 2 for a tail of 2570), so
nothing is padded and exactly n indices travel. One norm per block travels
in round 0 (8 bytes per 16 KB of float32), and each block gets its own
range. Why 2^12 rather than the paper's whole vector padded to a power of
two: H_B costs one batched GEMM per factor H_16 (``_fwht_rows``), each about
two memory copies here, so 2^12 (three factors) costs a quarter less than
2^16 and 40% less than 2^20, while the error does not depend on B (the
per-block ranges add up to sum_j ||x_j||^2 = ||x||^2).

Payloads (common header with shape (n,); extra ``_EXTRA`` = kind, b, flags
(bit 0: transform), log2 B, sum_bits, sum width w, g, count c, CRC-32 of the
table), bodies of little-endian int32 words, so every kernel loads and
stores whole words (inductor's CPU code loads single bytes eight at a time):

    range (round 0)    float64 per block: ||x_j||; or (max, -min), once
    indices (round 1)  m = n // (32/b) words: word j holds elements j, m + j,
                       2m + j, ... in its b-bit fields 0, 1, 2, ... (``_build/fused.py``'s
                       planar layout, by words); the last n - m 32/b elements
                       sit in one more word, fields 0, 1, ..., zero after them
    sums (merged)      the same fields widened to w bits, 32/w lanes per word:
                       w/b arrays of m words (field k in array k // (32/w),
                       lane k % (32/w)), then one word per array for the last
                       elements

Merging takes any mix of index and sum payloads (a PS aggregator's N index
payloads, a Ring hop's [partial sum, own indices]); the counts c add up and
the sum width is the narrowest w in (8, 16, 32), at most ``sum_bits``, with
c g <= 2^w - 1 (2^31 - 1 for 32): sums are exact integers, so every grouping
gives the same bytes, and no lane can carry into the next, so packed words
add lane-wise (SWAR). Sec. 6.2: the width must hold N g; ``init`` raises
when ``world_size * g`` does not fit ``sum_bits``.

Partial aggregation (Sec. 6.1, ``hipress_like.partial``): a step may merge only
the ranks that arrived in time. ``state[CONTRIBUTORS]`` then says how many
ranges round 1 expects, and a rank sitting the step out takes the merged
range from ``absent_round`` and decodes the others' sum as they do.

Kernels and the transform's loops live in ``kernels.py`` (native C on the
CPU for the transform, inductor-compiled torch for the rest).

Bias: clamping to [m, M] biases the clamped coordinates (Sec. 5.1; the paper
adds error feedback, Alg. 3 l. 22: wrap THC in ``ErrorFeedback``), so THC
with the transform declares ``unbiased=False``; without it [m, M] is the true
range and SQ is unbiased. The decode's Hadamard sums are exact integers
(float32 while B c g < 2^24, else float64), so ranks agree bit for bit
whatever order a BLAS adds in.
"""
from __future__ import annotations

import struct
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._build import native as _native
from .._build.fused import Kernel, compute_dtype
from ..base import (
    CONTRIBUTORS,
    Capabilities,
    PayloadError,
    State,
    check_gradient,
    decode_output,
    header_nbytes,
    pack_payload,
    step_seed,
    unpack_fields,
    view_as_dtype,
    workspace,
)
from ..kernels import Kernels
from ..ops import VALID_BITS, _as_i32, mix_seed
from ..params import ParamError, check_bool, check_int, check_real
from ..quantizers.fused import minmax as _fused_minmax
from ..quantizers.terngrad import step_seed as rank_step_seed
from ..registry import register
from ..rounds import MultiRoundCompressor
from . import native as _c
from . import tables as thc_tables
from .kernels import (
    _K_AFFINE,
    _K_CENTER,
    _K_MERGE,
    _K_QUANT,
    BLOCK,
    BLOCK_LOG2,
    _hinges,
    _sign_key,
    forward_rht,
    inverse_rht,
    randomized_hadamard,
)
from .payload import _EXTRA, _INDEX, _RANGE, _SUM, _WIDTHS, _Layout, _Parsed, sum_width

__all__ = ["THC", "BLOCK", "randomized_hadamard", "sum_width"]

_DEFAULT_G = {2: 36, 4: 30}  # App. C.1 for b=2; Sec. 8's evaluation default for b=4


@register("thc")
class THC(MultiRoundCompressor):
    """THC (Li et al., NSDI 2024): homomorphic b-bit quantization; the aggregator sums.

    Args:
        bits: b, bits per index (1, 2, 4, 8; default 4).
        granularity: g, the largest table value, 2^b - 1 <= g <= 1023 (default:
            2^b - 1 for the uniform table, else 30 for b=4 (Sec. 8), 36 for b=2).
        p: the fraction of transformed coordinates the range may clamp
            (default 1/32, Sec. 8); it also names the table T_{b,g,p}. Without
            the transform nothing is clamped and p only selects the table.
        transform: apply the randomized Hadamard transform (default True).
        table: None (the shipped optimal T_{b,g,p}), "uniform" (Alg. 1:
            g = 2^b - 1, T = identity) or the path of a table file
            (``tables.py``: ``python -m hipress_like.compressors.thc.cli_tables solve``).
        sum_bits: the widest summed value allowed, 8, 16 or 32 (default 32; the
            paper's switch prototype uses 8). ``init`` raises when
            ``world_size * g`` does not fit.

    Raises:
        ParamError / ParamTypeError: a parameter out of range or of the wrong
            type; tables.TableError: no or a bad table for (b, g, p).

    Example (two ranks, the engine's calling sequence played by hand):
        >>> c = THC()
        >>> gs = [torch.randn(5000), torch.randn(5000)]
        >>> sts = [c.init(g, seed=r, world_size=2, shared_seed=7) for r, g in enumerate(gs)]
        >>> rng = c.merge_round(0, [c.encode_round(0, g, s, None)[0] for g, s in zip(gs, sts)])
        >>> enc = [c.encode_round(1, g, s, rng) for g, s in zip(gs, sts)]
        >>> total = c.merge_round(1, [p for p, _ in enc])
        >>> avg, st = c.decode_rounds(gs[0], enc[0][1], total, average=True)
        >>> avg.shape
        torch.Size([5000])
    """

    name = "thc"
    algo_id = 50
    capabilities = Capabilities("quantization", aggregatable=True, rounds=2,
                                round_reductions=("max", "sum"), summable=(False, False),
                                merge_widens=True, shared_randomness=True, unbiased=False,
                                stateful=True, own_decode=True, absent_rounds=True,
                                checks_finite=True)  # the block statistics

    def __init__(self, bits: int = 4, granularity: Optional[int] = None, p: float = 1 / 32,
                 transform: bool = True, table: Optional[str] = None, sum_bits: int = 32) -> None:
        self.bits = check_int("thc", "bits", bits, choices=VALID_BITS, example=4)
        self.p = check_real("thc", "p", p, low=1e-12, high=1.0, high_open=True, example=1 / 32)
        self.transform = check_bool("thc", "transform", transform)
        self.sum_bits = check_int("thc", "sum_bits", sum_bits, choices=(8, 16, 32), example=32)
        if table is not None and not isinstance(table, str):
            raise ParamError(f"thc: table must be None, 'uniform' or a table file path, found "
                             f"{type(table).__name__} {table!r}")
        self.table = table
        lo = (1 << self.bits) - 1
        if granularity is None:
            granularity = lo if table == "uniform" else _DEFAULT_G.get(self.bits)
            if granularity is None:
                raise ParamError(f"thc: no default granularity for bits={self.bits}; pass "
                                 f"granularity=G with {lo} <= G <= {thc_tables.MAX_GRANULARITY}")
        self.granularity = check_int("thc", "granularity", granularity, low=lo, example=30)
        if self.granularity > thc_tables.MAX_GRANULARITY:
            raise ParamError(f"thc: granularity must be <= {thc_tables.MAX_GRANULARITY}, found "
                             f"{granularity!r}")
        if table == "uniform":
            if self.granularity != lo:
                raise ParamError(f"thc: table='uniform' is Alg. 1 (T = identity), which needs "
                                 f"granularity = 2^bits - 1 = {lo}, found {granularity!r}")
            values = tuple(range(lo + 1))
        else:
            key = (self.bits, self.granularity, self.p)
            t = (thc_tables.shipped(*key) if table is None else thc_tables.load(table, key))
            values = t.values
        self.values = values
        self.t_p = thc_tables.t_p(self.p)
        self.crc = zlib.crc32(struct.pack(f"<BI{len(values)}I", self.bits, self.granularity,
                                          *values))
        self._phi, self._tz = _hinges(values)
        # the table as 16 bytes for the native 4-bit merge (its sums are 8-bit: g <= 255)
        self._tab8 = (torch.tensor(values, dtype=torch.uint8)
                      if self.bits == 4 and max(values) <= 255 else None)
        if not transform:  # [min, max] is the true range: no clamping, unbiased SQ
            self.capabilities = Capabilities(
                "quantization", aggregatable=True, rounds=2, round_reductions=("max", "sum"),
                summable=(False, False), merge_widens=True, shared_randomness=True,
                unbiased=True, stateful=True, own_decode=True, absent_rounds=True,
                checks_finite=True)

    def params(self) -> Dict[str, Any]:
        """Constructor parameters."""
        return {"bits": self.bits, "granularity": self.granularity, "p": self.p,
                "transform": self.transform, "table": self.table, "sum_bits": self.sum_bits}

    # -- state -----------------------------------------------------------------------
    def init(self, grad: torch.Tensor, seed: int = 0, *, world_size: int = 1,
             shared_seed: int = 0) -> State:
        """The run's constants: this rank's ``seed``, ``world_size`` N, ``shared_seed``.

        Raises:
            ValueError: N * g does not fit ``sum_bits`` (Sec. 6.2), or a bad N.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"thc: world_size must be an int >= 1, found {world_size!r}")
        if not sum_width(world_size, self.granularity, self.sum_bits):
            top = dict(_WIDTHS)[self.sum_bits]
            raise ValueError(
                f"thc: the sum of {world_size} ranks' table values can reach {world_size} * "
                f"granularity {self.granularity} = {world_size * self.granularity}, more than "
                f"{top}, the largest {self.sum_bits}-bit sum (sum_bits={self.sum_bits}); raise "
                f"sum_bits or lower granularity to <= {top // world_size}")
        return {"seed": int(seed), "step": 0, "shared_seed": int(shared_seed),
                "world_size": world_size}

    # -- payloads --------------------------------------------------------------------
    def _pack(self, kind: int, grad_dtype, n: int, nbytes: int, device, count: int = 1,
              width: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        extra = _EXTRA.pack(kind, self.bits, int(self.transform), BLOCK_LOG2, self.sum_bits,
                            width, self.granularity, count, self.crc)
        return pack_payload(self.algo_id, grad_dtype, (n,), extra, nbytes, device)

    def _parse(self, payload: torch.Tensor, kinds: Sequence[int], n: Optional[int] = None
               ) -> _Parsed:
        h, fields = unpack_fields(payload, self.algo_id, _EXTRA, "thc")
        x = _Parsed(h, fields)
        mine = (self.bits, int(self.transform), BLOCK_LOG2, self.sum_bits, self.granularity,
                self.crc)
        if (x.bits, x.flags, x.log2b, x.cap, x.g, x.crc) != mine:
            raise PayloadError(
                f"thc payload from bits={x.bits}, transform={bool(x.flags & 1)}, block 2^"
                f"{x.log2b}, sum_bits={x.cap}, granularity={x.g}, table crc {x.crc:#x}; this "
                f"THC has {mine[0]}, {bool(mine[1])}, 2^{mine[2]}, {mine[3]}, {mine[4]}, "
                f"{mine[5]:#x} (all ranks must use the same parameters and table)")
        if x.kind not in kinds:
            names = {_RANGE: "range (round 0)", _INDEX: "indices (round 1)", _SUM: "sums"}
            raise PayloadError(f"thc payload holds {names.get(x.kind, f'kind {x.kind}')}, "
                               f"expected {' or '.join(names[k] for k in kinds)}")
        if x.n < 1 or (n is not None and x.n != n):
            raise PayloadError(f"thc payload has shape {x.h.shape}, expected "
                               f"({n if n is not None else 'n >= 1'},)")
        if x.count < 1 or (x.kind != _SUM and x.width) or (x.kind == _INDEX and x.count != 1) or (
                x.kind == _SUM and x.width != sum_width(x.count, x.g, x.cap)):
            raise PayloadError(f"thc payload declares {x.count} summed payloads of width "
                               f"{x.width}, inconsistent with its kind {x.kind}")
        lay = _Layout(x.n, x.bits, bool(x.flags & 1))
        want = {_RANGE: 8 * lay.k * lay.nstat, _INDEX: lay.index_nbytes,
                _SUM: lay.sum_nbytes(x.width) if x.width else -1}[x.kind]
        if x.body.numel() != want:
            raise PayloadError(f"thc body has {x.body.numel()} bytes, expected {want} for "
                               f"{x.n} elements (kind {x.kind}; truncated or padded?)")
        return x

    def round_nbytes(self, numel: int, rnd: int) -> int:
        """Exact size of a rank's round-0 (range) or round-1 (indices) payload."""
        lay = _Layout(numel, self.bits, self.transform)
        body = 8 * lay.k * lay.nstat if rnd == 0 else lay.index_nbytes
        return header_nbytes(1, _EXTRA.size) + body

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Bytes a rank sends per step: round 0 plus round 1 (the shape travels as (n,))."""
        return self.round_nbytes(numel, 0) + self.round_nbytes(numel, 1)

    # -- rounds ----------------------------------------------------------------------
    def encode_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> Tuple[torch.Tensor, State]:
        """Round 0: per-block norms or ranges. Round 1: the b-bit indices (module docstring).

        Args:
            r: 0 or 1.
            grad: this rank's gradient (the same tensor in both rounds; not modified).
            state: from ``init``; round 1 adds the merged range for ``decode_rounds``.
            aggregate: None in round 0; the merged round-0 payload in round 1.

        Raises:
            ValueError: NaN/Inf, bad round, rounds out of order.
            PayloadError: a malformed or foreign aggregate, or one merging fewer
                than N ranks.
        """
        check_gradient(grad, nonfinite="ignore")  # NaN/Inf: caught by the block statistics
        x = grad.detach().reshape(-1)
        lay = _Layout(x.numel(), self.bits, self.transform)
        if r == 0:
            stats = self._stats(x, lay)
            payload, body = self._pack(_RANGE, grad.dtype, lay.n, stats.numel() * 8, x.device)
            body.view(torch.float64).copy_(stats.reshape(-1))
            return payload, dict(state)
        if r != 1:
            raise ValueError(f"thc has rounds 0 and 1, asked for round {r}")
        stats, dseed = self._range(aggregate, lay, state)
        dev, cdt, g = x.device, compute_dtype(x.dtype), self.granularity
        seed = torch.tensor(_as_i32(mix_seed(rank_step_seed(int(state["seed"]),
                                                            int(state["step"])))),
                            dtype=torch.int32, device=dev)
        zero = torch.zeros((), dtype=torch.int32, device=dev)
        payload, body = self._pack(_INDEX, grad.dtype, lay.n, lay.index_nbytes, dev)
        x = x.contiguous()
        if self.transform:
            # a = H D x * g / (2 t_p ||x_j||max) + g/2, i.e. [m, M] = +-t_p ||x||max / sqrt(B)
            norm = stats[:, 0]
            scale = torch.where(norm > 0, g / (2 * self.t_p * norm), 0.0).to(cdt)
            bufs = (workspace(lay.n, cdt, dev, "thc-a"), workspace(lay.n, cdt, dev, "thc-b"))
            y = forward_rht(x, scale, _sign_key(dseed), bufs, lay.full, lay.tails)
            s, o = torch.ones((), dtype=cdt, device=dev), torch.tensor(g / 2, dtype=cdt,
                                                                          device=dev)
        else:  # a = (x - m) g / (M - m) for the global [m, M] (Alg. 1)
            hi, lo = float(stats[0, 0]), -float(stats[0, 1])
            sc = g / (hi - lo) if hi > lo else 0.0
            y = x
            s = torch.tensor(sc, dtype=cdt, device=dev)
            o = torch.tensor(-lo * sc, dtype=cdt, device=dev)
        spec = (self.bits, g, self._phi, cdt)
        words = view_as_dtype(body, torch.int32)
        if lay.m:
            _K_QUANT(y[: lay.m * lay.planes], words[: lay.m], s, o, seed, zero, spec=spec)
        if lay.rest:  # the last word: element m * planes + f in field f, zero codes after
            a = torch.zeros(lay.planes, dtype=cdt, device=dev)
            a[: lay.rest] = (y[lay.m * lay.planes:].to(cdt) * s + o).clamp(0.0, float(g))
            _K_QUANT.eager(spec)(a, words[lay.m:], s * 0 + 1, o * 0, seed,
                                 zero + lay.m * lay.planes)
        return payload, dict(state, thc_stats=stats, thc_dseed=dseed)

    def _range(self, aggregate: Optional[torch.Tensor], lay: _Layout, state: State
               ) -> Tuple[torch.Tensor, int]:
        """The merged round-0 payload's statistics (nstat, k) and the step's shared seed.

        The aggregate must merge every rank's range, or, under partial
        aggregation, ``state[CONTRIBUTORS]`` of them.
        """
        if aggregate is None:
            raise ValueError("thc round 1 needs the merged round-0 payload (the range)")
        agg = self._parse(aggregate, (_RANGE,), lay.n)
        part = state.get(CONTRIBUTORS)
        ws = int(part or state.get("world_size") or 1)
        if agg.count != ws:
            what = f"the step's {ws} contributors" if part else f"world_size={ws}"
            raise PayloadError(f"thc round-0 aggregate merges {agg.count} ranks' ranges, "
                               f"expected {what}")
        return view_as_dtype(agg.body, torch.float64).view(lay.nstat, lay.k).clone(), \
            step_seed(state)

    def absent_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> State:
        """Sit this step out (partial aggregation): round 1 keeps the contributors'
        merged range and the step's seed, all ``decode_rounds`` needs to decode
        their sum; round 0 changes nothing. ``grad`` gives only the size.

        Raises:
            ValueError: bad round; PayloadError: a malformed round-0 aggregate.
        """
        if r == 0:
            return dict(state)
        if r != 1:
            raise ValueError(f"thc has rounds 0 and 1, asked for round {r}")
        stats, dseed = self._range(aggregate, _Layout(grad.numel(), self.bits, self.transform),
                                   state)
        return dict(state, thc_stats=stats, thc_dseed=dseed)

    def _stats(self, x: torch.Tensor, lay: _Layout) -> torch.Tensor:
        """Round 0's float64 (nstat, k): per block ||x_j||, or the global (max, -min)."""
        if not self.transform:
            lo, hi = _fused_minmax(x.contiguous())
            stats = torch.stack([hi.double(), -lo.double()]).view(1, 2)
        else:
            cdt = compute_dtype(x.dtype)
            parts = [x[: lay.full].view(-1, BLOCK)] if lay.full else []
            start = lay.full
            for size in lay.tails:
                parts.append(x[start: start + size].view(1, size))
                start += size
            norms = []
            for v in parts:
                s = torch.linalg.vector_norm(v, dim=1, dtype=cdt)
                if not bool(torch.isfinite(s).all()):  # NaN/Inf, or float32 squares overflowed
                    check_gradient(x, nonfinite="always")
                    s = torch.linalg.vector_norm(v.double(), dim=1)
                norms.append(s.to(torch.float64))
            stats = torch.cat(norms).view(-1, 1)
        if not bool(torch.isfinite(stats).all()):
            check_gradient(x, nonfinite="always")  # raises the standard NaN/Inf error
        return stats

    def merge_round(self, r: int, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Round 0: elementwise max of the ranges. Round 1: the exact integer sum of
        T[z] over index payloads and of partial sums, in any mix (module docstring).

        Raises:
            ValueError: no payloads or a bad round.
            PayloadError: malformed, foreign or mismatched payloads, or a sum that
                would overflow ``sum_bits``.
        """
        if not payloads:
            raise ValueError("thc merge needs at least one payload")
        if r not in (0, 1):
            raise ValueError(f"thc has rounds 0 and 1, asked for round {r}")
        kinds = (_RANGE,) if r == 0 else (_INDEX, _SUM)
        first = self._parse(payloads[0], kinds)
        ps = [first] + [self._parse(p, kinds, first.n) for p in payloads[1:]]
        count = sum(p.count for p in ps)
        dev = payloads[0].device
        if r == 0:
            out, body = self._pack(_RANGE, first.h.dtype, first.n, first.body.numel(), dev,
                                   count)
            acc = body.view(torch.float64)
            acc.copy_(view_as_dtype(first.body, torch.float64))
            for p in ps[1:]:
                torch.maximum(acc, view_as_dtype(p.body, torch.float64), out=acc)
            return out
        width = sum_width(count, self.granularity, self.sum_bits)
        if not width:
            raise PayloadError(f"thc: a sum of {count} payloads can reach {count} * "
                               f"{self.granularity}, more than sum_bits={self.sum_bits} hold")
        lay = _Layout(first.n, self.bits, self.transform)
        out, body = self._pack(_SUM, first.h.dtype, first.n, lay.sum_nbytes(width), dev,
                               count, width)
        dst = body.view(torch.int32)
        kinds_w = tuple(0 if p.kind == _INDEX else p.width for p in ps)
        words = [view_as_dtype(p.body, torch.int32) for p in ps]
        lanes = 32 // width
        spec = (kinds_w, self.bits, width, self._tz)
        arrays = lay.planes // lanes
        # 4-bit indices into 8-bit sums (N g <= 255) on the CPU: one table lookup per
        # 16 values (``_c.thc_merge_b4w8``); the tail word stays on the kernel below
        native = (lay.m > 0 and self.bits == 4 and width == 8 and self._tab8 is not None
                  and all(k in (0, 8) for k in kinds_w)
                  and _native.usable(body, *[p.body for p in ps]))
        if native:
            _c.thc_merge_b4w8([w[: lay.m] for k, w in zip(kinds_w, words) if not k],
                                   [w for k, w in zip(kinds_w, words) if k], self._tab8, dst,
                                   lay.m)
        for h in range(arrays):  # output array h: fields h * lanes + l of the index words
            k0 = h * lanes
            args = []
            for kind, w in zip(kinds_w, words):
                in_lanes = 32 // (kind or self.bits)
                arr = k0 // in_lanes if kind else 0  # index payloads have one array
                bits_per = kind or self.bits
                args.append((w, arr, torch.tensor(bits_per * (k0 % in_lanes), dtype=torch.int32,
                                                  device=dev)))
            if lay.m and not native:
                _K_MERGE(dst[h * lay.m: (h + 1) * lay.m],
                         *[t for w, arr, sh in args for t in (w[arr * lay.m: (arr + 1) * lay.m],
                                                               sh)],
                         spec=spec, numel=lay.m * lanes)
            if lay.rest:  # the tail word group: array h at arrays * m + h
                _K_MERGE.eager(spec)(
                    dst[arrays * lay.m + h: arrays * lay.m + h + 1],
                    *[t for (w, arr, sh), kind in zip(args, kinds_w)
                      for t in (w[self._tail_word(lay, kind, arr)][None], sh)])
        return out

    def _tail_word(self, lay: _Layout, kind: int, arr: int) -> int:
        """Index of array ``arr``'s tail word in a body of ``kind`` (0: indices)."""
        if not kind:
            return lay.m
        return (lay.planes * kind // 32) * lay.m + arr

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """``merge_round`` of the payloads' round (ranges: max; indices and sums: sum)."""
        if not payloads:
            raise ValueError("thc merge needs at least one payload")
        first = self._parse(payloads[0], (_RANGE, _INDEX, _SUM))
        return self.merge_round(0 if first.kind == _RANGE else 1, payloads)

    def decode_rounds(self, grad: torch.Tensor, state: State, aggregate: torch.Tensor,
                      out: Optional[torch.Tensor] = None,
                      average: bool = False) -> Tuple[torch.Tensor, State]:
        """The sum (or, with ``average``, the mean over N) of the ranks' gradients.

        Args:
            grad: this rank's gradient (its shape and dtype; ``out`` may be it).
            state: the state round 1 returned (it holds the merged range).
            aggregate: the merged round-1 payload (sums; or one rank's indices).
            out: optional contiguous tensor of grad's dtype and size to write into.
            average: divide by ``state["world_size"]`` (the engine does).

        Returns:
            (the result in grad's shape and dtype, the state with ``step`` + 1).

        Raises:
            ValueError: round 1 did not run for this state; ``average`` with a
                sum of other than N payloads.
            PayloadError: a malformed or foreign aggregate.
        """
        stats = state.get("thc_stats")
        if not isinstance(stats, torch.Tensor):
            raise ValueError("thc decode_rounds before encode_round(1) of this step (the state "
                             "has no merged range); run the rounds in order")
        x = self._parse(aggregate, (_INDEX, _SUM), grad.numel())
        if x.kind == _INDEX:
            x = self._parse(self.merge_round(1, [aggregate]), (_SUM,))
        ws = int(state.get("world_size") or 1)
        if average and x.count != ws:
            raise ValueError(f"thc: the aggregate sums {x.count} payloads; averaging over "
                             f"world_size={ws} needs all of them")
        lay, c, g = _Layout(x.n, self.bits, self.transform), x.count, self.granularity
        div, dev = (ws if average else 1), grad.device
        res = (decode_output(x.h, out, dev) if out is not None
               else torch.empty(grad.shape, dtype=grad.dtype, device=dev))
        flat = res.view(-1)
        if self.transform:  # x = D H (2Y - c g) t_p ||x||max / (g B) / div
            exact32 = BLOCK * c * g < 2**24 and grad.dtype != torch.float64
            ddt = torch.float32 if exact32 else torch.float64
            dscale = (self.t_p * stats[:, 0] / (g * div)).to(ddt)
            bufs = (workspace(lay.n, ddt, dev, "thc-a"), workspace(lay.n, ddt, dev, "thc-b"))
            cg = torch.tensor(float(c * g), dtype=ddt, device=dev)
            self._per_field(x, lay, _K_CENTER, (x.width, ddt), bufs[0], cg)
            inverse_rht(bufs, flat, dscale, _sign_key(int(state["thc_dseed"])), lay.full,
                        lay.tails)
        else:  # x = c m + Y (M - m) / g, / div
            cdt = compute_dtype(grad.dtype)
            hi, lo = float(stats[0, 0]), -float(stats[0, 1])
            mul = torch.tensor((hi - lo) / (g * div), dtype=cdt, device=dev)
            add = torch.tensor(c * lo / div, dtype=cdt, device=dev)
            self._per_field(x, lay, _K_AFFINE, (x.width, cdt), flat, mul, add)
        new = {k: v for k, v in state.items() if k not in ("thc_stats", "thc_dseed")}
        new["step"] = int(state.get("step", 0)) + 1
        return res.view(grad.shape), new

    @staticmethod
    def _per_field(x: _Parsed, lay: _Layout, kernel: Kernel, spec: Tuple[Any, ...],
                   out: torch.Tensor, *extra: torch.Tensor) -> None:
        """``kernel`` on each field of a sum body, writing elements in order into ``out``:
        field k (array k // lanes, lane k % lanes) holds elements k m, ..., (k + 1) m - 1."""
        words = view_as_dtype(x.body, torch.int32)
        lanes = 32 // x.width
        arrays, m = lay.planes // lanes, lay.m
        for k in range(lay.planes):
            arr, lane = divmod(k, lanes)
            sh = torch.tensor(x.width * lane, dtype=torch.int32, device=words.device)
            if m:
                kernel(words[arr * m: (arr + 1) * m], out[k * m: (k + 1) * m], sh, *extra,
                       spec=spec)
            if k < lay.rest:
                e = m * lay.planes + k
                kernel.eager(spec)(words[arrays * m + arr][None], out[e: e + 1], sh, *extra)

    # -- single round: not an algorithm of its own --------------------------------------
    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """THC needs its range round: use ``encode_round`` (the engine runs both rounds)."""
        raise TypeError("thc has two rounds (a range exchange, then the indices); drive it "
                        "with encode_round/merge_round/decode_rounds, as the engine does")

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """See ``encode``: a THC sum decodes only with its step's range (``decode_rounds``)."""
        raise TypeError("thc payloads decode with decode_rounds (they need the step's range)")


class _THCKernels(Kernels):
    """THC's sums are wider than its indices (``capabilities.merge_widens``)."""

    def merged_nbytes(self, nbytes: int, n: int) -> int:
        """Size of ``merge_round(1)`` of ``n`` round-1 index payloads of ``nbytes`` each.

        Each b-bit field becomes a ``sum_width(n, g, sum_bits)``-bit lane, so the
        body grows by w / b (the header keeps its size).
        """
        c: THC = self.comp  # type: ignore[assignment]
        head = header_nbytes(1, _EXTRA.size)
        width = sum_width(n, c.granularity, c.sum_bits)
        if not width:
            raise ValueError(f"thc: {n} payloads overflow sum_bits={c.sum_bits}")
        return head + (nbytes - head) * width // c.bits


THC.kernels_class = _THCKernels
