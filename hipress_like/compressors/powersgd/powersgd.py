"""PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019): rank-r gradient compression.

The gradient is viewed as a matrix ``M`` (n x m) and approximated by
``P Q^T`` with ``P`` (n x r) and ``Q`` (m x r), found by one step of subspace
(power) iteration warm-started from the previous step's ``Q``. ``P`` and
``Q`` are linear in ``M``, so the payloads of all ranks can be *summed*
without decoding (``capabilities.aggregatable``), in two rounds.

Matrix view: an ``ndim >= 2`` tensor is ``(shape[0], prod(shape[1:]))``
(PyTorch's ``powerSGD_hook`` does the same). A 0-d or 1-D tensor of ``L``
entries becomes a near-square ``rows = ceil(sqrt(L))``,
``cols = ceil(L / rows)`` matrix, zero-padded at the end (fewer than
``rows`` padding entries); the padding is dropped on decode. The effective
rank is ``min(rank, rows, cols)``.

Two-round protocol (Vogels Alg. 1 with the error feedback of Alg. 2; the
engine runs the rounds, the compressor never communicates):

    round 0  encode_round(0, grad, state, None)
             Q = orthogonalize(Q_prev)              (warm start, Sec. 3)
             M = grad + e                          (Alg. 2: error feedback)
             payload P = M Q                       (Alg. 1 line 2)
    engine   sums the round-0 payloads of all N ranks with ``merge``
    round 1  encode_round(1, grad, state, sum_P)
             P^ = orthogonalize(sum_P)              (line 4; scale is irrelevant)
             payload Q = M^T P^                     (line 5)
    engine   sums the round-1 payloads with ``merge``
    decode   decode_rounds(grad, state, sum_Q)
             returns P^ sum_Q^T  -- the SUM over ranks; the engine divides by N
             e   = M - P^ (sum_Q / N)^T             (local error vs. the average)
             Q_prev = sum_Q / N                     (warm start of the next step)

The error is the local matrix minus the *averaged* approximation, as in the
reference implementation (epfml/powersgd ``RankKReducer``: ``mem = tensor -
out``) and PyTorch's ``powerSGD_hook`` (``error = input_tensor_cp -
input_tensor`` after dividing the summed Q by the world size).

Factored error (why: on a memory-bound CPU every pass over the matrix
costs as much as a matmul with rank 4). The state keeps ``e`` as
``state["error"] - state["error_p"] @ state["q"]^T``: decode leaves M in the
error buffer and records ``P^``; the next round 0 forms
``M = grad + (error - P^ Q^T)`` (rounded as the explicit ``e`` would be)
and computes ``P = M Q`` in the same sweep (``lowrank.powersgd_form_m``), and
decode writes ``P^ Q^T`` with one write of ``out``
(``lowrank.powersgd_lowrank``).

Summation order: on float32 CPU tensors every product and Gram-Schmidt
sums in the lane order of CompLL's matrix operators (``compll/matrices.py``;
``lowrank.py``), so the CompLL program ``powersgd.compll`` gives these
payloads, states and decodes byte for byte, and the order depends on no
library, thread count or address. Per step the matrix is swept by
the NaN check, by round 0 (read grad and the buffer, write the buffer), by
``M^T P^`` and by the decode's write, instead of two more passes for
``M = grad + e`` and ``e = M - P^ Q^T``. ``PowerSGD.error(state)`` returns
``e`` itself.

Error memory in 16 bits (``error_dtype="bfloat16"``): the three passes over
the matrix that remain are the algorithm's own (M is read again after P's sum
and the decode writes after Q's, and neither can join a pass across a
collective), so what is left to cut is their bytes. With M stored in
bfloat16 (rounded to nearest, ties to even, as torch converts), round 0 reads
half a matrix less and writes half a matrix less, and round 1 reads half a
matrix less: two reads and one and a half writes against float32's three and
two, 30% fewer bytes.
P, Q and the error all take the stored, rounded M; what rounding drops
(about 2^-9 of each entry) leaves the error feedback, the one approximation
this option adds. PyTorch's ``powerSGD_hook`` keeps its error in the
gradient's own dtype, so training in bfloat16 there has the same memory; here
the gradient and the payloads stay float32. The default (None) keeps M in the
accumulator dtype, bit for bit as before.

STATE CONTRACT (the engine honours it):

* ``init(grad, seed=0, world_size=None, shared_seed=0)`` returns
  ``{"error", "error_p", "q", "step", "seed", "shared_seed", "world_size"}``.
* The error feedback memory is ``error - error_p @ q^T`` in the matrix view
  when ``error_p`` is a tensor, else ``error``; read it with
  ``PowerSGD.error(state)``. Code that replaces ``state["error"]`` must set
  ``state["error_p"] = None``.
* ``state["world_size"]`` (int >= 1) must hold the number of ranks whose
  payloads ``merge`` sums, before ``decode_rounds``; it turns the summed Q
  into the average for the error and the warm start. ``encode_round(0)``
  raises if it is missing.
* ``state["shared_seed"]`` must be equal on every rank (default 0; e.g. a
  hash of the gradient name): the first ``Q`` is drawn from the counter RNG
  keyed by it, and every rank must start from the same ``Q`` (Alg. 1 needs
  one common ``Q``; afterwards the warm start keeps them equal because all
  ranks receive the same ``sum_Q``). ``seed`` (which may differ per rank)
  is not used for ``Q``. ``Q`` is created lazily at the first encode, so
  the engine may set ``shared_seed`` after ``init``.
* ``error`` has the gradient's shape (float32 for half-precision grads);
  ``q`` is (m x r) and ``error_p`` (n x r) or None; all three are
  checkpointed with the optimizer state.
* The round-1 and decode calls receive the same ``grad`` as round 0, and
  rounds of one step are not interleaved with another step of the same
  state. ``state["p"]`` carries ``P^`` from round 1 to decode.
* Buffers are reused, not copied: round 0 forms M in the error buffer
  itself (when the matrix view needs no padding), after the gradient
  passed its NaN/Inf check (a bad gradient leaves the state untouched),
  carries it in ``state["m"]`` with ``state["error"] = None``, and
  ``decode_rounds`` keeps the same buffer as the new (factored) error. So
  the state passed to round 0 must not be used again, and a step
  interrupted between round 0 and decode leaves a state without an error
  (the next round 0 raises; reload the checkpoint). A checkpoint is taken
  between steps.
* Double buffering (``detach_state``): a state given ``state["m_buffer"]``
  (a second matrix-sized buffer) has M formed there instead, with the same
  bits and the same traffic, so the state round 0 received keeps its
  tensors and stays valid: the engine keeps it, by reference, to undo a
  step some rank saw NaN/Inf in (``casync.nonfinite``) instead of copying
  the error every step. The key lives for one step (round 0 consumes it).

Single round (``encode``/``decode``): a *local* variant for benchmarks and
engines without rounds: one power-iteration step on the local ``M`` with
error feedback; the payload holds both ``P^`` and ``Q``, ``decode`` returns
``P^ Q^T``. It is not aggregatable (each rank's ``P^`` differs).
``power_iteration`` exposes the matmuls and orthogonalisation alone.

Payloads hold P and Q in float32 (float64 for float64 gradients), so sums
over ranks do not lose precision in half types.
"""
from __future__ import annotations

