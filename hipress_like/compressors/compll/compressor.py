"""A CompLL program as a normal ``Compressor``: registration with no integration code.

``register_dsl(path_or_source, name=...)`` parses and checks the program,
then registers a factory that builds ``DslCompressor`` objects taking the
``param`` block's fields as keyword parameters (defaults and choices
checked as the hand-written compressors check theirs). Payloads use the
common header (``payload.py``): the scalars of ``concat`` are the header's
algorithm fields (laid out like a C struct), its arrays the body.

The wire id comes from ``@wire(id)``: a program that declares the id of a
hand-written compressor promises that compressor's byte format, so either
decodes the other's payloads (the shipped six do, and the tests check it).
Without ``@wire`` the program gets a free id from 200 up. Capabilities come
from ``@capabilities(...)``; what is not declared is inferred: category
"quantization" when the body holds sub-byte codes, stateful (seed and step)
when the program draws random numbers, fixed size always (every array has
the gradient's length).

Execution: float32 CPU tensors run the generated C (``render_c``), built by
the project's native builder and cached by a hash of the source; float32
CUDA tensors run the generated CUDA (``render_cuda``) where cupy is
installed; every other case runs the reference interpreter (``interp``),
which gives the same bytes. Programs of other kinds get subclasses:
state-array programs ``sparse_compressor.SparseDslCompressor``, round
programs (``@rounds(k)``, PowerSGD) ``rounds_compressor.RoundsDslCompressor``.
"""
from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch

from ..base import (
    Capabilities,
    Compressor,
    State,
    check_gradient,
    decode_output,
    header_nbytes,
    pack_payload,
    unpack_payload,
)
from ..ops import mix_seed, packed_nbytes
from ..params import ParamError
from ..payload import PayloadError
from ..registry import _REGISTRY, register
from .checker import Checked, check
from .interp import Interpreter, layout
from .syntax import Node, find_node, parse

__all__ = ["DslCompressor", "register_dsl", "load", "compile_program", "get_program"]

_log = logging.getLogger(__name__)
_FREE_IDS = iter(range(200, 256))
_lock = threading.Lock()
# compressor classes of other program kinds, registered by their modules (the package
# __init__ imports them): "sparse" -> sparse_compressor.SparseDslCompressor
_BASES: Dict[str, type] = {}


def load(path_or_source: Union[str, Path], filename: Optional[str] = None) -> Checked:
    """Parse and check a program given as a path (an existing ``.compll`` file) or as source.

    Raises:
        CompllError: syntax or type errors, located.
    """
    src, fname = _source(path_or_source, filename)
    return check(parse(src, fname))


def _source(path_or_source: Union[str, Path], filename: Optional[str]) -> Tuple[str, str]:
    if isinstance(path_or_source, Path) or (
            isinstance(path_or_source, str) and "\n" not in path_or_source
            and path_or_source.endswith(".compll")):
        p = Path(path_or_source)
        return p.read_text(), filename or str(p)
    return str(path_or_source), filename or "<compll>"


def compile_program(checked: Checked) -> Any:
    """The generated-C backend of ``checked`` (built and cached), or None without a compiler."""
    from .checker import is_sparse
    from .render_c import NativeProgram
    from .render_rounds import RoundsNativeProgram
    from .render_seq import SeqNativeProgram
    program = SeqNativeProgram if is_sparse(checked) else (
        RoundsNativeProgram if checked.rounds else NativeProgram)
    try:
        return program(checked)
    except Exception as e:  # a missing toolchain must not break training: interpret
        _log.warning("CompLL: C backend of %s unavailable (%s: %s); using the interpreter",
                     checked.prog.filename, type(e).__name__, e)
        return None


def _capabilities(c: Checked) -> Capabilities:
    decl = dict(c.metas.get("capabilities", {}))
    if c.rounds:  # a round program (rounds_compressor.py): every round summed
        from .matrices import round_capabilities
        try:
            return round_capabilities(decl, len(c.rounds))
        except (TypeError, ValueError) as e:
            raise c.prog.error(f"@capabilities: {e}", c.prog.metas[0]) from None
    enc = c.encode.body
    sub_byte = _has_subbyte(c)
    decl.setdefault("category", "quantization" if sub_byte else "none")
    decl.setdefault("stateful", c.uses_random)
    decl.setdefault("fixed_size", True)
    # the generated C tests NaN/Inf in its sweep over g (render_c's nf_, render_seq's
    # cl_any_nonfinite); the other backends scan first (encode's check_gradient)
    decl.setdefault("checks_finite", True)
    try:
        return Capabilities(**decl)
    except (TypeError, ValueError) as e:
        raise c.prog.error(f"@capabilities: {e}", c.prog.metas[0] if c.prog.metas else enc) \
            from None


