"""``hpt.save_checkpoint`` / ``hpt.load_checkpoint``: one call, a file that is whole or refused.

Like DeepSpeed's ``save_checkpoint`` and Horovod's "rank 0 saves" idiom,
but the file cannot be half-written (``adapters.checkpoint_io``:
write aside, fsync, rename; a footer with the length and SHA-256).

What is saved, in one ``torch.save`` payload::

    {"format": FORMAT, "version": VERSION, "world_size": N, "rank": r or None,
     "model": model.state_dict(), "optimizer": optimizer.state_dict(...),
     "extra": {...}}                      # the keyword arguments (epoch, step, ...)

With ``plan="adaptive"`` the optimizer's state dict also holds the active
plan and its controller (``"hipress_adaptive"``, ``tuning.online``), and
``load_checkpoint`` switches to that plan before the compressor state is
restored: a job resumed from a checkpoint taken after a switch goes on with
the switched plan.

Who writes:

* ``DistributedOptimizer`` (and a plain optimizer, or none): the optimizer's
  ``state_dict(all_ranks=True)`` gathers every rank's compressor state
  (a collective), and **rank 0 alone** writes ``path``; a later run with
  another world size can reshard it (``adapters.checkpoint``).
* An optimizer whose compressor state is saved per rank only (partial
  aggregation, ``stragglers=Quorum(...)``): **every rank** writes its own
  file, ``rank_path(path, r)``.

Every rank then joins one small exchange of outcomes, so that no rank goes
on (or exits) before the file is whole: a writer that fails (a full disk)
makes every rank raise naming it, and a writer that dies makes the
exchange fail within the runtime's timeout; the previous checkpoint stays
intact either way. Loading reads the file with ``torch.load(weights_only=True)``:
tensors, numbers, strings and containers only, nothing else is unpickled,
so ``**extra`` must hold only those.
"""
from __future__ import annotations

import inspect
import io
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..checkpoint_io import CheckpointError, read_verified, write_atomic
from ..objects import allgather_object
from ..runtime import is_initialized, rank, size

__all__ = ["save_checkpoint", "load_checkpoint", "rank_path", "CheckpointError"]

FORMAT = "hipress-like-checkpoint"
VERSION = 1