import math
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...errors import HipressError
from ..base import (
    Capabilities,
    Header,
    PayloadError,
    State,
    accumulator_dtype,
    check_gradient,
    decode_output,
    header_nbytes,
    view_as_dtype,
    workspace,
)
from ..double_buffer import second_buffer
from ..kernels import Kernels
from ..ops import matmul, orthogonalize_, uniform
from ..params import check_bool, check_int, check_str
from ..registry import register
from ..rounds import MultiRoundCompressor
from . import deferred, lowrank

__all__ = ["ErrorMemoryRangeError", "PowerSGD", "matrix_shape", "power_iteration", "ROUND_P",
           "ROUND_Q", "ROUND_LOCAL"]

ROUND_P, ROUND_Q, ROUND_LOCAL = 0, 1, 255
_EXTRA = struct.Struct("<QQQQ")  # round, rows, cols, rank


def matrix_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """The (rows, cols) matrix view of a tensor shape (see the module docstring)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    n = math.prod(shape)
    rows = max(1, math.isqrt(n - 1) + 1) if n > 1 else 1  # ceil(sqrt(n))
    return rows, max(1, -(-n // rows))


def power_iteration(matrix: torch.Tensor, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One PowerSGD step on a local matrix: ``P^ = orth(M Q)``, ``Q' = M^T P^``.

    The compute kernel of PowerSGD alone (Vogels Alg. 1 lines 2, 4, 5,
    without communication), for benchmarks.

    Args:
        matrix: M (n x m).
        q: Q (m x r).

    Returns:
        (P^ with orthonormal columns (n x r), Q' (m x r)).
    """
    p = orthogonalize_(matmul(matrix, q))
    return p, matmul(matrix.t(), p)


