"""Collectives built from point-to-point messages, so the cost model's choice runs.

The flexible-communication paper (Tyagi & Sharma) prices collectives with the
alpha-beta model (Table I) and picks, per gradient, between an Allgather of
top-k values and indices and AR-Topk's Broadcast of indices followed by a
Ring or Tree allreduce of values (Eq. 4a/4b, 5a-5c;
``cost_model.collectives.select_collective``). Backends hide their
algorithms (gloo and NCCL choose their own), so this module implements each
one as the model describes it, over the transport's ``alltoallv`` (one call
per communication step; a rank with nothing to send or receive in a step
passes empty lists, which costs it nothing). Every step carries the
caller's timeout, as every transport call does, so a dead peer is an error
naming it, never a hang.

    ring_allreduce   2(N-1) steps: N-1 reduce-scatter, N-1 allgather hops of
                     M/N bytes (Table I, Ring-AR).
    tree_allreduce   binomial-tree reduce to rank 0, then binomial broadcast:
                     2 ceil(log2 N) steps of M bytes (Table I, Tree-AR).
    tree_broadcast   binomial tree from ``root``: ceil(log2 N) steps of M bytes
                     (Table I, Broadcast).
    bruck_allgather  Bruck's algorithm: ceil(log2 N) steps, (N-1) M bytes in
                     all (Table I, Allgather).

Sums are taken in a fixed order and the result is forwarded as bytes, so
every rank ends with bitwise-identical tensors.

The alpha and beta the selection needs are measured above this layer
(``tuning.link``) and handed to the engine as its link source
(``EngineConfig.link_source``), as its plan source is.

``topk_sync`` is the top-k synchronisation of the paper's comparison run by
the chosen collective: "allgather" (LWTopk: every rank's values and
indices), "art_ring" and "art_tree" (AR-Topk, Alg. 1 lines 16-19).
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional

import torch

from ..compressors.ops import extract, topk_abs
from ..compressors.sparse.topk import num_selected
from ..cost_model.collectives import check_collective
from .chunks import chunk_bounds
from .transport.base import DEFAULT_TIMEOUT, Transport

__all__ = ["exchange", "ring_allreduce", "tree_allreduce", "tree_broadcast",
           "bruck_allgather", "allreduce_by", "topk_sync", "ALLREDUCES"]

_log = logging.getLogger(__name__)

def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def exchange(tr: Transport, sends: Dict[int, torch.Tensor], recv_nbytes: Dict[int, int],
             timeout: float, device: Optional[torch.device] = None) -> Dict[int, torch.Tensor]:
    """One communication step: send ``sends[p]`` (uint8) to each ``p``, receive
    ``recv_nbytes[p]`` bytes from each ``p``. Collective: every rank calls it,
    possibly with nothing to send or receive.

    Args:
        device: where the received bytes go (the transport's device, e.g. the CPU of
            gloo, may differ from the data's, e.g. a GPU); None: left where they arrive.

    Returns:
        The received bytes by source rank (empty messages are left out).
    """
    send: List[Optional[torch.Tensor]] = [None] * tr.size
    sizes = [0] * tr.size
    for p, t in sends.items():
        if t.numel():
            send[p] = t
    for p, n in recv_nbytes.items():
        sizes[p] = int(n)
    got = tr.alltoallv(send, sizes, timeout)
    return {p: got[p] if device is None else got[p].to(device)
            for p in recv_nbytes if recv_nbytes[p] and got[p] is not None}


def ring_allreduce(tr: Transport, tensor: torch.Tensor,
                   timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place with a ring (Table I, Ring-AR).

    1. Cut the flat tensor into N chunks.
    2. Reduce-scatter: in step s (0..N-2) send chunk (rank - s) to the next
       rank, receive chunk (rank - s - 1) from the previous one and add it;
       afterwards chunk (rank + 1) holds the full sum.
    3. Allgather: N-1 steps forwarding the finished chunks unchanged.

    Args:
        tr: the transport; ``tensor``: contiguous, the same shape on every rank.
        timeout: seconds for each step.

    Returns:
        ``tensor``, now the sum (bitwise equal on every rank).
    """
    n, me = tr.size, tr.rank
    if n == 1:
        return tensor
    flat = tensor.view(-1)
    parts = chunk_bounds(flat.numel(), n)
    nxt, prv = (me + 1) % n, (me - 1) % n
    isz = flat.element_size()
    for s in range(n - 1):
        cs, ce = parts[(me - s) % n]
        rs, re_ = parts[(me - s - 1) % n]
        got = exchange(tr, {nxt: _bytes(flat[cs:ce])}, {prv: (re_ - rs) * isz}, timeout,
                       flat.device)
        if prv in got:
            flat[rs:re_].add_(got[prv].view(flat.dtype))
    for s in range(n - 1):
        cs, ce = parts[(me + 1 - s) % n]
        rs, re_ = parts[(me - s) % n]
        got = exchange(tr, {nxt: _bytes(flat[cs:ce])}, {prv: (re_ - rs) * isz}, timeout,
                       flat.device)
        if prv in got:
            flat[rs:re_].copy_(got[prv].view(flat.dtype))
    return tensor


def _check_tree(tr: Transport, what: str) -> None:
    if tr.size < 2:
        raise ValueError(f"{what} needs a world of at least 2 ranks, found {tr.size}: a tree "
                         "over one rank has no edges (and log2(1) = 0 makes its cost model "
                         "degenerate); with one rank there is nothing to reduce")


def tree_allreduce(tr: Transport, tensor: torch.Tensor,
                   timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place with a binomial tree (Table I, Tree-AR).

    1. Reduce: for mask = 1, 2, 4, ...: a rank with ``rank & mask`` (and no
       lower bit) sends its partial sum to ``rank - mask`` and is done; its
       partner adds it. Rank 0 ends with the sum.
    2. Broadcast the sum from rank 0 down the same tree (``tree_broadcast``).

    Raises:
        ValueError: a world of one rank (no tree).
    """
    _check_tree(tr, "tree_allreduce")
    n, me = tr.size, tr.rank
    flat = tensor.view(-1)
    nbytes = flat.numel() * flat.element_size()
    mask = 1
    while mask < n:
        sends, recvs = {}, {}
        if me % (2 * mask) == mask:  # active and its bit is set: send up
            sends[me - mask] = _bytes(flat)
        elif me % (2 * mask) == 0 and me + mask < n:
            recvs[me + mask] = nbytes
        got = exchange(tr, sends, recvs, timeout, flat.device)
        for b in got.values():
            flat.add_(b.view(flat.dtype))
        mask *= 2
    return tree_broadcast(tr, tensor, 0, timeout)


def tree_broadcast(tr: Transport, tensor: torch.Tensor, root: int,
                   timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """Broadcast ``tensor`` from ``root`` in place down a binomial tree (Table I, Broadcast).

    With ``v = (rank - root) mod N``: for mask = 2^(ceil(log2 N)-1) down to 1,
    a rank with ``v % (2 mask) == 0`` sends to ``v + mask`` (if it exists).

    Raises:
        ValueError: ``root`` outside the world.
    """
    n, me = tr.size, tr.rank
    if not 0 <= root < n:
        raise ValueError(f"broadcast root must be in [0, {n}), found {root}")
    if n == 1:
        return tensor
    flat = tensor.view(-1)
    nbytes = flat.numel() * flat.element_size()
    v = (me - root) % n
    mask = 1
    while mask < n:
        mask *= 2
    mask //= 2
    while mask >= 1:
        sends, recvs = {}, {}
        if v % (2 * mask) == 0 and v + mask < n:
            sends[(v + mask + root) % n] = _bytes(flat)
        elif v % (2 * mask) == mask:
            recvs[(v - mask + root) % n] = nbytes
        got = exchange(tr, sends, recvs, timeout, flat.device)
        for b in got.values():
            flat.copy_(b.view(flat.dtype))
        mask //= 2
    return tensor


def bruck_allgather(tr: Transport, tensor: torch.Tensor,
                    timeout: float = DEFAULT_TIMEOUT) -> List[torch.Tensor]:
    """Gather an equally-shaped tensor from every rank (Bruck et al. 1997; Table I,
    Allgather): ceil(log2 N) steps; in step s rank r sends the blocks it holds
    (its own and those of ranks r+1 .. r+2^s-1) to rank r - 2^s.

    Returns:
        The tensors by rank (the own one is ``tensor`` itself).
    """
    n, me = tr.size, tr.rank
    mine = _bytes(tensor)
    blocks = [mine]  # blocks[j] is rank (me + j)'s tensor
    step = 1
    while step < n:
        cnt = min(step, n - step)  # blocks the partner still lacks
        payload = torch.cat(blocks[:cnt]) if cnt > 1 else blocks[0]
        got = exchange(tr, {(me - step) % n: payload}, {(me + step) % n: cnt * mine.numel()},
                       timeout, tensor.device)
        recv = got[(me + step) % n]
        blocks.extend(recv[i * mine.numel():(i + 1) * mine.numel()] for i in range(cnt))
        step *= 2
    out: List[torch.Tensor] = [tensor] * n
    for j in range(1, n):
        out[(me + j) % n] = blocks[j].view(tensor.dtype).view(tensor.shape)
    return out


def _transport_allreduce(tr: Transport, t: torch.Tensor, timeout: float) -> torch.Tensor:
    return tr.allreduce(t, "sum", timeout)


# Allreduce algorithms by name (``allreduce_by``): "backend" is the transport's own.
ALLREDUCES: Dict[str, Callable[[Transport, torch.Tensor, float], torch.Tensor]] = {
    "ring": ring_allreduce,
    "tree": tree_allreduce,
    "backend": _transport_allreduce,
}


def allreduce_by(name: str, tr: Transport, tensor: torch.Tensor,
                 timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """Sum ``tensor`` in place with the allreduce algorithm ``name`` ("ring", "tree",
    "backend").

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    fn = ALLREDUCES.get(name)
    if fn is None:
        raise ValueError(f"unknown allreduce algorithm {name!r}; available: "
                         f"{', '.join(sorted(ALLREDUCES))}")
    return fn(tr, tensor, timeout)


def topk_sync(tr: Transport, grad: torch.Tensor, ratio: float, collective: str, *,
              owner: int = 0, timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
    """Average a top-k compressed gradient over ranks with ``collective``.

    * "allgather" (LWTopk): every rank's top-k (sorted int32 indices, float32
      values) is gathered (``bruck_allgather``) and the N sparse tensors are
      added in rank order.
    * "art_ring" / "art_tree" (AR-Topk, Alg. 1 lines 16-19): ``owner``'s
      top-k indices are broadcast (``tree_broadcast``), then every rank's
      values there are summed by ``ring_allreduce`` / ``tree_allreduce``.

    No residual is kept here (the compressors ``star_topk``/``var_topk`` and
    error feedback keep it in the engine); this is the communication the
    cost model prices, with the compression it needs.

    Args:
        tr: the transport; ``grad``: this rank's gradient (not modified).
        ratio: the compression ratio c in (0, 1].
        collective: "allgather", "art_ring" or "art_tree"
            (``cost_model.collectives.SELECTABLE``).
        owner: the rank whose indices AR-Topk uses.
        timeout: seconds per communication step.

    Returns:
        A new tensor shaped like ``grad``: the average (bitwise equal on every rank).

    Raises:
        ValueError: an unknown collective, a ratio outside (0, 1], an owner
            outside the world, or "art_tree" over one rank.
    """
    check_collective(collective)
    if not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
        raise ValueError(f"ratio (the compression ratio c) must be in (0, 1], found {ratio!r}")
    if not 0 <= owner < tr.size:
        raise ValueError(f"owner must be a rank in [0, {tr.size}), found {owner}")
    x = grad.detach().reshape(-1).float()
    n = x.numel()
    k = num_selected(ratio, n)
    out = torch.zeros(n, dtype=torch.float32)
    if collective == "allgather":
        idx = torch.sort(topk_abs(x, k)[0]).values
        mine = torch.cat([idx.to(torch.int32).view(torch.uint8),
                          extract(x, idx).view(torch.uint8)])
        for part in bruck_allgather(tr, mine, timeout):
            out.index_add_(0, part[: 4 * k].view(torch.int32).long(),
                           part[4 * k:].view(torch.float32))
    else:
        if collective == "art_tree":
            _check_tree(tr, "art_tree")
        idx = torch.empty(k, dtype=torch.int32)
        if tr.rank == owner:
            idx.copy_(torch.sort(topk_abs(x, k)[0]).values)
        tree_broadcast(tr, idx, owner, timeout)
        vals = extract(x, idx.long())
        allreduce_by("ring" if collective == "art_ring" else "tree", tr, vals, timeout)
        out[idx.long()] = vals
    return out.div_(tr.size).view(grad.shape).to(grad.dtype)

