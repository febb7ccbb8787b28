"""Horovod's functional collectives, framework-neutral: one implementation for every face.

``allreduce``, ``allgather``, ``broadcast`` (plus ``_`` in-place and
``_async`` forms with ``synchronize(handle)`` / ``poll(handle)``). These are
the small, blocking-by-default operations training scripts use around the
optimizer (metric averaging); gradients go through the engine instead.
Objects and parameters are in ``objects``.

They work on torch tensors, the library's one tensor type, over the
runtime's wire (torch.distributed's default group, or Horovod); the faces
convert at their edge only: ``hipress_like.torch`` re-exports them as they
are, TensorFlow (``adapters/tensorflow/bridge``) and MXNet
(``adapters/mxnet/tensors``) cast their tensors to torch views and back.
No face imports another face.

Every dtype Horovod's collectives take works, including those gloo lacks
(int16, uint16; also uint32 and uint64): ``allgather`` and ``broadcast``
move them as their bytes (exact for any dtype), and ``allreduce`` widens
int16/uint16 to int32 and uint32 to int64, reduces, and casts back, which
gives the same bits as reducing in the narrow type (a sum wraps around
alike). uint64 cannot be widened exactly and is refused by ``allreduce``.

In a job started by ``horovodrun`` the same calls run over Horovod itself
(``hvd.allreduce_async_``, ``allgather_async``, ``broadcast_async_``), as
the engines do: ``_Wire`` chooses once per call. Horovod's own stall check
then stands in for this module's timeout.
"""
from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import torch

from .agreement import RECORD_BYTES, disagreement, pack_call, unpack_call
from .compression import Compression, CompressionSpec
from .runtime import _require, default_timeout

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "allgather", "allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "synchronize", "poll",
]

log = logging.getLogger(__name__)

# Reduction ops, as Horovod names them.
Average, Sum, Adasum, Min, Max, Product = "average", "sum", "adasum", "min", "max", "product"

# dtypes torch.distributed's gloo backend refuses ("Invalid scalar type"), and the
# exact widening allreduce uses for them; allgather and broadcast move their bytes.
_NOT_ON_WIRE = {torch.int16, torch.uint16, torch.uint32, torch.uint64}
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


