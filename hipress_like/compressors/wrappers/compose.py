"""``compose``: a sparsifier, then a quantizer of the values it keeps.

Horváth et al., "Natural Compression for Distributed Deep Learning" (2019),
compose their quantizer with sparsification, ``C_nat ∘ S^q``: keep ``q`` of
the ``d`` entries, then send each kept value with fewer bits. ``Compose``
does that for any sparsifier of ``sparse/topk.py`` (topk, randomk, dgc, graddrop)
and any single-round quantizer (terngrad, onebit, tbq, ...):

1. ``sparse_payload, s_state = sparsifier.encode(grad, s_state)``;
2. ``header, idx, vals = sparse.unpack_sparse(sparse_payload)``;
3. ``inner, q_state = quantizer.encode(vals, q_state)`` (``vals`` is 1-D, k long);
4. send the indices and ``inner`` behind this compressor's own header.

Decode is the reverse: the quantizer decodes the k values, which are
scattered at the indices into zeros.

Payload (``payload.py`` header, algorithm id 43):

    header extra: k (uint64), index item size in bytes (uint64),
                  inner payload length in bytes (uint64)
    body:         k indices exactly as in ``sparse/topk.py`` (int32, or int64 when
                  n > 2**31; strictly increasing; zero-padded to 8 bytes);
                  then the quantizer's own payload of the k values (its
                  header says dtype = the gradient's, shape = (k,))

``k == 0`` (DGC may keep nothing) is sent with no inner payload. Decode
checks the index size, range and order as ``sparse.unpack_sparse`` does,
that the inner payload is the quantizer's, of the gradient's dtype and of
shape (k,), and that its length matches the header; any failure raises
``PayloadError`` before anything is scattered.

**Bits per kept value** (``Compose.bits_per_value``): this layout costs

    8 * (H + pad8(k * s) + H_q + B_q(k)) / k  ->  8 * s + b_q   (large k)

with ``H`` this header (48 bytes for a 1-D gradient), ``s`` the index item
size (4 bytes up to 2**31 entries), ``H_q`` the quantizer's header and
``B_q(k)`` its body (``b_q`` bits a value: terngrad's bitwidth, 1 for
onebit). The paper's table counts ``(10 + log2 d)`` bits a kept value for
``C_nat ∘ S^q``: 9 for the value (sign and 8-bit exponent), ``log2 d`` for
the index and one bit more (its ``S^q`` row likewise counts ``33 + log2 d``
for a 32-bit value). At ``d = 2**20`` that is 30 bits; here an index is a
whole int32, so top-k∘terngrad(2 bits) costs ~34 bits and top-k∘onebit ~33
(headers included, ratio 0.01). The index, not the value, dominates once
the value is quantized: bit-packing indices to ``ceil(log2 d)`` bits is
what would close the gap, at the price of the sparse layout shared with
the other sparsifiers.

**State** is explicit and nested, ``{"sparsifier": ..., "quantizer": ...}``,
each part's own ``init`` state. The quantizer's seed is derived from the
rank's seed (``base.mix_seed(seed, 1)``) so its stochastic rounding draws
from another stream than a random sparsifier's index selection. The
quantization error is *not* fed back into a sparsifier's own memory (DGC's
``v``, GradDrop's residual): those hold what was not selected; wrap the
composition in error feedback to keep the rest (``ErrorFeedback(Compose(...))``;
a part that is itself wrapped is refused).

Example:
    >>> c = compose(("topk", {"ratio": 0.1}), "terngrad")
    >>> g = torch.randn(1000)
    >>> payload, st = c.encode(g, c.init(g, seed=1))
    >>> out = c.decode(payload)
    >>> int((out != 0).sum()) <= 100
    True
"""
from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, Dict, Optional, Tuple

import torch

from ..base import (
    STEP_SEED,
    Capabilities,
    Compressor,
    PayloadError,
    State,
    check_body_nbytes,
    decode_output,
    header_nbytes,
    mix_seed,
    pack_payload,
    unpack_fields,
    unpack_payload,
    view_as_dtype,
)
from ..payload import pad8
from ..registry import get, register
from ..sparse.topk import Sparsifier, index_dtype, num_selected, unpack_sparse