def _has_subbyte(c: Checked) -> bool:
    return find_node(c.encode.body, lambda n: n.kind == "decl" and n.args[0].array
                     and n.args[0].name == "uint") is not None


class DslCompressor(Compressor):
    """A compressor generated from a CompLL program (see the module docstring).

    Args:
        **params: the program's ``param`` block fields (unknown names raise).
    """

    checked: Checked
    native: Any = None

    def __init__(self, **params: Any) -> None:
        known = {pn: (pt, dv, cv) for pn, pt, dv, cv in self.checked.params}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ParamError(f"{self.name}: unknown parameter(s) {unknown}; expected "
                             f"{sorted(known) or 'none'} (the program's param block)")
        vals: Dict[str, Any] = {}
        for pn, (pt, dv, cv) in known.items():
            v = params.get(pn, dv)
            if v is None:
                raise ParamError(f"{self.name}: parameter {pn!r} has no default; pass "
                                 f"{pn}=<{pt}>")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ParamError(f"{self.name}: parameter {pn!r} must be a finite number, "
                                 f"found {v!r}")
            if pt.name in ("uint", "int32", "int64") and v != int(v):
                raise ParamError(f"{self.name}: parameter {pn!r} is {pt}, found {v!r}; "
                                 f"pass an integer")
            if cv is not None and v not in cv:
                raise ParamError(f"{self.name}: parameter {pn!r} must be one of {cv}, found "
                                 f"{v!r}")
            vals[pn] = int(v) if pt.name in ("uint", "int32", "int64") else float(v)
        self._params = vals

    def params(self) -> Dict[str, Any]:
        """Constructor parameters (the param block's values)."""
        return dict(self._params)

    # -- layout ----------------------------------------------------------
    def _concat(self) -> Node:
        cls = type(self)
        node = cls.__dict__.get("_concat_node")
        if node is None:
            node = _find_call(self.checked.encode.body, "concat")
            if node is None:
                raise self.checked.prog.error("encode never calls concat(...)",
                                              self.checked.encode.node)
            cls._concat_node = node
            cls._layout = layout(node.args[1])
        return node

    def _body_nbytes(self, n: int) -> int:
        total = 0
        self._concat()
        for a, t in type(self)._layout.arrays:
            bits = self._bits_of(a, t)
            total += packed_nbytes(n, bits) if bits else n * (8 if t.name in (
                "double", "int64") else 4)
        return total

    def _bits_of(self, a: Node, t: Any) -> int:
        """Element width of a body array (0: not a packed unsigned array)."""
        if t.name != "uint":
            return 0
        decl = _decl_type(self.checked.encode.body, a.args[0]) if a.kind == "var" else None
        b = (decl or t).bits
        if isinstance(b, Node):
            b = int(self._params[b.args[0][-1]])
        return b

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Header (with the concat's scalar fields) plus the body arrays' bytes."""
        return header_nbytes(ndim, layout(self._concat().args[1]).extra_nbytes) + \
            self._body_nbytes(numel)

    # -- encode / decode -------------------------------------------------
    def _seed(self, state: State) -> int:
        if not self.checked.uses_random:
            return 0
        if not isinstance(state, dict) or "seed" not in state or "step" not in state:
            raise ValueError(f"{self.name} draws random numbers and needs the state from "
                             f"init(grad, seed) with 'seed' and 'step', found {state!r}")
        from ..ops import _fmix32
        s = _fmix32(_fmix32(int(state["seed"]) & 0xFFFFFFFF) ^ (int(state["step"]) & 0xFFFFFFFF)
                    ^ 0x85EBCA6B)  # terngrad.step_seed: the same stream as the hand-written one
        return mix_seed(s)

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Run the program's encode; the new state has ``step`` + 1 when it draws randomness.

        Raises:
            TypeError: non-tensor or non-float input.
            ValueError: empty input, NaN/Inf in it, or a missing seed/step state.
        """
        native = self._native() if grad.dtype == torch.float32 and grad.device.type == "cpu" \
            else None
        fast = native is not None
        # C tests NaN/Inf itself; the others scan even where the engine vouched, since
        # the engine leaves the scan to a compressor that declares checks_finite
        check_gradient(grad, nonfinite="ignore" if fast else "always")
        seed = self._seed(state)
        g = grad.detach().contiguous().reshape(-1)
        n = g.numel()
        self._concat()
        lay = type(self)._layout
        payload, body = pack_payload(self.algo_id, grad.dtype, grad.shape,
                                     bytes(lay.extra_nbytes), self._body_nbytes(n), g.device)
        start = header_nbytes(grad.dim(), 0)
        cuda = self._cuda() if g.is_cuda and g.dtype == torch.float32 else None
        if fast:
            native.encode(g, payload[start:start + lay.extra_nbytes], body, self._params, seed)
        elif cuda is not None:
            cuda.encode(g, payload[start:start + lay.extra_nbytes], body, self._params, seed)
            if cuda.error():
                raise ValueError(f"{self.name}: CUDA encode failed with error {cuda.error()}")
        else:
            extra, arrays = Interpreter(self.checked, self._params).encode(g.cpu(), seed)
            if extra:  # (frombuffer refuses an empty buffer: a concat of arrays only)
                payload[start:start + len(extra)] = torch.frombuffer(
                    bytearray(extra), dtype=torch.uint8).to(g.device)
            if arrays:
                body.copy_(torch.cat([a.reshape(-1) for a in arrays]).to(g.device))
        new_state = state
        if self.checked.uses_random:
            new_state = dict(state)
            new_state["step"] = int(state["step"]) + 1
        return payload, new_state

    def _extra_nbytes(self) -> int:
        """Bytes of the payload's extra fields (the layout of the program's ``concat``)."""
        self._concat()
        return type(self)._layout.extra_nbytes

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the program's decode into the original shape and dtype.

        Raises:
            PayloadError: malformed, foreign or wrongly sized payload.
        """
        h = unpack_payload(payload, self.algo_id)
        want = self._extra_nbytes()
        if len(h.extra) < want:
            raise PayloadError(f"{self.name} payload extra has {len(h.extra)} bytes, expected "
                               f"{want}")
        dev = payload.device
        res = decode_output(h, out, dev)
        native = self._native() if h.dtype == torch.float32 and dev.type == "cpu" else None
        try:
            cuda = self._cuda() if dev.type == "cuda" and h.dtype == torch.float32 else None
            if native is not None and h.dtype == torch.float32 and dev.type == "cpu":
                native.decode(h.extra, h.body, res.view(-1), self._params)
            elif cuda is not None:
                hn = header_nbytes(len(h.shape), 0)
                cuda.decode(payload[hn:hn + len(h.extra)], h.body, res.view(-1), self._params)
                if cuda.error():
                    raise ValueError(f"CUDA decode failed with error {cuda.error()} (a width "
                                     "outside 1, 2, 4, 8 or a short payload)")
            else:
                flat = Interpreter(self.checked, self._params).decode(h.extra, h.body.cpu(),
                                                                      h.numel)
                res.view(-1).copy_(flat.to(h.dtype))
        except ValueError as e:
            raise PayloadError(f"{self.name}: {e}") from e
        return res

    cuda: Any = None

    def _cuda(self) -> Any:
        """The CUDA backend (cupy.RawModule), or None without cupy or a GPU."""
        cls = type(self)
        if cls.cuda is None:
            with _lock:
                if cls.cuda is None:
                    try:
                        cls.cuda = self._make_cuda()
                    except Exception as e:  # no cupy / no GPU: the interpreter runs
                        _log.info("CompLL: no CUDA backend for %s (%s: %s)",
                                  self.checked.prog.filename, type(e).__name__, e)
                        cls.cuda = False
        return cls.cuda or None

    def _make_cuda(self) -> Any:
        """The program's cupy runner (``cuda_runners.CudaProgram`` for fused sweeps)."""
        from .cuda_runners import CudaProgram
        return CudaProgram(self.checked)

    def _native(self) -> Any:
        cls = type(self)
        if cls.native is None:
            with _lock:
                if cls.native is None:
                    cls.native = compile_program(self.checked) or False
        return cls.native or None


def _find_call(n: Any, name: str) -> Optional[Node]:
    return find_node(n, lambda x: x.kind == "call" and x.args[0] == name)


def _decl_type(n: Any, var: str) -> Any:
    d = find_node(n, lambda x: x.kind == "decl" and any(v.args[0] == var for v in x.args[1]))
    return None if d is None else d.args[0]


def register_dsl(path_or_source: Union[str, Path], name: Optional[str] = None,
                 replace: bool = False) -> type:
    """Compile a CompLL program and register it as compressor ``name``.

    Args:
        path_or_source: a ``.compll`` file path, or the program text.
        name: registry name (default: the file's stem).
        replace: allow re-registering ``name`` (a program edited at run time).

    Returns:
        The compressor class; ``hp.compressors.get(name, **params)`` builds instances.

    Raises:
        CompllError: the program does not parse or check (located message).
        ValueError: ``name`` is taken by another compressor.

    Example:
        >>> import hipress_like as hp
        >>> src = Path(hp.compressors.__file__).parent / "quantizers" / "tbq.compll"
        >>> cls = hp.compressors.register_dsl(src, name="tbq_dsl", replace=True)
        >>> c = hp.compressors.get("tbq_dsl", threshold=0.5)
        >>> p, _ = c.encode(torch.tensor([0.7, -0.2, -0.9, 0.5]), c.init(torch.zeros(4)))
        >>> c.decode(p).tolist()
        [0.5, 0.0, -0.5, 0.0]
    """
    checked = load(path_or_source)
    if name is None:
        name = Path(checked.prog.filename).stem if checked.prog.filename != "<compll>" \
            else None
        if not name:
            raise ValueError("register_dsl needs name= for a program given as source")
    key = name.strip().lower()
    wire = checked.metas.get("wire", {})
    algo_id = int(wire.get("0", wire.get("id", 0)) or 0)
    if not 1 <= algo_id <= 255:
        with _lock:
            algo_id = next(_FREE_IDS)
    caps = _capabilities(checked)
    from .checker import is_sparse
    base: type = DslCompressor
    if is_sparse(checked):  # state arrays or data-dependent payloads (sparse_compressor)
        base = _BASES["sparse"]
    elif checked.rounds:  # @rounds(k): encode_round0.., decode (rounds_compressor)
        base = _BASES["rounds"]
    cls = type(f"Dsl_{key}", (base,), {
        "name": key, "algo_id": algo_id, "capabilities": caps, "checked": checked,
        "native": None, "cuda": None, "__module__": __name__,
        "__doc__": f"CompLL program {checked.prog.filename} as a compressor."})

    def factory(**params: Any) -> DslCompressor:
        return cls(**params)

    factory.dsl_class = cls  # type: ignore[attr-defined]
    if replace:
        _REGISTRY.pop(key, None)
    register(key)(factory)  # a factory function: its wire id may match a hand-written one
    return cls


def _rebuild(source: str, filename: str, name: str, params: Dict[str, Any]) -> DslCompressor:
    """Unpickle a DslCompressor: reuse the registered class of the same source, or register it."""
    factory = _REGISTRY.get(name)
    cls = getattr(factory, "dsl_class", None)
    if cls is None or cls.checked.prog.source != source:
        cls = register_dsl(source if filename == "<compll>" else source, name=name,
                           replace=True)
    return cls(**params)


def _reduce(self: DslCompressor) -> Any:
    return (_rebuild, (self.checked.prog.source, self.checked.prog.filename, self.name,
                       self._params))


DslCompressor.__reduce__ = _reduce  # type: ignore[method-assign, assignment]


def get_program(path: str, **params: Any) -> DslCompressor:
    """A compressor of the CompLL program at ``path`` (``registry.get`` of a ``.compll``
    name): registered as ``<stem>.compll`` (so ``tbq.compll`` never shadows the
    hand-written ``tbq``) unless that name already holds this source.

    Raises:
        CompllError: the program does not parse or check.
        OSError: the file cannot be read.
        ValueError: the stem names another compressor.
    """
    p = Path(path)
    if not p.exists() and len(p.parts) == 1:  # a shipped program by name: "powersgd.compll"
        from . import PROGRAMS, program_path
        if p.stem in PROGRAMS:
            p = program_path(p.stem)
    src = p.read_text()
    key = Path(path).stem.strip().lower() + ".compll"
    cls = getattr(_REGISTRY.get(key), "dsl_class", None)
    if cls is None or cls.checked.prog.source != src:
        cls = register_dsl(p, name=key, replace=cls is not None)
    return cls(**params)
