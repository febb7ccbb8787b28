"""A fault-injecting wrapper around any ``Transport``, for the fault suite (tests/faults).

The suite needs faults *inside* the engine's bulk exchange (issue 46, Build
item 1): a message lost, truncated or with a flipped bit, or the rank itself
killed, stopped or raising while it exchanges. Wrapping the transport, rather
than patching one backend, gives every transport the same faults:
``adapters.runtime.engine_transport`` wraps what it builds when the
``HIPRESS_FAULT`` environment variable is set (the suite's harness sets it on
one rank), and does nothing otherwise.

A fault is one action at one bulk exchange (``alltoallv`` call, counted from 0
over every channel of this process, ``split()`` ones included), written as
``action:key=value,...``::

    HIPRESS_FAULT="drop:call=6,peer=0"       # the message to rank 0 is never sent
    HIPRESS_FAULT="truncate:call=6,peer=0"   # rank 0's message arrives cut in half
    HIPRESS_FAULT="flip:call=6,peer=0,byte=0,bit=3"   # one bit of it flipped
    HIPRESS_FAULT="kill:call=6"              # SIGKILL of this rank inside the exchange
    HIPRESS_FAULT="stop:call=6"              # SIGSTOP (frozen; the supervisor kills it)
    HIPRESS_FAULT="raise:call=6"             # an exception from inside the exchange
    HIPRESS_FAULT="raise:call=6,rank=1"      # ... on rank 1 only (a launcher such as
                                             # horovodrun gives every rank one environment)

``drop`` acts on the sending side (the peer waits for bytes that never come);
``truncate`` and ``flip`` on the receiving side (the bytes arrived damaged), so
that the wrapped transport's own framing stays intact. ``peer`` defaults to the
first peer with a non-empty message. ``byte`` counts from the start of the
message; negative values count from its end. The fault fires once. Before it
acts, the wrapper writes ``HIPRESS_FAULT_MARK`` (a file path, when set): one
JSON line with the wall-clock time and what it did, so the harness can time
every survivor's error from the moment of the fault.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from ...errors import HipressError
from .base import DEFAULT_TIMEOUT, Transport, TransportError

__all__ = ["FaultSpec", "FaultyTransport", "InjectedFault", "parse_fault", "wrap_from_env",
           "ENV", "MARK_ENV"]

log = logging.getLogger(__name__)

ENV = "HIPRESS_FAULT"
MARK_ENV = "HIPRESS_FAULT_MARK"
ACTIONS = ("drop", "truncate", "flip", "kill", "stop", "raise")
_MESSAGE_ACTIONS = ("drop", "truncate", "flip")


class InjectedFault(HipressError, RuntimeError):
    """The exception the ``raise`` action throws (a stand-in for a bug on one rank)."""


@dataclass(frozen=True)
class FaultSpec:
    """One fault: ``action`` at bulk exchange number ``call`` of this process.

    Attributes:
        action: one of ``drop``, ``truncate``, ``flip``, ``kill``, ``stop``, ``raise``.
        call: the ``alltoallv`` call (from 0, over all channels) it fires at.
        peer: the other end of the damaged message (None: the first non-empty one).
        byte, bit: where ``flip`` flips (byte index, negative from the end; bit 0-7).
        rank: the only rank that injects it (None: every rank whose environment has it).
    """

    action: str
    call: int = 0
    peer: Optional[int] = None
    byte: int = 0
    bit: int = 0
    rank: Optional[int] = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; available: "
                             f"{', '.join(ACTIONS)}")
        if self.call < 0 or not 0 <= self.bit < 8:
            raise ValueError(f"fault needs call >= 0 and bit in [0, 8), found call={self.call}, "
                             f"bit={self.bit}")


def parse_fault(text: str) -> FaultSpec:
    """Read ``action:key=value,...`` (the ``HIPRESS_FAULT`` syntax, module docstring).

    Raises:
        ValueError: an unknown action or key, or a value that is not an integer.

    Example:
        >>> parse_fault("flip:call=3,peer=1,byte=-1")
        FaultSpec(action='flip', call=3, peer=1, byte=-1, bit=0, rank=None)
    """
    action, _, rest = text.strip().partition(":")
    fields: Dict[str, int] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in ("call", "peer", "byte", "bit", "rank"):
            raise ValueError(f"{ENV}={text!r}: unknown key {key!r}; expected call, peer, byte, "
                             "bit, rank")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ValueError(f"{ENV}={text!r}: {key} must be an integer, found {value!r}") from None
    return FaultSpec(action, **fields)


class _Counter:
    """The bulk-exchange count shared by a transport and the channels it splits."""

    def __init__(self) -> None:
        self.n = 0
        self.fired = False
        self.lock = threading.Lock()

    def next(self, spec: FaultSpec) -> bool:
        """Count one exchange; True if the fault fires at it."""
        with self.lock:
            n, self.n = self.n, self.n + 1
            if self.fired or n != spec.call:
                return False
            self.fired = True
            return True

    def postpone(self) -> None:
        """The fault found nothing to act on (no message to that peer): fire at the next
        exchange instead."""
        with self.lock:
            self.fired = False
            self.n -= 1


class FaultyTransport(Transport):
    """``inner`` with one injected fault (``spec``); everything else passes through.

    Args:
        inner: the transport to wrap.
        spec: the fault.
        mark: file to append the fault's time to (default ``HIPRESS_FAULT_MARK``).
    """

    def __init__(self, inner: Transport, spec: FaultSpec, mark: Optional[str] = None,
                 _counter: Optional[_Counter] = None):
        self.inner = inner
        self.spec = spec
        self.rank, self.size = inner.rank, inner.size
        self._mark = mark if mark is not None else os.environ.get(MARK_ENV)
        self._counter = _counter or _Counter()

    def __getattr__(self, name: str) -> Any:  # backend details (device, group, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _record(self, what: str) -> None:
        log.warning("rank %d: injecting fault: %s", self.rank, what)
        if self._mark:
            with open(self._mark, "a") as f:
                f.write(json.dumps({"t": time.time(), "rank": self.rank, "fault": what}) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def _target(self, msgs: Sequence[Optional[torch.Tensor]]) -> Optional[int]:
        if self.spec.peer is not None:
            return self.spec.peer
        return next((p for p, m in enumerate(msgs)
                     if p != self.rank and m is not None and m.numel()), None)

    def alltoallv(self, send: Sequence[Optional[torch.Tensor]], recv_nbytes: Sequence[int],
                  timeout: float = DEFAULT_TIMEOUT, tag: Optional[str] = None
                  ) -> List[Optional[torch.Tensor]]:
        spec = self.spec
        if not self._counter.next(spec):
            return self.inner.alltoallv(send, recv_nbytes, timeout, tag)
        desc = f"{spec.action} at bulk exchange #{spec.call}"
        if spec.action not in _MESSAGE_ACTIONS:
            self._record(desc)
            if spec.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if spec.action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
                return self.inner.alltoallv(send, recv_nbytes, timeout, tag)
            raise InjectedFault(f"rank {self.rank}: injected exception inside {desc}")
        if spec.action == "drop":
            peer = self._target(send)
            if peer is None:  # nothing to drop this time: try the next exchange
                self._counter.postpone()
                return self.inner.alltoallv(send, recv_nbytes, timeout, tag)
            self._record(f"{desc}: message to rank {peer} ({send[peer].numel()} bytes) not sent")
            send = list(send)
            send[peer] = None
            return self.inner.alltoallv(send, recv_nbytes, timeout, tag)
        received = self.inner.alltoallv(send, recv_nbytes, timeout, tag)
        peer = self._target(received)
        if peer is None:
            self._counter.postpone()
            return received
        msg = received[peer].clone()
        if spec.action == "truncate":
            self._record(f"{desc}: message from rank {peer} cut from {msg.numel()} to "
                         f"{msg.numel() // 2} bytes")
            received[peer] = msg[: msg.numel() // 2]
        else:
            i = spec.byte % msg.numel()
            self._record(f"{desc}: bit {spec.bit} of byte {i} of the message from rank {peer} "
                         "flipped")
            msg[i] ^= 1 << spec.bit
            received[peer] = msg
        return received

    def allgather(self, tensor: torch.Tensor, timeout: float = DEFAULT_TIMEOUT
                  ) -> List[torch.Tensor]:
        return self.inner.allgather(tensor, timeout)

    def allgather_bytes(self, data: bytes, timeout: float = DEFAULT_TIMEOUT) -> List[bytes]:
        return self.inner.allgather_bytes(data, timeout)

    def broadcast(self, tensor: torch.Tensor, root: int, timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        return self.inner.broadcast(tensor, root, timeout)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", timeout: float = DEFAULT_TIMEOUT
                  ) -> torch.Tensor:
        return self.inner.allreduce(tensor, op, timeout)

    def barrier(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.inner.barrier(timeout)

    def split(self) -> "FaultyTransport":
        """The inner transport's new channel, wrapped with the same fault and count."""
        return FaultyTransport(self.inner.split(), self.spec, self._mark, self._counter)

    def free(self, timeout: float = 10.0, watch: Sequence[Transport] = ()) -> bool:
        inner_watch = [w.inner if isinstance(w, FaultyTransport) else w for w in watch]
        return self.inner.free(timeout, inner_watch)

    def peers_waiting(self) -> List[int]:
        return self.inner.peers_waiting()

    def abort(self, reason: str) -> bool:
        return self.inner.abort(reason)

    def close(self) -> None:
        self.inner.close()


def wrap_from_env(transport: Transport) -> Transport:
    """``transport`` wrapped in ``FaultyTransport`` when ``HIPRESS_FAULT`` is set (and names
    this rank, when it names one), else itself.

    Raises:
        TransportError: ``HIPRESS_FAULT`` does not parse (the message says why).
    """
    text = os.environ.get(ENV)
    if not text:
        return transport
    try:
        spec = parse_fault(text)
    except ValueError as e:
        raise TransportError(f"{ENV} is set but invalid: {e}; unset it outside the fault "
                             "suite") from e
    if spec.rank is not None and spec.rank != transport.rank:
        return transport
    log.warning("rank %d: %s=%r: this transport injects a fault", transport.rank, ENV, text)
    return FaultyTransport(transport, spec)
