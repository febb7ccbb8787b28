"""The consistency guard: every replica must hold the same parameters and optimizer state.

Data-parallel training is correct only while every rank's model stays
bitwise identical: every rank applies the same averaged gradient to the same
parameters with the same optimizer state. A bug, a non-deterministic kernel,
a rank resumed from another checkpoint or a bit flipped in memory breaks
that silently, and the replicas drift apart. Horovod and DDP have no guard
against it; this is one, off by default and cheap when on
(``DistributedOptimizer(..., check_consistency_every=K)``).

One check:

1. Every rank lists its state as named entries, in the model's order: each
   parameter, then each of its optimizer-state values (momentum buffers,
   Adam's moments, the step count), then each param group's settings (lr,
   momentum, ...), and hashes each entry's bytes (BLAKE2b, 8 bytes; dtype
   and shape included).
2. The ranks allgather one small record: the number of entries and a hash
   of all of them. When every rank's record is the same (the normal case),
   the check ends here: one allgather of 256 bytes.
3. Otherwise they allgather the per-entry hashes (8 bytes per entry), and
   every rank raises the same ``ConsistencyError``, naming the first entry
   that differs (a parameter's name, or its optimizer state's key), which
   ranks hold which version, and how many entries differ in all.

Hashes, not values, travel: comparing two ranks' hashes of the same bytes
finds any difference except a hash collision (about 2^-64 per entry).
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import torch

from ..errors import HipressError
from .collectives import _gather_records, _Handle, _Wire

__all__ = ["ConsistencyError", "replica_entries", "check_replicas"]

log = logging.getLogger(__name__)

# Entries a message names in full after the first one; the rest are counted.
_LISTED = 8


class ConsistencyError(HipressError, RuntimeError):
    """Replicas differ: raised on every rank by the consistency guard.

    Attributes:
        entry: the first entry (in the model's order) that differs.
        ranks: the ranks outside the majority version of that entry (every
            rank when no version has a majority).
        differing: every differing entry's name, in order.
    """

    def __init__(self, message: str, entry: str = "", ranks: Sequence[int] = (),
                 differing: Sequence[str] = ()):
        super().__init__(message)
        self.entry = entry
        self.ranks = tuple(ranks)
        self.differing = tuple(differing)


def _digest(value: Any) -> int:
    """A signed 64-bit BLAKE2b hash of a tensor's dtype, shape and bytes (or a repr)."""
    h = hashlib.blake2b(digest_size=8)
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_sparse:
            t = t.to_dense()
        t = t.cpu().contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(value).encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def replica_entries(named_params: Iterable[Tuple[str, torch.Tensor]],
                    optimizer: Any = None) -> List[Tuple[str, int]]:
    """This rank's state as (entry name, hash), in the model's order.

    Args:
        named_params: (name, parameter) pairs, in the same order on every rank.
        optimizer: a ``torch.optim.Optimizer`` whose state and param-group
            settings are included; None: parameters only.

    Returns:
        One entry per parameter, per optimizer-state value of each parameter,
        and per param-group setting (its ``params`` list excluded).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> [n for n, _ in replica_entries([("w", p)], torch.optim.SGD([p], lr=0.1))][:2]
        ['w', "param_groups[0]['dampening']"]
    """
    entries: List[Tuple[str, int]] = []
    state = optimizer.state if optimizer is not None else {}
    for name, p in named_params:
        entries.append((name, _digest(p)))
        for key, value in sorted(state.get(p, {}).items(), key=lambda kv: str(kv[0])):
            entries.append((f"{name} (optimizer state {key!r})", _digest(value)))
    if optimizer is not None:
        for i, group in enumerate(optimizer.param_groups):
            for key in sorted(k for k in group if k != "params"):
                entries.append((f"param_groups[{i}][{key!r}]", _digest(group[key])))
    return entries


def _groups(values: Sequence[int]) -> Dict[int, List[int]]:
    out: Dict[int, List[int]] = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    return out


def _outside_majority(groups: Dict[int, List[int]], n: int) -> List[int]:
    sizes = sorted((len(rs) for rs in groups.values()), reverse=True)
    if len(sizes) > 1 and sizes[0] > sizes[1]:
        return sorted(r for rs in groups.values() if len(rs) < sizes[0] for r in rs)
    return list(range(n))


def check_replicas(named_params: Sequence[Tuple[str, torch.Tensor]], optimizer: Any = None,
                   step: Any = None) -> None:
    """Raise on every rank unless every rank holds identical parameters and state.

    A collective call over the runtime's default group: every rank calls it
    at the same point of training (the module docstring has the algorithm).

    Args:
        named_params: (name, parameter) pairs, in the same order on every rank.
        optimizer: the (wrapped) optimizer whose state and settings to compare.
        step: the step number, for the message.

    Raises:
        ConsistencyError: some entry differs (names the first, and the ranks).
    """
    wire = _Wire()
    if wire.size == 1:
        return
    entries = replica_entries(named_params, optimizer)
    hashes = torch.tensor([h for _, h in entries], dtype=torch.int64)
    total = _digest(hashes)
    at = f" after step {step}" if step is not None else ""
    what = f"consistency check{at}"
    records = _gather_records(wire, what, {"collective": "check_consistency",
                                           "entries": len(entries), "all": total})
    if all(r == records[0] for r in records):
        return
    counts = _groups([r.get("entries", -1) for r in records])
    if len(counts) > 1:
        raise ConsistencyError(
            f"replicas differ{at}: the ranks hold different numbers of parameters and "
            "optimizer-state entries: " + "; ".join(
                f"{c} on rank(s) {rs}" for c, rs in counts.items())
            + ". Expected every rank to build the same model and optimizer and to step it "
            "alike (a rank whose optimizer state is still empty has not stepped yet)",
            "", _outside_majority(counts, wire.size))
    outs = [torch.empty_like(hashes) for _ in range(wire.size)]
    _Handle([wire.all_gather(outs, hashes)], lambda: hashes, what).wait()
    table = torch.stack(outs)  # [rank, entry]
    differing = [i for i in range(len(entries))
                 if not bool((table[:, i] == table[0, i]).all())]
    first = differing[0]
    groups = _groups(table[:, first].tolist())
    ranks = _outside_majority(groups, wire.size)
    versions = "; ".join(f"version {k + 1} on rank(s) {rs}"
                         for k, rs in enumerate(groups.values()))
    names = [entries[i][0] for i in differing]
    listed = ", ".join(names[:_LISTED]) + (f", and {len(names) - _LISTED} more"
                                           if len(names) > _LISTED else "")
    log.error("consistency check%s failed: %d entries differ, first %s", at, len(names),
              names[0])
    raise ConsistencyError(
        f"replicas differ{at}: the first entry that differs is {names[0]!r} ({versions}); "
        f"{len(names)} of {len(entries)} entries differ: {listed}. Expected every rank to "
        f"hold bitwise-identical parameters and optimizer state; rank(s) {ranks} diverged "
        "(a non-deterministic operation, a rank resumed from another checkpoint, or state "
        "changed on some ranks only)", names[0], ranks, names)