def rank_path(path: str, r: int) -> str:
    """Rank ``r``'s file of a per-rank checkpoint: ``ck.pt`` -> ``ck.rank1.pt``."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{r}{ext}"


def _optimizer_state(optimizer: Any, dist: bool) -> Tuple[Optional[Dict[str, Any]], bool]:
    """(the state dict to save, whether it holds this rank's compressor state only).

    ``state_dict(all_ranks=True)`` where the optimizer offers it (a collective);
    otherwise the plain state dict, which is per rank when it carries a
    ``"hipress"`` compressor state (partial aggregation)."""
    if optimizer is None:
        return None, False
    if "all_ranks" in inspect.signature(optimizer.state_dict).parameters:
        return optimizer.state_dict(all_ranks=dist), False
    sd = optimizer.state_dict()
    return sd, "hipress" in sd


def save_checkpoint(path: str, model: torch.nn.Module, optimizer: Any = None, *,
                    progress: Optional[Callable[[int, int], None]] = None,
                    **extra: Any) -> str:
    """Save model, optimizer (compressor state included) and ``extra`` atomically.

    A collective call when ``hpt.init()`` ran: every rank calls it at the
    same point (it gathers every rank's compressor state, and ends with an
    exchange of the writers' outcomes).

    Args:
        path: the checkpoint file (its directory must exist). Rank 0 writes
            it; under partial aggregation every rank writes
            ``rank_path(path, rank)``.
        model: its ``state_dict()`` is saved.
        optimizer: a ``DistributedOptimizer`` (or any optimizer, or None).
        progress: ``progress(bytes_written, total)`` after every MiB written.
        **extra: anything else to keep (epoch, step, a scheduler's state
            dict): tensors, numbers, strings and containers of them.

    Returns:
        The file this rank wrote, or ``path`` on ranks that wrote nothing.

    Raises:
        OSError: the write failed on this rank or, on the others, on the
            writing rank (named); ``path`` keeps its previous content.
        TypeError: ``extra`` holds something ``load_checkpoint`` would refuse.

    Example:
        >>> hpt.save_checkpoint("ck.pt", model, opt, epoch=3)      # doctest: +SKIP
        >>> extra = hpt.load_checkpoint("ck.pt", model, opt)       # doctest: +SKIP
    """
    dist = is_initialized()
    r, n = (rank(), size()) if dist else (0, 1)
    opt_sd, per_rank = _optimizer_state(optimizer, dist)
    target = rank_path(path, r) if per_rank else path
    failure: Optional[BaseException] = None
    if per_rank or r == 0:
        try:
            _check_extra(extra)
            blob = {"format": FORMAT, "version": VERSION, "world_size": n,
                    "rank": r if per_rank else None, "model": model.state_dict(),
                    "optimizer": opt_sd, "extra": extra}
            buf = io.BytesIO()
            torch.save(blob, buf)
            write_atomic(target, buf.getbuffer(), progress=progress)
        except Exception as e:  # told to the other ranks below, then raised here
            failure = e
    if dist:
        # every rank leaves only once the file is whole, or learns which rank failed and
        # why (a dead writer fails this exchange within the runtime's timeout)
        told = allgather_object(None if failure is None else f"{type(failure).__name__}: "
                                f"{failure}", name="save_checkpoint")
        bad = {i: m for i, m in enumerate(told) if m is not None}
        if bad and failure is None:
            raise OSError(f"save_checkpoint: rank(s) {sorted(bad)} could not write the "
                          f"checkpoint ({'; '.join(f'rank {i}: {m}' for i, m in bad.items())}); "
                          f"{path} keeps its previous content")
    if failure is not None:
        raise failure
    return target


def _check_extra(extra: Dict[str, Any]) -> None:
    """Refuse, before anything is written, ``**extra`` that loading would refuse.

    Raises:
        TypeError: a value is not tensors, numbers, strings and containers
            of them (what ``torch.load(weights_only=True)`` reads back).
    """
    for key, value in extra.items():
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        try:
            torch.load(buf, weights_only=True)
        except Exception as e:
            raise TypeError(f"save_checkpoint: {key}={type(value).__name__} cannot be "
                            "loaded back without unpickling arbitrary objects (load_checkpoint "
                            "reads with torch.load(weights_only=True)); pass tensors, numbers, "
                            f"strings and containers of them, e.g. {key}=obj.state_dict()"
                            ) from e


def load_checkpoint(path: str, model: Optional[torch.nn.Module] = None,
                    optimizer: Any = None) -> Dict[str, Any]:
    """Load what ``save_checkpoint`` wrote into ``model`` and ``optimizer``.

    Every rank reads ``path`` (a file system every rank sees), or its own
    ``rank_path(path, rank)`` when ``path`` is absent (partial aggregation;
    rank 0's file on a rank that did not exist when it was saved). The
    file's footer is checked before anything is read from it; with another
    world size the optimizer reshards the compressor state or says what it
    resets (``CompressorStateReset``).

    Args:
        path: what was passed to ``save_checkpoint``.
        model: receives the saved ``state_dict`` (None: not loaded).
        optimizer: receives the saved optimizer state (None: not loaded).

    Returns:
        The ``**extra`` keyword arguments given to ``save_checkpoint``.

    Raises:
        FileNotFoundError: neither ``path`` nor this rank's file exists.
        CheckpointError: the file is incomplete (its writer died mid-save),
            corrupted, or not a checkpoint of this format; the message
            names the file.
    """
    r = rank() if is_initialized() else 0
    # a per-rank checkpoint loaded by more ranks than saved it: a new rank reads rank 0's
    # file (the model is the same on every rank); the optimizer then starts its compressor
    # state fresh with a warning (another world size), or refuses another rank's state
    tried = [path, rank_path(path, r), rank_path(path, 0)]
    target = next((t for t in tried if os.path.exists(t)), None)
    if target is None:
        raise FileNotFoundError(f"no checkpoint at {path} (nor {tried[1]} or {tried[2]}, "
                                f"the per-rank files of rank {r} and rank 0); pass the path "
                                "given to save_checkpoint")
    payload = read_verified(target)
    try:
        blob = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # an unpickler refusal names the offending type
        raise CheckpointError(f"checkpoint {target} holds something other than tensors, "
                              f"numbers, strings and containers, which is never unpickled "
                              f"(torch.load weights_only=True): {e}") from e
    if not isinstance(blob, dict) or blob.get("format") != FORMAT \
            or blob.get("version") != VERSION:
        found = (blob.get("format"), blob.get("version")) if isinstance(blob, dict) else None
        raise CheckpointError(f"{target} is not a checkpoint this version reads: expected "
                              f"format {FORMAT!r} version {VERSION}, found {found!r}; write it "
                              "with hpt.save_checkpoint")
    if model is not None:
        model.load_state_dict(blob["model"])
    if optimizer is not None and blob["optimizer"] is not None:
        optimizer.load_state_dict(blob["optimizer"])
    return dict(blob["extra"])
