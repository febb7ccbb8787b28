"""The rounds protocol of multi-round compressors (HiPress Sec. 3.2's multi-round CaSync).

Idea: most algorithms send one payload per step (``base.Compressor``: encode,
merge, decode). Some need several communication rounds whose later payloads
depend on the merged earlier ones: PowerSGD's P then Q (Vogels et al. 2019,
Alg. 1), THC's range round then its index round (THC Alg. 3), AR-Topk's
broadcast of one rank's indices then the values at them. Such an algorithm
derives from ``MultiRoundCompressor``, declares its rounds in
``capabilities`` (``rounds``, and per round the reduction and summability)
and writes the protocol below instead of ``encode``/``decode``:

    encode_round(r, grad, state, aggregate)   # payload of round r (aggregate: round r-1 merged)
    merge_round(r, payloads)                  # reduce round r (sum, max or broadcast)
    decode_rounds(grad, state, aggregate)     # the last round's merged payload -> gradient
    absent_round(r, grad, state, aggregate)   # a rank that sits the step out (optional)
    broadcast_nbytes(r, numel, ndim)          # a broadcast round's size when known (optional)
    broadcast_root(state)                     # the owner of the broadcast round just encoded

The engine (``casync.workflows``) runs the rounds; a single-round compressor
answers the same calls with its one round (``base.Compressor``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .base import Compressor, State

__all__ = ["MultiRoundCompressor"]


class MultiRoundCompressor(Compressor):
    """Base class of compressors with more than one communication round.

    Subclasses write ``init``, ``encode_round``, ``decode_rounds`` and
    ``params``, ``merge`` (or ``merge_round``) for their aggregatable rounds,
    ``payload_nbytes`` (the bytes a rank sends over all rounds), and declare
    ``capabilities`` with ``rounds > 1``.
    """

    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """A multi-round compressor has no single payload: the engine calls ``encode_round``."""
        raise TypeError(f"{self.name} has {self.capabilities.rounds} rounds: call encode_round "
                        "for each (the engine does)")

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A multi-round compressor decodes with ``decode_rounds`` (it needs the state)."""
        raise TypeError(f"{self.name} has {self.capabilities.rounds} rounds: decode with "
                        "decode_rounds")

    def _world_size(self, state: State) -> int:
        """``state["world_size"]``: how many ranks' payloads the summed rounds add up.

        Raises:
            ValueError: it is missing or not an int >= 1 (the engine sets it).
        """
        ws = state.get("world_size") if isinstance(state, dict) else None
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise ValueError(
                f"{self.name}: state['world_size'] must be the number of ranks whose payloads "
                f"are summed (an int >= 1), found {ws!r}; the engine sets it (init(grad, "
                "world_size=N) or state['world_size'] = N) before the first round")
        return ws

    def encode_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> Tuple[torch.Tensor, State]:
        """Payload of round ``r`` and the new state; ``aggregate`` is round r-1's merged
        payload (None in round 0)."""
        raise NotImplementedError(f"{self.name} must write encode_round")

    def decode_rounds(self, grad: torch.Tensor, state: State, aggregate: torch.Tensor,
                      out: Optional[torch.Tensor] = None,
                      average: bool = False) -> Tuple[torch.Tensor, State]:
        """The merged payload of the last round -> the summed gradient (into ``out``),
        divided by ``state["world_size"]`` when ``average``; and the new state."""
        raise NotImplementedError(f"{self.name} must write decode_rounds")

    def absent_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> State:
        """Round ``r`` for a rank that contributes nothing this step (``capabilities.
        absent_rounds``): the state ``encode_round`` would have left, without a
        payload. ``grad`` gives only the shape and dtype; ``aggregate`` is the
        merged payload of round r-1 (of the contributing ranks), None in round 0.
        """
        raise NotImplementedError(f"{self.name} cannot sit a step out (it does not declare "
                                  "capabilities.absent_rounds)")

    def broadcast_nbytes(self, r: int, numel: int, ndim: int = 1) -> Optional[int]:
        """Bytes of the owner's payload in broadcast round ``r``, when every rank can
        tell them before the round (a non-owner's payload is then replaced by a
        buffer of that size, which the broadcast fills); None (default) keeps
        broadcast rounds off the collective lane (point to point via PS/Ring)."""
        return None

    def broadcast_root(self, state: State) -> int:
        """The owner rank of the broadcast round just encoded with ``state``: by
        contract, ``encode_round`` of a broadcast round records it in the state
        as ``"owner"`` (equal on every rank)."""
        owner = state.get("owner")
        if not isinstance(owner, int):
            raise ValueError(f"{self.name}: encode_round of a broadcast round must record "
                             "its owner rank in the state as 'owner'")
        return owner