class _Handle:
    """An in-flight collective; ``synchronize(handle)`` returns its result."""

    def __init__(self, works: List[Any], finish: Callable[[], torch.Tensor], what: str):
        self._works = works
        self._finish = finish
        self._what = what
        self._result: Optional[torch.Tensor] = None
        self._done = False

    def poll(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> torch.Tensor:
        if not self._done:
            t = timedelta(seconds=default_timeout())
            try:
                for w in self._works:
                    w.wait(timeout=t)
            except RuntimeError as e:  # gloo's error, or _HorovodWork's timeout
                from ..casync.transport import TransportError

                raise TransportError(
                    f"{self._what} failed: {e}; a peer rank may have crashed or stalled "
                    f"(timeout {default_timeout():.0f}s, see HIPRESS_TIMEOUT)") from e
            self._result = self._finish()
            self._done = True
        return self._result


class _HorovodWork:
    """A Horovod handle shaped like a torch.distributed work (``is_completed``, ``wait``).

    ``wait`` never blocks in Horovod's ``synchronize`` before ``poll`` says the
    operation is done: it polls until the timeout, then raises naming the
    collective. (Ranks that drifted into different collectives otherwise wait
    in ``synchronize`` for ever: Horovod's stall check only logs.)
    """

    _FIRST_SLEEP, _MAX_SLEEP = 1e-4, 0.05  # seconds between polls: quick first, then 20/s

    def __init__(self, hvd: Any, handle: Any):
        self._hvd, self._h, self.result = hvd, handle, None

    def is_completed(self) -> bool:
        return self.result is not None or bool(self._hvd.poll(self._h))

    def wait(self, timeout: Any = None) -> None:
        """Finish the operation, or raise ``TransportError`` after ``timeout``.

        Args:
            timeout: a ``timedelta`` or seconds; None: the runtime's timeout.

        Raises:
            TransportError: not finished within the timeout (``_Handle`` adds
                which collective).
        """
        if self.result is not None:
            return
        if timeout is None:
            timeout = default_timeout()
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        deadline = time.monotonic() + seconds
        pause = self._FIRST_SLEEP
        while not self._hvd.poll(self._h):
            if time.monotonic() >= deadline:
                from ..casync.transport import TransportError

                raise TransportError(
                    f"Horovod did not finish it within {seconds:g}s; "
                    "expected every rank to enter the same collectives in the same order: "
                    "a peer rank is in another collective, has stalled or has died (raise "
                    "the timeout with HIPRESS_TIMEOUT or init(timeout=...) if it is just slow)")
            time.sleep(pause)
            pause = min(2 * pause, self._MAX_SLEEP)
        self.result = self._hvd.synchronize(self._h)


class _Wire:
    """Where this process's user-facing collectives go: torch.distributed's
    default group, or Horovod in a horovodrun job (``runtime`` decided at init).

    ``process_set``: a process set made outside horovodrun
    (``adapters/horovod_calls.ProcessSet``, which holds a torch.distributed
    group): the collectives then span its ranks only.
    """

    def __init__(self, process_set: Any = None) -> None:
        self.dist = _dist()
        self.hvd = None
        if _require().transport == "horovod":
            import horovod.torch as hvd

            self.hvd = hvd
        self.group = getattr(process_set, "_group", None)
        self.size = (process_set.size() if self.group is not None else
                     self.hvd.size() if self.hvd else self.dist.get_world_size())

    def all_reduce(self, wire: torch.Tensor, op: str) -> Any:
        """Start an in-place reduction of ``wire`` (op: Sum/Min/Max/Product; Average sums)."""
        if self.hvd:
            hop = {Average: self.hvd.Sum, Sum: self.hvd.Sum, Min: self.hvd.Min,
                   Max: self.hvd.Max, Product: self.hvd.Product}[op]
            return _HorovodWork(self.hvd, self.hvd.allreduce_async_(wire, op=hop))
        rop = self.dist.ReduceOp
        reduce_op = {Average: rop.SUM, Sum: rop.SUM, Min: rop.MIN, Max: rop.MAX,
                     Product: rop.PRODUCT}[op]
        return self.dist.all_reduce(wire, op=reduce_op, group=self.group, async_op=True)

    def all_gather(self, outs: List[torch.Tensor], t: torch.Tensor) -> Any:
        """Start gathering equal-shaped ``t`` from every rank into ``outs`` (rank order)."""
        if self.hvd:
            work = _HorovodWork(self.hvd, self.hvd.allgather_async(t))

            class _Into:
                def is_completed(self) -> bool:
                    return work.is_completed()

                def wait(self, timeout: Any = None) -> None:
                    work.wait(timeout)
                    for o, part in zip(outs, work.result.chunk(len(outs))):  # noqa: B905
                        o.copy_(part)

            return _Into()
        return self.dist.all_gather(outs, t, group=self.group, async_op=True)

    def broadcast(self, t: torch.Tensor, root: int) -> Any:
        """Start an in-place broadcast of ``t`` from rank ``root``."""
        if self.hvd:
            return _HorovodWork(self.hvd, self.hvd.broadcast_async_(t, root_rank=root))
        return self.dist.broadcast(t, src=root, group=self.group, async_op=True)


def _gather_records(wire: _Wire, what: str, fields: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Allgather every rank's ``pack_call`` record of ``fields``; list index = rank."""
    mine = torch.frombuffer(bytearray(pack_call(fields)), dtype=torch.uint8)
    outs = [torch.empty(RECORD_BYTES, dtype=torch.uint8) for _ in range(wire.size)]
    _Handle([wire.all_gather(outs, mine)], lambda: mine, what).wait()
    return [unpack_call(bytes(o.tolist())) for o in outs]


def _agree(wire: _Wire, what: str, **fields: Any) -> None:
    """Raise on every rank unless all ranks describe this call alike (``agreement``).

    One allgather of a ``RECORD_BYTES`` record per call, before any data moves;
    nothing in a world of one.
    """
    if wire.size == 1:
        return
    err = disagreement(what, _gather_records(wire, what, fields))
    if err is not None:
        raise err


def synchronize(handle: _Handle) -> torch.Tensor:
    """Wait for an ``*_async`` operation and return its output tensor."""
    return handle.wait()


def poll(handle: _Handle) -> bool:
    """True when an ``*_async`` operation has finished (``synchronize`` will not block)."""
    return handle.poll()


def _dist():
    import torch.distributed as dist

    _require()
    return dist


def _check_tensor(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, found {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{what} does not take sparse tensors; use allgather on its "
                        "indices and values, or .to_dense()")
    return tensor


def _resolve_op(op: Optional[str], average: Optional[bool]) -> str:
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if op is None:
        op = Average if average is None or average else Sum
    if op == Adasum:
        raise NotImplementedError(
            "Adasum is not implemented by hipress-like; use op=hpt.Average (the default)")
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"unknown reduction op {op!r}; expected one of "
                         "Average, Sum, Min, Max, Product")
    return op


def _spec(compression: Any) -> CompressionSpec:
    if compression is None:
        return Compression.none
    if isinstance(compression, str):
        return CompressionSpec(compression.lower())
    if isinstance(compression, CompressionSpec):
        return compression
    raise TypeError(f"compression must be a Compression.<name> spec, found {compression!r}")


def _scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor`` in Horovod's arithmetic: float64 for integers (then truncated
    back, as its integer average), float32 for half types, the dtype's own otherwise."""
    if t.dtype in (torch.float32, torch.float64):
        return t.mul_(factor)
    wide = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else torch.float64
    return (t.to(wide) * factor).to(t.dtype)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[str] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = None, compression: Any = None) -> _Handle:
    """Start an in-place allreduce; ``synchronize(handle)`` returns ``tensor``.

    Args:
        tensor: dense tensor, reduced in place.
        average: deprecated Horovod flag (True: Average, False: Sum).
        name: label used in error messages.
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor: multiply before reducing.
        postscale_factor: multiply after reducing.
        process_set: only ``None`` (all ranks).
        compression: ``Compression.none`` or ``Compression.fp16`` (the wire
            type); other compressors are for gradients, see ``allreduce``.
    """
    wire_to = _Wire(process_set)
    _check_tensor(tensor, "allreduce")
    what = f"allreduce {name!r}" if name else "allreduce"
    hvd = _foreign_set(wire_to, process_set)
    if hvd is not None:
        return _handed(hvd, hvd.allreduce_async_(
            tensor, name=name, op=_hop(hvd, op, average), prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, process_set=process_set), what)
    op = _resolve_op(op, average)
    spec = _spec(compression)
    if spec.name not in ("identity", "fp16"):
        raise ValueError(f"allreduce_async_ supports Compression.none and Compression.fp16, "
                         f"found {spec!r}; use the blocking allreduce() for other compressors")
    _agree(wire_to, what, collective="allreduce", name=name, dtype=str(tensor.dtype),
           shape=list(tensor.shape), op=op, compression=spec.name)
    wire, ctx = spec.compress(tensor)
    if wire is tensor:
        wire = tensor if tensor.is_contiguous() else tensor.contiguous()
    if wire.dtype in _NOT_ON_WIRE:
        if wire.dtype not in _WIDER:
            raise TypeError(f"{what}: {wire.dtype} cannot be reduced exactly (no wider "
                            "integer type); cast it to torch.int64 first")
        wire = wire.to(_WIDER[wire.dtype])  # exact; finish() casts back into tensor
    if prescale_factor != 1.0:
        wire.copy_(_scaled(wire, prescale_factor))
    work = wire_to.all_reduce(wire, op)
    n = wire_to.size

    def finish() -> torch.Tensor:
        out = spec.decompress(wire, ctx)
        scale = postscale_factor / n if op == Average else postscale_factor
        with torch.no_grad():
            if scale != 1.0:
                out = _scaled(out, scale)
            if out is not tensor:
                tensor.copy_(out)
        return tensor

    return _Handle([work], finish, what)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[str] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = None,
               compression: Any = None) -> torch.Tensor:
    """In-place allreduce (blocking); returns ``tensor``."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                            process_set, compression).wait()


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[str] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None, compression: Any = None) -> _Handle:
    """Start an allreduce into a new tensor; ``synchronize(handle)`` returns it."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor,
                            postscale_factor, process_set, compression)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = None, op: Optional[str] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks into a new tensor (default: average).

    With ``Compression.none``/``fp16`` this is one torch.distributed
    allreduce. With a CompLL compressor (``Compression.onebit``, ...) each
    rank encodes once, the payloads are allgathered, and every rank decodes
    and sums them in rank order, so all ranks get bitwise-identical results.
    Stateful compressors run from a fresh state here; use
    ``DistributedOptimizer`` for error feedback and pipelining.

    Example:
        >>> hpt.allreduce(torch.tensor([float(hpt.rank())]))   # 4 ranks
        tensor([1.5000])

    Raises:
        ValueError: a multi-round compressor (PowerSGD), or min/max/product
            with a lossy compressor.
    """
    spec = _spec(compression)
    _check_tensor(tensor, "allreduce")
    hvd = _foreign_set(_Wire(), process_set)
    if hvd is not None:  # Horovod's own, autograd included
        return hvd.allreduce(tensor, name=name, op=_hop(hvd, op, average),
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             process_set=process_set)
    if spec.name in ("identity", "fp16"):
        if tensor.requires_grad and torch.is_grad_enabled():
            return _AllreduceGrad.apply(tensor, average, name, op, prescale_factor,
                                        postscale_factor, spec, process_set)
        return allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                               process_set, spec).wait()
    op = _resolve_op(op, average)
    if op not in (Average, Sum):
        raise ValueError(f"op {op!r} cannot be combined with lossy compression {spec!r}")
    c = spec.build()
    if c.capabilities.rounds > 1:
        raise ValueError(f"{spec!r} needs {c.capabilities.rounds} communication rounds; "
                         "use it through DistributedOptimizer (the engine runs the rounds)")
    what = f"allreduce {name!r}" if name else "allreduce"
    _agree(_Wire(), what, collective="allreduce", name=name, dtype=str(tensor.dtype),
           shape=list(tensor.shape), op=op, compression=spec.name)
    x = tensor.detach() * prescale_factor if prescale_factor != 1.0 else tensor.detach()
    payload, _ = c.encode(x.contiguous(), c.init(x))
    parts = _allgather_uint8(payload, what)
    total = None
    for p in parts:  # rank order: identical sums everywhere
        d = c.decode(p)
        total = d.clone() if total is None else total.add_(d)
    scale = postscale_factor / len(parts) if op == Average else postscale_factor
    return (total * scale).to(tensor.dtype) if scale != 1.0 else total.to(tensor.dtype)


def grouped_allreduce(tensors: List[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = None,
                      op: Optional[str] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None
                      ) -> List[torch.Tensor]:
    """Allreduce a list of tensors (all in flight together); returns new tensors.

    Tensors that require grad go one by one through ``allreduce``, whose
    gradient is Horovod's (the same allreduce of the output's gradient).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return [allreduce(t, average, f"{name}.{i}" if name else None, compression, op,
                          prescale_factor, postscale_factor, process_set)
                for i, t in enumerate(tensors)]
    # one name per tensor: Horovod (a set handed to it) refuses two in flight alike
    handles = [allreduce_async(t, average, f"{name}.{i}" if name else None, op,
                               prescale_factor, postscale_factor, process_set, compression)
               for i, t in enumerate(tensors)]
    return [h.wait() for h in handles]


