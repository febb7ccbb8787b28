"""The compressor of a CompLL program with state arrays or a data-dependent payload.

DGC and GradDrop (``sparse/dgc.compll``, ``sparse/graddrop.compll``) keep
per-gradient arrays between encodes and send as many (index, value) pairs as
their selection finds (``arrays.py`` has the operators). Their compressor
differs from ``DslCompressor`` in three places:

- ``init`` creates the state: each global array (zeros, float32, shaped like
  the gradient, flat), plus ``seed`` and ``step`` (``threshold`` samples by
  them, as the hand-written sparsifiers do); ``encode`` updates the arrays in
  place and returns the state with ``step + 1``.
- the payload is assembled after the program ran: the concat's scalars in
  the header, its arrays in the body, each after the first starting at a
  multiple of 8 bytes, so the plain sparse payload of ``sparse.py`` comes out
  byte for byte when the program writes ``concat(k, 4, idx, vals)``.
- ``payload_nbytes`` is an upper bound (every array as long as the gradient)
  unless the program's capabilities say otherwise.

float32 CPU gradients run the generated C (``render_seq``), float32 CUDA
gradients its CUDA (``render_cuda_seq``, run by ``cuda_runners.SeqCudaProgram``)
where cupy loads it; everything else runs the interpreter.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..base import check_gradient, header_nbytes, pack_payload
from .arrays import assemble_body
from .compressor import _BASES, DslCompressor, State
from .interp import Interpreter, layout

__all__ = ["SparseDslCompressor"]


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


class SparseDslCompressor(DslCompressor):
    """A ``DslCompressor`` whose program keeps state arrays or sends data-dependent sizes."""

    def _state_names(self) -> List[str]:
        return [n for n, t in self.checked.globals.items() if t.array]

    def init(self, grad: torch.Tensor, seed: int = 0, *, world_size: int = 1,
             shared_seed: int = 0) -> State:
        """Zero state arrays shaped like ``grad`` (float32), ``step`` 0 and ``seed``."""
        st: Dict[str, Any] = {name: torch.zeros(grad.shape, dtype=torch.float32,
                                                device=grad.device)
                              for name in self._state_names()}
        st.update(step=0, seed=int(seed))
        return st

    def _check_state(self, grad: torch.Tensor, state: State) -> Dict[str, torch.Tensor]:
        out = {}
        for name in self._state_names():
            t = state.get(name) if isinstance(state, dict) else None
            if not isinstance(t, torch.Tensor) or t.shape != grad.shape:
                raise ValueError(
                    f"{self.name}: state[{name!r}] must be a tensor of shape "
                    f"{tuple(grad.shape)}, found {getattr(t, 'shape', type(t).__name__)}; "
                    f"create the state with init(grad) for this gradient (or partition)")
            if t.dtype != torch.float32 or not t.is_contiguous():
                t = t.to(torch.float32).contiguous()
            out[name] = t
        return out

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """An upper bound: every body array as long as the gradient (4-byte elements)."""
        lay = layout(self._concat().args[1])
        return header_nbytes(ndim, lay.extra_nbytes) + sum(
            _pad8(numel * 4) for _ in lay.arrays)

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Run encode; the state arrays are updated in place, ``step`` advances.

        Raises:
            TypeError: non-tensor or non-float input.
            ValueError: empty input, NaN/Inf in it, or a state of another shape.
        """
        f32 = grad.dtype == torch.float32
        native = self._native() if f32 and grad.device.type == "cpu" else None
        cuda = self._cuda() if f32 and grad.device.type == "cuda" else None
        fast = native if native is not None else cuda
        # the C tests NaN/Inf itself; otherwise scan even where the engine vouched
        # (it leaves the scan to a compressor that declares checks_finite)
        check_gradient(grad, nonfinite="ignore" if fast is not None else "always")
        arrays = self._check_state(grad, state)
        step, seed = int(state.get("step", 0)), int(state.get("seed", 0))
        g = grad.detach().contiguous().reshape(-1)
        flat = {k: v.view(-1) for k, v in arrays.items()}
        if fast is not None:  # the generated C, or its CUDA on a CUDA gradient
            extra, body = fast.encode_arrays(g, flat, self._params, seed, step,
                                               seed=self._seed(state))
        else:
            dev = g.device
            cpu = {k: v.cpu() for k, v in flat.items()}
            it = Interpreter(self.checked, self._params, cpu, raw_seed=seed, step=step)
            extra, parts = it.encode(g.cpu(), self._seed(state))
            body = assemble_body(parts)
            for k in cpu:
                if it.globals[k].data_ptr() != flat[k].data_ptr():
                    flat[k].copy_(it.globals[k].to(dev))
        payload, pbody = pack_payload(self.algo_id, grad.dtype, grad.shape, extra,
                                      body.numel(), g.device)
        pbody.copy_(body.to(g.device))
        new_state = dict(state, step=step + 1, seed=seed)
        new_state.update({k: v.view(grad.shape) for k, v in arrays.items()})
        return payload, new_state

    def _extra_nbytes(self) -> int:
        """Bytes of the extra fields: the layout of ``concat``'s leading scalars (the
        arrays after them are the body). ``DslCompressor.decode`` does the rest; with
        no CUDA runner (``_cuda``) it runs the C library or the interpreter."""
        return layout(self._concat().args[1]).extra_nbytes

    def _make_cuda(self) -> Any:
        """The state-array program's cupy runner (``cuda_runners.SeqCudaProgram``)."""
        from .cuda_runners import SeqCudaProgram
        return SeqCudaProgram(self.checked)


_BASES["sparse"] = SparseDslCompressor  # register_dsl builds state-array programs on it
