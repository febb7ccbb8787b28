"""Fast paths of a compressor, behind one protocol with defaults.

A compressor's public surface is small: ``init``, ``encode``, ``decode``,
``capabilities``, ``payload_nbytes``, ``params`` (and ``merge``,
``encode_round``/``decode_rounds`` where declared). Everything an engine or
error feedback may do *faster* with the same bits lives in
``compressor.kernels``, an object whose defaults are written in terms of
``encode``/``decode``:

    k = compressor.kernels
    k.decode_add_(payload, acc)          # acc += decode(payload)
    k.decode_add_many_(payloads, acc)    # the same for each payload, in order
    k.decode_div_(payload, out, n)       # out = decode(payload) / n
    k.subtract_decoded_(x, payload)      # x -= decode(payload), payload = encode(x)
    k.encode_accumulated_(mem, g, st)    # mem += g; encode(mem), or None (not fused)
    k.deferred_residual(payload, x)      # a token for a later subtract_decoded_, or None
    k.apply_residual_(x, token)          # x -= decode(...) from that token
    k.summable_view(payload)             # the view merge sums elementwise, or None
    k.merged_nbytes(nbytes, n)           # size of merge() of n payloads of nbytes

A compressor with faster versions names a ``Kernels`` subclass in its
``kernels_class``; each override must give the same bits as the default.
Wrappers (error feedback, composition, bidirectional) whose payload is
their inner compressor's use ``InnerKernels``, which forwards the payload
side to the inner kernels, so nothing is forwarded by hand.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

__all__ = ["Kernels", "FusedDecodeKernels", "FusedDecode", "InnerKernels", "workspace"]

# base.py imports this module (and re-exports ``workspace``), so nothing here
# imports base (the import graph stays acyclic); its types are aliased below.
_Compressor = Any  # base.Compressor
_State = Dict[str, Any]  # base.State


_workspaces = threading.local()


def workspace(numel: int, dtype: torch.dtype, device: Any, slot: str) -> torch.Tensor:
    """A reusable scratch tensor of ``numel`` elements for this thread and ``slot``.

    Decoding into a fresh gradient-sized tensor every step costs more in
    page faults than the decode (a 64 MB allocation ~ 4 memory copies
    here), so callers that only need a temporary (error feedback's
    ``decode``, an aggregator's per-source decode) borrow this buffer. It
    grows to the largest size asked for and is kept per thread (the
    engine's compute executor is one thread per engine) and per ``slot``
    (one per nesting level of use). The contents are garbage; a second
    call with the same slot in the same thread returns the same memory.
    """
    cache = getattr(_workspaces, "buffers", None)
    if cache is None:
        cache = _workspaces.buffers = {}
    key = (slot, dtype, str(device))
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        cache[key] = buf
    return buf[:numel]


_workspace = workspace


class Kernels:
    """Default fast paths of ``comp``, in terms of its ``encode``/``decode``.

    Args:
        comp: the compressor these kernels belong to.
    """

    def __init__(self, comp: _Compressor) -> None:
        self.comp = comp

    def decode_add_(self, payload: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """``acc += decode(payload)`` in place (a PS aggregator's or Ring hop's sum).

        Args:
            payload: a payload of this compressor.
            acc: contiguous tensor with the payload's element count and dtype.

        Returns:
            ``acc``.
        """
        dec = self.comp.decode(payload, out=_workspace(acc.numel(), acc.dtype, acc.device,
                                                       "decode"))
        return acc.add_(dec.view(acc.shape))

    def decode_add_many_(self, payloads: Sequence[torch.Tensor],
                         acc: torch.Tensor) -> torch.Tensor:
        """``acc += decode(p)`` for each payload in order; returns ``acc``."""
        for p in payloads:
            self.decode_add_(p, acc)
        return acc

    def decode_div_(self, payload: torch.Tensor, out: torch.Tensor, n: int) -> torch.Tensor:
        """``out = decode(payload) / n`` (the average of a summed payload over n ranks)."""
        self.comp.decode(payload, out=out)
        return out.div_(n)

    def subtract_decoded_(self, x: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """``x -= decode(payload)`` in place, where ``payload = encode(x)``: the residual."""
        dec = self.comp.decode(payload, out=_workspace(x.numel(), x.dtype, x.device, "residual"))
        return x.sub_(dec.view(x.shape))

    def encode_accumulated_(self, mem: torch.Tensor, grad: torch.Tensor, state: _State,
                            residual: Any = None) -> Optional[Tuple[torch.Tensor, _State]]:
        """``mem += grad``, then ``encode(mem, state)``, fused; None when not fused here.

        When None is returned ``mem`` is untouched (even with a ``residual``)
        and the caller adds and encodes in two steps. ``residual`` is a token
        from ``deferred_residual`` to take out of ``mem`` first.
        """
        return None

    def deferred_residual(self, payload: torch.Tensor, x: torch.Tensor) -> Any:
        """A token that lets ``subtract_decoded_(x, payload)`` run later, or None (default)."""
        return None

    def apply_residual_(self, x: torch.Tensor, token: Any) -> torch.Tensor:
        """``x -= decode(payload)`` for the payload ``token`` came from; returns ``x``."""
        raise NotImplementedError(f"{self.comp.name}: gives no deferred residuals")

    def summable_view(self, payload: torch.Tensor) -> Optional[torch.Tensor]:
        """The part of ``payload`` that ``merge`` sums elementwise, as a view, or None.

        Declared by ``capabilities.summable``: an engine may then allreduce
        this view in place instead of gathering payloads at an aggregator.
        """
        return None

    def merged_nbytes(self, nbytes: int, n: int) -> int:
        """Size of ``merge`` of ``n`` payloads of ``nbytes`` each (``capabilities.merge_widens``
        compressors override it; otherwise the merged payload keeps the inputs' size)."""
        return nbytes


class FusedDecodeKernels(Kernels):
    """``decode_add_``/``decode_div_`` through the compressor's own one-pass decode.

    For compressors whose decode is one pointwise kernel (the quantizers):
    they implement ``_decode(payload, out, mode, d)`` with the modes of
    ``_build.fused._emit`` ("set", "add", "div" by ``d``).
    """

    def decode_add_(self, payload: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """``acc += decode(payload)`` in one fused pass (same bits as decode, then add)."""
        if not acc.is_contiguous():
            return super().decode_add_(payload, acc)
        self.comp._decode(payload, acc, "add", 1.0)  # type: ignore[attr-defined]
        return acc

    def decode_div_(self, payload: torch.Tensor, out: torch.Tensor, n: int) -> torch.Tensor:
        """``out = decode(payload) / n`` in one fused pass (same bits as decode, then divide)."""
        if not out.is_contiguous():
            return super().decode_div_(payload, out, n)
        self.comp._decode(payload, out, "div", float(n))  # type: ignore[attr-defined]
        return out


class FusedDecode:
    """Mixin of a compressor whose decode is one pointwise kernel (the quantizers).

    It writes ``_decode(payload, out, mode, d)`` once, with the modes of
    ``_build.fused._emit`` ("set", "add", "div" by ``d``); ``decode`` is its
    "set" mode and ``FusedDecodeKernels`` its decode-add and decode-div.
    Listed before ``Compressor`` in the bases (``class TBQ(FusedDecode,
    Compressor)``).
    """

    kernels_class: type = FusedDecodeKernels

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decompress a payload into a tensor of the original shape and dtype.

        Args:
            payload: a payload from ``encode``.
            out: optional preallocated result (shape and dtype of the
                original, ``base.decode_output``); reusing it avoids the page
                faults of a fresh allocation, which cost more than the decode
                itself for large tensors.

        Raises:
            PayloadError: malformed, foreign or wrongly sized payload, or
                fields out of range.
        """
        return self._decode(payload, out, "set", 1.0)

    def _decode(self, payload: torch.Tensor, out: Optional[torch.Tensor], mode: str,
                d: float) -> torch.Tensor:
        """Decode ``payload`` into ``out`` (a new tensor when None) by ``mode``:
        "set" writes the values, "add" adds them, "div" writes them divided by ``d``."""
        raise NotImplementedError


class InnerKernels(Kernels):
    """Kernels of a wrapper whose payload is ``comp.inner``'s: the payload side
    (decode-add, decode-div, summable view, merged size) is the inner kernels';
    the encode side keeps the defaults (the wrapper's encode is its own)."""

    def _inner(self) -> Kernels:
        return self.comp.inner.kernels  # type: ignore[attr-defined]

    def decode_add_(self, payload: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """The inner ``decode_add_``."""
        return self._inner().decode_add_(payload, acc)

    def decode_add_many_(self, payloads: Sequence[torch.Tensor],
                         acc: torch.Tensor) -> torch.Tensor:
        """The inner ``decode_add_many_``."""
        return self._inner().decode_add_many_(payloads, acc)

    def decode_div_(self, payload: torch.Tensor, out: torch.Tensor, n: int) -> torch.Tensor:
        """The inner ``decode_div_``."""
        return self._inner().decode_div_(payload, out, n)

    def summable_view(self, payload: torch.Tensor) -> Optional[torch.Tensor]:
        """The inner ``summable_view``."""
        return self._inner().summable_view(payload)

    def merged_nbytes(self, nbytes: int, n: int) -> int:
        """The inner ``merged_nbytes``."""
        return self._inner().merged_nbytes(nbytes, n)
