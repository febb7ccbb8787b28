"""Workflows on the collective lane: every rank reduces, no aggregator.

``rounds_collective_workflow``: a multi-round compressor whose rounds are
reduced across ranks by collectives, one per round. Sum and max rounds
reduce the payload's ``summable_view`` in place (by the transport's fused
allreduce, or by the ring or tree of ``casync.collectives`` when the
gradient's decision names one). A broadcast round (AR-Topk's indices, the
flexible-communication paper's Alg. 1 line 16) sends the owner's payload
to every rank: the owner offers its payload, every other rank a buffer of
the size every rank knows (``Compressor.broadcast_nbytes``), and the
collective fills it from the owner (``Compressor.broadcast_root``).

``gather_workflow``: the Allgather path of top-k (LWTopk, the paper's
Sec. 3-D baseline): every rank's payload reaches every rank, and each rank
decodes them all into zeros in rank order, so every rank holds the same
bits.

Every collective of a gradient with a named collective runs alone
(``layout.Layout.solo``), in the order the replicated coordinator plans it.
"""
from __future__ import annotations

from typing import Any, List

import torch

from .tasks import Kind

__all__ = ["rounds_collective_workflow", "gather_workflow"]


def rounds_collective_workflow(b, grad: torch.Tensor, codec: Any) -> None:
    """A multi-round compressor's rounds, each reduced by one lane collective.

    Round r: every rank encodes ``encode_round(r, grad, state, merged_{r-1})``;
    a sum or max round's ``summable_view`` is reduced in place (the layout's
    static round groups fuse the same round of several gradients, as
    PyTorch's PowerSGD hook batches them), so the payload becomes the merged
    one on every rank: one collective per round instead of a gather at an
    aggregator and a send back (two bulk rounds). A broadcast round's buffer
    becomes the owner's payload on every rank.
    """
    comp, site = codec.comp, "rounds"

    def view(payload: torch.Tensor, r: int) -> torch.Tensor:
        v = comp.kernels.summable_view(payload)
        if v is None:
            raise RuntimeError(f"{comp.name}: round {r} payload has no summable view "
                               "(misaligned); use raw_collective=False")
        return v

    def bview(payload: torch.Tensor, r: int, nbytes: int) -> torch.Tensor:
        if codec.broadcast_root(site) != b.rank:
            return torch.empty(nbytes, dtype=torch.uint8, device=payload.device)
        if payload.numel() != nbytes:
            raise RuntimeError(f"{comp.name}: round {r}'s owner payload has "
                               f"{payload.numel()} bytes, broadcast_nbytes promised {nbytes}")
        return payload

    prev = None  # the collective whose result is the previous round's merged payload
    for r, red in enumerate(comp.capabilities.round_reductions):
        def enc(*merged: torch.Tensor, r=r) -> torch.Tensor:
            return codec.encode_round(r, grad, site, merged[0] if merged else None)
        e = b.compute(Kind.ENCODE, 0, enc, [prev] if prev is not None else [])
        if red == "broadcast":
            nbytes = comp.broadcast_nbytes(r, grad.numel(), grad.dim())
            prev = b.collective(e, r, lambda payload, r=r, nb=nbytes: bview(payload, r, nb),
                                op="broadcast", root=lambda: codec.broadcast_root(site))
        else:
            prev = b.collective(e, r, lambda payload, r=r: view(payload, r), op=red)
    b.compute(Kind.WRITE, 0, lambda merged: codec.decode_rounds_into(grad, site, merged), [prev])


def gather_workflow(b, grad: torch.Tensor, codec: Any) -> None:
    """Encode, gather every rank's payload, then ``grad = sum(decode(p_r)) / N`` in rank order."""
    def enc() -> torch.Tensor:
        return codec.encode(grad, "push")

    def write(payloads: List[torch.Tensor]) -> None:
        flat = grad.view(-1)
        flat.zero_()
        codec.add_decoded_many(list(payloads), flat)
        flat.div_(b.size)

    e = b.compute(Kind.ENCODE, 0, enc)
    g = b.collective(e, 0, op="gather")
    b.compute(Kind.WRITE, 0, write, [g])
