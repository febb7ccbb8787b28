"""CompLL's reference interpreter on torch tensors: the oracle of the generated code.

It runs a checked program directly: scalars are 0-d tensors of their CompLL
type (float is float32, double float64, int32/uint<k> int32, int64 int64),
arrays 1-D tensors (sub-byte arrays hold one int32 code per element until
``concat`` packs them). A user function is evaluated on whole tensors at
once: ``map(g, f)`` binds f's parameter to all of g and each ``if`` becomes
a mask, so a branch's assignments and returns apply only where its
condition holds (``torch.where``), the vectorised reading of C's per-element
semantics. An entry point's own ``if`` on a scalar branches for real (so
an array or matrix assigned in one branch only is assigned only then).
Arithmetic converts both operands to the type the checker gave the
expression before applying the operator, as the generated C does, so the
two agree bit for bit (floating-point contraction is off in both).

``random<float>(a, b)`` inside a mapped function is element i's number of the
counter-based hash stream (``ops.uniform``'s ``_uniform_from_counter``), keyed
by the call's seed: the same stream as the hand-written TernGrad.
Reductions: min, max and sums (in float64 for floats, int64 for integers).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..ops import _as_i32, _uniform_from_counter, packed_nbytes
from . import arrays, matrices
from .checker import ARRAY_OPS, MATRIX_OPS, REDUCTIONS, Checked, Func
from .syntax import Node, Type

__all__ = ["Interpreter", "dtype_of", "pack_planar", "unpack_planar", "Layout", "layout"]

_DT = {"float": torch.float32, "double": torch.float64, "int32": torch.int32,
       "int64": torch.int64, "uint": torch.int32, "bool": torch.bool}
_FMT = {"float": "f", "double": "d", "int32": "i", "int64": "q", "bool": "?"}


def dtype_of(t: Type) -> torch.dtype:
    """The torch dtype holding values of CompLL type ``t`` (arrays: of their elements)."""
    return _DT[t.name]


def convert(v: torch.Tensor, t: Type) -> torch.Tensor:
    """C's conversion of ``v`` to scalar type ``t`` (float to int truncates; uint<k> masks)."""
    dt = _DT[t.name]
    if t.name == "bool":
        return v != 0
    if v.dtype == dt:
        out = v
    elif v.is_floating_point() and not dt.is_floating_point:
        out = torch.trunc(v).to(torch.int64).to(dt)
    else:
        out = v.to(dt)
    if t.name == "uint" and isinstance(t.bits, int):
        out = out & ((1 << t.bits) - 1)
    return out


