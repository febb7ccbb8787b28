"""Transports: in-process threads, torch.distributed, MPI, Horovod."""
from .base import DEFAULT_TIMEOUT, PeerError, Transport, TransportError

__all__ = ["DEFAULT_TIMEOUT", "PeerError", "Transport", "TransportError"]