__all__ = ["Compose", "compose"]

_EXTRA = struct.Struct("<QQQ")  # k, index item size, inner payload length
_QUANTIZER_STREAM = 1  # mixed into the seeds handed to the quantizer (module docstring)


def _index_itemsize(n: int) -> int:
    return torch.empty((), dtype=index_dtype(n)).element_size()


def _describe(c: Compressor) -> str:
    return f"{c.name!r} (category {c.capabilities.category!r})"


def _resolve(role: str, spec: Any, params: Optional[Mapping]) -> Compressor:
    """A part from a registry name, a ``Compressor`` or a (name, params) pair."""
    if isinstance(spec, tuple):
        if (len(spec) != 2 or not isinstance(spec[0], (str, Compressor))
                or not isinstance(spec[1], Mapping)):
            raise TypeError(f"compose: {role} as a pair must be (name, params dict), found "
                            f"{spec!r}; e.g. ('topk', {{'ratio': 0.01}})")
        if params:
            raise ValueError(f"compose: {role} parameters given twice, in the pair {spec!r} "
                             f"and in {role}_params={dict(params)!r}; pass them once")
        spec, params = spec
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"compose: {role}_params must be a dict, found "
                        f"{type(params).__name__} {params!r}")
    if isinstance(spec, Compressor) and params:
        raise ValueError(f"compose: {role} is a compressor instance ({spec!r}); its "
                         f"parameters {dict(params)!r} cannot be given too: pass a name "
                         "with parameters, or the instance alone")
    if not isinstance(spec, (str, Compressor)):
        raise TypeError(f"compose: {role} must be a registry name, a Compressor or a "
                        f"(name, params) pair, found {type(spec).__name__} {spec!r}")
    try:
        return get(spec, **dict(params or {}))
    except ValueError as e:  # unknown name or bad parameters (ParamError keeps its type)
        raise type(e)(f"compose: {role}: {e}") from e


def _check_parts(sp: Compressor, q: Compressor) -> None:
    """Raise a ``ValueError`` naming what cannot be composed, and how to fix it."""
    from .error_feedback import ErrorFeedback  # error_feedback imports the registry too

    for role, part in (("sparsifier", sp), ("quantizer", q)):
        if isinstance(part, ErrorFeedback):
            raise ValueError(
                f"compose: the {role} is wrapped in error feedback ({part!r}); wrap the "
                "composition instead: ErrorFeedback(Compose(sparsifier, quantizer)), or "
                "get('ef', inner='compose', ...)")
        if part.capabilities.rounds > 1:
            raise ValueError(
                f"compose: the {role} {part.name!r} has {part.capabilities.rounds} "
                "communication rounds; only single-round compressors compose (the "
                "engine runs a multi-round compressor's rounds itself)")
    if not isinstance(sp, Sparsifier):
        hint = ("; did you swap them? the order is Compose(sparsifier, quantizer)"
                if q.capabilities.category == "sparsification" else "")
        raise ValueError(
            f"compose: the first part must be a sparsifier sharing sparse/topk.py's payload "
            f"(topk, randomk, dgc, graddrop), found {_describe(sp)}{hint}")
    if not sp._plain:  # compose quantizes the plain layout's values and copies its indices
        raise ValueError(
            f"compose: the sparsifier {sp.name!r} codes its payload with index_codec="
            f"{sp.index_codec.name!r}, value_codec={sp.value_codec.name!r}; a composition "
            "quantizes the values of the plain layout itself: build the sparsifier with the "
            "plain codecs (the default), or use the codecs without compose")
    if q.capabilities.category != "quantization":
        what = ("composing two sparsifiers only sparsifies twice; "
                if q.capabilities.category == "sparsification" else "")
        raise ValueError(
            f"compose: the second part must be a quantizer (category 'quantization', e.g. "
            f"terngrad, onebit, tbq), found {_describe(q)}; {what}"
            "pick a quantizer for the kept values")
    if q.capabilities.keeps_memory:
        raise ValueError(
            f"compose: the quantizer {q.name!r} keeps its own memory, which would be indexed "
            "by kept positions that change every step; use a memoryless quantizer and wrap "
            "the composition in error feedback")


