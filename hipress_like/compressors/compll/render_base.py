"""What CompLL's renderers share: one tree, several renderers.

The C (``render_c``), CUDA (``render_cuda``) and state-array (``render_seq``,
``render_cuda_seq``) targets render the same checked, lowered program. Like
a compiler's C-style renderer family (tinygrad's ``renderer/cstyle.py``
renders one program to C, CUDA and Metal), the logic that is the same for
every target lives here once, and each target supplies only what differs:

- ``LoopRenderer``: the element statements of a fused loop group (the
  reductions' updates and the map operator's stores), a loop's trip count
  and an array's byte size, for the C and CUDA loop renderers; a target
  overrides ``INT64`` (its 64-bit integer spelling), ``_acc`` (where a
  reduction accumulates) and ``_store`` (where a map writes its element);
- ``read_extra_fields``: extract's header fields read back from ``extra``
  (the inverse of concat's layout, ``interp.layout``), with the target's
  error exit and ``memcpy``;
- ``write_extra_fields``: concat's header fields written into ``extra``;
- ``counted_arrays``: extract's ``name[count]`` arrays of the state-array
  targets, in layout order.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

from .interp import _size
from .lower import Loop, ctype, reduction
from .syntax import Node, Type

__all__ = ["LoopRenderer", "counted_arrays", "read_extra_fields", "write_extra_fields"]


class LoopRenderer:
    """Base of the C and CUDA loop renderers: what both write the same way.

    A subclass sets ``c`` (the checked program), ``ex`` (its ``ExprC``) and
    defines ``elem`` (an array element read inside the loop).
    """

    INT64 = "int64_t"

    def _acc(self, x: Loop) -> str:
        """The accumulator a reduction ``x`` updates in the loop body."""
        return x.target

    def _store(self, x: Loop) -> str:
        """The byte pointer a map ``x`` stores its elements through."""
        return f"l_{x.target}"

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