def _no_process_set(process_set: Any) -> None:
    """Refuse a process set other than the global one (callers that cannot hand it off)."""
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
        raise ValueError("process sets are not supported here; operations span all ranks")


def _foreign_set(wire: _Wire, process_set: Any) -> Any:
    """``horovod.torch`` when ``process_set`` is a set other than the global one.

    Process sets are Horovod's: under horovodrun a call on one is handed to
    Horovod whole (returns the module); on the global set (or None) it stays
    here (returns None).

    Raises:
        NotImplementedError: a process set outside a horovodrun job.
    """
    if (process_set is None or getattr(process_set, "process_set_id", 0) == 0
            or hasattr(process_set, "_group")):  # global, or a torch.distributed group's
        return None
    if wire.hvd is None:
        raise NotImplementedError(
            f"process set {process_set!r} needs Horovod's runtime, and this job runs "
            "without it; launch with horovodrun (Horovod installed with PyTorch: "
            "scripts/env_horovod.sh), or leave process_set out (all ranks)")
    return wire.hvd


def _hop(hvd: Any, op: Optional[str], average: Optional[bool] = None) -> Any:
    """This module's reduction op (a name) as Horovod's constant."""
    op = _resolve_op(op, average) if op != Adasum else op
    return {Average: hvd.Average, Sum: hvd.Sum, Adasum: hvd.Adasum, Min: hvd.Min,
            Max: hvd.Max, Product: hvd.Product}[op]


