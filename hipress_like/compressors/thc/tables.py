"""THC's lookup tables T_{b,g,p}: the exact solver, the JSON format, the shipped tables.

THC (Li et al., "THC: Accelerating Distributed Deep Learning Using Tensor
Homomorphic Compression", NSDI 2024) sends b-bit indices z whose table
values T[z] are integers in {0, ..., g}; the aggregator sums T[z] without
decoding (``thc.py``). Sec. 5.3 and Appendix B choose T to minimise the
variance of stochastic quantization (SQ) of a standard normal truncated to
[-t_p, t_p], t_p = Phi^-1(1 - p/2), on the grid x_i = -t_p + 2 t_p i / g:

    minimise   sum_j  integral_{x_T[j]}^{x_T[j+1]} (a - x_T[j]) (x_T[j+1] - a) phi(a) da
    subject to 0 = T[0] < T[1] < ... < T[2^b - 1] = g,  T[j] integers

The objective is Appendix B's, once the optimal P (SQ between the two
nearest table values, Basat et al. 2021, which Appendix B uses) is plugged
in: the variance of SQ of a between neighbours l <= a <= r is
(a - l)(r - a). It is a sum over *consecutive* table values, so a dynamic
program over the integer grid finds the exact optimum in O(2^b g^2) steps
(the paper enumerates stars-and-bars options instead; both are exact):

    f[k][j] = min_{i < j} f[k-1][i] + cost(i, j),   f[0][0] = 0,  answer f[2^b - 1][g]

with cost(i, j) in closed form from the normal's partial moments
(``interval_cost``). Ties are broken towards the smaller T[k].

JSON format (``FORMAT``, ``VERSION``; ``load`` validates every field, and a
table for other (b, g, p) than asked for is an error):

    {"format": "hipress-like/thc-table", "version": 1, "bits": 4,
     "granularity": 30, "p": 0.03125, "t_p": 2.1538..., "values": [0, ..., 30],
     "objective": <E[SQ variance] of the truncated normal, per coordinate>,
     "solver": "dp-exact-1", "source": "<where (b, g, p) comes from>"}

Shipped tables (``tables/*.json``, solved with ``cli_tables``):

    python -m hipress_like.compressors.thc.cli_tables solve --bits 4 --granularity 30 \\
        --p 1/32 -o hipress_like/compressors/thc/tables/b4_g30_p0.03125.json
    python -m hipress_like.compressors.thc.cli_tables check FILE
    python -m hipress_like.compressors.thc.cli_tables list
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ...errors import HipressError

__all__ = ["FORMAT", "VERSION", "SOLVER", "TABLE_DIR", "MAX_GRANULARITY", "Table",
           "TableError", "t_p", "interval_cost", "objective", "solve", "from_json",
           "load", "dump", "file_name", "shipped", "shipped_tables"]

FORMAT = "hipress-like/thc-table"
VERSION = 1
SOLVER = "dp-exact-1"
TABLE_DIR = Path(__file__).with_name("tables")
#: The solver's cost matrix is (g+1)^2 floats; THC's useful g are <= 51 (Appendix B).
MAX_GRANULARITY = 1023
_BITS = (1, 2, 4, 8)  # index widths that pack into whole bytes (ops.VALID_BITS)
_REQUIRED = ("format", "version", "bits", "granularity", "p", "t_p", "values", "objective",
             "solver")
_OPTIONAL = ("source",)


class TableError(HipressError, ValueError):
    """A THC table file is malformed, or is for other parameters than asked for."""


def t_p(p: float) -> float:
    """THC's truncation threshold ``Phi^-1(1 - p/2)`` (Sec. 5.2), via ``erfinv``.

    ``Phi^-1(q) = sqrt(2) erfinv(2q - 1)``; torch's float64 ``erfinv`` keeps
    scipy out of the library.
    """
    import torch

    v = float(torch.special.erfinv(torch.tensor(1.0 - float(p), dtype=torch.float64)))
    return math.sqrt(2.0) * v


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def interval_cost(lo: float, hi: float) -> float:
    """``integral_lo^hi (a - lo)(hi - a) phi(a) da``: SQ's variance between lo and hi.

    Expanding the product, with m0, m1, m2 the normal's partial moments on
    [lo, hi] (m0 = Phi(hi) - Phi(lo), m1 = phi(lo) - phi(hi),
    m2 = m0 + lo phi(lo) - hi phi(hi)):  -m2 + (lo + hi) m1 - lo hi m0.
    """
    m0 = _cdf(hi) - _cdf(lo)
    m1 = _phi(lo) - _phi(hi)
    m2 = m0 + lo * _phi(lo) - hi * _phi(hi)
    return max(0.0, -m2 + (lo + hi) * m1 - lo * hi * m0)


def _grid(t: float, g: int) -> List[float]:
    return [-t + 2.0 * t * i / g for i in range(g + 1)]


def objective(values: Sequence[int], granularity: int, p: float) -> float:
    """Per-coordinate E[SQ variance] of N(0,1) given |a| <= t_p, quantized to ``values``
    (on the grid of ``granularity``), in units of the standard normal's variance."""
    t = t_p(p)
    x = _grid(t, granularity)
    total = sum(interval_cost(x[a], x[b]) for a, b in zip(values[:-1], values[1:]))
    return total / (_cdf(t) - _cdf(-t))


