"""CompLL's type checker: names, arity, types and bit widths, each error located.

It walks a parsed ``Program`` once, resolves every name (globals, the param
block, locals, function parameters), annotates each expression node with its
type (``node.ty``) and rejects, with line and column:

- unknown names, functions and operators (the message lists what exists);
- calls with the wrong number of arguments, a map whose function takes
  another number of elements, a reduce by an unknown reduction;
- type mismatches (an array where a scalar is needed, a bit operation on a
  float, a struct used as a value);
- a ``uint<k>`` wider than its declaration: a width outside {1, 2, 4, 8}, a
  literal larger than 2**k - 1 stored in it, a width parameter whose default
  or choices exceed 8 bits.

Types follow C with two rules of their own (documented in docs/compll.md):
a literal takes the type of the other operand (``x * 0.5`` with float x is
float, as torch does with Python scalars), and unsigned sub-byte values
promote to int32 in arithmetic. Sub-byte arrays are packed HiPress-style,
with no padding but the last byte's (ops.packed_nbytes), in the planar order
of the hand-written quantizers (``_fused``'s rule 1) so payloads match theirs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from . import matrices
from .syntax import Node, Program, Type, find_node

__all__ = ["check", "Checked", "ELEMENTWISE", "OPERATORS", "REDUCTIONS", "VALID_BITS",
           "ARRAY_OPS", "MATRIX_OPS", "is_sparse", "is_rounds", "round_name"]

VALID_BITS = (1, 2, 4, 8)
# elementwise builtins: name -> (min args, max args)
ELEMENTWISE = {"floor": (1, 1), "ceil": (1, 1), "abs": (1, 1), "fabs": (1, 1), "sign": (1, 1),
               "min": (2, 2), "max": (2, 2), "clamp": (3, 3), "rint": (1, 1), "sqrt": (1, 1),
               "exp": (1, 1), "log": (1, 1), "ldexp": (2, 2), "exponent": (1, 1),
               "fma": (3, 3), "pow": (2, 2)}
# common operators of HiPress Table 4 understood here; the others are named in errors
OPERATORS = {"map": (2, 3), "reduce": (2, 3), "concat": (1, 64), "extract": (2, 64),
             "range": (1, 1), "filter": (2, 2), "topk": (3, 3), "threshold": (3, 3),
             "gather": (2, 2), "scatter": (2, 3), "matrix": (1, 3), "matmul": (2, 2),
             "orthogonalize": (1, 1)}
# the sparsification operators (arrays.py): their arrays have data-dependent lengths
ARRAY_OPS = ("filter", "topk", "threshold", "gather", "scatter")
# the matrix operators of round programs (matrices.py): matrix views, products, Gram-Schmidt
MATRIX_OPS = ("matrix", "matmul", "orthogonalize")
_TABLE4_LATER = ("sort", "decomp")
REDUCTIONS = {"smaller": "min", "min": "min", "greater": "max", "max": "max", "add": "sum",
              "sum": "sum", "maxAbs": "maxabs"}
_RANK = {"bool": 0, "uint": 1, "int32": 2, "int64": 3, "float": 4, "double": 5}
BOOL, I32, I64, F32, F64 = Type("bool"), Type("int32"), Type("int64"), Type("float"), Type("double")


@dataclass
class Func:
    """A user function: return type (None: void), parameters, body, its definition node."""

    name: str
    ret: Optional[Type]
    params: List[Tuple[Type, str]]
    body: Node
    node: Node
    uses_random: bool = False


@dataclass
class Checked:
    """A checked program: what the renderers and the interpreter need."""

    prog: Program
    params: List[Tuple[str, Type, Any, Optional[List[Any]]]]  # name, type, default, choices
    param_struct: Optional[str]
    globals: Dict[str, Type]
    funcs: Dict[str, Func]
    encode: Func
    decode: Optional[Func]
    metas: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    uses_random: bool = False
    rounds: List[Func] = field(default_factory=list)  # encode_round0, 1, ... (@rounds(k))


def round_name(i: int) -> str:
    """The entry point of round ``i`` of a round program (``@rounds(k)``)."""
    return f"encode_round{i}"


def _const(prog: Program, node: Node) -> Any:
    """The value of a literal node (metas and param defaults are literals)."""
    if node.kind in ("int", "float", "bool", "str"):
        return node.args[0]
    if node.kind == "unop" and node.args[0] == "-":
        return -_const(prog, node.args[1])
    raise prog.error(f"expected a literal value, found {node.kind}", node)


def is_num(t: Type) -> bool:
    """True for a numeric (or bool) scalar type."""
    return not t.array and t.name in _RANK


def is_int(t: Type) -> bool:
    """True for an integer scalar type (bool and uint<k> included)."""
    return not t.array and t.name in ("bool", "uint", "int32", "int64")


def promote(a: Type, b: Type, wa: bool = False, wb: bool = False) -> Type:
    """The arithmetic type of ``a op b``; ``wa``/``wb``: the operand is a (weak) literal."""
    if wa and not wb:
        return b if _RANK[b.name] >= 4 or _RANK[a.name] < 4 else F32
    if wb and not wa:
        return a if _RANK[a.name] >= 4 or _RANK[b.name] < 4 else F32
    hi = max(_RANK[a.name], _RANK[b.name])
    return {0: I32, 1: I32, 2: I32, 3: I64, 4: F32, 5: F64}[hi]


class _Scope:
    def __init__(self, parent: Optional["_Scope"] = None) -> None:
        self.vars: Dict[str, Type] = {}
        self.parent = parent

    def get(self, name: str) -> Optional[Type]:
        s: Optional[_Scope] = self
        while s is not None:
            if name in s.vars:
                return s.vars[name]
            s = s.parent
        return None


class _Checker:
    def __init__(self, prog: Program) -> None:
        self.p = prog
        self.funcs: Dict[str, Func] = {}
        self.params: List[Tuple[str, Type, Any, Optional[List[Any]]]] = []
        self.param_struct: Optional[str] = None
        self.globals = _Scope()
        self.cur: Optional[Func] = None

    # ------------------------------------------------------------ declarations
    def run(self) -> Checked:
        p = self.p
        metas: Dict[str, Dict[str, Any]] = {}
        for m in p.metas:
            name, args = m.args
            if name not in ("wire", "capabilities", "state", "rounds"):
                raise p.error(f"unknown annotation @{name}; expected @wire(id), @rounds(k) or "
                              "@capabilities(category=..., unbiased=...)", m)
            metas[name] = {(k or str(i)): _const(p, v) for i, (k, v) in enumerate(args)}
        self.n_rounds = 0
        if "rounds" in metas:
            k = metas["rounds"].get("0")
            if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= 8 or \
                    set(metas["rounds"]) != {"0"}:
                raise p.error(f"@rounds takes the number of rounds, 2 to 8: @rounds(2); found "
                              f"{metas['rounds']}", [m for m in p.metas
                                                     if m.args[0] == "rounds"][0])
            self.n_rounds = k
        entries = ("encode", "decode") + tuple(round_name(i) for i in range(self.n_rounds))
        self.entries = entries
        if len(p.params) > 1:
            raise p.error("only one param block is allowed; merge them", p.params[1])
        for blk in p.params:
            self.param_struct = blk.args[0]
            for f in blk.args[1]:
                ty, name, default, choices = f.args
                self._check_type(ty, f)
                dv = None if default is None else _const(p, default)
                cv = None if choices is None else [_const(p, c) for c in choices]
                if ty.name == "uint":
                    lim = (1 << ty.bits) - 1
                    for v in ([dv] if dv is not None else []) + (cv or []):
                        if not isinstance(v, int) or not 0 <= v <= lim:
                            raise p.error(f"param {name!r} is {ty}: values must be integers in "
                                          f"[0, {lim}], found {v!r}", f)
                if cv is not None and dv is not None and dv not in cv:
                    raise p.error(f"param {name!r}: default {dv!r} is not among its choices "
                                  f"{cv}", f)
                self.params.append((name, ty, dv, cv))
        for d in p.globals:
            ty = d.args[0]
            self._check_type(ty, d)
            if ty.array and ty.name != "float":
                raise p.error(f"a global array is per-gradient state (float*, kept between "
                              f"encodes); found {ty}", d)
            if ty.matrix and not self.n_rounds:
                raise p.error("matrices (float**) are the state of round programs: declare "
                              f"the rounds with @rounds(k); found {ty}", d)
            for decl in d.args[1]:
                if decl.args[1] is not None:
                    raise p.error("globals are computed in encode/decode; declare "
                                  f"{decl.args[0]!r} without an initialiser", decl)
                self.globals.vars[decl.args[0]] = ty
        for name, fn in p.functions.items():
            ret, _, params, body, _lam = fn.args
            if name.startswith("encode_round") and name not in entries:
                raise p.error(f"{name} is a round's entry point: declare the rounds with "
                              "@rounds(k) (or name the function otherwise)", fn)
            if ret is not None:
                self._check_type(ret, fn)
                if ret.array or ret.name == "struct":
                    raise p.error(f"function {name!r} returns {ret}: user functions work on "
                                  "one element and return a scalar", fn)
            for t, _n in params:
                self._check_type(t, fn)
                if name not in entries and (t.array or t.name == "struct"):
                    raise p.error(f"parameter {_n!r} of {name!r} is {t}: user functions take "
                                  "scalars (one element each)", fn)
            self.funcs[name] = Func(name, ret, list(params), body, fn)
        if self.n_rounds:
            return self._run_rounds(metas)
        enc = self.funcs.get("encode")
        if enc is None:
            raise p.error("a CompLL program needs an encode function: void encode(float* "
                          "gradient, uint8* compressed, Params params) { ... }")
        self._check_entry(enc, ("float", "uint"), "encode(float* gradient, uint8* compressed"
                          ", Params params)")
        dec = self.funcs.get("decode")
        if dec is not None:
            self._check_entry(dec, ("uint", "float"), "decode(uint8* compressed, float* "
                              "gradient, Params params)")
        # user functions first (their types are needed by map), then the entry points
        for f in self.funcs.values():
            if f.name not in ("encode", "decode"):
                self._func(f)
        for f in (enc, dec):
            if f is not None:
                self._func(f)
        return Checked(p, self.params, self.param_struct, dict(self.globals.vars),
                       self.funcs, enc, dec, metas,
                       any(f.uses_random for f in self.funcs.values()))

    def _run_rounds(self, metas: Dict[str, Dict[str, Any]]) -> Checked:
        """A round program: encode_round0 .. encode_round{k-1} and decode (matrices.py)."""
        p = self.p
        if "encode" in self.funcs:
            raise p.error("a round program (@rounds(k)) has encode_round0, encode_round1, ... "
                          "instead of encode", self.funcs["encode"].node)
        rounds = []
        for i in range(self.n_rounds):
            f = self.funcs.get(round_name(i))
            want = (f"{round_name(i)}(float* gradient, uint8* compressed, Params params)" if i == 0
                    else f"{round_name(i)}(uint8* aggregate, float* gradient, uint8* "
                    "compressed, Params params)")
            if f is None:
                raise p.error(f"@rounds({self.n_rounds}) needs void {want}",
                              [m for m in p.metas if m.args[0] == "rounds"][0])
            kinds = ("float", "uint") if i == 0 else ("uint", "float", "uint")
            self._check_entry(f, kinds, want)
            rounds.append(f)
        dec = self.funcs.get("decode")
        if dec is None:
            raise p.error("a round program needs void decode(uint8* compressed, float* "
                          "gradient, Params params): compressed is the last round's merged "
                          "payload")
        self._check_entry(dec, ("uint", "float"), "decode(uint8* compressed, float* gradient, "
                          "Params params)")
        for f in self.funcs.values():
            if f.name not in self.entries:
                self._func(f)
        for f in rounds + [dec]:
            self._func(f)
        return Checked(p, self.params, self.param_struct, dict(self.globals.vars),
                       self.funcs, rounds[0], dec, metas,
                       any(f.uses_random for f in self.funcs.values()), rounds)

    def _check_entry(self, f: Func, kinds: Tuple[str, ...], want: str) -> None:
        ps = f.params
        k = len(kinds)
        ok = (len(ps) in (k, k + 1) and all(
            t.array and not t.matrix and t.name == want_t for (t, _), want_t in zip(ps, kinds))
              and (len(ps) == k or ps[k][0].name == "struct"))
        if not ok or f.ret is not None:
            raise self.p.error(f"{f.name} must be declared as void {want}", f.node)
        if len(ps) == k + 1 and ps[k][0].struct != self.param_struct:
            raise self.p.error(f"{f.name}'s params are of type {ps[2][0].struct!r}, but the "
                               f"param block is {self.param_struct!r}", f.node)

    def _check_type(self, ty: Type, node: Node) -> None:
        if ty.name == "uint":
            b = ty.bits
            if isinstance(b, int):
                if b not in VALID_BITS:
                    raise self.p.error(f"uint<{b}>: widths must be one of {VALID_BITS} (sub-byte "
                                       "fields pack into bytes)", node)
            elif isinstance(b, Node):
                path = b.args[0]
                name = path[-1]
                entry = [x for x in self.params if x[0] == name]
                if entry:
                    _, pty, dv, cv = entry[0]
                    vals = ([dv] if dv is not None else []) + (cv or [])
                    bad = [v for v in vals if v not in VALID_BITS]
                    if bad:
                        raise self.p.error(f"uint<{'.'.join(path)}> is wider than a byte or not "
                                           f"a valid width: param {name!r} allows {bad}; "
                                           f"widths must be one of {VALID_BITS}", b)
                # else: a local of decode (read from the payload), checked at run time
        if ty.name == "struct" and ty.struct not in (self.param_struct,):
            raise self.p.error(f"unknown type {ty.struct!r}; the param block is "
                               f"{self.param_struct!r}", node)

    # ------------------------------------------------------------ statements
    def _func(self, f: Func) -> None:
        self.cur = f
        scope = _Scope(self.globals)
        if f.name == "encode" and self._sparse_syntax():
            scope.vars["step"] = I64  # the state's encode counter (arrays.py)
        if self.n_rounds and f.name in self.entries:
            scope.vars["step"] = I64  # the state's step counter (matrices.py)
            scope.vars["world_size"] = I64  # the number of ranks whose payloads are summed
        for t, n in f.params:
            scope.vars[n] = t
        self._block(f.body, scope)
        if f.ret is not None and not self._returns(f.body):
            raise self.p.error(f"function {f.name!r} returns {f.ret} but may end without a "
                               "return", f.node)

    def _sparse_syntax(self) -> bool:
        """A program with state arrays or sparse operators (``is_sparse`` before checking)."""
        if self.n_rounds:
            return False
        if any(t.array for t in self.globals.vars.values()):
            return True
        return _calls_array_op([f.body for f in self.funcs.values()])

    def _returns(self, s: Node) -> bool:
        if s.kind == "return":
            return True
        if s.kind == "block":
            return any(self._returns(x) for x in s.args[0])
        if s.kind == "if":
            return s.args[2] is not None and self._returns(s.args[1]) and self._returns(s.args[2])
        return False

    def _block(self, blk: Node, scope: _Scope) -> None:
        inner = _Scope(scope)
        for s in blk.args[0]:
            self._stmt(s, inner)

    def _stmt(self, s: Node, scope: _Scope) -> None:
        k = s.kind
        if k == "block":
            self._block(s, scope)
        elif k == "decl":
            ty = s.args[0]
            self._check_type(ty, s)
            for d in s.args[1]:
                name, init = d.args
                if name in scope.vars:
                    raise self.p.error(f"{name!r} is already declared in this block", d)
                if name == "step" and scope.get("step") == I64 and self.cur is not None and \
                        self.cur.name == "encode" and self._sparse_syntax():
                    raise self.p.error("'step' is the state's encode counter here; choose "
                                       "another name", d)
                if init is not None:
                    self._assignable(ty, self._expr(init, scope), init, name)
                scope.vars[name] = ty
        elif k == "assign":
            lv, op, e = s.args
            if lv.kind == "index":
                raise self.p.error("element assignment is not supported: compute arrays with "
                                   "map over a function", lv)
            name = lv.args[0]
            ty = scope.get(name)
            if ty is None:
                raise self.p.error(f"unknown name {name!r}; declare it first", lv)
            lv.ty = ty
            et = self._expr(e, scope)
            if et.matrix and ty.array and not ty.matrix and self.n_rounds and (
                    name in self.globals.vars or (self.cur is not None and self.cur.name ==
                                                  "decode" and name == self.cur.params[1][1])):
                et = et.elem().of_array()  # gradient-length: the matrix's first n elements
            if op != "=":
                if ty.array:
                    raise self.p.error(f"{op} on an array", lv)
                et = promote(ty, et, False, _weak(e))
            self._assignable(ty, et, e, name)
        elif k == "if":
            c = self._expr(s.args[0], scope)
            if not is_num(c):
                raise self.p.error(f"if needs a scalar condition, found {c}", s.args[0])
            self._stmt(s.args[1], _Scope(scope))
            if s.args[2] is not None:
                self._stmt(s.args[2], _Scope(scope))
        elif k == "return":
            f = self.cur
            assert f is not None
            if f.ret is None:
                if s.args[0] is not None:
                    raise self.p.error(f"{f.name} is void: return takes no value", s)
            else:
                if s.args[0] is None:
                    raise self.p.error(f"{f.name} must return a {f.ret}", s)
                self._assignable(f.ret, self._expr(s.args[0], scope), s.args[0], "return value")
        elif k == "expr_stmt":
            e = s.args[0]
            self._expr(e, scope)
            if not (e.kind == "call" and e.args[0] in ("extract", "scatter")):
                raise self.p.error("an expression statement has no effect; assign its value",
                                   e)
        elif k == "func":
            raise self.p.error("lambda_func must be defined at the top level of the program",
                               s)
        else:  # pragma: no cover - the grammar has no other statement
            raise self.p.error(f"unexpected statement {k}", s)

    def _assignable(self, ty: Type, et: Type, e: Node, what: str) -> None:
        if ty.array != et.array or ty.matrix != et.matrix or ty.name == "struct" or \
                et.name == "struct":
            raise self.p.error(f"type mismatch: {what} is {ty}, the value is {et}", e)
        if ty.array:
            if ty.name != et.name or (ty.name == "uint" and not _same_bits(ty.bits, et.bits)):
                raise self.p.error(f"type mismatch: {what} is {ty}, the array is {et}", e)
            return
        if ty.name == "uint" and isinstance(ty.bits, int) and e.kind == "int":
            if not 0 <= e.args[0] < (1 << ty.bits):
                raise self.p.error(f"{e.args[0]} does not fit in uint<{ty.bits}> (max "
                                   f"{(1 << ty.bits) - 1})", e)

    # ------------------------------------------------------------ expressions
    def _expr(self, e: Node, scope: _Scope) -> Type:
        ty = self._expr_inner(e, scope)
        e.ty = ty
        return ty

    def _expr_inner(self, e: Node, scope: _Scope) -> Type:
        k = e.kind
        p = self.p
        if k == "int":
            return I32
        if k == "float":
            return F32 if e.args[1] == "float" else F64
        if k == "bool":
            return BOOL
        if k == "str":
            raise p.error("strings are only allowed in annotations", e)
        if k == "var":
            name = e.args[0]
            ty = scope.get(name)
            if ty is None:
                for pn, pt, _, _ in self.params:
                    if pn == name:
                        return pt
                known = sorted(set(self._visible(scope)))
                raise p.error(f"unknown name {name!r}; known here: {', '.join(known)}", e)
            if ty.name == "struct":
                raise p.error(f"{name!r} is the parameter block; use {name}.<field>", e)
            return ty
        if k == "field":
            obj, fname = e.args
            if fname == "size":
                ot = self._expr(obj, scope)
                if not ot.array:
                    raise p.error(f".size of a scalar ({ot}); .size applies to arrays", e)
                return I64
            if fname in ("rows", "cols", "T") and self.n_rounds:
                return matrices.check_field(self, e, scope)
            if obj.kind == "var" and (scope.get(obj.args[0]) or Type("")).name == "struct":
                for pn, pt, _, _ in self.params:
                    if pn == fname:
                        return pt
                raise p.error(f"param block has no field {fname!r}; fields: "
                              f"{', '.join(x[0] for x in self.params) or '(none)'}", e)
            raise p.error(f"unknown field .{fname}; only .size, params.<field> and, in round "
                          "programs, .rows, .cols and .T exist", e)
        if k == "index":
            at = self._expr(e.args[0], scope)
            it = self._expr(e.args[1], scope)
            if not at.array:
                raise p.error(f"indexing a scalar ({at})", e)
            if not is_int(it):
                raise p.error(f"an index must be an integer, found {it}", e.args[1])
            return at.elem()
        if k == "cast":
            t = self._expr(e.args[1], scope)
            if not is_num(t):
                raise p.error(f"cannot cast {t} to {e.args[0]}", e)
            return e.args[0]
        if k == "unop":
            op, a = e.args
            t = self._expr(a, scope)
            if not is_num(t):
                raise p.error(f"operator {op} needs a scalar, found {t}", e)
            if op == "!":
                return BOOL
            if op == "~" and not is_int(t):
                raise p.error(f"operator ~ needs an integer, found {t}", e)
            return promote(t, I32) if is_int(t) else t
        if k == "binop":
            op, a, b = e.args
            ta, tb = self._expr(a, scope), self._expr(b, scope)
            for t, n in ((ta, a), (tb, b)):
                if not is_num(t):
                    raise p.error(f"operator {op} needs scalars, found {t}", n)
            if op in ("&&", "||"):
                return BOOL
            if op in ("&", "|", "^", "<<", ">>", "%"):
                for t, n in ((ta, a), (tb, b)):
                    if not is_int(t):
                        raise p.error(f"operator {op} needs integers, found {t}; cast with "
                                      "(int32)", n)
            common = promote(ta, tb, _weak(a), _weak(b))
            e.args = (op, a, b, common)
            if op in ("<", ">", "<=", ">=", "==", "!="):
                return BOOL
            if op in ("<<", ">>"):
                return promote(ta, I32)
            return common
        if k == "cond":
            c, a, b = e.args
            tc = self._expr(c, scope)
            if not is_num(tc):
                raise p.error(f"a condition must be a scalar, found {tc}", c)
            ta, tb = self._expr(a, scope), self._expr(b, scope)
            if not (is_num(ta) and is_num(tb)):
                raise p.error(f"?: needs scalar branches, found {ta} and {tb}", e)
            return promote(ta, tb, _weak(a), _weak(b))
        if k == "random":
            rt, args = e.args
            if self.cur is not None:
                self.cur.uses_random = True
            if rt.name not in ("float", "double") or len(args) != 2:
                raise p.error("random takes a float type and two bounds: random<float>(lo, "
                              "hi)", e)
            for a in args:
                if not is_num(self._expr(a, scope)):
                    raise p.error("random's bounds must be scalars", a)
            return rt
        if k == "call":
            return self._call(e, scope)
        raise p.error(f"unexpected expression {k}", e)  # pragma: no cover

    def _visible(self, scope: _Scope) -> List[str]:
        out: List[str] = [x[0] for x in self.params]
        s: Optional[_Scope] = scope
        while s is not None:
            out.extend(s.vars)
            s = s.parent
        return out

    def _call(self, e: Node, scope: _Scope) -> Type:
        p = self.p
        name, args = e.args
        n = len(args)
        if name in ELEMENTWISE:
            lo, hi = ELEMENTWISE[name]
            if not lo <= n <= hi:
                raise p.error(f"{name} takes {lo} argument(s), found {n}", e)
            ts = [self._expr(a, scope) for a in args]
            for t, a in zip(ts, args):
                if not is_num(t):
                    raise p.error(f"{name} works on scalars (apply it to arrays with map), "
                                  f"found {t}", a)
            if name == "exponent":
                return I32
            if name in ("floor", "ceil", "rint", "sqrt", "exp", "log"):
                return ts[0] if ts[0].name in ("float", "double") else F32
            if name == "ldexp":
                return ts[0] if ts[0].name in ("float", "double") else F64
            t = ts[0]
            for tt, a in zip(ts[1:], args[1:]):
                t = promote(t, tt, False, _weak(a))
            return t if name != "sign" else (t if not is_int(t) else I32)
        if name in ARRAY_OPS:
            where = self.cur.name if self.cur is not None else ""
            allowed = ("scatter",) if where == "decode" else ARRAY_OPS if where == "encode" \
                else ()
            if name not in allowed or (where == "decode" and n != 2):
                raise p.error(f"{name} cannot be used in {where or 'this place'}: the "
                              "sparsification operators stand in encode's statements (decode "
                              "has scatter(idx, vals))", e)
        if name in MATRIX_OPS and not self.n_rounds:
            raise p.error(f"{name} is a matrix operator of round programs: declare the rounds "
                          "with @rounds(k) (see docs/compll.md, PowerSGD)", e)
        if name in OPERATORS:
            lo, hi = OPERATORS[name]
            if not lo <= n <= hi:
                raise p.error(f"{name} takes {lo}..{hi} arguments, found {n}", e)
            return getattr(self, f"_op_{name}")(e, args, scope)
        if name in self.funcs:
            f = self.funcs[name]
            if n != len(f.params):
                raise p.error(f"{name} takes {len(f.params)} argument(s), found {n}", e)
            for (pt, pn), a in zip(f.params, args):
                self._assignable(pt, self._expr(a, scope), a, f"argument {pn!r} of {name}")
            if f.uses_random and self.cur is not None:
                self.cur.uses_random = True
            if f.ret is None:
                raise p.error(f"{name} is void: it has no value", e)
            return f.ret
        if name in _TABLE4_LATER:
            hint = " (topk(x, candidates, k) and threshold(x, density, sample_ratio) are its " \
                "selection forms)" if name == "sort" else ""
            raise p.error(f"operator {name!r} (HiPress Table 4) is not available in this CompLL "
                          f"yet{hint}; available: " + ", ".join(sorted(OPERATORS)), e)
        known = sorted(set(ELEMENTWISE) | set(OPERATORS) | set(self.funcs) - set(self.entries))
        raise p.error(f"unknown function or operator {name!r}; known: {', '.join(known)}", e)

    def _array_arg(self, a: Node, scope: _Scope, what: str) -> Type:
        t = self._expr(a, scope)
        if not t.array:
            raise self.p.error(f"{what} needs an array, found {t}", a)
        return t

    def _op_range(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        t = self._expr(args[0], scope)
        if not is_int(t):
            raise self.p.error(f"range needs an integer length, found {t}", args[0])
        return Type("int64", array=True)

    def _op_matrix(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        return matrices.check_matrix(self, e, args, scope)

    def _op_matmul(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        return matrices.check_matmul(self, e, args, scope)

    def _op_orthogonalize(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        return matrices.check_orthogonalize(self, e, args, scope)

    def _op_map(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        if len(args) == 3 and args[2].kind == "var" and args[2].args[0] in self.funcs:
            if self.n_rounds:
                return matrices.check_map2(self, args, scope)
            return self._map2(args, scope)
        src = self._array_arg(args[0], scope, "map")
        fn = args[1]
        if fn.kind != "var" or fn.args[0] not in self.funcs:
            raise self.p.error("map's second argument must name a function; known: "
                               + ", ".join(sorted(set(self.funcs) - {"encode", "decode"})), fn)
        f = self.funcs[fn.args[0]]
        if len(f.params) != 1 or f.params[0][0].array:
            raise self.p.error(f"map calls {f.name} with one element; {f.name} takes "
                               f"{len(f.params)} parameter(s)", fn)
        if f.ret is None:
            raise self.p.error(f"map needs a function with a value; {f.name} is void", fn)
        self._assignable(f.params[0][0], src.elem(), args[0], f"{f.name}'s element")
        if len(args) == 3:
            if not is_num(self._expr(args[2], scope)) or args[2].kind not in ("int", "float",
                                                                               "unop"):
                raise self.p.error("map's third argument is the padding element of the last "
                                   "byte, a literal", args[2])
        if f.uses_random and self.cur is not None:
            self.cur.uses_random = True
        return Type(f.ret.name, True, f.ret.bits, None, src.matrix)

    def _map2(self, args: List[Node], scope: _Scope) -> Type:
        """``map(a, b, f)``: f of two elements, a and b of one length (state updates)."""
        f = self.funcs[args[2].args[0]]
        ts = [self._array_arg(a, scope, "map") for a in args[:2]]
        if len(f.params) != 2 or f.ret is None:
            raise self.p.error(f"map(a, b, f) calls {f.name} with an element of each array: "
                               f"{f.name} must take two scalars and return one", args[2])
        for (pt, pn), t, a in zip(f.params, ts, args):
            self._assignable(pt, t.elem(), a, f"{f.name}'s {pn!r}")
            if a.kind != "var":
                raise self.p.error("map(a, b, f) takes named arrays", a)
        if args[0].args[0] not in self.globals.vars or (self.cur and self.cur.name != "encode"):
            raise self.p.error("map(a, b, f) updates a state array in encode: a = map(a, b, f) "
                               "with a a global float*", args[0])
        if f.uses_random and self.cur is not None:
            self.cur.uses_random = True
        return f.ret.of_array()

    def _float_array(self, a: Node, scope: _Scope, what: str) -> Type:
        t = self._array_arg(a, scope, what)
        if t.name != "float" or a.kind != "var":
            raise self.p.error(f"{what} works on a named float array (the gradient, a state "
                               f"array or an array made by map), found {t}", a)
        return t

    def _index_array(self, a: Node, scope: _Scope, what: str) -> None:
        t = self._array_arg(a, scope, what)
        if t.name != "int32":
            raise self.p.error(f"{what} takes an int32* index array (made by filter or topk), "
                               f"found {t}", a)

    def _op_filter(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        self._float_array(args[0], scope, "filter")
        fn = args[1]
        f = self.funcs.get(fn.args[0]) if fn.kind == "var" else None
        if f is None or len(f.params) != 1 or f.ret is None or f.ret.name != "bool":
            raise self.p.error("filter's second argument must name a predicate: bool f(float "
                               "elem)", fn)
        return Type("int32", array=True)

    def _op_topk(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        self._float_array(args[0], scope, "topk")
        if args[1].kind == "call" and args[1].args[0] == "filter":
            if self._expr(args[1], scope).name != "int32":  # pragma: no cover
                raise self.p.error("topk's candidates are indices", args[1])
        else:
            self._index_array(args[1], scope, "topk")
        if not is_int(self._expr(args[2], scope)):
            raise self.p.error("topk's k must be an integer", args[2])
        return Type("int32", array=True)

    def _op_threshold(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        self._float_array(args[0], scope, "threshold")
        for a in args[1:]:
            if not is_num(self._expr(a, scope)):
                raise self.p.error("threshold(x, density, sample_ratio) takes scalar ratios", a)
        if self.cur is not None:
            self.cur.uses_random = True
        return F32

    def _op_gather(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        self._float_array(args[0], scope, "gather")
        self._index_array(args[1], scope, "gather")
        return Type("float", array=True)

    def _op_scatter(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        if len(args) == 2:  # decode: zeros with the values at the indices
            self._index_array(args[0], scope, "scatter")
            t = self._array_arg(args[1], scope, "scatter")
            if t.name != "float":
                raise self.p.error(f"scatter's values must be float*, found {t}", args[1])
            return Type("float", array=True)
        t = self._float_array(args[0], scope, "scatter")
        if args[0].args[0] not in self.globals.vars:
            raise self.p.error("scatter(x, idx, value) writes into a state array (a global "
                               "float*)", args[0])
        self._index_array(args[1], scope, "scatter")
        if not is_num(self._expr(args[2], scope)):
            raise self.p.error("scatter's value must be a scalar", args[2])
        return I32

    def _op_reduce(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        src = self._array_arg(args[0], scope, "reduce")
        op = args[-1]
        if op.kind != "var" or op.args[0] not in REDUCTIONS:
            raise self.p.error("reduce's last argument must be one of "
                               f"{', '.join(REDUCTIONS)}", op)
        if len(args) == 3 and not is_num(self._expr(args[1], scope)):
            raise self.p.error("reduce's initial value must be a scalar", args[1])
        t = src.elem()
        if REDUCTIONS[op.args[0]] == "sum":
            return F64 if t.name in ("float", "double") else I64
        return promote(t, I32) if is_int(t) else t

    def _op_concat(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        seen_array = False
        for a in args:
            t = self._expr(a, scope)
            if t.array:
                seen_array = True
            elif seen_array:
                raise self.p.error("concat takes the scalars (header fields) first, then the "
                                   "arrays (the body)", a)
            if t.name == "struct":
                raise self.p.error("concat of the parameter block; name its fields", a)
        return Type("uint", True, 8)

    def _op_extract(self, e: Node, args: List[Node], scope: _Scope) -> Type:
        src = self._array_arg(args[0], scope, "extract")
        if src.name != "uint":
            raise self.p.error("extract reads a uint8* payload", args[0])
        seen_array = False
        for a in args[1:]:
            if a.kind == "index" and a.args[0].kind == "var" and \
                    (scope.get(a.args[0].args[0]) or Type("")).array:
                # name[count]: an array of count elements (a data-dependent length)
                if not is_int(self._expr(a.args[1], scope)):
                    raise self.p.error("an extracted array's length must be an integer", a)
                a.ty = self._expr(a.args[0], scope)
                seen_array = True
                continue
            if a.kind != "var" or scope.get(a.args[0]) is None:
                raise self.p.error("extract's arguments after the payload must be declared "
                                   "variables", a)
            t = self._expr(a, scope)
            if t.array:
                seen_array = True
            elif seen_array:
                raise self.p.error("extract takes the scalars first, then the arrays", a)
        return I32


def _weak(e: Node) -> bool:
    return e.kind == "int" or (e.kind == "float" and e.args[1] is None) or (
        e.kind == "unop" and e.args[0] == "-" and _weak(e.args[1]))


def _same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, Node) and isinstance(b, Node):
        return a.args[0][-1] == b.args[0][-1]
    return a == b


def is_rounds(c: Checked) -> bool:
    """True for a round program (``@rounds(k)``, matrices.py): encode_round0.. and decode."""
    return bool(c.rounds)


def is_sparse(c: Checked) -> bool:
    """True for a program with state arrays or a sparsification operator (``arrays.py``):
    its payload arrays have data-dependent lengths, and it runs statement by statement."""
    if c.rounds:
        return False
    if any(t.array for t in c.globals.values()):
        return True
    return _calls_array_op([f.body for f in c.funcs.values()])


def _calls_array_op(bodies: List[Node]) -> bool:
    """True when a function body calls a sparsification operator (``ARRAY_OPS``)."""
    return find_node(bodies, lambda n: n.kind == "call" and n.args[0] in ARRAY_OPS) is not None


def check(prog: Program) -> Checked:
    """Type-check ``prog``; annotate its expression nodes with ``.ty``.

    Raises:
        CompllError: the first error found, located.
    """
    return _Checker(prog).run()