def pack_planar(codes: torch.Tensor, bits: int, pad_codes: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """Pack int codes (< 2**bits) planar: byte j holds elements j, m + j, ... (m = n // per).

    The last ``n - m * per`` elements go into one extra byte (fields 0, 1, ...);
    its unused fields hold ``pad_codes`` (default 0). The layout of the
    hand-written quantizers (``_fused``, rule 1), ``packed_nbytes(n, bits)`` bytes.
    """
    per = 8 // bits
    n = codes.numel()
    m = n // per
    out = torch.zeros(packed_nbytes(n, bits), dtype=torch.int32)
    c = codes.to(torch.int32) & ((1 << bits) - 1)
    for k in range(per):
        out[:m] |= c[k * m:(k + 1) * m] << (k * bits)
    t = n - m * per
    if t:
        last = 0
        for k in range(per):
            code = int(c[m * per + k]) if k < t else (
                int(pad_codes[k]) & ((1 << bits) - 1) if pad_codes is not None else 0)
            last |= code << (k * bits)
        out[m] = last
    return out.to(torch.uint8)


def unpack_planar(body: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Codes of ``pack_planar`` (int32, ``n`` of them)."""
    per = 8 // bits
    m = n // per
    b = body.to(torch.int32)
    mask = (1 << bits) - 1
    parts = [(b[:m] >> (k * bits)) & mask for k in range(per)]
    t = n - m * per
    if t:
        parts.append(torch.tensor([(int(b[m]) >> (k * bits)) & mask for k in range(t)],
                                  dtype=torch.int32))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


class Layout:
    """Where concat puts things: scalar fields (name, type, offset) and the body arrays."""

    def __init__(self) -> None:
        self.fields: List[Tuple[Node, Type, int]] = []
        self.extra_nbytes = 0
        self.arrays: List[Tuple[Node, Type]] = []


def _size(t: Type) -> int:
    return {"float": 4, "double": 8, "int32": 4, "int64": 8, "uint": 1, "bool": 1}[t.name]


def layout(items: List[Node]) -> Layout:
    """The C-struct layout of concat's/extract's scalars (each aligned to its size).

    The arrays follow, in order, in the body."""
    lay = Layout()
    off = 0
    for a in items:
        if a.ty.array:
            lay.arrays.append((a, a.ty))
            continue
        sz = _size(a.ty)
        off = (off + sz - 1) // sz * sz
        lay.fields.append((a, a.ty, off))
        off += sz
    lay.extra_nbytes = off
    return lay


class Interpreter:
    """Runs a checked program's encode or decode on torch tensors (CPU or any device).

    Args:
        checked: the checked program.
        params: the parameter values by name.
    """

    def __init__(self, checked: Checked, params: Dict[str, Any],
                 state: Optional[Dict[str, torch.Tensor]] = None, raw_seed: int = 0,
                 step: int = 0) -> None:
        self.c = checked
        self.params = dict(params)
        self.state = {} if state is None else state  # state arrays by name (flat float32)
        self.raw_seed, self.step = int(raw_seed), int(step)

    # ------------------------------------------------------------ entry points
    def encode(self, grad: torch.Tensor, seed: int = 0) -> Tuple[bytes, List[Tuple[torch.Tensor,
                                                                                     int]]]:
        """Run encode on flat float ``grad``.

        Returns:
            (the header extra bytes, the body arrays as (uint8 packed tensor or values, bits)).
        """
        self.seed = torch.tensor(_as_i32(seed), dtype=torch.int32)
        self.n = grad.numel()
        self.dev = grad.device
        f = self.c.encode
        env: Dict[str, Any] = {}
        env[f.params[0][1]] = grad.reshape(-1).to(torch.float32)
        if arrays.is_sparse(self.c):
            env["step"] = torch.tensor(self.step, dtype=torch.int64)
        env[f.params[1][1]] = None
        self.out: Optional[Tuple[bytes, list]] = None
        self._run_entry(f, env)
        if self.out is None:
            raise ValueError(f"{self.c.prog.filename}: encode never assigned "
                             f"{f.params[1][1]} = concat(...)")
        return self.out

    def decode(self, extra: bytes, body: torch.Tensor, n: int) -> torch.Tensor:
        """Run decode on a payload's extra bytes and body; return the flat float32 gradient."""
        f = self.c.decode
        if f is None:
            raise ValueError(f"{self.c.prog.filename} has no decode function")
        self.n, self.dev = n, body.device
        self.seed = torch.zeros((), dtype=torch.int32)
        self.extra, self.body = extra, body
        env: Dict[str, Any] = {f.params[0][1]: body, f.params[1][1]: None}
        self._run_entry(f, env)
        res = env[f.params[1][1]]
        if res is None:
            raise ValueError(f"{self.c.prog.filename}: decode never assigned "
                             f"{f.params[1][1]} = map(...)")
        return res

    def run_round(self, f: Func, grad: torch.Tensor, shape: Tuple[int, ...],
                  aggregate: Optional[Tuple[bytes, torch.Tensor]], seed: int, step: int,
                  world_size: int) -> Any:
        """Run an entry point of a round program (``matrices.py``).

        Args:
            f: encode_round<i> or decode.
            grad: the flat float gradient (its values are read by round 0 only).
            shape: the gradient's shape (its matrix view).
            aggregate: (extra bytes, body) of the merged payload the entry reads
                (round i > 0: round i-1's; decode: the last round's), or None.
            seed: the mixed key of ``random`` (``ops.mix_seed(shared_seed)``).
            step, world_size: the values of ``step`` and ``world_size``.

        Returns:
            (extra bytes, body arrays) for a round; the flat gradient for decode.
            The state matrices are in ``self.globals`` afterwards.
        """
        self.seed = torch.tensor(_as_i32(seed), dtype=torch.int32)
        self.shape = tuple(int(x) for x in shape)
        r, c = matrices.matrix_shape(self.shape)
        self.n, self.dev = r * c, torch.device("cpu")  # extract's bound: the padded matrix
        if aggregate is not None:
            self.extra, self.body = aggregate
        names = [pn for _, pn in f.params if _.name != "struct"]
        env: Dict[str, Any] = {}
        g = grad.reshape(-1).to(torch.float32)
        if f.name == "decode":
            env = {names[0]: self.body, names[1]: None}
        elif f.name == "encode_round0":
            env = {names[0]: g, names[1]: None}
        else:
            env = {names[0]: self.body, names[1]: g, names[2]: None}
        env["step"] = torch.tensor(int(step), dtype=torch.int64)
        env["world_size"] = torch.tensor(int(world_size), dtype=torch.int64)
        self.out = None
        self._run_entry(f, env)
        if f.name == "decode":
            res = env[names[1]]
            if res is None:
                raise ValueError(f"{self.c.prog.filename}: decode never assigned {names[1]}")
            return res.reshape(-1)[:math.prod(self.shape)]
        if self.out is None:
            raise ValueError(f"{self.c.prog.filename}: {f.name} never assigned "
                             f"{names[-1]} = concat(...)")
        return self.out

    shape: Tuple[int, ...] = ()

    def _run_entry(self, f: Func, env: Dict[str, Any]) -> None:
        self.entry = f
        self.globals: Dict[str, Any] = {}
        for name, ty in self.c.globals.items():
            self.globals[name] = self.state.get(name) if ty.array else \
                torch.zeros((), dtype=dtype_of(ty))
        self.index = None
        self.pads: Dict[str, Any] = {}
        self.types: Dict[str, Type] = {}
        self.done = None
        self.fn = None
        self.mask = torch.ones((), dtype=torch.bool)
        self._exec_block(f.body, [env])

    # ------------------------------------------------------------ statements
    def _lookup(self, scopes: List[Dict[str, Any]], name: str) -> Tuple[Dict[str, Any], Any]:
        for s in reversed(scopes):
            if name in s:
                return s, s[name]
        if name in self.globals:
            return self.globals, self.globals[name]
        if name in self.params:
            return self.params, self._param(name)
        raise KeyError(name)  # pragma: no cover - the checker rejects unknown names

    def _param(self, name: str) -> torch.Tensor:
        for pn, pt, _, _ in self.c.params:
            if pn == name:
                return convert(torch.tensor(self.params[name], dtype=torch.float64), pt)
        raise KeyError(name)  # pragma: no cover

    def _exec_block(self, blk: Node, scopes: List[Dict[str, Any]]) -> None:
        scopes = scopes + [{}]
        for s in blk.args[0]:
            self._exec(s, scopes)

    def _store(self, scope: Dict[str, Any], name: str, value: Any, ty: Type,
               fresh: bool = False) -> None:
        if ty.array or value is None:
            scope[name] = value
            return
        v = convert(value, ty)
        old = None if fresh else scope.get(name)
        live = self.mask & ~self.done if self.done is not None else self.mask
        if old is None:
            old = torch.zeros((), dtype=v.dtype)
        scope[name] = torch.where(live, v, old) if not bool(live.all()) else (
            v.expand(live.shape) if v.dim() < live.dim() else v)

    def _exec(self, s: Node, scopes: List[Dict[str, Any]]) -> None:
        k = s.kind
        if k == "block":
            self._exec_block(s, scopes)
        elif k == "decl":
            ty = s.args[0]
            for d in s.args[1]:
                name, init = d.args
                if ty.array and isinstance(ty.bits, Node) and init is not None:
                    ty = Type(ty.name, True, self._width(ty.bits, scopes), ty.struct)
                val = self._eval(init, scopes) if init is not None else (
                    None if ty.array else torch.zeros((), dtype=dtype_of(ty)))
                if ty.array and init is not None and init.kind == "call" and \
                        init.args[0] == "map":
                    self.pads[name] = self.last_pad
                self._store(scopes[-1], name, val, ty, fresh=True)
                self.types[name] = ty
        elif k == "assign":
            lv, op, e = s.args
            name = lv.args[0]
            scope, old = self._lookup(scopes, name)
            val = self._eval(e, scopes)
            if op != "=":
                tt = lv.ty
                val = _binary(op[:-1], convert(old, tt), val, tt)
            if self.entry is not None and name in self._outputs():
                scope[name] = val  # the output array
                return
            if isinstance(val, torch.Tensor) and val.dim() == 2 and lv.ty.array and \
                    not lv.ty.matrix:  # a matrix into a gradient-length array (matrices.py)
                val = matrices.first_n(val, math.prod(self.shape))
            self._store(scope, name, val, lv.ty)
        elif k == "if":
            c = self._eval(s.args[0], scopes) != 0
            if self.fn is None and c.dim() == 0:  # an entry point's statement: branch
                taken = s.args[1] if bool(c) else s.args[2]  # (array assignments included)
                if taken is not None:
                    self._exec(taken, scopes)
                return
            saved = self.mask
            self.mask = saved & c
            self._exec(s.args[1], scopes)
            if s.args[2] is not None:
                self.mask = saved & ~c
                self._exec(s.args[2], scopes)
            self.mask = saved
        elif k == "return":
            f = self.fn
            v = convert(self._eval(s.args[0], scopes), f.ret)
            live = self.mask & ~self.done
            self.ret = torch.where(live, v, self.ret)
            self.done = self.done | live
        elif k == "expr_stmt":
            self._eval(s.args[0], scopes)

    def _outputs(self) -> Tuple[str, ...]:
        """The entry point's output parameter (encode_round<i>>0: its third)."""
        ps = self.entry.params
        return (ps[2][1],) if self.entry.name.startswith("encode_round") and \
            self.entry.name != "encode_round0" else (ps[1][1],)

    # ------------------------------------------------------------ functions
    done: Optional[torch.Tensor] = None
    fn: Optional[Func] = None

    def _call_user(self, f: Func, args: List[torch.Tensor], index: Optional[torch.Tensor]
                   ) -> torch.Tensor:
        saved = (self.fn, self.ret if self.fn else None, self.done, self.mask, self.index)
        shape = max((a.shape for a in args), key=len) if args else ()
        if index is not None and index.dim() > len(shape):
            shape = index.shape
        self.fn = f
        self.ret = torch.zeros(shape, dtype=dtype_of(f.ret))
        self.done = torch.zeros(shape, dtype=torch.bool)
        self.mask = torch.ones(shape, dtype=torch.bool)
        self.index = index if index is not None else self.index
        env = {pn: convert(a, pt) for (pt, pn), a in zip(f.params, args)}
        self._exec_block(f.body, [env])
        out = self.ret
        self.fn, self.ret, self.done, self.mask, self.index = saved
        return out

    # ------------------------------------------------------------ expressions
    last_pad: Any = None

    def _width(self, w: Any, scopes: List[Dict[str, Any]]) -> int:
        if isinstance(w, int):
            return w
        name = w.args[0][-1]
        try:
            _, v = self._lookup(scopes, name)
        except KeyError:
            v = self._param(name)
        b = int(v)
        if b not in (1, 2, 4, 8):
            raise ValueError(f"{self.c.prog.filename}: uint<{name}> = uint<{b}>, widths must "
                             "be 1, 2, 4 or 8")
        return b

    def _eval(self, e: Node, scopes: List[Dict[str, Any]]) -> Any:
        k = e.kind
        if k in ("int", "float", "bool"):
            return torch.tensor(e.args[0], dtype=dtype_of(e.ty))
        if k == "var":
            try:
                return self._lookup(scopes, e.args[0])[1]
            except KeyError:
                return self._param(e.args[0])
        if k == "field":
            obj, fname = e.args
            if fname == "size":
                v = self._eval(obj, scopes)
                return torch.tensor(self.n if v is None else v.numel(), dtype=torch.int64)
            if fname in ("rows", "cols", "T") and self.c.rounds:
                return matrices.interp_field(self, e, scopes)
            return self._param(fname)
        if k == "index":
            a = self._eval(e.args[0], scopes)
            return a[self._eval(e.args[1], scopes).to(torch.int64)]
        if k == "cast":
            return convert(self._eval(e.args[1], scopes), e.args[0])
        if k == "unop":
            op, a = e.args
            v = self._eval(a, scopes)
            if op == "!":
                return v == 0
            v = convert(v, e.ty)
            return -v if op == "-" else (~v if op == "~" else v)
        if k == "binop":
            op, a, b, common = e.args
            va, vb = self._eval(a, scopes), self._eval(b, scopes)
            if op in ("&&", "||"):
                return (va != 0) & (vb != 0) if op == "&&" else (va != 0) | (vb != 0)
            if op in ("<<", ">>"):
                return _binary(op, convert(va, e.ty), convert(vb, Type("int32")), e.ty)
            return _binary(op, convert(va, common), convert(vb, common), common)
        if k == "cond":
            c, a, b = e.args
            return torch.where(self._eval(c, scopes) != 0, convert(self._eval(a, scopes), e.ty),
                               convert(self._eval(b, scopes), e.ty))
        if k == "random":
            rt, (lo, hi) = e.args
            idx = self.index if self.index is not None else torch.zeros((), dtype=torch.int64)
            u = _uniform_from_counter((idx & 0xFFFFFFFF).to(torch.int64).to(torch.int32)
                                      if idx.dtype != torch.int32 else idx, self.seed)
            u = u.to(dtype_of(rt))
            vlo = convert(self._eval(lo, scopes), rt)
            vhi = convert(self._eval(hi, scopes), rt)
            return u * (vhi - vlo) + vlo
        if k == "call":
            return self._call(e, scopes)
        raise ValueError(f"cannot evaluate {k}")  # pragma: no cover

    def _call(self, e: Node, scopes: List[Dict[str, Any]]) -> Any:
        name, args = e.args
        if name in self.c.funcs:
            f = self.c.funcs[name]
            return self._call_user(f, [self._eval(a, scopes) for a in args], None)
        if name in ARRAY_OPS:
            return getattr(arrays, f"interp_{name}")(self, e, args, scopes)
        if name in MATRIX_OPS:
            return getattr(matrices, f"interp_{name}")(self, e, args, scopes)
        vals = [self._eval(a, scopes) for a in args] if name not in (
            "map", "reduce", "extract", "concat") else None
        if name == "range":
            return torch.arange(int(vals[0]), dtype=torch.int64)
        if vals is not None:
            return _builtin(name, vals, e.ty)
        return getattr(self, f"_op_{name}")(e, args, scopes)

    def _op_map(self, e: Node, args: List[Node], scopes: List[Dict[str, Any]]) -> torch.Tensor:
        if len(args) == 3 and args[2].kind == "var" and args[2].args[0] in self.c.funcs:
            a, b = self._eval(args[0], scopes), self._eval(args[1], scopes)
            if a.shape != b.shape:
                raise ValueError(f"map(a, b, f) of shapes {tuple(a.shape)} and "
                                 f"{tuple(b.shape)}: they must be equal")
            idx = torch.arange(a.numel(), dtype=torch.int64).reshape(a.shape)
            self.last_pad = None
            return self._call_user(self.c.funcs[args[2].args[0]], [a, b], idx)
        src = self._eval(args[0], scopes)
        f = self.c.funcs[args[1].args[0]]
        n = src.numel()
        idx = torch.arange(n, dtype=torch.int64).reshape(src.shape)
        out = self._call_user(f, [src], idx)
        self.last_pad = None
        if len(args) == 3:  # the padding element, coded in concat once the width is known
            self.last_pad = (f, self._eval(args[2], scopes))
        return out

    def _op_reduce(self, e: Node, args: List[Node], scopes: List[Dict[str, Any]]
                   ) -> torch.Tensor:
        src = self._eval(args[0], scopes)
        op = REDUCTIONS[args[-1].args[0]]
        if op == "sum":
            v = src.to(torch.float64 if src.is_floating_point() else torch.int64).sum()
        elif op == "min":
            v = src.amin()
        elif op == "max":
            v = src.amax()
        else:
            v = src.abs().amax()
        if len(args) == 3:
            init = convert(self._eval(args[1], scopes), e.ty)
            v = _binary({"sum": "+", "min": "min", "max": "max", "maxabs": "max"}[op],
                        convert(v, e.ty), init, e.ty)
        return convert(v, e.ty)

    def _op_concat(self, e: Node, args: List[Node], scopes: List[Dict[str, Any]]) -> int:
        lay = layout(args)
        extra = bytearray(lay.extra_nbytes)
        import struct
        for a, t, off in lay.fields:
            v = convert(self._eval(a, scopes), t)
            if t.name == "uint":
                extra[off] = int(v) & 0xFF
            else:
                struct.pack_into("<" + _FMT[t.name], extra, off, v.item())
        body = []
        for a, t in lay.arrays:
            v = self._eval(a, scopes)
            name = a.args[0] if a.kind == "var" else None
            if t.name in ("float", "int32") and arrays.is_sparse(self.c):
                body.append(v.to(dtype_of(t)).contiguous().view(torch.uint8))
                continue
            ty = self.types.get(name, t) if name else t
            bits = ty.bits if ty.name == "uint" else None
            if bits is not None and bits < 8:
                pad = self.pads.get(name)
                if pad is not None:  # field k of the last byte is element m * per + k
                    per = 8 // bits
                    m = v.numel() // per
                    idx = torch.arange(m * per, m * per + per, dtype=torch.int64)
                    pad = convert(self._call_user(pad[0], [pad[1].expand(per)], idx), ty.elem())
                body.append(pack_planar(v, bits, pad))
            elif bits == 8:
                body.append(v.to(torch.uint8))
            else:
                body.append(v.to(dtype_of(ty)).contiguous().view(torch.uint8))
        self.out = (bytes(extra), body)
        return 0

    def _op_extract(self, e: Node, args: List[Node], scopes: List[Dict[str, Any]]) -> int:
        import struct
        lay = layout(args[1:])
        if len(self.extra) < lay.extra_nbytes:
            raise ValueError(f"payload extra has {len(self.extra)} bytes, the program reads "
                             f"{lay.extra_nbytes}")
        for a, t, off in lay.fields:
            if t.name == "uint":
                v = torch.tensor(self.extra[off], dtype=torch.int32)
            else:
                v = torch.tensor(struct.unpack_from("<" + _FMT[t.name], self.extra, off)[0],
                                 dtype=dtype_of(t))
            scope, _ = self._lookup(scopes, a.args[0])
            scope[a.args[0]] = convert(v, t)
        pos = 0
        for a, t in lay.arrays:
            if a.kind == "index":  # name[count]: data-dependent length, 8-byte aligned
                pos = arrays.interp_extract_array(self, a, t, pos, scopes)
                continue
            bits = self._width(t.bits, scopes) if t.name == "uint" else None
            if bits is not None:
                nb = packed_nbytes(self.n, bits)
                chunk = self.body[pos:pos + nb]
                val = unpack_planar(chunk.cpu(), bits, self.n) if bits < 8 else chunk.to(
                    torch.int32)
            else:
                sz = _size(t) * self.n
                nb = sz
                val = self.body[pos:pos + nb].view(dtype_of(t)).clone()
            if pos + nb > self.body.numel():
                raise ValueError(f"payload body has {self.body.numel()} bytes, the program "
                                 f"reads {pos + nb}")
            pos += nb
            scope, _ = self._lookup(scopes, a.args[0])
            scope[a.args[0]] = val
        return 0


def _binary(op: str, a: torch.Tensor, b: torch.Tensor, t: Type) -> torch.Tensor:
    """``a op b`` with C semantics on operands already converted to type ``t``."""
    fl = t.name in ("float", "double")
    if op == "+":
        r = a + b
    elif op == "-":
        r = a - b
    elif op == "*":
        r = a * b
    elif op == "/":
        r = a / b if fl else torch.div(a, b, rounding_mode="trunc")
    elif op == "%":
        r = torch.fmod(a, b)
    elif op == "&":
        r = a & b
    elif op == "|":
        r = a | b
    elif op == "^":
        r = a ^ b
    elif op == "<<":
        r = a << b
    elif op == ">>":
        r = a >> b
    elif op == "min":
        r = torch.minimum(a, b)
    elif op == "max":
        r = torch.maximum(a, b)
    else:
        return {"<": torch.lt, ">": torch.gt, "<=": torch.le, ">=": torch.ge, "==": torch.eq,
                "!=": torch.ne}[op](a, b)
    return r.to(dtype_of(t)) if t.name != "uint" else r


def _builtin(name: str, vals: List[torch.Tensor], t: Type) -> torch.Tensor:
    """The elementwise builtins, in type ``t`` (C's math library semantics)."""
    if name == "fma":
        return arrays.fma(*[convert(x, t) for x in vals])
    if name == "pow":  # C's pow (Python's math.pow) for scalars, as the generated C
        a, b = convert(vals[0], t), convert(vals[1], t)
        if a.dim() == 0 and b.dim() == 0:
            import math
            return torch.tensor(math.pow(float(a), float(b)), dtype=a.dtype)
        return torch.pow(a, b)
    if name == "exponent":  # frexp's exponent (0 for 0), as C's frexp
        return torch.frexp(vals[0].to(torch.float64)).exponent.to(torch.int32)
    if name == "ldexp":
        x = convert(vals[0], t)
        return torch.ldexp(x, vals[1].to(torch.int64).to(x.dtype)).to(x.dtype)
    v = [convert(x, t) for x in vals]
    if name == "floor":
        return torch.floor(v[0])
    if name == "ceil":
        return torch.ceil(v[0])
    if name in ("abs", "fabs"):
        return v[0].abs()
    if name == "sign":
        return torch.sign(v[0])
    if name == "rint":
        return torch.round(v[0])  # half to even, as rint in the default rounding mode
    if name == "sqrt":  # sqrtf's correctly rounded root: torch.sqrt of float32 is not always
        return torch.sqrt(v[0].double()).to(v[0].dtype) if v[0].dtype == torch.float32 \
            else torch.sqrt(v[0])
    if name == "exp":
        return torch.exp(v[0])
    if name == "log":
        return torch.log(v[0])
    if name == "min":
        return torch.minimum(v[0], v[1])
    if name == "max":
        return torch.maximum(v[0], v[1])
    if name == "clamp":
        return torch.minimum(torch.maximum(v[0], v[1]), v[2])
    raise ValueError(f"unknown builtin {name}")  # pragma: no cover
