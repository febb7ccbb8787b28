"""Objects and parameters across ranks (Horovod's names), framework-neutral.

``broadcast_object`` / ``allgather_object`` move plain data as
``torch.save`` bytes read back with ``torch.load(weights_only=True)``:
tensors, numbers, strings, None, lists, tuples and dicts (optimizer state
dicts included) travel; arbitrary classes are refused on the sender before
anything is sent, and nothing received is ever unpickled.
``broadcast_parameters`` packs named tensors by dtype into a few broadcasts;
the TensorFlow and MXNet faces pass torch views of their variables. The
torch face's ``broadcast_optimizer_state`` (``torch.optim`` state) builds on
these in ``adapters/torch/objects.py``.
"""
from __future__ import annotations

import io
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .collectives import (
    Sum,
    _allgather_uint8,
    _dist,
    _foreign_set,
    _no_process_set,
    _Wire,
    allreduce_,
    broadcast_,
)

__all__ = ["broadcast_object", "allgather_object", "broadcast_parameters"]


def _dumps(obj: Any) -> bytes:
    """Serialise with torch.save and prove it reads back under ``weights_only=True``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "Unsupported global" in ln]
        reason = lines[0] if lines else str(e).splitlines()[0]
        raise TypeError(
            f"cannot send a {type(obj).__name__}: only tensors, numbers, strings, None, "
            "lists, tuples and dicts of them cross the wire (they are read back with "
            f"torch.load(weights_only=True), never unpickled); convert it first ({reason})"
        ) from e
    return data


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = None) -> Any:
    """Send a plain-data object from ``root_rank`` to every rank; return it.

    The root serialises it and checks that it loads under
    ``torch.load(weights_only=True)``; if not, every rank raises (the root with
    the reason) instead of waiting.

    Example:
        >>> state = hpt.broadcast_object({"epoch": 3} if hpt.rank() == 0 else None)

    Raises:
        TypeError: the object holds something other than tensors, numbers,
            strings, None, lists, tuples and dicts.
    """
    dist = _dist()
    _foreign_set(_Wire(), process_set)  # a Horovod process set under horovodrun, else refused
    what = f"broadcast_object {name!r}" if name else "broadcast_object"
    error: Optional[BaseException] = None
    if dist.get_rank() == root_rank:
        try:
            data = _dumps(obj)
        except TypeError as e:
            error, data = e, str(e).encode()
        length = torch.tensor([-len(data) - 1 if error else len(data)], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, what, process_set)
    n = int(length.item())
    buf = torch.empty(max(abs(n) - (1 if n < 0 else 0), 1), dtype=torch.uint8)
    if dist.get_rank() == root_rank:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    broadcast_(buf, root_rank, what, process_set)
    if n < 0:
        if error is not None:
            raise error
        raise TypeError(f"{what}: rank {root_rank} could not serialise its object: "
                        f"{buf[: -n - 1].numpy().tobytes().decode(errors='replace')}")
    return obj if dist.get_rank() == root_rank else _loads(buf[:n].numpy().tobytes())


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = None
                     ) -> List[Any]:
    """Gather a plain-data object from every rank; list index = rank."""
    _no_process_set(process_set)
    what = f"allgather_object {name!r}" if name else "allgather_object"
    try:
        data, bad = _dumps(obj), ""
    except TypeError as e:
        data, bad = b"", str(e)
    flag = torch.tensor([1 if bad else 0], dtype=torch.int64)
    allreduce_(flag, op=Sum, name=what)
    if int(flag.item()):
        raise TypeError(f"{what}: {bad}" if bad else f"{what}: another rank could not "
                        "serialise its object (see its error)")
    parts = _allgather_uint8(torch.frombuffer(bytearray(data), dtype=torch.uint8), what)
    return [_loads(p.numpy().tobytes()) for p in parts]


# -- model and optimizer state -----------------------------------------------------------

def _named_tensors(params: Any) -> List[Tuple[str, torch.Tensor]]:
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable):
        items = list(params)
        if items and not isinstance(items[0], tuple):
            items = [(str(i), p) for i, p in enumerate(items)]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}: expected a dict "
                         "(model.state_dict()) or a list of (name, tensor) "
                         "(model.named_parameters())")
    out = []
    for k, v in items:
        if v is None:
            continue
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"broadcast_parameters: entry {k!r} is a {type(v).__name__}, "
                             "not a tensor; broadcast it with broadcast_object")
        out.append((str(k), v))
    return out


def broadcast_parameters(params: Any, root_rank: int = 0, process_set: Any = None) -> None:
    """Overwrite every rank's parameters/buffers in place with ``root_rank``'s.

    Tensors are packed by dtype into one flat buffer each, so a model costs a
    few broadcasts, not one per tensor.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a
            list of tensors (same order on every rank).
        root_rank: the rank whose values win.

    Example:
        >>> hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    _dist()
    _no_process_set(process_set)
    tensors = _named_tensors(params)
    groups: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for _, t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for (dtype, _), ts in groups.items():
            flat = torch.cat([t.detach().reshape(-1) for t in ts]) if ts else None
            broadcast_(flat, root_rank, f"broadcast_parameters[{dtype}]")
            off = 0
            for t in ts:
                n = t.numel()
                t.copy_(flat[off: off + n].view_as(t))
                off += n
