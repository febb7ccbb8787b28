"""The compressor of a CompLL round program (``@rounds(k)``): a ``MultiRoundCompressor``.

PowerSGD (``powersgd/powersgd.compll``) needs what one encode and one decode
cannot give: round 1 reads the *sum over ranks* of round 0's payloads, and
its state (error memory, warm-start Q) is matrix-shaped (``matrices.py``
defines the language side). ``RoundsDslCompressor`` runs such a program
under the engine's rounds protocol (``rounds.py``) and the state contract of
the hand-written PowerSGD (``powersgd.py``'s module docstring):

* ``init(grad, seed=0, world_size=None, shared_seed=0)`` returns the
  program's state matrices (empty until the program assigns them), ``step``,
  ``seed``, ``shared_seed`` and ``world_size``. ``random`` draws from the
  counter stream keyed by ``shared_seed`` (equal on every rank), so the
  first Q is the hand-written one's; ``world_size`` must be set before
  round 0 (it raises otherwise).
* ``encode_round(i, grad, state, aggregate)`` runs ``encode_round<i>``
  (``aggregate``: round i-1's merged payload, checked against ``grad``'s
  shape); ``decode_rounds`` runs ``decode`` on the last round's merged
  payload and advances ``step``. The program's decode returns the *average*
  over ranks (the engine asks for it); ``average=False`` multiplies it by
  ``world_size``.
* Each round returns a new state dict; no operator writes into a state
  tensor (value semantics), so the state given to round 0 stays valid (the
  engine may keep it to undo a step that saw NaN/Inf).
* ``merge`` sums same-round payloads' float32 bodies in the given order
  (``capabilities.summable``): the hand-written PowerSGD's merge.

float32 CPU gradients run the generated C (``render_rounds``), float32 CUDA
gradients its CUDA (``render_cuda_rounds``, run by
``cuda_runners.RoundsCudaProgram``) where cupy loads it; every other case
runs the interpreter, with the same bits (the matrix operators' sums have
one fixed order). The body is float32 whatever the gradient's dtype.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..base import (
    PayloadError,
    State,
    check_gradient,
    pack_payload,
    unpack_payload,
)
from ..kernels import Kernels
from ..ops import mix_seed
from ..rounds import MultiRoundCompressor
from .compressor import _BASES, DslCompressor, _find_call
from .interp import Interpreter, layout
from .matrices import matrix_shape

__all__ = ["RoundsDslCompressor"]


class RoundsDslCompressor(MultiRoundCompressor, DslCompressor):
    """A ``MultiRoundCompressor`` running a CompLL round program (module docstring)."""

    # -- state -------------------------------------------------------------
    def _matrices(self) -> List[str]:
        """The state's names: the program's global matrices and gradient-length arrays."""
        return [n for n, t in self.checked.globals.items() if t.array]

    def init(self, grad: torch.Tensor, seed: int = 0, world_size: Optional[int] = None,
             shared_seed: int = 0) -> State:
        """Empty state matrices, zero state arrays (float32, ``grad``'s shape), ``step`` 0,
        the seeds and ``world_size``."""
        st: Dict[str, Any] = {
            n: torch.zeros(0, 0, dtype=torch.float32, device=grad.device) if t.matrix else
            torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
            for n, t in self.checked.globals.items() if t.array}
        st.update(step=0, seed=int(seed), shared_seed=int(shared_seed), world_size=world_size)
        return st

    def _state_matrices(self, state: State, grad: torch.Tensor,
                        device: Any = "cpu") -> Dict[str, torch.Tensor]:
        out = {}
        for n in self._matrices():
            t = state.get(n) if isinstance(state, dict) else None
            if not self.checked.globals[n].matrix:  # gradient-length: flat
                if not isinstance(t, torch.Tensor) or t.shape != grad.shape:
                    raise ValueError(
                        f"{self.name}: state[{n!r}] must be a tensor of shape "
                        f"{tuple(grad.shape)}, found {getattr(t, 'shape', type(t).__name__)}; "
                        "create the state with init(grad) for this gradient")
                out[n] = t.detach().to(device, torch.float32).reshape(-1).contiguous()
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"{self.name}: state[{n!r}] must be a matrix (a 2-D tensor; "
                                 f"empty before the first step), found "
                                 f"{getattr(t, 'shape', type(t).__name__)}; create the state "
                                 "with init(grad)")
            out[n] = t.detach().to(device, torch.float32).contiguous()
        return out

    # -- payloads ----------------------------------------------------------
    def _layout(self, rnd: int) -> Any:
        f = self.checked.rounds[rnd]
        node = _find_call(f.body, "concat")
        if node is None:
            raise self.checked.prog.error(f"{f.name} never calls concat(...)", f.node)
        return layout(node.args[1])

    def _aggregate(self, aggregate: Optional[torch.Tensor], grad: torch.Tensor,
                   rnd: int) -> Tuple[bytes, torch.Tensor]:
        if aggregate is None:
            raise ValueError(f"{self.name}: round {rnd} needs the merged payload of round "
                             f"{rnd - 1}")
        h = unpack_payload(aggregate, self.algo_id)
        if (tuple(h.shape), h.dtype) != (tuple(grad.shape), grad.dtype):
            raise PayloadError(f"{self.name} payload is for shape {tuple(h.shape)} {h.dtype}, "
                               f"expected {tuple(grad.shape)} {grad.dtype}")
        return bytes(h.extra), h.body.detach()

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Bytes of all rounds' payloads for float32, with the near-square matrix view of
        ``numel`` (exact for 1-D tensors; for ``ndim >= 2`` the size depends on
        ``shape[0]``: use ``round_nbytes(shape, ...)``), as the hand-written PowerSGD."""
        shape = [numel] if ndim <= 1 else list(matrix_shape([numel])) + [1] * (ndim - 2)
        return sum(self.round_nbytes(shape, r) for r in range(len(self.checked.rounds)))

    def round_nbytes(self, shape: Any, rnd: int) -> int:
        """Exact bytes of round ``rnd``'s payload for ``shape`` (run on zeros)."""
        g = torch.zeros(tuple(shape), dtype=torch.float32)
        st = self.init(g, world_size=1)
        agg = None
        for r in range(rnd + 1):
            payload, st = self.encode_round(r, g, st, agg)
            agg = payload
        return int(payload.numel())

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Sum same-round payloads' float32 bodies, in the given order.

        Raises:
            ValueError: no payloads.
            PayloadError: malformed payloads, or of different rounds/shapes.
        """
        if not payloads:
            raise ValueError("merge needs at least one payload")
        hs = [unpack_payload(p, self.algo_id) for p in payloads]
        h0 = hs[0]
        for h in hs[1:]:
            if (bytes(h.extra), tuple(h.shape), h.dtype, h.body.numel()) != (
                    bytes(h0.extra), tuple(h0.shape), h0.dtype, h0.body.numel()):
                raise PayloadError(f"cannot merge {self.name} payloads of different rounds or "
                                   f"shapes ({h0.shape} and {h.shape})")
        if h0.body.numel() % 4:
            raise PayloadError(f"{self.name} payload body of {h0.body.numel()} bytes is not "
                               "float32 values")
        out = payloads[0].clone()
        acc = out[out.numel() - h0.body.numel():].view(torch.float32)
        for h in hs[1:]:
            acc.add_(h.body.view(torch.float32))
        return out

    # -- rounds ------------------------------------------------------------
    def _run(self, rnd: Optional[int], grad: torch.Tensor, state: State,
             aggregate: Optional[Tuple[bytes, torch.Tensor]]) -> Tuple[Any, Dict[str, Any]]:
        """Run round ``rnd`` (None: decode) by the CUDA, the C or the interpreter."""
        ws = self._world_size(state)
        step = int(state.get("step", 0))
        seed = mix_seed(int(state.get("shared_seed", 0)))
        g = grad.detach().reshape(-1)
        cuda = self._cuda() if grad.dtype == torch.float32 and grad.is_cuda else None
        if cuda is not None:
            return cuda.run(rnd, g.contiguous(), tuple(grad.shape), aggregate,
                            self._state_matrices(state, grad, grad.device), self._params,
                            seed, step, ws)
        mats = self._state_matrices(state, grad)
        if aggregate is not None:
            aggregate = (aggregate[0], aggregate[1].cpu())
        native = self._native() if grad.dtype == torch.float32 else None
        if native is not None:
            return native.run(rnd, g.to("cpu").contiguous(), tuple(grad.shape), aggregate,
                              mats, self._params, seed, step, ws)
        it = Interpreter(self.checked, self._params, dict(mats))
        f = self.checked.decode if rnd is None else self.checked.rounds[rnd]
        res = it.run_round(f, g.cpu(), tuple(grad.shape), aggregate, seed, step, ws)
        return res, {n: it.globals[n] for n in self._matrices()}

    def _make_cuda(self) -> Any:
        """The round program's cupy runner (``cuda_runners.RoundsCudaProgram``)."""
        from .cuda_runners import RoundsCudaProgram
        return RoundsCudaProgram(self.checked)

    def encode_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> Tuple[torch.Tensor, State]:
        """Round ``r``'s payload (``encode_round<r>``) and the new state.

        Raises:
            ValueError: bad round, NaN/Inf in round 0's gradient, a missing
                ``world_size``, a state of another shape.
            PayloadError: a malformed or mismatched aggregate.
        """
        k = len(self.checked.rounds)
        if not isinstance(r, int) or not 0 <= r < k:
            raise ValueError(f"{self.name} has rounds 0..{k - 1}, asked for round {r}")
        if r == 0:
            check_gradient(grad)
        agg = None if r == 0 else self._aggregate(aggregate, grad, r)
        (extra, parts), mats = self._run(r, grad, state, agg)
        body = torch.cat([p.reshape(-1).view(torch.uint8) if p.dtype != torch.uint8
                          else p.reshape(-1) for p in parts]) if parts else \
            torch.zeros(0, dtype=torch.uint8)
        payload, pbody = pack_payload(self.algo_id, grad.dtype, tuple(grad.shape), extra,
                                      body.numel(), grad.device)
        pbody.copy_(body.to(grad.device))
        return payload, self._new_state(state, mats, grad)

    def _new_state(self, state: State, mats: Dict[str, torch.Tensor],
                   grad: torch.Tensor) -> State:
        new = dict(state)
        for n, v in mats.items():
            v = (v if v is not None else torch.zeros(0, 0)).to(grad.device, torch.float32)
            new[n] = v if self.checked.globals[n].matrix else v.reshape(grad.shape)
        return new

    def decode_rounds(self, grad: torch.Tensor, state: State, aggregate: torch.Tensor,
                      out: Optional[torch.Tensor] = None,
                      average: bool = False) -> Tuple[torch.Tensor, State]:
        """The program's decode on the last round's merged payload: the sum over ranks
        (the average when ``average``), and the new state with ``step + 1``.

        Raises:
            ValueError: no ``world_size``; ``out`` of another size.
            PayloadError: a malformed or mismatched aggregate.
        """
        agg = self._aggregate(aggregate, grad, len(self.checked.rounds))
        flat, mats = self._run(None, grad, state, agg)
        n = grad.numel()
        if out is not None and out.numel() != n:
            raise ValueError(f"{self.name}: out has {out.numel()} elements, the gradient {n}")
        if not average:
            flat = flat * float(self._world_size(state))
        new = self._new_state(state, mats, grad)
        new["step"] = int(state.get("step", 0)) + 1
        res = flat.reshape(grad.shape).to(grad.device, grad.dtype)
        if out is not None:
            return out.reshape(grad.shape).copy_(res), new
        return res, new


class _RoundsKernels(Kernels):
    """The float32 body of a round payload is what ``merge`` sums (``summable``)."""

    def summable_view(self, payload: torch.Tensor) -> Optional[torch.Tensor]:
        """The body as float32 values, a view into ``payload`` (None when misaligned)."""
        h = unpack_payload(payload, self.comp.algo_id)
        try:
            return h.body.view(torch.float32)
        except RuntimeError:
            return None


RoundsDslCompressor.kernels_class = _RoundsKernels
_BASES["rounds"] = RoundsDslCompressor  # register_dsl builds round programs on it