@dataclass(frozen=True)
class Table:
    """A lookup table T_{b,g,p}: ``values[z]`` is the integer table value of index z."""

    bits: int
    granularity: int
    p: float
    values: Tuple[int, ...]
    objective: float
    t_p: float
    solver: str = SOLVER
    source: str = ""

    def to_json(self) -> Dict[str, Any]:
        """The JSON object of this table (``FORMAT`` version ``VERSION``)."""
        return {"format": FORMAT, "version": VERSION, "bits": self.bits,
                "granularity": self.granularity, "p": self.p, "t_p": self.t_p,
                "values": list(self.values), "objective": self.objective,
                "solver": self.solver, "source": self.source}


def _check_params(bits: Any, granularity: Any, p: Any, err=TableError) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in _BITS:
        raise err(f"bits must be one of {_BITS}, found {bits!r}")
    lo = (1 << bits) - 1
    if (isinstance(granularity, bool) or not isinstance(granularity, int)
            or not lo <= granularity <= MAX_GRANULARITY):
        raise err(f"granularity must be an integer in [2^bits - 1, {MAX_GRANULARITY}] = "
                  f"[{lo}, {MAX_GRANULARITY}] for bits={bits}, found {granularity!r}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 1e-12 <= p < 1:
        raise err(f"p must be a number in [1e-12, 1), found {p!r}")


def solve(bits: int, granularity: int, p: float, source: str = "") -> Table:
    """The optimal table T_{b,g,p} (Sec. 5.3, Appendix B), exactly, by dynamic programming.

    Args:
        bits: b, the index width (1, 2, 4 or 8): 2^b table entries.
        granularity: g >= 2^b - 1, the largest table value.
        p: the clamped fraction; the grid spans [-t_p, t_p].
        source: where this choice of (b, g, p) comes from (kept in the file).

    Returns:
        The table with its objective (E[variance] per coordinate).

    Raises:
        TableError: parameters out of range.
    """
    import torch

    _check_params(bits, granularity, p)
    g, k = granularity, 1 << bits
    x = _grid(t_p(p), g)
    inf = float("inf")
    cost = torch.full((g + 1, g + 1), inf, dtype=torch.float64)
    for i in range(g):
        cost[i, i + 1:] = torch.tensor([interval_cost(x[i], x[j]) for j in range(i + 1, g + 1)],
                                       dtype=torch.float64)
    f = torch.full((g + 1,), inf, dtype=torch.float64)
    f[0] = 0.0
    back = []
    for _ in range(k - 1):
        cand = f.unsqueeze(1) + cost  # cand[i, j]: last value i, next value j
        best, arg = cand.min(0)  # first minimum: ties go to the smaller previous value
        back.append(arg)
        f = best
    values = [g]
    for arg in reversed(back):
        values.append(int(arg[values[-1]]))
    values.reverse()
    if values[0] != 0 or any(a >= b for a, b in zip(values[:-1], values[1:])):
        raise AssertionError(f"solver produced a non-increasing table {values}")
    return Table(bits, g, float(p), tuple(values), objective(values, g, p), t_p(p),
                 SOLVER, source)


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def from_json(obj: Any, where: str = "table",
              expect: Optional[Tuple[int, int, float]] = None) -> Table:
    """Validate a parsed JSON table; ``expect`` = (bits, granularity, p) it must be for.

    Raises:
        TableError: a wrong format tag or version, a missing or unknown field,
            values that are not a strictly increasing 0..g table of 2^b
            integers, a t_p or objective that does not match the values, or
            a table for other parameters than ``expect``.
    """
    if not isinstance(obj, dict):
        raise TableError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    if obj.get("format") != FORMAT:
        raise TableError(f"{where}: format tag is {obj.get('format')!r}, expected {FORMAT!r} "
                         "(not a THC table file)")
    if obj.get("version") != VERSION:
        raise TableError(f"{where}: table format version {obj.get('version')!r} is not "
                         f"supported (this build reads version {VERSION}); re-solve it with "
                         "`python -m hipress_like.compressors.thc.cli_tables solve`")
    missing = [k for k in _REQUIRED if k not in obj]
    unknown = sorted(set(obj) - set(_REQUIRED) - set(_OPTIONAL))
    if missing or unknown:
        raise TableError(f"{where}: missing fields {missing}, unknown fields {unknown}; "
                         f"expected {list(_REQUIRED)} (+ optional {list(_OPTIONAL)})")
    bits, g, p, values = obj["bits"], obj["granularity"], obj["p"], obj["values"]
    _check_params(bits, g, p, lambda m: TableError(f"{where}: {m}"))
    if (not isinstance(values, list) or len(values) != 1 << bits
            or any(isinstance(v, bool) or not isinstance(v, int) for v in values)):
        raise TableError(f"{where}: values must be a list of {1 << bits} integers, found "
                         f"{values!r}")
    if values[0] != 0 or values[-1] != g or any(a >= b for a, b in zip(values[:-1], values[1:])):
        raise TableError(f"{where}: values must increase strictly from 0 to granularity {g} "
                         f"(THC Sec. 4.2: 0 = T[0] < ... < T[2^b - 1] = g), found {values}")
    if not isinstance(obj["t_p"], (int, float)) or not _close(float(obj["t_p"]), t_p(p)):
        raise TableError(f"{where}: t_p {obj['t_p']!r} does not match Phi^-1(1 - p/2) = "
                         f"{t_p(p)!r} for p={p!r}")
    obj_v = objective(values, g, p)
    if not isinstance(obj["objective"], (int, float)) or not _close(float(obj["objective"]),
                                                                      obj_v, 1e-6):
        raise TableError(f"{where}: objective {obj['objective']!r} does not match the values' "
                         f"{obj_v!r}")
    if expect is not None:
        eb, eg, ep = expect
        if (bits, g) != (eb, eg) or not _close(float(p), float(ep), 1e-12):
            raise TableError(f"{where}: table is for bits={bits}, granularity={g}, p={p!r}; "
                             f"expected bits={eb}, granularity={eg}, p={ep!r} (solve one for "
                             "these parameters, or pass matching ones)")
    return Table(bits, g, float(p), tuple(values), float(obj["objective"]), float(obj["t_p"]),
                 str(obj["solver"]), str(obj.get("source", "")))


def load(path: Union[str, Path], expect: Optional[Tuple[int, int, float]] = None) -> Table:
    """Read and validate a table file (JSON, never pickle); see ``from_json``.

    Raises:
        TableError: unreadable, not JSON, or invalid (the message names the file).
    """
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TableError(f"{path}: cannot read a THC table ({type(e).__name__}: {e})") from e
    return from_json(obj, str(path), expect)


def dump(table: Table, path: Union[str, Path]) -> None:
    """Write ``table`` as JSON (sorted keys, one file per (b, g, p))."""
    Path(path).write_text(json.dumps(table.to_json(), indent=1, sort_keys=True) + "\n",
                          encoding="utf-8")


def file_name(bits: int, granularity: int, p: float) -> str:
    """The shipped file name of (b, g, p), e.g. ``b4_g30_p0.03125.json``."""
    return f"b{bits}_g{granularity}_p{float(p)!r}.json"


_shipped: Optional[Dict[Tuple[int, int, float], Table]] = None


def shipped_tables() -> Dict[Tuple[int, int, float], Table]:
    """Every table in ``TABLE_DIR``, validated, keyed by (bits, granularity, p).

    Raises:
        TableError: a shipped file is malformed, or named for other parameters.
    """
    global _shipped
    if _shipped is None:
        out: Dict[Tuple[int, int, float], Table] = {}
        for f in sorted(TABLE_DIR.glob("*.json")):
            t = load(f)
            if f.name != file_name(t.bits, t.granularity, t.p):
                raise TableError(f"{f}: holds the table for bits={t.bits}, granularity="
                                 f"{t.granularity}, p={t.p!r}, which belongs in "
                                 f"{file_name(t.bits, t.granularity, t.p)}")
            out[(t.bits, t.granularity, t.p)] = t
        _shipped = out
    return _shipped


def shipped(bits: int, granularity: int, p: float) -> Table:
    """The shipped optimal table for (b, g, p).

    Raises:
        TableError: none is shipped (the message says how to solve one).
    """
    tables = shipped_tables()
    for (b, g, q), t in tables.items():
        if (b, g) == (bits, granularity) and _close(q, float(p), 1e-12):
            return t
    have = ", ".join(f"(b={b}, g={g}, p={q!r})" for b, g, q in sorted(tables))
    raise TableError(
        f"no shipped THC table for bits={bits}, granularity={granularity}, p={p!r} (shipped: "
        f"{have}); solve one with `python -m hipress_like.compressors.thc.cli_tables solve "
        f"--bits {bits} --granularity {granularity} --p {p!r} -o FILE` and pass table=FILE")
