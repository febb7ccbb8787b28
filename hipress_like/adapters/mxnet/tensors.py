"""MXNet NDArrays as torch tensors (zero-copy, through DLPack), and back.

The engine and the collectives work on torch tensors; MXNet hands over its
arrays without a copy:

- ``as_torch(arr, write=True)`` calls ``arr.to_dlpack_for_write()``, which
  first waits (``WaitToWrite``) for every pending MXNet operation that reads
  or writes ``arr``. MXNet runs its operators asynchronously, so this is the
  point where an asynchronously computed gradient becomes final; the torch
  tensor then aliases MXNet's memory, and what torch writes, MXNet reads.
- ``as_torch(arr, write=False)`` waits only for pending writes.
- ``to_mxnet(t, like)`` copies a torch result into a new NDArray on the
  context of ``like`` (results of out-of-place collectives are small and
  the copy keeps their lifetime MXNet's own).

Only dense (``stype == "default"``) arrays convert; MXNet's sparse arrays
(``row_sparse``, ``csr``) are refused with the fix.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["as_torch", "to_mxnet", "check_dense"]


def check_dense(arr: Any, what: str) -> None:
    """Raise ``TypeError`` unless ``arr`` is a dense MXNet NDArray."""
    import mxnet as mx

    if not isinstance(arr, mx.nd.NDArray):
        raise TypeError(f"{what} expects an mxnet.nd.NDArray, found {type(arr).__name__}")
    if arr.stype != "default":
        raise TypeError(f"{what}: {arr.stype} arrays are not supported; convert with "
                        "arr.tostype('default'), or build the layer with sparse_grad=False")


def as_torch(arr: Any, write: bool = True) -> torch.Tensor:
    """A torch tensor sharing ``arr``'s memory, once MXNet's pending work on it is done.

    Args:
        arr: a dense ``mx.nd.NDArray`` (any context DLPack can describe).
        write: wait for pending reads too (the caller will write into it).
    """
    capsule = arr.to_dlpack_for_write() if write else arr.to_dlpack_for_read()
    return torch.from_dlpack(capsule)


def to_mxnet(t: torch.Tensor, like: Any) -> Any:
    """A new NDArray holding a copy of ``t``, on ``like``'s context."""
    import mxnet as mx

    data = t.detach().cpu().contiguous().numpy()
    return mx.nd.array(data, ctx=like.context, dtype=data.dtype)
