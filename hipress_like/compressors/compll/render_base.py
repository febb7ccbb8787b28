"""What CompLL's renderers share: one tree, several renderers.

The C (``render_c``), CUDA (``render_cuda``) and state-array (``render_seq``,
``render_cuda_seq``) targets render the same checked, lowered program. Like
a compiler's C-style renderer family (tinygrad's ``renderer/cstyle.py``
renders one program to C, CUDA and Metal), the logic that is the same for
every target lives here once, and each target supplies only what differs:

- ``LoopRenderer``: element ``i_`` of an array expression, the element
  statements of a fused loop group (the reductions' updates and the map
  operator's stores), a loop's trip count, a packed width and an array's
  byte size, for the C and CUDA loop renderers; a target overrides ``INT64``
  (its 64-bit integer spelling), ``_array_elem`` (how it reads a made
  array), ``_acc`` (where a reduction accumulates) and ``_store`` (where a
  map writes its element);
- ``read_extra_fields``: extract's header fields read back from ``extra``
  (the inverse of concat's layout, ``interp.layout``), with the target's
  error exit and ``memcpy``;
- ``write_extra_fields``: concat's header fields written into ``extra``;
- ``SeqExpr`` and ``SeqArrays``: the state-array targets' expressions (an
  array's ``.size`` is its length variable; an array never nests inside an
  expression), their named arrays (gradient, state, or a made one) and
  their statements' dispatch (with concat's and decode's scatter output
  checked once): a target renders each kind of statement (``array_op``,
  ``concat``, ``state_loop``, ``scatter_loop``, ``scalar``, ``special``);
- ``counted_arrays``: extract's ``name[count]`` arrays of the state-array
  targets, in layout order;
- ``NativeRunner``: the ctypes glue both C runners (``render_c.NativeProgram``,
  ``render_seq.SeqNativeProgram``) share: the library's name, the params
  vector and the decode entry point's signature.
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .interp import _size
from .lower import ExprC, Loop, ctype, reduction
from .syntax import Node, Type

__all__ = ["LoopRenderer", "NativeRunner", "SeqArrays", "SeqExpr", "counted_arrays",
           "read_extra_fields", "write_extra_fields"]


class LoopRenderer:
    """Base of the C and CUDA loop renderers: what both write the same way.

    A subclass sets ``c`` (the checked program), ``ex`` (its ``ExprC``) and
    ``arrays`` (the entry point's arrays), and defines ``_array_elem`` (how
    the loop reads element ``i_`` of a made array).
    """

    INT64 = "int64_t"

    def _acc(self, x: Loop) -> str:
        """The accumulator a reduction ``x`` updates in the loop body."""
        return x.target

    def _store(self, x: Loop) -> str:
        """The byte pointer a map ``x`` stores its elements through."""
        return f"l_{x.target}"

    def elem(self, n: Node, grad: Optional[str]) -> str:
        """C text of element ``i_`` of array expression ``n`` (``grad`` reads as ``x_``)."""
        if n.kind == "var":
            if n.args[0] == grad:
                return "x_"
            return self._array_elem(n, self.arrays.get(n.args[0]))
        if n.kind == "call" and n.args[0] == "range":
            return "i_"
        if n.kind == "call" and n.args[0] == "map":
            src, fn = n.args[1][0], n.args[1][1]
            f = self.c.funcs[fn.args[0]]
            pt = f.params[0][0]
            return f"u_{f.name}(c, {self.ex.conv(self.elem(src, grad), src.ty.elem(), pt)}, i_)"
        raise self.c.prog.error("expected an array (a name, map(...) or range(n))", n)

    def bits_expr(self, t: Type) -> str:
        """A packed array type's bit width: a literal or the scalar holding it."""
        b = t.bits
        if isinstance(b, int):
            return str(b)
        return self.ex.name(b.args[0][-1])

    def _nbytes(self, t: Type) -> str:
        if t.name == "uint" and t.bits != 8:
            return f"cl_packed_nbytes(n, {self.bits_expr(t)})"
        return f"(n * {_size(t.elem()) if t.name != 'uint' else 1})"

    def _length(self, item: Loop) -> str:
        n = item.node.args[1][0]
        while n.kind == "call" and n.args[0] == "map":
            n = n.args[1][0]
        if n.kind == "call" and n.args[0] == "range":
            return f"(({self.INT64})({self.ex.expr(n.args[1][0])}))"
        return "n"

    def _element_stmts(self, items: List[Loop], grad: str, ind: str,
                       code_var: Optional[str]) -> List[str]:
        """Each item's statement for element ``i_``: a reduction's update or a map's store.

        With ``code_var``, a packed map item writes its code there (the planar
        packer shifts it into the byte) instead of storing it.
        """
        out = []
        for x in items:
            src = x.node.args[1][0]
            if x.kind == "reduce":
                ct = ctype(x.ty)
                v = self.ex.conv(self.elem(src, grad), src.ty.elem(), x.ty)
                op = reduction(x)
                a = self._acc(x)
                if op == "sum":
                    out.append(f"{ind}{a} += {v};")
                elif op == "maxabs":
                    out.append(f"{ind}{{ {ct} v_ = {v}; v_ = v_ < 0 ? -v_ : v_; "
                               f"{a} = v_ > {a} ? v_ : {a}; }}")
                else:
                    cmp = "<" if op == "min" else ">"
                    out.append(f"{ind}{{ {ct} v_ = {v}; {a} = v_ {cmp} {a} ? v_ : {a}; }}")
            else:
                fn = self.c.funcs[x.node.args[1][1].args[0]]
                pt = fn.params[0][0]
                val = (f"u_{fn.name}(c, {self.ex.conv(self.elem(src, grad), src.ty.elem(), pt)}"
                       ", i_)")
                if code_var is not None and x.packed_bits is not None:
                    out.append(f"{ind}{code_var} = (uint32_t)({val});")
                else:
                    et = x.ty.elem()
                    store = "uint8_t" if et.name == "uint" else ctype(et)
                    out.append(f"{ind}(({store}*){self._store(x)})[i_] = ({store})"
                               f"{self.ex.conv(val, fn.ret, et)};")
        return out


