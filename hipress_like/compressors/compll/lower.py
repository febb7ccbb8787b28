"""Lowering shared by the C and CUDA renderers: expressions to C text, bodies to loop groups.

Both targets see one tree. Each user function becomes a C function of one
element (its index ``i_`` rides along for ``random``); globals, params and
the RNG seed live in a context struct. An entry point's statements become a
sequence of operations:

- ``Loop`` items: a ``reduce`` (hoisted out of whatever expression holds it
  into a temporary) or an array made by ``map``;
- ``Scalar`` statements, ``Concat`` and ``Extract``, and the decode's output map.

Loop items move up past scalar statements they do not read from, and
consecutive independent items fuse into one sweep over the gradient (onebit's
sign packing and its max|x| share a pass; its three fixed-point sums share
another), as CompLL fuses operator chains (HiPress Sec. 5). A sweep that
packs a sub-byte array walks the planar layout (byte j, fields k = element
k*m + j) so the packing vectorises; the others are flat.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

from .checker import REDUCTIONS, Checked, Func
from .syntax import Node, Type

__all__ = ["ctype", "Lowered", "lower", "Loop", "ExprC"]

_CT = {"float": "float", "double": "double", "int32": "int32_t", "int64": "int64_t",
       "uint": "int32_t", "bool": "int32_t"}


def ctype(t: Type) -> str:
    """The C type holding a CompLL scalar of type ``t``."""
    return _CT[t.name]


def lit(v: Any, t: Type) -> str:
    """A literal of CompLL type ``t`` in C."""
    if t.name in ("float", "double"):
        r = repr(float(v))
        if "inf" in r or "nan" in r:
            r = "(1.0/0.0)" if r == "inf" else "(-1.0/0.0)" if r == "-inf" else "(0.0/0.0)"
        elif "." not in r and "e" not in r:
            r += ".0"
        return f"((float){r})" if t.name == "float" else f"({r})"
    if t.name == "int64":
        return f"((int64_t){int(v)}LL)"
    return f"((int32_t){int(v)})"


@dataclass
class Loop:
    """One loop item: ``reduce`` into ``target`` or ``map`` into array ``target``."""

    kind: str  # "reduce" | "map"
    target: str
    node: Node
    reads: Set[str]
    ty: Type  # the reduce's type, or the array's type
    packed_bits: Any = None  # int or param name: a planar-packed sub-byte array


@dataclass
class Lowered:
    """An entry point as operations, and what the renderers need about its arrays."""

    func: Func
    ops: List[Any] = field(default_factory=list)  # Loop groups (lists) and Nodes
    arrays: Dict[str, Type] = field(default_factory=dict)


class ExprC:
    """Render expressions and function bodies as C text (shared by the C and CUDA targets)."""

    def __init__(self, c: Checked, target: str = "c") -> None:
        self.c = c
        self.target = target
        self.params = {pn: pt for pn, pt, _, _ in c.params}
        self.locals: List[Set[str]] = []
        self.args: Set[str] = set()
        self.temps: Dict[int, str] = {}  # id(reduce node) -> temp name
        self.in_ctx: Set[str] = set()  # entry-point scalars kept in the context (CUDA)

    # names
    def name(self, n: str) -> str:
        for s in reversed(self.locals):
            if n in s:
                return f"c->l_{n}" if n in self.in_ctx else f"l_{n}"
        if n in self.args:
            return f"a_{n}"
        if n in self.c.globals:
            return f"c->g_{n}"
        if n in self.params:
            return f"c->p_{n}"
        raise KeyError(n)  # pragma: no cover - checked

    def conv(self, text: str, frm: Type, to: Type) -> str:
        """C text converting ``text`` (of type ``frm``) to ``to`` as the interpreter does."""
        if to.name == "bool":
            return f"(({text}) != 0)"
        if frm.name == to.name and (to.name != "uint" or frm.bits == to.bits):
            return text
        ct = ctype(to)
        if to.name == "uint" and isinstance(to.bits, int):
            if frm.name in ("float", "double"):
                return f"(((int32_t)({text})) & {(1 << to.bits) - 1})"
            return f"(((int32_t)({text})) & {(1 << to.bits) - 1})"
        if frm.name in ("float", "double") and ct in ("int32_t", "int64_t"):
            return f"(({ct})({text}))"
        return f"(({ct})({text}))"

    def expr(self, e: Node) -> str:
        k = e.kind
        if k in ("int", "float"):
            return lit(e.args[0], e.ty)
        if k == "bool":
            return "1" if e.args[0] else "0"
        if k == "var":
            if id(e) in self.temps:
                return self.temps[id(e)]
            return self.name(e.args[0])
        if k == "field":
            if e.args[1] == "size":
                return "n"
            return f"c->p_{e.args[1]}"
        if k == "cast":
            return self.conv(self.expr(e.args[1]), e.args[1].ty, e.args[0])
        if k == "unop":
            op, a = e.args
            if op == "!":
                return f"(!({self.expr(a)}))"
            return f"({op}{self.conv(self.expr(a), a.ty, e.ty)})"
        if k == "binop":
            op, a, b, common = e.args
            if op in ("&&", "||"):
                return f"(({self.expr(a)}) {op} ({self.expr(b)}))"
            if op in ("<<", ">>"):
                return (f"({self.conv(self.expr(a), a.ty, e.ty)} {op} "
                        f"{self.conv(self.expr(b), b.ty, Type('int32'))})")
            return f"({self.conv(self.expr(a), a.ty, common)} {op} " \
                   f"{self.conv(self.expr(b), b.ty, common)})"
        if k == "cond":
            c, a, b = e.args
            return (f"(({self.expr(c)}) ? {self.conv(self.expr(a), a.ty, e.ty)} : "
                    f"{self.conv(self.expr(b), b.ty, e.ty)})")
        if k == "random":
            rt, (lo, hi) = e.args
            u = "cl_uniform(c->seed, i_)"
            if rt.name == "double":
                u = f"((double){u})"
            vlo, vhi = self.conv(self.expr(lo), lo.ty, rt), self.conv(self.expr(hi), hi.ty, rt)
            return f"({u} * ({vhi} - {vlo}) + {vlo})"
        if k == "call":
            if id(e) in self.temps:
                return self.temps[id(e)]
            return self.call(e)
        if k == "index":
            raise self.c.prog.error("array indexing is not compiled yet: use map over the "
                                    "array", e)
        raise self.c.prog.error(f"cannot compile {k} here", e)  # pragma: no cover

    def call(self, e: Node) -> str:
        name, args = e.args
        t = e.ty
        if name in self.c.funcs:
            f = self.c.funcs[name]
            vals = [self.conv(self.expr(a), a.ty, pt) for (pt, _), a in zip(f.params, args)]
            return f"u_{name}({', '.join(['c'] + vals + ['i_'])})"
        if name in ("map", "reduce", "concat", "extract", "range"):
            raise self.c.prog.error(f"{name} can only stand in an entry point's statement (its "
                                    "own assignment), not inside an expression here", e)
        f = "f" if t.name == "float" else ""
        v = [self.conv(self.expr(a), a.ty, t) for a in args]
        if name == "exponent":
            return f"cl_exponent((double)({self.expr(args[0])}))"
        if name == "fma":  # one rounding, as torch's add(alpha=) on CPUs
            return f"fma{f}({v[0]}, {v[1]}, {v[2]})"
        if name == "pow":
            return f"pow{f}({v[0]}, {v[1]})"
        if name == "ldexp":
            return f"ldexp{f}({v[0]}, (int)({self.expr(args[1])}))"
        if name in ("floor", "ceil", "rint", "sqrt", "exp", "log"):
            return f"{name}{f}({v[0]})"
        if name in ("abs", "fabs"):
            return f"fabs{f}({v[0]})" if t.name in ("float", "double") else \
                f"({v[0]} < 0 ? -{v[0]} : {v[0]})"
        if name == "sign":
            return f"(({ctype(t)})(({v[0]} > 0) - ({v[0]} < 0)))"
        if name == "min":
            return f"({v[0]} < {v[1]} ? {v[0]} : {v[1]})"
        if name == "max":
            return f"({v[0]} > {v[1]} ? {v[0]} : {v[1]})"
        if name == "clamp":
            return f"cl_clamp_{ctype(t)}({v[0]}, {v[1]}, {v[2]})"
        raise self.c.prog.error(f"cannot compile {name}", e)  # pragma: no cover

    def stmt(self, s: Node, ind: str, ret: Optional[Type]) -> List[str]:
        """C lines of a statement inside a function body."""
        k = s.kind
        if k == "block":
            self.locals.append(set())
            out = [ind + "{"]
            for x in s.args[0]:
                out += self.stmt(x, ind + "    ", ret)
            self.locals.pop()
            return out + [ind + "}"]
        if k == "decl":
            ty = s.args[0]
            out = []
            for d in s.args[1]:
                name, init = d.args
                v = self.conv(self.expr(init), init.ty, ty) if init is not None else "0"
                self.locals[-1].add(name)
                if name in self.in_ctx:
                    out.append(f"{ind}c->l_{name} = {v};")
                else:
                    out.append(f"{ind}{ctype(ty)} l_{name} = {v};")
            return out
        if k == "assign":
            lv, op, e = s.args
            tgt = self.name(lv.args[0])
            if op == "=":
                return [f"{ind}{tgt} = {self.conv(self.expr(e), e.ty, lv.ty)};"]
            from .checker import promote
            common = promote(lv.ty, e.ty, False, False)
            rhs = (f"({self.conv(tgt, lv.ty, common)} {op[:-1]} "
                   f"{self.conv(self.expr(e), e.ty, common)})")
            return [f"{ind}{tgt} = {self.conv(rhs, common, lv.ty)};"]
        if k == "if":
            out = [f"{ind}if ({self.expr(s.args[0])}) {{"]
            out += self.stmt(_blk(s.args[1]), ind + "    ", ret)[1:-1]
            if s.args[2] is not None:
                out.append(f"{ind}}} else {{")
                out += self.stmt(_blk(s.args[2]), ind + "    ", ret)[1:-1]
            return out + [ind + "}"]
        if k == "return":
            assert ret is not None
            return [f"{ind}return {self.conv(self.expr(s.args[0]), s.args[0].ty, ret)};"]
        raise self.c.prog.error(f"cannot compile statement {k} here", s)

    def function(self, f: Func, qual: str) -> str:
        """A user function as C text: ``u_name(ctx, params..., i_)``."""
        self.args = {n for _, n in f.params}
        self.locals = [set()]
        saved, self.in_ctx = self.in_ctx, set()
        ps = ", ".join(["const ctx_t* c"] + [f"{ctype(t)} a_{n}" for t, n in f.params]
                       + ["int64_t i_"])
        body = self.stmt(f.body, "", f.ret)
        self.args = set()
        self.in_ctx = saved
        ret = ctype(f.ret) if f.ret is not None else "void"
        unused = "(void)c; (void)i_;"
        return "\n".join([f"{qual} {ret} u_{f.name}({ps}) {{", "    " + unused] + body[1:])


def _blk(s: Node) -> Node:
    return s if s.kind == "block" else Node("block", ([s],), s.line, s.col)


def reads_of(c: Checked, n: Any, seen: Optional[Set[str]] = None) -> Set[str]:
    """Names a node reads, through user functions (globals and params included)."""
    seen = set() if seen is None else seen
    out: Set[str] = set()

    def walk(x: Any) -> None:
        if isinstance(x, Node):
            if x.kind == "var":
                out.add(x.args[0])
                if x.args[0] in c.funcs and x.args[0] not in seen:
                    seen.add(x.args[0])
                    walk(c.funcs[x.args[0]].body)
            if x.kind == "call" and x.args[0] in c.funcs and x.args[0] not in seen:
                seen.add(x.args[0])
                walk(c.funcs[x.args[0]].body)
            for a in x.args:
                walk(a)
        elif isinstance(x, (list, tuple)):
            for a in x:
                walk(a)
    walk(n)
    return out


def writes_of(s: Node) -> Set[str]:
    """Names a top-level statement writes."""
    if s.kind == "decl":
        return {d.args[0] for d in s.args[1]}
    if s.kind == "assign":
        return {s.args[0].args[0]}
    if s.kind in ("block", "if"):
        out: Set[str] = set()
        for x in (s.args[0] if s.kind == "block" else [s.args[1], s.args[2]]):
            if isinstance(x, Node):
                out |= writes_of(x)
        return out
    return set()


def _reduces(n: Any, acc: List[Node]) -> None:
    if isinstance(n, Node):
        if n.kind == "call" and n.args[0] == "reduce":
            acc.append(n)
            return
        for a in n.args:
            _reduces(a, acc)
    elif isinstance(n, (list, tuple)):
        for a in n:
            _reduces(a, acc)


def lower(c: Checked, f: Func, ex: ExprC, out_name: str) -> Lowered:
    """Split entry point ``f`` into loop groups and other statements (module docstring)."""
    low = Lowered(f)
    ops: List[Any] = []
    count = 0
    for s in f.body.args[0]:
        if s.kind == "decl" and s.args[0].array:
            ty = s.args[0]
            for d in s.args[1]:
                low.arrays[d.args[0]] = ty
                init = d.args[1]
                if init is None:
                    continue
                if init.kind != "call" or init.args[0] != "map":
                    raise c.prog.error("an array is made by map(...) (or read by extract)", init)
                bits = ty.bits if ty.name == "uint" and ty.bits != 8 else None
                if isinstance(bits, Node):
                    bits = bits.args[0][-1]
                ops.append(Loop("map", d.args[0], init, reads_of(c, init), ty, bits))
            continue
        if s.kind == "assign" and s.args[0].args[0] == out_name:
            ops.append(s)
            continue
        reds: List[Node] = []
        _reduces(s, reds)
        for r in reds:
            name = f"r{count}_"
            count += 1
            ex.temps[id(r)] = name
            ops.append(Loop("reduce", name, r, reads_of(c, r.args[1]), r.ty))
        ops.append(s)
    # move loop items up past scalar statements they do not read from
    moved: List[Any] = []
    for op in ops:
        moved.append(op)
        if not isinstance(op, Loop):
            continue
        j = len(moved) - 1
        while j > 0 and isinstance(moved[j - 1], Node) and _movable(moved[j - 1], op):
            moved[j - 1], moved[j] = moved[j], moved[j - 1]
            j -= 1
    # fuse consecutive independent loop items
    for op in moved:
        if isinstance(op, Loop) and low.ops and isinstance(low.ops[-1], list) and \
                _fusable(low.ops[-1], op):
            low.ops[-1].append(op)
        elif isinstance(op, Loop):
            low.ops.append([op])
        else:
            low.ops.append(op)
    return low


def _movable(s: Node, loop: Loop) -> bool:
    if s.kind == "expr_stmt" or (s.kind == "assign" and s.args[2].kind == "call"
                                 and s.args[2].args[0] == "concat"):
        return False
    return not (writes_of(s) & loop.reads)


def _fusable(group: List[Loop], item: Loop) -> bool:
    written = {x.target for x in group}
    if item.reads & written:
        return False
    if item.kind == "map" and any(x.kind == "map" for x in group):
        return False
    src = _source_name(item)
    return all(_source_name(x) == src for x in group)


def _source_name(item: Loop) -> Any:
    """The array a loop sweeps (its length decides the loop's trip count)."""
    n = item.node.args[1][0]
    while n.kind == "call" and n.args[0] == "map":
        n = n.args[1][0]
    return n.args[0] if n.kind == "var" else ("range", id(n))


def reduction(item: Loop) -> str:
    """min, max, sum or maxabs: what a reduce item computes."""
    return REDUCTIONS[item.node.args[1][-1].args[0]]