def _handed(hvd: Any, handle: Any, what: str) -> _Handle:
    """A Horovod handle as this module's (polled, so a stalled peer times out)."""
    work = _HorovodWork(hvd, handle)
    return _Handle([work], lambda: work.result, what)


def _allgather_uint8(data: torch.Tensor, what: str) -> List[torch.Tensor]:
    """Allgather 1-D uint8 tensors of any lengths; list index = rank."""
    wire = _Wire()
    n = wire.size
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    _Handle([wire.all_gather(sizes, size)], lambda: size, what).wait()
    m = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(m, 1), dtype=torch.uint8)
    buf[: data.numel()] = data
    outs = [torch.empty_like(buf) for _ in range(n)]
    _Handle([wire.all_gather(outs, buf)], lambda: buf, what).wait()
    return [o[: int(s.item())] for o, s in zip(outs, sizes)]  # noqa: B905


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: Any = None) -> _Handle:
    """Start an allgather; ``synchronize(handle)`` returns the concatenation."""
    wire = _Wire(process_set)
    _check_tensor(tensor, "allgather")
    what = f"allgather {name!r}" if name else "allgather"
    hvd = _foreign_set(wire, process_set)
    if hvd is not None:
        return _handed(hvd, hvd.allgather_async(tensor, name=name, process_set=process_set),
                       what)
    t = tensor.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    t = t.contiguous()
    dtype, rest = t.dtype, tuple(t.shape[1:])
    # the first dims may differ (Horovod's allgather concatenates them), the rest may not
    _agree(wire, what, collective="allgather", name=name, dtype=str(dtype),
           trailing_shape=list(rest))
    if dtype in _NOT_ON_WIRE:  # move the rows' bytes: exact for any dtype
        t = t.reshape(-1).view(torch.uint8).reshape(t.shape[0], math.prod(rest) * t.itemsize)
    n = wire.size
    rows = torch.tensor([t.shape[0]], dtype=torch.int64)
    all_rows = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    _Handle([wire.all_gather(all_rows, rows)], lambda: rows, what).wait()
    counts = [int(r.item()) for r in all_rows]
    m = max(counts)
    padded = t
    if t.shape[0] < m:
        padded = torch.cat([t, t.new_zeros((m - t.shape[0],) + tuple(t.shape[1:]))])
    outs = [torch.empty_like(padded) for _ in range(n)]
    work = wire.all_gather(outs, padded)

    def finish() -> torch.Tensor:
        out = torch.cat([o[:c] for o, c in zip(outs, counts)])  # noqa: B905
        if out.dtype != dtype:  # back from bytes
            out = out.reshape(-1).view(dtype).reshape((sum(counts),) + rest)
        return out

    return _Handle([work], finish, what)


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (first dims may differ).

    Example:
        >>> hpt.allgather(torch.tensor([hpt.rank()]))   # 4 ranks
        tensor([0, 1, 2, 3])
    """
    hvd = _foreign_set(_Wire(), process_set)
    if hvd is not None:  # Horovod's own, autograd included
        return hvd.allgather(tensor, name=name, process_set=process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherGrad.apply(tensor, name, process_set)
    return allgather_async(tensor, name, process_set).wait()


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = None) -> _Handle:
    """Start an in-place broadcast from ``root_rank``."""
    wire_to = _Wire(process_set)
    _check_tensor(tensor, "broadcast")
    hvd = _foreign_set(wire_to, process_set)
    if hvd is not None:
        return _handed(hvd, hvd.broadcast_async_(tensor, root_rank, name=name,
                                                 process_set=process_set), "broadcast")
    n = wire_to.size
    if wire_to.group is not None:
        if root_rank not in process_set.ranks:
            raise ValueError(f"root_rank must be one of {process_set!r}'s ranks "
                             f"{process_set.ranks}, found {root_rank}")
    elif not 0 <= root_rank < n:
        raise ValueError(f"root_rank must be in [0, {n}), found {root_rank}")
    what = f"broadcast {name!r}" if name else "broadcast"
    _agree(wire_to, what, collective="broadcast", name=name, dtype=str(tensor.dtype),
           shape=list(tensor.shape), root_rank=int(root_rank))
    wire = tensor.data if tensor.is_contiguous() else tensor.detach().contiguous()
    # a dtype gloo lacks travels as its bytes (a view: received bytes land in wire)
    send = wire.reshape(-1).view(torch.uint8) if wire.dtype in _NOT_ON_WIRE else wire
    work = wire_to.broadcast(send, root_rank)

    def finish() -> torch.Tensor:
        if wire is not tensor.data:
            with torch.no_grad():
                tensor.copy_(wire)
        return tensor

    return _Handle([work], finish, what)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s value; returns it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = None) -> _Handle:
    """Start a broadcast into a new tensor."""
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = None) -> torch.Tensor:
    """Return a new tensor holding ``root_rank``'s value of ``tensor``."""
    hvd = _foreign_set(_Wire(), process_set)
    if hvd is not None:  # Horovod's own, autograd included
        return hvd.broadcast(tensor, root_rank, name=name, process_set=process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastGrad.apply(tensor, root_rank, name, process_set)
    return broadcast_async(tensor, root_rank, name, process_set).wait()


# Gradients of the blocking collectives: Horovod's (horovod/torch/mpi_ops.py,
# HorovodAllreduce / HorovodAllgather / HorovodBroadcast .backward).


class _AllreduceGrad(torch.autograd.Function):
    """allreduce's gradient is the same allreduce of the output's gradient."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, spec,
                process_set):
        ctx.args = (average, op, prescale_factor, postscale_factor, spec, process_set)
        return allreduce_async(tensor.detach(), average, name, op, prescale_factor,
                               postscale_factor, process_set, spec).wait()

    @staticmethod
    def backward(ctx, grad):
        average, op, pre, post, spec, ps = ctx.args
        return (allreduce(grad.contiguous(), average, None, spec, op, pre, post, ps),
                None, None, None, None, None, None, None)


class _AllgatherGrad(torch.autograd.Function):
    """allgather's gradient: this rank's rows of the averaged output gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.ps = process_set
        return allgather_async(tensor.detach(), name, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.ps)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=ctx.ps)
        start = int(rows[:_rank_in(ctx.ps)].sum())
        return reduced.narrow(0, start, ctx.rows), None, None


class _BroadcastGrad(torch.autograd.Function):
    """broadcast's gradient: the averaged output gradient on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.ps = root_rank, process_set
        return broadcast_async(tensor.detach(), root_rank, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        from .runtime import rank

        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.ps)
        if rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


def _rank_in(process_set: Any) -> int:
    """This process's rank within ``process_set`` (its global rank for the global set)."""
    if process_set is not None and hasattr(process_set, "_group"):
        return process_set.rank()
    from .runtime import rank

    return rank()