class SeqExpr(ExprC):
    """``ExprC`` of the state-array targets: ``idx.size`` reads the array's length variable.

    Args:
        c: the checked program.
        target: ``"c"`` or ``"cuda"``.
        lens: array name -> the C expression of its length (shared with the renderer).
        int64: the target's 64-bit integer spelling.
    """

    def __init__(self, c: Any, target: str, lens: Dict[str, str], int64: str) -> None:
        super().__init__(c, target)
        self.lens = lens
        self.int64 = int64

    def expr(self, e: Node) -> str:
        if e.kind == "field" and e.args[1] == "size" and e.args[0].kind == "var" and \
                e.args[0].args[0] in self.lens:
            return f"(({self.int64}){self.lens[e.args[0].args[0]]})"
        if e.ty is not None and getattr(e.ty, "array", False) and e.kind != "field":
            raise self.c.prog.error("an array stands in its own statement here (int32* idx = "
                                    "filter(...); scatter(...);), not inside an expression", e)
        try:
            return super().expr(e)
        except KeyError as k:
            raise self.c.prog.error(f"{k} cannot be read here", e) from None


class SeqArrays:
    """The state-array renderers' named arrays.

    A subclass sets ``c`` (the checked program), ``grad`` (the gradient's
    name in the entry point being rendered), ``state`` (the state arrays'
    names) and ``lens`` (array name -> length expression of the arrays made
    so far).
    """

    def arr(self, n: Node) -> str:
        """C pointer of a named array: ``g``, ``s_<state>`` or ``l_<made>``.

        Raises:
            CompllError: ``n`` is not a name, or names an array not made yet.
        """
        if n.kind != "var":
            raise self.c.prog.error("expected a named array here", n)
        name = n.args[0]
        if name == self.grad:
            return "g"
        if name in self.state:
            return f"s_{name}"
        if name not in self.lens:
            raise self.c.prog.error(f"{name!r} has no value here: make it with filter, topk "
                                    "or gather (encode) or read it with extract (decode)", n)
        return f"l_{name}"

    def length(self, n: Node) -> str:
        """The C expression of a named array's length (``n`` for the gradient and state)."""
        self.arr(n)
        return self.lens.get(n.args[0], "n")

    def special(self, s: Node) -> bool:
        """Render a statement only this target knows (True when done); none by default."""
        return False

    def stmt(self, s: Node, out_name: str) -> None:
        """Render one statement of an entry point whose output is ``out_name``.

        Raises:
            CompllError: an array declared without a value or reassigned, or a
                state array updated other than by map(a, b, f) or scatter.
        """
        if s.kind == "decl" and s.args[0].array:
            for d in s.args[1]:
                if d.args[1] is None:
                    raise self.c.prog.error("declare an array with its value here", d)
                self.array_op(d.args[0], d.args[1])
            return
        if s.kind == "assign" and s.args[0].args[0] == out_name:
            self.concat(s.args[2])
            return
        if s.kind == "assign" and s.args[0].args[0] in self.state:
            e = s.args[2]
            if not (e.kind == "call" and e.args[0] == "map" and len(e.args[1]) == 3):
                raise self.c.prog.error("a state array is updated by map(a, b, f) or "
                                        "scatter", e)
            a, b, fn = e.args[1]
            f = self.c.funcs[fn.args[0]]
            (pa, _), (pb, _) = f.params
            va = self.ex.conv(f"{self.arr(a)}[i_]", a.ty.elem(), pa)
            vb = self.ex.conv(f"{self.arr(b)}[i_]", b.ty.elem(), pb)
            call = self.ex.conv(f"u_{f.name}(c, {va}, {vb}, i_)", f.ret, Type("float"))
            self.state_loop(s.args[0].args[0], call)
            return
        if s.kind == "expr_stmt" and s.args[0].kind == "call" and s.args[0].args[0] == "scatter":
            x, idx, val = s.args[0].args[1]
            v = self.ex.conv(self.ex.expr(val), val.ty, Type("float"))
            self.scatter_loop(self.length(idx), f"{self.arr(x)}[{self.arr(idx)}[i_]] = {v};")
            return
        if self.special(s):
            return
        if s.kind == "assign" and s.args[0].ty.array:
            raise self.c.prog.error("arrays are declared with their value (int32* idx = "
                                    "filter(...)), not reassigned", s)
        self.scalar(s)

    def scatter_output(self, e: Node) -> Tuple[Node, Node, str, str]:
        """Decode's output ``scatter(idx, vals)``: the two array nodes and their pointers.

        Raises:
            CompllError: the output is assigned anything else.
        """
        if not (e.kind == "call" and e.args[0] == "scatter" and len(e.args[1]) == 2):
            raise self.c.prog.error("decode's output here is scatter(idx, vals)", e)
        idx, vals = e.args[1]
        return idx, vals, self.arr(idx), self.arr(vals)

    def concat_arrays(self, lay: Any) -> Iterator[Tuple[int, Node]]:
        """Concat's arrays in layout order: (position, name node).

        Raises:
            CompllError: an array argument is not a named float* or int32* array.
        """
        for j, (a, t) in enumerate(lay.arrays):
            if a.kind != "var" or t.name not in ("float", "int32"):
                raise self.c.prog.error("concat's arrays here are named float* or int32* "
                                        "arrays", a)
            yield j, a


