"""CompLL's matrix operators and round programs: what they mean, checked and interpreted.

HiPress's Table 4 lists ``matmul(G0, G1)`` and ``decomp(G, o)`` among the
common operators; PowerSGD (Vogels et al. 2019, Alg. 1) needs them, plus
two communication rounds and state that is not gradient-shaped. A *round
program* declares ``@rounds(k)`` and writes ``encode_round0`` ..
``encode_round{k-1}`` and ``decode`` (``rounds_compressor.py`` runs them as
a ``MultiRoundCompressor``; every round's payloads are summed). It may use:

- ``float** m``: a matrix (row-major). Globals of that type are state kept
  across rounds and steps (empty, ``m.size == 0``, until first assigned);
  assignment rebinds (value semantics: no operator writes into its input).
  A global ``float* e`` is gradient-length state, zero at ``init``;
  assigning a matrix to it (or to decode's gradient) keeps the matrix's
  first n elements (row-major): the padding of a 1-D view is dropped.
- ``matrix(x)``: the gradient-length array ``x`` as the gradient's matrix
  view, ``(gradient.rows, gradient.cols)`` as ``powersgd.matrix_shape``
  (an ``ndim >= 2`` tensor is ``(shape[0], prod(shape[1:]))``, a 1-D one
  near-square, zero-padded at the end); ``matrix(x, r, c)``: the first
  ``r c`` elements of ``x`` as an r x c matrix.
- ``m.rows``, ``m.cols``, ``m.T`` (the transpose), ``gradient.rows/cols``.
- ``matmul(a, b)``: ``c[i, j] = sum_l a[i, l] b[l, j]`` in float32 products
  and sums (no fused multiply-add) in *the lane order*: a sum over an index
  ``t`` of ``x_t`` is ``((L0 + L1) + L2) ... + L7`` with
  ``Lc = ((-0 + x_c) + x_{c+8}) + x_{c+16} ...``, each lane left to right.
  ``-0`` is the additive identity (``-0 + x == x`` for every x, signed zeros
  included), so an empty lane changes nothing and a sum of at most 8 terms
  is ``x_0 + x_1 + ...`` left to right (with inner size r <= 8, the
  hand-written decode's outer-product sum, ``lowrank._outer_sum``). Eight
  lanes are one AVX register, so the long sums vectorise without
  reassociating, and the order depends on nothing but the index. This
  fixed order is the operator's definition: the interpreter, the C, the CUDA
  and the hand-written PowerSGD's float32 CPU kernels
  (``powersgd/powersgd.c``) agree bit for bit.
- ``orthogonalize(a)``: Gram-Schmidt on the columns as ``ops.orthogonalize_``
  (Vogels Alg. 1 "ORTHOGONALIZE"): for column i, ``d = a[:, :i]^T col``,
  ``col -= a[:, :i] d``, ``col /= sqrt(sum col^2) + 1e-8``, every sum (over
  rows, or over the earlier columns) in the lane order, in float32.
- ``map(a, f)`` / ``map(a, b, f)`` on matrices of one shape: elementwise.
- ``random<float>(lo, hi)`` in a function mapped over ``range(n)``: element
  i of the counter stream keyed by the state's ``shared_seed`` (equal on
  every rank), so every rank draws the same initial matrix.
- in the entry points, ``step`` (int64, the state's step counter) and
  ``world_size`` (int64, the number of ranks whose payloads are summed).

Round i > 0 receives the merged payload of round i - 1 as ``aggregate`` and
reads it with ``extract``; ``decode`` receives the last round's merged
payload and assigns the gradient (a matrix's first n elements).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .syntax import Node, Type

__all__ = ["matrix_shape", "matmul", "orthogonalize", "check_field", "check_matrix",
           "check_matmul", "check_orthogonalize", "check_map2", "interp_matrix",
           "interp_matmul", "interp_orthogonalize", "interp_field", "ORTHO_EPS",
           "round_capabilities", "first_n"]

MAT = Type("float", True, None, None, True)
I64 = Type("int64")
#: Gram-Schmidt's guard against a zero column (``ops.orthogonalize_``'s eps), as float32.
ORTHO_EPS = 1e-8


def matrix_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """The (rows, cols) matrix view of a tensor shape: ``powersgd.matrix_shape``'s rule."""
    shape = tuple(int(s) for s in shape)
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    n = math.prod(shape)
    rows = max(1, math.isqrt(n - 1) + 1) if n > 1 else 1
    return rows, max(1, -(-n // rows))


# ---------------------------------------------------------------- definitions (torch)
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32, each sum in the lane order (the module docstring).

    Vectorised over the output, sequential over the inner index.
    """
    n, k = a.shape
    k2, m = b.shape
    if k != k2:
        raise ValueError(f"matmul of a {n}x{k} and a {k2}x{m} matrix: the inner sizes differ")
    a, b = a.to(torch.float32), b.to(torch.float32)
    if k == 0:
        return torch.zeros(n, m, dtype=torch.float32)
    if n * m <= k:  # few outputs, a long sum: loop over the outputs' columns instead
        out = torch.empty(n, m, dtype=torch.float32)
        for j in range(m):
            out[:, j] = _lane_dot(a, b[:, j])
        return out
    lanes = [torch.full((n, m), -0.0, dtype=torch.float32) for _ in range(min(k, 8))]
    for t in range(k):
        lanes[t & 7] = lanes[t & 7] + a[:, t:t + 1] * b[t:t + 1, :]
    return _lanes_total(lanes)


def _lanes_total(lanes: List[torch.Tensor]) -> torch.Tensor:
    """``((L0 + L1) + L2) ...``: the lanes summed left to right (an absent lane is -0)."""
    acc = lanes[0]
    for x in lanes[1:]:
        acc = acc + x
    return acc


def _lane_dot(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``a @ v`` for each row of ``a``, in the lane order (float32)."""
    k = a.shape[1]
    lanes = [torch.full((a.shape[0],), -0.0, dtype=torch.float32) for _ in range(min(k, 8))]
    for t in range(k):
        lanes[t & 7] = lanes[t & 7] + a[:, t] * v[t]
    return _lanes_total(lanes) if lanes else torch.full((a.shape[0],), -0.0)


def _lane_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of a 1-D float32 tensor in the lane order (-0 when empty)."""
    return _lane_dot(x.reshape(1, -1), torch.ones(x.numel(), dtype=torch.float32))[0]


def orthogonalize(a: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of a copy of ``a`` (``ops.orthogonalize_``'s steps, with
    every sum in the lane order in float32; see the module docstring)."""
    m = a.to(torch.float32).clone()
    rows, cols = m.shape
    if rows == 0:
        return m
    for i in range(cols):
        col = m[:, i]
        if i:
            prev = m[:, :i]
            d = _lane_dot(prev.t().contiguous(), col)  # (i,)
            t = _lane_dot(prev, d)                     # (rows,)
            col = col - t
        sq = col * col
        # sqrtf's correctly rounded float32 root (through float64, which rounds once more
        # harmlessly); torch.sqrt of a float32 scalar is not always correctly rounded
        norm = torch.sqrt(_lane_sum(sq).double()).float()
        m[:, i] = col / (norm + torch.tensor(ORTHO_EPS, dtype=torch.float32))
    return m


def first_n(m: torch.Tensor, n: int) -> torch.Tensor:
    """A matrix's first ``n`` elements in row-major order (a matrix view's gradient)."""
    if m.numel() < n:
        raise ValueError(f"a {tuple(m.shape)} matrix has fewer than the gradient's {n} "
                         "elements")
    return m.reshape(-1)[:n].clone()


def round_capabilities(decl: Dict[str, Any], k: int) -> Any:
    """The ``Capabilities`` of a k-round program: its ``@capabilities`` plus k summed rounds."""
    from ..base import Capabilities
    decl = dict(decl)
    decl.setdefault("category", "lowrank")
    decl.update(rounds=k, round_reductions=("sum",) * k, summable=(True,) * k)
    decl.setdefault("aggregatable", True)
    decl.setdefault("stateful", True)
    return Capabilities(**decl)


# ---------------------------------------------------------------- checker
def _is_gradient(ck: Any, a: Node) -> bool:
    f = ck.cur
    if f is None or a.kind != "var":
        return False
    pos = 0 if f.name == "encode_round0" else 1
    return len(f.params) > pos and f.params[pos][1] == a.args[0] and f.name in ck.entries \
        and f.name != "decode"


def check_field(ck: Any, e: Node, scope: Any) -> Type:
    """``.rows``, ``.cols`` (of a matrix or the gradient) and ``.T`` (of a matrix)."""
    obj, fname = e.args
    t = ck._expr(obj, scope)
    if fname == "T":
        if not t.matrix:
            raise ck.p.error(f".T transposes a matrix (float**), found {t}", e)
        return t
    if t.matrix or (t.array and _is_gradient(ck, obj)):
        return I64
    raise ck.p.error(f".{fname} of {t}: rows and cols belong to matrices and to the "
                     "gradient (its matrix view)", e)


def check_matrix(ck: Any, e: Node, args: List[Node], scope: Any) -> Type:
    """``matrix(x)`` (the gradient's view of a gradient-length array) or ``matrix(x, r, c)``."""
    t = ck._expr(args[0], scope)
    if not t.array or t.matrix or t.name != "float":
        raise ck.p.error(f"matrix views a float* array, found {t}", args[0])
    if len(args) == 2:
        raise ck.p.error("matrix takes an array and, optionally, rows and cols: matrix(x) or "
                         "matrix(x, rows, cols)", e)
    for a in args[1:]:
        if not (ck._expr(a, scope).name in ("int32", "int64", "uint", "bool")
                and not a.ty.array):
            raise ck.p.error(f"matrix's rows and cols are integers, found {a.ty}", a)
    return MAT


def check_matmul(ck: Any, e: Node, args: List[Node], scope: Any) -> Type:
    """``matmul(a, b)`` of two float matrices (inner sizes are checked at run time)."""
    for a in args:
        t = ck._expr(a, scope)
        if not t.matrix:
            raise ck.p.error(f"matmul multiplies matrices (float**; view an array with "
                             f"matrix(x)), found {t}", a)
    return MAT


def check_orthogonalize(ck: Any, e: Node, args: List[Node], scope: Any) -> Type:
    """``orthogonalize(a)`` of a float matrix."""
    t = ck._expr(args[0], scope)
    if not t.matrix:
        raise ck.p.error(f"orthogonalize works on a matrix's columns (float**), found {t}",
                         args[0])
    return MAT


def check_map2(ck: Any, args: List[Node], scope: Any) -> Type:
    """``map(a, b, f)`` on two matrices of one shape: f of an element of each."""
    f = ck.funcs[args[2].args[0]]
    ts = [ck._expr(a, scope) for a in args[:2]]
    for t, a in zip(ts, args):
        if not t.matrix:
            raise ck.p.error(f"map(a, b, f) in a round program works on two matrices of one "
                             f"shape, found {t}", a)
    if len(f.params) != 2 or f.ret is None:
        raise ck.p.error(f"map(a, b, f) calls {f.name} with an element of each matrix: "
                         f"{f.name} must take two scalars and return one", args[2])
    for (pt, pn), t, a in zip(f.params, ts, args):
        ck._assignable(pt, t.elem(), a, f"{f.name}'s {pn!r}")
    if f.uses_random and ck.cur is not None:
        ck.cur.uses_random = True
    return Type(f.ret.name, True, f.ret.bits, None, True)


# ---------------------------------------------------------------- interpreter
def interp_field(it: Any, e: Node, scopes: List[Dict[str, Any]]) -> torch.Tensor:
    """``.rows``, ``.cols``, ``.T`` (the gradient's rows/cols are its matrix view's)."""
    obj, fname = e.args
    v = it._eval(obj, scopes)
    if fname == "T":
        return v.t()
    if v.dim() == 2:
        r, c = v.shape
    else:
        r, c = matrix_shape(it.shape)
    return torch.tensor(r if fname == "rows" else c, dtype=torch.int64)


def interp_matrix(it: Any, e: Node, args: List[Node], scopes: List[Dict[str, Any]]
                  ) -> torch.Tensor:
    """``matrix(x)``: the zero-padded view; ``matrix(x, r, c)``: the first r c elements."""
    x = it._eval(args[0], scopes).reshape(-1).to(torch.float32)
    if len(args) == 1:
        rows, cols = matrix_shape(it.shape)
        if x.numel() != math.prod(it.shape):
            raise ValueError(f"matrix(x) views a gradient-length array; x has {x.numel()} "
                             f"elements, the gradient {math.prod(it.shape)}")
    else:
        rows, cols = (int(it._eval(a, scopes)) for a in args[1:])
        if rows < 0 or cols < 0 or rows * cols > x.numel():
            raise ValueError(f"matrix(x, {rows}, {cols}) needs {rows * cols} elements, x has "
                             f"{x.numel()}")
    out = torch.zeros(rows * cols, dtype=torch.float32)
    k = min(x.numel(), rows * cols)
    out[:k] = x[:k]
    return out.view(rows, cols)


def interp_matmul(it: Any, e: Node, args: List[Node], scopes: List[Dict[str, Any]]
                  ) -> torch.Tensor:
    """``matmul(a, b)`` (the fixed-order definition above)."""
    return matmul(it._eval(args[0], scopes), it._eval(args[1], scopes))


def interp_orthogonalize(it: Any, e: Node, args: List[Node], scopes: List[Dict[str, Any]]
                         ) -> torch.Tensor:
    """``orthogonalize(a)`` (Gram-Schmidt, the fixed-order definition above)."""
    return orthogonalize(it._eval(args[0], scopes))