@register("compose")
class Compose(Compressor):
    """A sparsifier, then a quantizer of the kept values (``C ∘ S^q``, Natural Compression).

    Args:
        sparsifier: a ``sparse.Sparsifier`` (topk, randomk, dgc, graddrop) as a
            registry name, an instance, or a (name, params) pair; default topk.
        quantizer: a single-round compressor of category "quantization"
            (terngrad, onebit, tbq, ...), in the same forms; default terngrad.
        sparsifier_params: parameters of ``sparsifier`` when it is a name.
        quantizer_params: parameters of ``quantizer`` when it is a name.

    Raises:
        ValueError: an unknown name or bad parameters of a part, a first part
            that is not a sparsifier, a second part that is not a quantizer
            (two sparsifiers), a multi-round part, a part wrapped in error
            feedback, or a quantizer with its own memory.
        TypeError: a part of another type, or a malformed (name, params) pair.

    Example:
        >>> import hipress_like as hp
        >>> c = hp.compressors.get("compose", sparsifier="topk", quantizer="terngrad",
        ...                        sparsifier_params={"ratio": 0.01},
        ...                        quantizer_params={"bitwidth": 2})
        >>> hp.compressors.get(c.name, **c.params()).params() == c.params()
        True
    """

    name = "compose"
    algo_id = 43
    # the declaration of the default topk∘terngrad; each instance declares its own
    capabilities = Capabilities("sparsification", aggregatable=False, fixed_size=True,
                                stateful=True)

    def __init__(self, sparsifier: Any = "topk", quantizer: Any = "terngrad", *,
                 sparsifier_params: Optional[Mapping] = None,
                 quantizer_params: Optional[Mapping] = None) -> None:
        self.sparsifier = _resolve("sparsifier", sparsifier, sparsifier_params)
        self.quantizer = _resolve("quantizer", quantizer, quantizer_params)
        _check_parts(self.sparsifier, self.quantizer)
        sc, qc = self.sparsifier.capabilities, self.quantizer.capabilities
        self.capabilities = Capabilities(
            "sparsification", aggregatable=False,
            fixed_size=sc.fixed_size and qc.fixed_size,
            unbiased=sc.unbiased and qc.unbiased,
            stateful=True,  # the nested states (steps, seeds, a sparsifier's memory)
            keeps_memory=sc.keeps_memory,
            shared_randomness=sc.shared_randomness or qc.shared_randomness)

    def params(self) -> Dict[str, Any]:
        """Constructor parameters: ``get("compose", **c.params())`` rebuilds ``c``."""
        return {"sparsifier": self.sparsifier.name,
                "sparsifier_params": self.sparsifier.params(),
                "quantizer": self.quantizer.name,
                "quantizer_params": self.quantizer.params()}

    def __repr__(self) -> str:
        return f"Compose({self.sparsifier!r}, {self.quantizer!r})"

    # -- state -------------------------------------------------------------
    @staticmethod
    def _run_keywords(part: Compressor, world_size: int, shared_seed: int,
                      rank: Optional[int]) -> Dict[str, Any]:
        """The keywords the engine would pass ``part`` itself (``Compressor.init``)."""
        kw: Dict[str, Any] = {"world_size": world_size}
        if part.capabilities.shared_randomness:
            kw["shared_seed"] = shared_seed
        if rank is not None and "broadcast" in part.capabilities.round_reductions:
            kw["rank"] = rank
        return kw

    def init(self, grad: torch.Tensor, seed: int = 0, *, world_size: int = 1,
             shared_seed: int = 0, rank: Optional[int] = None) -> State:
        """Both parts' initial states: ``{"sparsifier": ..., "quantizer": ...}``.

        The sparsifier is initialised on ``grad``, the quantizer on a 1-D
        tensor of the largest number of values a payload keeps, with seeds
        ``mix_seed(seed, 1)`` and ``mix_seed(shared_seed, 1)``.
        """
        k = num_selected(self.sparsifier._max_density(), grad.numel())
        values = grad.detach().reshape(-1)[:k]
        q_shared = mix_seed(int(shared_seed), _QUANTIZER_STREAM)
        return {
            "sparsifier": self.sparsifier.init(
                grad, seed, **self._run_keywords(self.sparsifier, world_size, shared_seed,
                                                 rank)),
            "quantizer": self.quantizer.init(
                values, mix_seed(int(seed), _QUANTIZER_STREAM),
                **self._run_keywords(self.quantizer, world_size, q_shared, rank)),
        }

    def _parts_state(self, state: State) -> Tuple[State, State]:
        if not isinstance(state, dict) or not all(
                isinstance(state.get(key), dict) for key in ("sparsifier", "quantizer")):
            raise ValueError("compose: the state must hold the parts' states under "
                             f"'sparsifier' and 'quantizer', found {state!r}; create it with "
                             "Compose.init(grad) for this gradient (or partition)")
        s_state, q_state = state["sparsifier"], state["quantizer"]
        step = state.get(STEP_SEED)
        if step is not None:  # the engine's per-step shared seed, passed down
            if self.sparsifier.capabilities.shared_randomness:
                s_state = dict(s_state, **{STEP_SEED: int(step)})
            if self.quantizer.capabilities.shared_randomness:
                q_state = dict(q_state, **{STEP_SEED: mix_seed(int(step), _QUANTIZER_STREAM)})
        return s_state, q_state

    # -- encode / decode ---------------------------------------------------
    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Sparsify, quantize the kept values, pack (module docstring, steps 1-4).

        Returns:
            (payload, ``dict(state, sparsifier=new, quantizer=new)``).

        Raises:
            TypeError, ValueError: a bad gradient, or a state not made by ``init``.
        """
        s_state, q_state = self._parts_state(state)
        sparse_payload, s_state = self.sparsifier.encode(grad, s_state)
        payload, q_state = self._quantize(sparse_payload, q_state)
        return payload, dict(state, sparsifier=s_state, quantizer=q_state)

    def _quantize(self, sparse_payload: torch.Tensor, q_state: State
                  ) -> Tuple[torch.Tensor, State]:
        """This compressor's payload of a sparse payload: its indices, quantized values."""
        h, idx, vals = unpack_sparse(sparse_payload, self.sparsifier.algo_id)
        k, isz = idx.numel(), _index_itemsize(h.numel)
        ipad = pad8(k * isz)
        inner = None
        if k:
            inner, q_state = self.quantizer.encode(vals, q_state)
        qn = 0 if inner is None else inner.numel()
        payload, body = pack_payload(self.algo_id, h.dtype, h.shape, _EXTRA.pack(k, isz, qn),
                                     ipad + qn, sparse_payload.device)
        body[:ipad].copy_(h.body[:ipad])  # sparse/topk.py's index bytes, padding included
        if inner is not None:
            body[ipad:].copy_(inner)
        return payload, q_state

    def _unpack(self, payload: torch.Tensor):
        """(header, int64 indices, inner payload or None), all validated."""
        h, (k, isz, qn) = unpack_fields(payload, self.algo_id, _EXTRA, "compose")
        n = h.numel
        if k > n:
            raise PayloadError(f"compose payload declares k={k} entries for a tensor of {n}")
        if isz != _index_itemsize(n):
            raise PayloadError(f"compose payload index size {isz} bytes, expected "
                               f"{_index_itemsize(n)} for n={n}")
        if (k == 0) != (qn == 0):
            raise PayloadError(f"compose payload declares k={k} values in an inner payload "
                               f"of {qn} bytes")
        ipad = pad8(k * isz)
        check_body_nbytes(h, ipad + qn, "compose", f" with k={k} and a {qn}-byte inner payload")
        idx = view_as_dtype(h.body[: k * isz], index_dtype(n)).to(torch.int64)
        if not k:
            return h, idx, None
        # the checks of sparse.unpack_sparse: no bad index reaches the scatter
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= n:
            raise PayloadError(f"compose payload index out of range [0, {n}): min {lo}, max {hi}")
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise PayloadError("compose payload indices are not strictly increasing "
                               "(duplicated or corrupted)")
        inner = h.body[ipad:]
        try:
            ih = unpack_payload(inner, self.quantizer.algo_id)
        except PayloadError as e:
            raise PayloadError(f"compose payload's values are not a {self.quantizer.name!r} "
                               f"payload: {e}") from e
        if ih.dtype != h.dtype or ih.shape != (k,):
            raise PayloadError(f"compose payload's values are {ih.dtype} of shape {ih.shape}, "
                               f"expected {h.dtype} of shape ({k},)")
        return h, idx, inner

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode the values with the quantizer, scatter them at the indices into zeros.

        Args:
            payload: a payload of this compressor.
            out: optional buffer to write into (see ``base.decode_output``).

        Raises:
            PayloadError: malformed, truncated or foreign payload, an index out
                of range or out of order, or an inner payload that is not the
                quantizer's k values.
        """
        h, idx, inner = self._unpack(payload)
        vals = None
        if inner is not None:
            try:
                vals = self.quantizer.decode(inner)
            except PayloadError as e:
                raise PayloadError(f"compose payload's values: {e}") from e
        res = decode_output(h, out, payload.device)
        flat = res.view(-1)
        flat.zero_()
        if vals is not None:
            flat.index_copy_(0, idx, vals.reshape(-1))
        return res

    # -- sizes and re-selection ---------------------------------------------
    def _max_kept(self, numel: int) -> int:
        return num_selected(self.sparsifier._max_density(), numel)

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """``header + pad8(k * index size) + quantizer.payload_nbytes(k)`` for the largest k.

        Exact when both parts have fixed sizes, else an upper bound.
        """
        k = self._max_kept(numel)
        return (header_nbytes(ndim, _EXTRA.size) + pad8(k * _index_itemsize(numel))
                + self.quantizer.payload_nbytes(k, 1))

    def bits_per_value(self, numel: int, ndim: int = 1) -> float:
        """Payload bits per kept value, headers and padding included.

        ``8 * payload_nbytes(numel, ndim) / k`` for the largest ``k`` a payload
        keeps; tends to ``8 * index size + the quantizer's bits per value``
        (module docstring, against the paper's ``10 + log2 d`` for C_nat ∘ top-k).
        """
        return 8.0 * self.payload_nbytes(numel, ndim) / self._max_kept(numel)

    def reselect(self, grad: torch.Tensor, k: Optional[int] = None, *,
                 seed: int = 0) -> torch.Tensor:
        """The sparsifier's ``reselect`` of a merged tensor, values quantized; no worker state.

        HiPress Sec. 5.3: a Ring hop re-selects the top ``k`` of the merged
        sum (``Sparsifier.reselect``); the kept values are quantized with a
        fresh quantizer state seeded by ``seed``.

        Args:
            grad: the merged tensor.
            k: entries to keep; default the sparsifier's ``ceil(ratio * n)``.
            seed: the quantizer's seed (stochastic rounding).

        Returns:
            A payload of this compressor.
        """
        sparse_payload = self.sparsifier.reselect(grad, k)
        kmax = max(1, min(grad.numel(), k if k is not None else self._max_kept(grad.numel())))
        values = grad.detach().reshape(-1)[:kmax]
        kw = self._run_keywords(self.quantizer, 1, int(seed), None)
        q_state = self.quantizer.init(values, mix_seed(int(seed), _QUANTIZER_STREAM), **kw)
        return self._quantize(sparse_payload, q_state)[0]


def compose(sparsifier: Any, quantizer: Any) -> Compose:
    """``Compose(sparsifier, quantizer)``: each a registry name, an instance or a
    (name, params) pair.

    Example:
        >>> compose(("randomk", {"ratio": 0.05}), ("terngrad", {"bitwidth": 4})).params()[
        ...     "quantizer_params"]
        {'bitwidth': 4}
    """
    return Compose(sparsifier, quantizer)