def read_extra_fields(lay: Any, ex: Any, fail: str, memcpy: str, int64: str) -> List[str]:
    """Extract's header: check ``extra``'s length, read each field, start the body offset.

    Args:
        lay: the ``interp.layout`` of extract's arguments.
        ex: the target's ``ExprC`` (names the scalars the fields land in).
        fail: the target's error exit, a format string of the error code
            (``"return {};"`` in C).
        memcpy: the target's byte copy (``memcpy``, ``cl_memcpy`` on the device).
        int64: the target's 64-bit integer spelling.

    Returns:
        The lines, ending with the body offset ``off_``'s declaration.
    """
    out = [f"    if (extra_len < {lay.extra_nbytes}) {fail.format(3)}"]
    for a, t, off in lay.fields:
        tgt = ex.name(a.args[0])
        if t.name == "uint":
            out.append(f"    {tgt} = extra[{off}];")
        else:
            out.append(f"    {{ {ctype(t)} v_; {memcpy}(&v_, extra + {off}, {_size(t)}); "
                       f"{tgt} = v_; }}")
    out.append(f"    {int64} off_ = 0;")
    return out


def write_extra_fields(lay: Any, ex: Any, memcpy: str) -> List[str]:
    """Concat's header: each field's value converted to its type and stored in ``extra``.

    Args:
        lay: the ``interp.layout`` of concat's arguments.
        ex: the target's ``ExprC`` (renders the field values).
        memcpy: the target's byte copy (``memcpy``, ``cl_memcpy`` on the device).

    Returns:
        The lines, one a field.
    """
    out = []
    for a, t, off in lay.fields:
        v = ex.conv(ex.expr(a), a.ty, t)
        if t.name == "uint":
            out.append(f"    extra[{off}] = (uint8_t)({v});")
        else:
            out.append(f"    {{ {ctype(t)} v_ = {v}; {memcpy}(extra + {off}, &v_, {_size(t)}); }}")
    return out


def counted_arrays(c: Any, lay: Any) -> Iterator[Tuple[int, str, Type, Node]]:
    """Extract's ``name[count]`` arrays in layout order: (position, name, type, count).

    Raises:
        CompllError: an array argument is not written ``name[count]``.
    """
    for j, (a, t) in enumerate(lay.arrays):
        if a.kind != "index":
            raise c.prog.error("extract reads these arrays as name[count]", a)
        yield j, a.args[0].args[0], t, a.args[1]


class NativeRunner:
    """Base of the C runners: the ctypes glue of a built program library.

    A subclass sets ``c`` (the checked program) and ``lib`` (the loaded library).
    """

    @staticmethod
    def _stem(c: Any) -> str:
        """The library's file stem: ``compll_`` and the program file's name, C-safe."""
        return "compll_" + "".join(ch if ch.isalnum() else "_" for ch in
                                   c.prog.filename.rsplit("/", 1)[-1].split(".")[0])[:40]

    def _bind_decode(self) -> None:
        """Declare ``cl_decode``'s C signature (where the program has a decode)."""
        if self.c.decode is not None:
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            self.lib.cl_decode.argtypes = [p, i64, p, i64, p, i64, p]
            self.lib.cl_decode.restype = ctypes.c_int

    def _params(self, params: Dict[str, Any]) -> Any:
        """The program's parameters, in declaration order, as a C double array."""
        vals = [float(params[pn]) for pn, _, _, _ in self.c.params]
        return (ctypes.c_double * max(len(vals), 1))(*vals)