class ErrorMemoryRangeError(HipressError, ValueError):
    """PowerSGD's bfloat16 error memory rounded a finite value to Inf."""


class _Parsed:
    __slots__ = ("h", "round", "rows", "cols", "rank", "values")

    def __init__(self, h: Header, rnd: int, rows: int, cols: int, rank: int,
                 values: torch.Tensor) -> None:
        self.h, self.round, self.rows, self.cols, self.rank = h, rnd, rows, cols, rank
        self.values = values


def _check_product(p: torch.Tensor, grad: torch.Tensor,
                   m: Optional[torch.Tensor] = None) -> None:
    """Raise the standard NaN/Inf error when ``grad`` holds NaN/Inf, read off a product
    ``p`` of M (``grad`` + error) with a matrix: every entry of a row of M enters
    that row's products, and NaN * q, Inf * 0 and Inf + (-Inf) are NaN, Inf * q
    is +-Inf (IEEE 754), so a non-finite M gives a non-finite ``p``. Checking the
    small ``p`` (rows x rank) replaces a scan of the gradient; a finite M whose
    product overflowed takes the exact scan, which then lets it pass as before.

    ``m``: the stored M when it is bfloat16, whose rounding turns a finite value
    past bfloat16's largest (about 3.39e38, 2^-8 below float32's) into Inf: the
    error memory would then stay Inf in every later step, so that raises."""
    if not bool(torch.isfinite(p).all()):
        check_gradient(grad, nonfinite="always")
        if m is not None and m.dtype == torch.bfloat16 and not bool(torch.isfinite(m).all()):
            raise ErrorMemoryRangeError(
                "powersgd: the error memory M (gradient + error feedback) passed bfloat16's "
                "range (|M| > 3.39e38) though the gradient is finite; use error_dtype=None "
                "(float32), or find why the gradients grow this large")


