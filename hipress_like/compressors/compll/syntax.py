"""CompLL's syntax tree and parser: ``compll.lark`` read by lark, turned into small nodes.

The grammar (``compll.lark`` beside this module) covers HiPress's Fig. 5 form
(a ``param`` block, globals, user functions, ``encode``/``decode``) and the
open-source pseudocode form (``lambda_func f = [&](int index) -> T {...};``).
A lark ``Transformer`` turns the parse tree into the dataclasses below; every
node keeps its source line and column so the checker and the renderers can
point at the code. Parse errors become ``CompllError`` with a caret under the
offending token and the list of what was expected there.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import lark

from ...errors import HipressError

__all__ = ["CompllError", "Node", "Type", "Program", "parse", "GRAMMAR_PATH"]

GRAMMAR_PATH = Path(__file__).with_name("compll.lark")


class CompllError(HipressError, ValueError):
    """A bad CompLL program: the message gives line, column, a caret and what was expected."""

    def __init__(self, message: str, source: str = "", line: int = 0, column: int = 0,
                 filename: str = "<compll>") -> None:
        self.msg, self.line, self.column, self.filename = message, line, column, filename
        text = f"{filename}:{line}:{column}: {message}"
        lines = source.splitlines()
        if 0 < line <= len(lines):
            src = lines[line - 1].replace("\t", " ")
            text += f"\n    {src}\n    {' ' * max(column - 1, 0)}^"
        super().__init__(text)


@dataclass
class Node:
    """Any syntax node: ``kind`` names it, ``args`` its children, (line, col) where it starts."""

    kind: str
    args: Tuple[Any, ...]
    line: int = 0
    col: int = 0
    ty: Any = None  # filled by the checker: the node's value type

    def __repr__(self) -> str:
        return f"{self.kind}{self.args!r}@{self.line}:{self.col}"


@dataclass(frozen=True)
class Type:
    """A CompLL type: a scalar name (float, double, int32, uint<k>, bool), or an array of one
    (``T*``), or a matrix of one (``T**``, ``matrix`` set; a matrix is also an array).

    ``bits`` is the element width of unsigned types (an int, or a Node for
    ``uint<params.bitwidth>``); ``struct`` names a param block type.
    """

    name: str
    array: bool = False
    bits: Any = None
    struct: Optional[str] = None
    matrix: bool = False  # ``float**``: a row-major matrix (an array with rows and cols)

    def elem(self) -> "Type":
        """The element type of an array type."""
        return Type(self.name, False, self.bits, self.struct)

    def of_array(self) -> "Type":
        """The array type of this element type."""
        return Type(self.name, True, self.bits, self.struct)

    def __str__(self) -> str:
        if self.name == "uint" and not isinstance(self.bits, int):
            base = "uint<param>"
        elif self.name == "uint":
            base = f"uint{self.bits}"
        else:
            base = self.struct or self.name
        return base + ("**" if self.matrix else "*" if self.array else "")


@dataclass
class Program:
    """A parsed program: metas, param blocks, globals, functions (by name), and its source."""

    source: str
    filename: str
    metas: List[Node] = field(default_factory=list)
    params: List[Node] = field(default_factory=list)
    globals: List[Node] = field(default_factory=list)
    functions: dict = field(default_factory=dict)

    def error(self, message: str, node: Optional[Node] = None) -> CompllError:
        """A located error at ``node`` (or the file start)."""
        return CompllError(message, self.source, getattr(node, "line", 0),
                           getattr(node, "col", 0), self.filename)


_SCALARS = {"int": "int32", "uint1": ("uint", 1), "uint2": ("uint", 2), "uint4": ("uint", 4),
            "uint8": ("uint", 8)}


def find_node(tree: Any, pred: Callable[[Node], bool]) -> Optional[Node]:
    """The first node of ``tree`` (a Node, or lists/tuples of them), in source order
    (pre-order), that satisfies ``pred``; None when none does."""
    if isinstance(tree, Node):
        if pred(tree):
            return tree
        tree = tree.args
    if isinstance(tree, (list, tuple)):
        for a in tree:
            r = find_node(a, pred)
            if r is not None:
                return r
    return None


def scalar(name: str) -> Type:
    """The Type of a scalar keyword (``int`` is int32; ``uint2`` is ``uint`` of 2 bits)."""
    v = _SCALARS.get(name, name)
    if isinstance(v, tuple):
        return Type("uint", bits=v[1])
    return Type(v)


def _pos(meta: Any) -> Tuple[int, int]:
    return (getattr(meta, "line", 0) or 0, getattr(meta, "column", 0) or 0)


@lark.v_args(meta=True)
class _Build(lark.Transformer):
    """Parse tree -> Nodes (each rule method keeps the rule's line/col)."""

    def _n(self, kind: str, meta: Any, *args: Any) -> Node:
        return Node(kind, tuple(args), *_pos(meta))

    def start(self, meta, items):
        return list(items)

    def meta(self, meta, c):
        return self._n("meta", meta, str(c[0]), [a for a in c[1:] if a is not None])

    def meta_arg(self, meta, c):
        return (str(c[0]), c[1]) if len(c) == 2 else (None, c[0])

    def param_block(self, meta, c):
        return self._n("param_block", meta, str(c[0]), list(c[1:]))

    def param_field(self, meta, c):
        ty, name, default = c[0], str(c[1]), c[2]
        choices = [x for x in c[4:] if x is not None] if len(c) > 3 and c[3] is not None else None
        return self._n("param_field", meta, ty, name, default, choices)

    def global_decl(self, meta, c):
        return self._n("decl", meta, c[0], list(c[1:]))

    decl = global_decl

    def declarator(self, meta, c):
        return self._n("declarator", meta, str(c[0]), c[1])

    def func_def(self, meta, c):
        ret = None if isinstance(c[0], lark.Token) and c[0].type == "VOID" else c[0]
        params = [p for p in c[2:-1] if p is not None]
        return self._n("func", meta, ret, str(c[1]), params, c[-1], False)

    def lambda_def(self, meta, c):
        params = [p for p in c[1:-2] if p is not None]
        ret = None if isinstance(c[-2], lark.Token) and c[-2].type == "VOID" else c[-2]
        return self._n("func", meta, ret, str(c[0]), params, c[-1], True)

    def fparam(self, meta, c):
        return (c[0], str(c[1]))

    def type(self, meta, c):
        t = c[0]
        stars = len([x for x in c[1:] if x is not None])
        return Type(t.name, stars > 0, t.bits, t.struct, stars > 1)

    def scalar_type(self, meta, c):
        return scalar(str(c[0]))

    def uint_type(self, meta, c):
        return Type("uint", bits=c[0])

    def named_type(self, meta, c):
        # T (the open-source form's element type) is float; others name a param block
        return Type("float") if str(c[0]) == "T" else Type("struct", struct=str(c[0]))

    def width_int(self, meta, c):
        return int(str(c[0]), 0)

    def width_name(self, meta, c):
        return self._n("path", meta, tuple(str(x) for x in c))

    def block(self, meta, c):
        return self._n("block", meta, list(c))

    def assign(self, meta, c):
        return self._n("assign", meta, c[0], "=", c[1])

    assign_nosemi = assign  # Fig. 5 line 13 has none: tolerated after an assignment

    def augassign(self, meta, c):
        return self._n("assign", meta, c[0], str(c[1]), c[2])

    def if_stmt(self, meta, c):
        return self._n("if", meta, c[0], c[1], c[2] if len(c) > 2 else None)

    def return_stmt(self, meta, c):
        return self._n("return", meta, c[0] if c else None)

    def expr_stmt(self, meta, c):
        return self._n("expr_stmt", meta, c[0])

    def index_lv(self, meta, c):
        return self._n("index", meta, self._n("var", meta, str(c[0])), c[1])

    def cond(self, meta, c):
        return self._n("cond", meta, *c)

    def binop(self, meta, c):
        return self._n("binop", meta, str(c[1]), c[0], c[2])

    def unop(self, meta, c):
        return self._n("unop", meta, str(c[0]), c[1])

    def cast(self, meta, c):
        return self._n("cast", meta, scalar(str(c[0])), c[1])

    def field(self, meta, c):
        return self._n("field", meta, c[0], str(c[1]))

    def index(self, meta, c):
        return self._n("index", meta, c[0], c[1])

    def number(self, meta, c):
        s = str(c[0])
        if s.startswith(("0x", "0X")):
            return self._n("int", meta, int(s, 16))
        if s.endswith("f"):
            return self._n("float", meta, float(s[:-1]), "float")
        if any(ch in s for ch in ".eE"):
            return self._n("float", meta, float(s), None)
        return self._n("int", meta, int(s))

    def boolean(self, meta, c):
        return self._n("bool", meta, str(c[0]) == "true")

    def string(self, meta, c):
        return self._n("str", meta, str(c[0])[1:-1])

    def var(self, meta, c):
        return self._n("var", meta, str(c[0]))

    def call(self, meta, c):
        return self._n("call", meta, str(c[0]), [a for a in c[1:] if a is not None])

    def random(self, meta, c):
        return self._n("random", meta, scalar(str(c[0])), [a for a in c[1:] if a is not None])


@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(GRAMMAR_PATH.read_text(), parser="lalr", propagate_positions=True,
                     maybe_placeholders=True)


_NICE = {"SEMICOLON": "';'", "RBRACE": "'}'", "LBRACE": "'{'", "RPAR": "')'", "LPAR": "'('",
         "COMMA": "','", "EQUAL": "'='", "NAME": "a name", "SCALAR": "a type",
         "NUMBER": "a number", "RSQB": "']'", "LSQB": "'['", "MORETHAN": "'>'"}


def _expected(names: Any) -> str:
    nice = sorted({_NICE.get(n, n) for n in names})
    return ", ".join(nice[:12]) + (" ..." if len(nice) > 12 else "")


def parse(source: str, filename: str = "<compll>") -> Program:
    """Parse CompLL source into a ``Program``.

    Raises:
        CompllError: a syntax error, with line, column, caret and the expected tokens.
    """
    try:
        items = _build(_parser().parse(source))
    except lark.UnexpectedCharacters as e:
        raise CompllError(f"unexpected character {source[e.pos_in_stream]!r}; expected "
                          f"{_expected(e.allowed or [])}", source, e.line, e.column,
                          filename) from None
    except lark.UnexpectedToken as e:
        found = "end of file" if e.token.type == "$END" else repr(str(e.token))
        raise CompllError(f"unexpected {found}; expected {_expected(e.expected)}", source,
                          e.line if e.line != -1 else len(source.splitlines()),
                          e.column if e.column != -1 else 1, filename) from None
    except lark.UnexpectedEOF as e:
        n = len(source.splitlines())
        raise CompllError(f"unexpected end of file; expected {_expected(e.expected)}", source,
                          n, 1, filename) from None
    except lark.exceptions.VisitError as e:  # pragma: no cover - a transformer bug
        raise CompllError(f"internal parser error: {e.orig_exc}", source, 0, 0,
                          filename) from e
    prog = Program(source, filename)
    for it in items:
        if it.kind == "meta":
            prog.metas.append(it)
        elif it.kind == "param_block":
            prog.params.append(it)
        elif it.kind == "decl":
            prog.globals.append(it)
        else:
            if it.args[1] in prog.functions:
                raise prog.error(f"function {it.args[1]!r} is defined twice; rename one", it)
            prog.functions[it.args[1]] = it
    return prog


def _build(tree: Any) -> list:
    return _Build().transform(tree)
