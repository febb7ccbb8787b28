"""Transports: in-process threads, torch.distributed, MPI, Horovod.

Implementations are imported lazily (PEP 562 ``__getattr__``): importing
this package never imports mpi4py or horovod, which may be absent or may
initialise MPI as a side effect.

    from hipress_like.casync.transport import make_transport, InProcGroup
    t = make_transport("gloo")      # after torch.distributed.init_process_group
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Optional

from .base import DEFAULT_TIMEOUT, KeyValueStore, NoStoreError, PeerError, Transport, TransportError

__all__ = [
    "DEFAULT_TIMEOUT", "PeerError", "Transport", "TransportError", "KeyValueStore",
    "NoStoreError",
    "InProcGroup", "InProcTransport", "run_threads",
    "TorchDistTransport", "MPITransport", "HorovodTransport",
    "make_transport", "BACKENDS",
]

# public name -> submodule defining it
_LAZY = {
    "InProcGroup": "inproc",
    "InProcTransport": "inproc",
    "run_threads": "inproc",
    "TorchDistTransport": "torch_dist",
    "MPITransport": "mpi",
    "HorovodTransport": "horovod",
}

# backend name accepted by make_transport -> (submodule, class)
_FACTORY = {
    "gloo": ("torch_dist", "TorchDistTransport"),
    "nccl": ("torch_dist", "TorchDistTransport"),
    "torch": ("torch_dist", "TorchDistTransport"),
    "mpi": ("mpi", "MPITransport"),
    "horovod": ("horovod", "HorovodTransport"),
}
BACKENDS = tuple(sorted(_FACTORY))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_transport(backend: Optional[str] = None, *, timeout: Optional[float] = None,
                   **kwargs: Any) -> Transport:
    """Build a transport: the one factory the engine's front ends and tools use.

    Args:
        backend: None reads ``HIPRESS_TRANSPORT`` (default ``"torch"``);
            ``"gloo"``, ``"nccl"`` or ``"torch"`` (``TorchDistTransport``
            over the already-initialised default torch.distributed group;
            gloo/nccl must match the group's backend), ``"mpi"``
            (``MPITransport`` over ``MPI.COMM_WORLD``) or ``"horovod"``
            (``HorovodTransport``; calls ``hvd.init()`` if needed). The
            in-process transport is not built here: use ``InProcGroup``.
        timeout: seconds a torch.distributed group of the transport's own may
            block (its ``group_timeout``); other transports time each call.
        **kwargs: passed to the transport's constructor.

    Returns:
        A ready ``Transport``.

    Raises:
        ValueError: unknown backend name, from the argument or
            ``HIPRESS_TRANSPORT`` (the message lists the known ones),
            or a gloo/nccl name that differs from the initialised group's.
        TransportError: torch.distributed is not initialised (torch backends).
        ImportError: mpi4py / horovod is not installed.

    Example:
        >>> torch.distributed.init_process_group("gloo")
        >>> t = make_transport("gloo")
    """
    if backend is None:
        backend = os.environ.get("HIPRESS_TRANSPORT", "torch")
    key = backend.lower() if isinstance(backend, str) else backend
    if key not in _FACTORY:
        hint = " (the in-process transport: use InProcGroup(size))" if key == "inproc" else ""
        raise ValueError(f"unknown transport backend {backend!r}{hint}; available: "
                         f"{', '.join(BACKENDS)}")
    if key in ("gloo", "nccl"):
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and str(dist.get_backend()) != key:
            raise ValueError(f"make_transport({backend!r}) but the default process group uses "
                             f"{dist.get_backend()!r}; pass 'torch' to use whatever it uses")
    module, cls = _FACTORY[key]
    if timeout is not None and module == "torch_dist":
        kwargs.setdefault("group_timeout", float(timeout))
    return getattr(importlib.import_module(f".{module}", __name__), cls)(**kwargs)