@register("powersgd")
class PowerSGD(MultiRoundCompressor):
    """Rank-r PowerSGD with warm start and built-in error feedback.

    Args:
        rank: approximation rank r >= 1 (default 4); clamped to the matrix.
        warm_start: reuse the previous step's Q (default True, Vogels Sec. 3);
            otherwise draw a fresh Q each step from (shared_seed, step).
        error_dtype: None (default: the gradient's accumulator dtype, float32
            for float32 gradients) or ``"bfloat16"``: keep the error memory M in
            16 bits, 30% fewer bytes per step and half the memory (the
            module docstring says what it changes).

    Raises:
        ValueError: rank < 1, or an error_dtype other than None and "bfloat16".

    Example (one rank, the engine's role played by hand):
        >>> c = PowerSGD(rank=2)
        >>> g = torch.randn(64, 32)
        >>> st = c.init(g, world_size=1)
        >>> p0, st = c.encode_round(0, g, st, None)
        >>> p1, st = c.encode_round(1, g, st, c.merge([p0]))
        >>> approx_sum, st = c.decode_rounds(g, st, c.merge([p1]))
    """

    name = "powersgd"
    algo_id = 30
    # P and Q are plain float sums (summable); the first Q must be equal on
    # every rank (shared_randomness); the error is its own memory.
    capabilities = Capabilities("lowrank", aggregatable=True, fixed_size=True, rounds=2,
                                stateful=True, round_reductions=("sum", "sum"),
                                summable=(True, True), shared_randomness=True,
                                keeps_memory=True,
                                checks_finite=True)  # P = M Q (_round_zero)

    def __init__(self, rank: int = 4, warm_start: bool = True,
                 error_dtype: Optional[str] = None) -> None:
        self.rank = check_int("powersgd", "rank", rank, low=1, example=4)
        self.warm_start = check_bool("powersgd", "warm_start", warm_start)
        self.error_dtype = None if error_dtype is None else check_str(
            "powersgd", "error_dtype", error_dtype, choices=("bfloat16",))

    def params(self) -> Dict[str, object]:
        """Constructor parameters (``error_dtype`` only when set, so the reprs that
        checkpoints and plans compare stay those of earlier versions)."""
        out: Dict[str, object] = {"rank": self.rank, "warm_start": self.warm_start}
        if self.error_dtype is not None:
            out["error_dtype"] = self.error_dtype
        return out

    def _m_dtype(self, grad: torch.Tensor) -> torch.dtype:
        """The dtype M (the error memory) is kept in for ``grad``."""
        return torch.bfloat16 if self.error_dtype else accumulator_dtype(grad.dtype)

    # -- state ---------------------------------------------------------------
    def init(self, grad: torch.Tensor, seed: int = 0, world_size: Optional[int] = None,
             shared_seed: int = 0) -> State:
        """Zero error, no Q yet (drawn from ``shared_seed`` at the first encode)."""
        return {"error": torch.zeros(grad.shape, dtype=self._m_dtype(grad), device=grad.device),
                "error_p": None, "q": None, "step": 0, "seed": int(seed),
                "shared_seed": int(shared_seed), "world_size": world_size}

    def _dims(self, shape: Sequence[int]) -> Tuple[int, int, int]:
        rows, cols = matrix_shape(shape)
        return rows, cols, min(self.rank, rows, cols)

    def _initial_q(self, cols: int, r: int, state: State, dtype, device) -> torch.Tensor:
        """Q from the counter RNG keyed by the rank-independent ``shared_seed``.

        Centred uniform entries: any start not orthogonal to the top singular
        subspace converges under power iteration; Q is orthogonalised before use.
        """
        offset = 0 if self.warm_start else int(state.get("step", 0)) * cols * r
        q = uniform(cols * r, int(state.get("shared_seed", 0)), offset, device) - 0.5
        return q.to(dtype).reshape(cols, r)

    def _check_error(self, grad: torch.Tensor, state: State) -> torch.Tensor:
        err = state.get("error")
        if err is None and "m" in state:
            raise ValueError("powersgd: state['error'] is in use as M of a step whose "
                             "decode_rounds never ran (an interrupted step); restore the "
                             "state from a checkpoint")
        return self.state_tensor(state, "error", grad)

    def _pending(self, state: State, rows: int, cols: int):
        """The factors ``(P^, Q^T)`` still to be subtracted from ``state["error"]``, or Nones."""
        p = state.get("error_p")
        if p is None:
            return None, None
        q = state.get("q")
        if (not isinstance(p, torch.Tensor) or not isinstance(q, torch.Tensor)
                or p.dim() != 2 or p.shape[0] != rows or tuple(q.shape) != (cols, p.shape[1])):
            raise ValueError(
                f"powersgd: state['error_p'] ({getattr(p, 'shape', type(p).__name__)}) and "
                f"state['q'] ({getattr(q, 'shape', type(q).__name__)}) must be the ({rows}, r) "
                f"and ({cols}, r) factors of the pending error; set state['error_p'] = None "
                "when replacing state['error']")
        return p, q.t().contiguous()

    def error(self, state: State) -> torch.Tensor:
        """The error feedback memory ``e`` of ``state`` as a new tensor (grad's shape).

        Raises:
            ValueError: the state has no error (a step interrupted after round 0).
        """
        err = state.get("error")
        if not isinstance(err, torch.Tensor):
            raise ValueError("powersgd: the state has no error buffer (a step interrupted "
                             "between round 0 and decode_rounds); restore it from a checkpoint")
        rows, cols = matrix_shape(err.shape)
        p, qt = self._pending(state, rows, cols)
        if p is None:
            return err.clone()
        # e = M - P^ Q^T rounded as decode would have rounded the explicit form (in
        # the factors' dtype: a bfloat16 M widens first, as round 0 widens it)
        approx = torch.empty(rows, cols, dtype=p.dtype, device=err.device)
        lowrank.powersgd_lowrank(p, qt.to(p.dtype), approx)
        return (err.reshape(rows, cols).to(p.dtype) - approx).reshape(err.shape)

    def _matrix(self, grad: torch.Tensor, state: State) -> torch.Tensor:
        """M = grad + error as a fresh (rows, cols) matrix in the compute dtype.

        One allocation: the sum is written into the (zero-padded) matrix itself.
        """
        err = self._check_error(grad, state)
        if state.get("error_p") is not None:
            err = self.error(state)
        acc = accumulator_dtype(grad.dtype)
        rows, cols, _ = self._dims(grad.shape)
        n = grad.numel()
        m = torch.empty(rows * cols, dtype=acc, device=grad.device)
        torch.add(grad.detach().reshape(-1).to(acc), err.reshape(-1).to(acc), out=m[:n])
        m[n:].zero_()
        return m.view(rows, cols)

    def _round_zero(self, grad: torch.Tensor, state: State,
                    q: torch.Tensor) -> Tuple[torch.Tensor, State]:
        """M for the two-round protocol (built once per step) and ``P = M Q``.

        When the matrix view needs no padding and the error buffer is a
        contiguous accumulator, M is formed in the buffer itself, in the
        same sweep as ``P = M Q`` (``lowrank.powersgd_form_m``; no 64 MB
        allocation) and the buffer stays the error after decode. Otherwise M
        is a fresh padded matrix. Either way it travels to round 1 and decode
        in ``state["m"]``.
        """
        err = self._check_error(grad, state)
        rows, cols, _ = self._dims(grad.shape)
        state = dict(state)
        buf = state.pop("m_buffer", None)
        if (rows * cols == grad.numel() and err.dtype == self._m_dtype(grad)
                and err.is_contiguous()):
            p_prev, qt_prev = self._pending(state, rows, cols)
            e = err.view(rows, cols)
            m = e if buf is None else buf.view(rows, cols)
            if p_prev is not None:  # the factors in the compute dtype (q's), whatever M's
                p_prev, qt_prev = p_prev.to(q.dtype), qt_prev.to(q.dtype)
            p = lowrank.powersgd_form_m(e, grad.detach().reshape(rows, cols), p_prev,
                                               qt_prev, q.t().contiguous(), out=m)
            return p, dict(state, m=m, error=None, error_p=None)
        m = self._matrix(grad, state)  # a fresh matrix: the state's tensors stay as they are
        return lowrank.powersgd_mq(m, q), dict(state, m=m, error_p=None)

    def detach_state(self, state: State, spare: Optional[State]) -> Optional[State]:
        """``state`` with ``"m_buffer"`` (see the state contract), for which
        ``spare``'s error buffer is reused when it fits and is free.

        Example:
            >>> c = PowerSGD(rank=1); g = torch.randn(8, 8)
            >>> st = c.init(g, world_size=1); e = st["error"].clone()
            >>> p0, st1 = c.encode_round(0, g, c.detach_state(st, None), None)
            >>> torch.equal(st["error"], e), st1["m"] is not st["error"]
            (True, True)
        """
        err = state.get("error")
        if not isinstance(err, torch.Tensor):
            return None  # mid-step (M in flight): the caller copies as before
        return dict(state, m_buffer=second_buffer(spare, "error", err, state, "m_buffer"))

    @staticmethod
    def _round_matrix(state: State) -> torch.Tensor:
        m = state.get("m")
        if not isinstance(m, torch.Tensor):
            raise ValueError("powersgd: state['m'] is missing: round 0 (encode_round(0)) did not "
                             "run for this state in this step; run the rounds in order")
        return m

    def _q(self, state: State, cols: int, r: int, dtype, device) -> torch.Tensor:
        q = state.get("q")
        if q is None or not self.warm_start:
            q = self._initial_q(cols, r, state, dtype, device)
        elif not isinstance(q, torch.Tensor) or tuple(q.shape) != (cols, r):
            raise ValueError(f"powersgd: state['q'] must be a ({cols}, {r}) tensor, found "
                             f"{getattr(q, 'shape', type(q).__name__)}; the rank or the "
                             "gradient shape changed: create a new state with init()")
        return lowrank.powersgd_orthogonalize(
            q.to(dtype).clone(memory_format=torch.contiguous_format))

    # -- payloads ------------------------------------------------------------
    def _pack(self, rnd: int, grad: torch.Tensor, rows: int, cols: int, r: int,
              mats: Sequence[torch.Tensor]) -> torch.Tensor:
        dt = mats[0].dtype
        nbytes = sum(m.numel() for m in mats) * mats[0].element_size()
        payload, body = self.frame_payload(grad, _EXTRA.pack(rnd, rows, cols, r), nbytes)
        view, off = body.view(dt), 0
        for m in mats:
            view[off: off + m.numel()].copy_(m.reshape(-1))
            off += m.numel()
        return payload

    def _parse(self, payload: torch.Tensor, expect_round: Optional[int] = None,
               like: Optional[torch.Tensor] = None) -> _Parsed:
        def body_nbytes(h: Header, rnd: int, rows: int, cols: int, r: int) -> int:
            if rnd not in (ROUND_P, ROUND_Q, ROUND_LOCAL):
                raise PayloadError(f"powersgd payload has unknown round {rnd}")
            if expect_round is not None and rnd != expect_round:
                raise PayloadError(f"powersgd payload is of round {rnd}, expected "
                                   f"{expect_round}")
            if like is not None and (tuple(h.shape), h.dtype) != (tuple(like.shape), like.dtype):
                raise PayloadError(f"powersgd payload is for shape {h.shape} {h.dtype}, "
                                   f"expected {tuple(like.shape)} {like.dtype}")
            if (rows, cols, r) != self._dims(h.shape):
                raise PayloadError(f"powersgd payload declares a {rows}x{cols} rank-{r} "
                                   f"factorisation; shape {h.shape} with rank {self.rank} "
                                   f"needs {self._dims(h.shape)} (ranks must use the same rank)")
            n = {ROUND_P: rows * r, ROUND_Q: cols * r, ROUND_LOCAL: (rows + cols) * r}[rnd]
            return n * accumulator_dtype(h.dtype).itemsize

        h, (rnd, rows, cols, r) = self.check_payload(payload, _EXTRA, body_nbytes,
                                                     lambda rnd, *_: f" of round {rnd}")
        return _Parsed(h, rnd, rows, cols, r, view_as_dtype(h.body, accumulator_dtype(h.dtype)))

    def round_nbytes(self, shape: Sequence[int], rnd: int, itemsize: int = 4) -> int:
        """Exact payload size of round ``rnd`` (ROUND_P, ROUND_Q or ROUND_LOCAL) for ``shape``."""
        rows, cols, r = self._dims(shape)
        n = {ROUND_P: rows * r, ROUND_Q: cols * r, ROUND_LOCAL: (rows + cols) * r}[rnd]
        return header_nbytes(len(tuple(shape)), _EXTRA.size) + n * itemsize

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Bytes of both rounds for float32, with the near-square matrix view of ``numel``.

        Exact for 1-D tensors; for ``ndim >= 2`` the size depends on
        ``shape[0]``: use ``round_nbytes(shape, ...)``.
        """
        shape = [numel] if ndim <= 1 else list(matrix_shape([numel])) + [1] * (ndim - 2)
        return self.round_nbytes(shape, ROUND_P) + self.round_nbytes(shape, ROUND_Q)

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Sum same-round payloads (P's or Q's) in the given order.

        Raises:
            ValueError: no payloads.
            PayloadError: malformed payloads, or payloads of different rounds/shapes.
        """
        if not payloads:
            raise ValueError("merge needs at least one payload")
        parsed = [self._parse(p) for p in payloads]
        p0 = parsed[0]
        if p0.round == ROUND_LOCAL:
            raise PayloadError("local single-round powersgd payloads cannot be merged; use the "
                               "two-round protocol (encode_round) to aggregate")
        for q in parsed[1:]:
            if (q.round, q.h.shape, q.h.dtype) != (p0.round, p0.h.shape, p0.h.dtype):
                raise PayloadError(f"cannot merge powersgd payloads of round/shape/dtype "
                                   f"{(p0.round, p0.h.shape, p0.h.dtype)} and "
                                   f"{(q.round, q.h.shape, q.h.dtype)}")
        out = payloads[0].clone()
        acc = out[out.numel() - p0.h.body.numel():].view(p0.values.dtype)
        for q in parsed[1:]:
            acc.add_(q.values)
        return out

    # -- two rounds ----------------------------------------------------------
    def encode_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> Tuple[torch.Tensor, State]:
        """Round 0: payload ``P = M Q``. Round 1: payload ``Q = M^T orth(sum P)``.

        Args:
            r: the round, 0 or 1.
            grad: this rank's gradient (the same tensor in both rounds).
            state: this gradient's state. A new dict is returned; round 0 reuses
                the error buffer for M in place (see the state contract).
            aggregate: None for round 0; the merged round-0 payload for round 1.

        Returns:
            (payload, new state).

        Raises:
            ValueError: bad round, missing ``world_size``, state of another shape.
            PayloadError: a malformed or mismatched aggregate.
        """
        rows, cols, rk = self._dims(grad.shape)
        if r == ROUND_P:
            check_gradient(grad)
            self._world_size(state)
            q = self._q(state, cols, rk, accumulator_dtype(grad.dtype), grad.device)
            p, new_state = self._round_zero(grad, state, q)
            _check_product(p, grad, new_state.get("m") if self.error_dtype else None)
            return self._pack(ROUND_P, grad, rows, cols, rk, [p]), new_state
        if r == ROUND_Q:
            if aggregate is None:
                raise ValueError("powersgd round 1 needs the merged round-0 payload (sum of P)")
            agg = self._parse(aggregate, ROUND_P, grad)
            m = self._round_matrix(state)
            p = lowrank.powersgd_orthogonalize(agg.values.reshape(rows, rk).to(
                accumulator_dtype(grad.dtype)).clone(memory_format=torch.contiguous_format))
            payload = self._pack(ROUND_Q, grad, rows, cols, rk, [lowrank.powersgd_mtp(m, p)])
            return payload, dict(state, p=p)
        raise ValueError(f"powersgd has rounds 0 and 1, asked for round {r}")

    def decode_rounds(self, grad: torch.Tensor, state: State, aggregate: torch.Tensor,
                      out: Optional[torch.Tensor] = None,
                      average: bool = False) -> Tuple[torch.Tensor, State]:
        """The SUM over ranks ``P^ sum_Q^T`` (or the average); update e and Q.

        Args:
            grad: this rank's gradient (its shape and dtype; its values were
                taken in round 0, so ``out`` may be ``grad`` itself).
            state: the state returned by round 1.
            aggregate: the merged round-1 payload (sum of Q).
            out: optional tensor of ``grad.numel()`` elements to write the result
                into instead of allocating one (the engine passes the gradient).
            average: return ``P^ (sum_Q / N)^T``, the average over ranks (the
                engine uses it and saves a pass dividing by N).

        Returns:
            (summed, or averaged, approximation in ``grad``'s shape and dtype,
            new state with the new error, ``q = sum_Q / N`` and ``step + 1``).

        Raises:
            ValueError: round 1 did not run for this state, or no ``world_size``.
            PayloadError: a malformed or mismatched aggregate.
        """
        p = state.get("p")
        if not isinstance(p, torch.Tensor):
            raise ValueError("powersgd decode_rounds called before encode_round(1) for this "
                             "state (state['p'] is missing); run the rounds in order")
        n_ranks = self._world_size(state)
        rows, cols, rk = self._dims(grad.shape)
        agg = self._parse(aggregate, ROUND_Q, grad)
        m = self._round_matrix(state)
        acc = p.dtype  # the compute dtype (M's but for a bfloat16 M, whose factors are float32)
        q_sum = agg.values.reshape(cols, rk).to(acc)
        # a true division (a tensor divisor: CUDA turns a Python scalar's into a
        # multiplication by its reciprocal, an ulp off), as the DSL's sum_q / ranks
        q_avg = q_sum / torch.tensor(float(n_ranks), dtype=q_sum.dtype, device=q_sum.device)
        numel = grad.numel()
        if out is not None and out.numel() != numel:
            raise ValueError(f"powersgd: out has {out.numel()} elements, the gradient {numel}")
        new_state = {k: v for k, v in state.items() if k not in ("p", "m")}
        new_state.update(q=q_avg, step=int(state.get("step", 0)) + 1)
        fused = state.get("error") is None  # round 0 formed M in the error buffer
        # P^ Q^T goes straight into ``out`` when it can, else into a buffer (reused when
        # the result is copied into ``out`` anyway). The error is e = M - P^ q_avg^T
        # either way: factored on the fused path (round 0 forms g + (M - P^ q_avg^T)
        # in one sweep), explicit on the padded one
        direct = (fused and out is not None and out.dtype == acc and out.is_contiguous())
        if direct:
            approx = out.view(rows, cols)
        elif out is not None:
            approx = workspace(rows * cols, acc, m.device, "powersgd").view(rows, cols)
        else:
            approx = torch.empty(rows, cols, dtype=acc, device=m.device)
        if fused:  # M stays as the error, factored: e = M - P^ q_avg^T
            qt = (q_avg if average else q_sum).t().contiguous()
            # into a gradient an optimizer step is about to read, the step writes it
            # in its own sweep (deferred.py); else here
            if not (direct and deferred.offer(p, qt, out)):
                lowrank.powersgd_lowrank(p, qt, approx)
            new_state.update(error=m.reshape(grad.shape), error_p=p)
        else:  # a fresh (padded) M: e = M - P^ q_avg^T, kept explicit
            lowrank.powersgd_lowrank(p, q_avg.t().contiguous(), approx)
            err = m.sub_(approx).reshape(-1)[:numel].reshape(grad.shape)
            new_state.update(error=err.to(self._m_dtype(grad)), error_p=None)
            if not average:
                lowrank.powersgd_lowrank(p, q_sum.t().contiguous(), approx)
        if direct:
            return out, new_state
        res = approx.reshape(-1)[:numel].reshape(grad.shape)
        if out is not None:
            return out.reshape(grad.shape).copy_(res), new_state
        return (res if res.dtype == grad.dtype else res.to(grad.dtype)), new_state

    # -- single round (local) -------------------------------------------------
    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Local single-round variant: ``P^ = orth(M Q)``, ``Q' = M^T P^``; send both.

        Error feedback and warm start use the local ``Q'``. Use the two-round
        protocol to aggregate across ranks.
        """
        check_gradient(grad)
        rows, cols, rk = self._dims(grad.shape)
        m = self._matrix(grad, state)
        p, q = power_iteration(m, self._q(state, cols, rk, m.dtype, m.device))
        _check_product(q, grad)
        payload = self._pack(ROUND_LOCAL, grad, rows, cols, rk, [p, q])
        err = (m - matmul(p, q.t())).reshape(-1)[: grad.numel()].reshape(grad.shape)
        return payload, dict(state, error=err.to(self._m_dtype(grad)), error_p=None, q=q,
                             step=int(state.get("step", 0)) + 1)

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``P^ Q^T`` of a local single-round payload, in the original shape and dtype.

        Args:
            payload: a ``ROUND_LOCAL`` payload from ``encode``.
            out: optional buffer to write into (see ``base.decode_output``).

        Raises:
            PayloadError: malformed payload, or a round-0/1 payload (use decode_rounds).
        """
        x = self._parse(payload, ROUND_LOCAL)
        p = x.values[: x.rows * x.rank].reshape(x.rows, x.rank)
        q = x.values[x.rows * x.rank:].reshape(x.cols, x.rank)
        n = x.h.numel
        res = matmul(p, q.t()).reshape(-1)[:n].reshape(x.h.shape).to(x.h.dtype)
        if out is None:
            return res
        return decode_output(x.h, out, payload.device).copy_(res)


class _PowerSGDKernels(Kernels):
    """PowerSGD's payloads merge by summing their values (``capabilities.summable``)."""

    def summable_view(self, payload: torch.Tensor) -> Optional[torch.Tensor]:
        """The P or Q values of a round-0/1 payload as a float view (``merge`` sums them).

        Raises:
            PayloadError: malformed payload or a local single-round payload.
        """
        x = self.comp._parse(payload)
        if x.round == ROUND_LOCAL:
            raise PayloadError("local single-round powersgd payloads are not summable")
        try:
            return x.h.body.view(x.values.dtype)
        except RuntimeError:  # misaligned: a copy would not be a view into the payload
            return None


PowerSGD.kernels_class = _PowerSGDKernels
