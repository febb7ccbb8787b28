"""Horovod's calls this project does not implement itself: handed to Horovod, or run here.

The project implements the collectives it can compress or fuse (``allreduce``,
``allgather``, ``broadcast`` in ``adapters.collectives``, and the gradient
path of ``DistributedOptimizer``). The rest of ``horovod.torch``'s surface
(``reducescatter``, ``alltoall``, the grouped forms, ``join``, process sets,
``SyncBatchNorm``, the timeline, sparse allreduce) is what a plugin owes its
users. Like ``adapters.collectives`` it works on torch tensors and serves
every face: the PyTorch face exports it as it is, the MXNet face hands its
arrays to it through DLPack (``adapters.mxnet.horovod_calls``). Each call here
goes one of two ways, decided per call by the
runtime's wire (``collectives._Wire``):

- in a job started by ``horovodrun`` (Horovod installed and initialized), the
  call is handed to ``horovod.torch`` itself: Horovod's semantics, autograd,
  errors and timeline, with this project's op constants and
  ``Compression.none``/``fp16`` translated to Horovod's;
- otherwise (torchrun, mpirun, one process) the simple ones run over this
  project's own collectives, on torch.distributed: ``reducescatter`` (an
  allreduce, then the rows this rank owns, split as Horovod splits them),
  ``alltoall`` (``all_to_all_single`` on the rows' bytes, so any dtype), the
  grouped forms (one call per tensor, all in flight), sparse allreduce (an
  allgather of indices and values, as Horovod does it), process sets (a
  torch.distributed group each, which every collective here takes as
  ``process_set=``). The calls that need Horovod's background runtime
  (``join``, ``SyncBatchNorm``, the timeline) raise ``HorovodRequiredError``
  naming the call and how to get it (install Horovod, launch with horovodrun).

Gradients: ``reducescatter``'s and ``alltoall``'s backward passes are
Horovod's (``horovod/torch/mpi_ops.py``: an allgather of the output gradient
scaled by the op, and the alltoall back along the received splits).
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence

import torch

from ..errors import HipressError
from . import collectives as C
from .runtime import rank as _rank

log = logging.getLogger(__name__)

__all__ = [
    "HorovodInternalError", "HorovodRequiredError", "ProcessSet", "global_process_set",
    "add_process_set", "remove_process_set", "ccl_built", "ddl_built", "barrier", "join",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "alltoall", "alltoall_async", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "sparse_allreduce_async", "start_timeline", "stop_timeline",
    "SyncBatchNorm", "synchronize", "poll",
]

@contextmanager
def refused_as(error: type, call: str) -> Iterator[None]:
    """Re-raise a ``ValueError`` from the block as ``error`` (a face's own class, also a
    ``RuntimeError``, which is what Horovod's framework ops raise), naming ``call``;
    ``RuntimeError`` (this project's mismatch errors are both) passes as it is."""
    try:
        yield
    except RuntimeError:
        raise
    except ValueError as e:
        raise error(f"{call}: {e}") from e


_HOW = ("install Horovod with PyTorch (scripts/env_horovod.sh) and launch with "
        "horovodrun (e.g. horovodrun -np 2 python train.py)")


class HorovodInternalError(HipressError, RuntimeError):
    """A collective failed inside the runtime (Horovod's name for it; a RuntimeError)."""


class HorovodRequiredError(HipressError, NotImplementedError):
    """A Horovod call that only Horovod's own runtime provides, outside a horovodrun job."""


def _required(call: str, why: str) -> HorovodRequiredError:
    return HorovodRequiredError(
        f"hvd.{call} needs Horovod's runtime ({why}); this job runs without it. "
        f"To use it, {_HOW}.")


def _horovod() -> Any:
    """``horovod.torch`` when this job's wire is Horovod, else None."""
    return C._Wire().hvd


def _hop(hvd: Any, op: Optional[str], average: Optional[bool] = None) -> Any:
    """This project's op (a name) as Horovod's op constant."""
    if op is None and average is not None:
        op = C.Average if average else C.Sum
    if op is None or not isinstance(op, str):
        return op
    return {C.Average: hvd.Average, C.Sum: hvd.Sum, C.Adasum: hvd.Adasum, C.Min: hvd.Min,
            C.Max: hvd.Max, C.Product: hvd.Product}[op]


def _hcompression(hvd: Any, compression: Any) -> Any:
    name = getattr(compression, "name", compression)
    if compression is None or name in ("identity", "none"):
        return hvd.Compression.none
    if name == "fp16":
        return hvd.Compression.fp16
    if compression in (hvd.Compression.none, hvd.Compression.fp16):
        return compression
    raise ValueError(f"Horovod's collectives take Compression.none or Compression.fp16, "
                     f"found {compression!r}; lossy compressors are for gradients "
                     "(DistributedOptimizer)")


# ---------------------------------------------------------------- process sets


class ProcessSet:
    """A set of ranks outside horovodrun: a torch.distributed group (Horovod's own inside).

    ``ProcessSet()`` is the global set (all ranks, id 0); ``add_process_set``
    makes the others, on every rank, in the same order (as Horovod requires).
    The collectives of ``hipress_like.torch`` take it as ``process_set=``.
    """

    def __init__(self, ranks: Optional[Sequence[int]] = None) -> None:
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id = 0 if ranks is None else None  # set by add_process_set
        self._group = None  # the torch.distributed group, once added

    def size(self) -> int:
        """Number of ranks in the set."""
        return C._Wire().size if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 when not in it)."""
        r = _rank()
        if self.ranks is None:
            return r
        return self.ranks.index(r) if r in self.ranks else -1

    def included(self) -> bool:
        """True when this process is one of the set's ranks."""
        return self.ranks is None or _rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks or 'all'})"


global_process_set = ProcessSet()
_SETS: dict = {}  # id -> ProcessSet, the sets added outside horovodrun


class _ForgetAtShutdown:
    """Removes the sets added through this face when ``shutdown()`` runs, as Horovod's
    shutdown forgets its process sets (a script that re-inits may add them again).

    One object for all sets, removing them in the order they were added: Horovod's
    removal is collective, so every rank must remove the same sets in the same order.
    """

    def __init__(self) -> None:
        self.added: list = []

    def close(self) -> None:
        added, self.added = self.added, []
        for ps in added:
            try:
                remove_process_set(ps)
            except Exception as e:  # noqa: BLE001 (shutting down: report, keep going)
                log.debug("forgetting %r at shutdown: %s", ps, e)


_FORGET = _ForgetAtShutdown()


def _set(process_set: Any, hvd: Any) -> Any:
    """Horovod's process set for ``process_set`` (ours stands for Horovod's global one)."""
    if process_set is None or isinstance(process_set, ProcessSet):
        return hvd.global_process_set
    return process_set


def _global_only(process_set: Any, call: str) -> None:
    if process_set is not None and getattr(process_set, "process_set_id", 0) != 0 \
            and not isinstance(process_set, ProcessSet):
        raise _required(call, "a process set other than the global one")


def _set_size(process_set: Any) -> int:
    """Ranks in ``process_set`` (None: all): ours or Horovod's, which both have ``size()``."""
    return C._Wire().size if process_set is None else process_set.size()


def _set_rank(process_set: Any) -> int:
    """This rank within ``process_set`` (None: all), ours or Horovod's."""
    return _rank() if process_set is None else process_set.rank()


def add_process_set(process_set: Any) -> Any:
    """Register a process set on every rank (collective); Horovod's, under horovodrun.

    Outside horovodrun the set is a torch.distributed group. Every rank must
    add the same sets in the same order (a set that differs across ranks is a
    ``CollectiveMismatchError`` on every rank, not a hang).

    Args:
        process_set: a list of global ranks, or a ``ProcessSet``.

    Raises:
        ValueError: a rank out of range, or a set already added.
        CollectiveMismatchError: ranks passed different sets.
    """
    from .runtime import _track

    hvd = _horovod()
    if hvd is not None:
        added = hvd.add_process_set(process_set)
        _FORGET.added.append(added)
        _track(_FORGET)
        return added
    ranks = process_set.ranks if isinstance(process_set, ProcessSet) else process_set
    ps = ProcessSet(ranks)
    n = C._Wire().size
    if not ps.ranks or len(set(ps.ranks)) != len(ps.ranks) or not all(
            0 <= r < n for r in ps.ranks):
        raise ValueError(f"add_process_set expects distinct ranks in [0, {n}), found {ranks}")
    C._agree(C._Wire(), "add_process_set", collective="add_process_set", ranks=ps.ranks)
    if ps.ranks == list(range(n)) or any(s.ranks == ps.ranks for s in _SETS.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {ps.ranks}; "
                         "reuse the set added before")
    import torch.distributed as dist

    ps._group = dist.new_group(ps.ranks)  # collective over all ranks, as Horovod's
    ps.process_set_id = max(_SETS, default=0) + 1
    _SETS[ps.process_set_id] = ps
    if isinstance(process_set, ProcessSet):
        process_set.__dict__.update(ps.__dict__)
        _SETS[ps.process_set_id] = ps = process_set
    _FORGET.added.append(ps)
    _track(_FORGET)
    return ps


def remove_process_set(process_set: Any) -> bool:
    """Deregister a process set added by ``add_process_set`` (on every rank).

    Returns:
        True when the set was registered (and is now removed).
    """
    hvd = _horovod()
    if hvd is not None:
        return hvd.remove_process_set(process_set)
    found = _SETS.pop(getattr(process_set, "process_set_id", None), None)
    if found is None:
        return False
    found.process_set_id = None  # its torch group is left to torch.distributed's teardown
    return True


def _horovod_if_initialized() -> Any:
    """``_horovod()`` once ``init()`` ran, else None (for queries Horovod answers before init)."""
    from .runtime import is_initialized

    return _horovod() if is_initialized() else None


def ccl_built() -> bool:
    """False: this project does not use oneCCL (Horovod's answer under horovodrun)."""
    hvd = _horovod_if_initialized()
    return bool(hvd.ccl_built()) if hvd is not None else False


def ddl_built() -> bool:
    """False: this project does not use IBM DDL (Horovod's answer under horovodrun)."""
    hvd = _horovod_if_initialized()
    return bool(hvd.ddl_built()) if hvd is not None else False


def barrier(process_set: Any = None) -> None:
    """Wait until every rank of ``process_set`` (default: all) arrives."""
    hvd = _horovod()
    if hvd is not None:
        return hvd.barrier(process_set=_set(process_set, hvd))
    _global_only(process_set, "barrier(process_set=...)")
    group = getattr(process_set, "_group", None)
    if group is None:
        from .runtime import barrier as all_ranks_barrier

        return all_ranks_barrier()
    from datetime import timedelta

    import torch.distributed as dist

    from .runtime import default_timeout

    dist.barrier(group=group, async_op=True).wait(timeout=timedelta(seconds=default_timeout()))


def join(device: int = -1) -> int:
    """Horovod's join: this rank has no more data; returns the last rank to join.

    Raises:
        HorovodRequiredError: outside horovodrun (join answers the other ranks'
            collectives with zeros from Horovod's background thread).
    """
    hvd = _horovod()
    if hvd is None:
        raise _required("join", "a joined rank answers others' collectives from "
                        "Horovod's background thread")
    return hvd.join(device)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start Horovod's timeline (Horovod's call; the handed calls appear in it)."""
    hvd = _horovod()
    if hvd is None:
        raise _required("start_timeline", "the timeline records Horovod's operations")
    return hvd.start_timeline(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    """Stop Horovod's timeline."""
    hvd = _horovod()
    if hvd is None:
        raise _required("stop_timeline", "the timeline records Horovod's operations")
    return hvd.stop_timeline()


def SyncBatchNorm(*args: Any, **kwargs: Any) -> torch.nn.Module:  # noqa: N802 (Horovod's name)
    """Horovod's ``SyncBatchNorm`` module (batch statistics over all ranks)."""
    hvd = _horovod()
    if hvd is None:
        raise _required("SyncBatchNorm", "its statistics are Horovod allreduces; "
                        "torch.nn.SyncBatchNorm is the torchrun equivalent (CUDA only)")
    return hvd.SyncBatchNorm(*args, **kwargs)


# ----------------------------------------------------------- handles, either kind


def synchronize(handle: Any) -> Any:
    """Wait for an ``*_async`` operation (this project's or one handed to Horovod)."""
    if isinstance(handle, C._Handle):
        return handle.wait()
    if callable(handle):  # a sparse allreduce handle (Horovod's or ours)
        return handle()
    hvd = _horovod()
    if hvd is None:
        raise TypeError(f"synchronize expects a handle from an *_async call, found {handle!r}")
    work = C._HorovodWork(hvd, handle)  # polls, so a stalled peer is an error, not a hang
    work.wait()
    return work.result


def poll(handle: Any) -> bool:
    """True when an ``*_async`` operation has finished (``synchronize`` will not block)."""
    if isinstance(handle, C._Handle):
        return handle.poll()
    if callable(handle):
        return True
    return bool(_horovod().poll(handle))


# ------------------------------------------------------------------ reducescatter


def _scatter_rows(n: int, size: int) -> List[int]:
    """Rows per rank for ``n`` rows: Horovod's split, the first ``n % size`` get one more."""
    return [n // size + (1 if r < n % size else 0) for r in range(size)]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, prescale_factor, postscale_factor, process_set
        full = C.allreduce(tensor.detach(), name=name, op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, process_set=process_set)
        rows = _scatter_rows(tensor.shape[0], _set_size(process_set))
        me = _set_rank(process_set)
        start = sum(rows[:me])
        return full[start:start + rows[me]].clone()

    @staticmethod
    def backward(ctx, grad):
        # horovod/torch/mpi_ops.py HorovodReducescatter.backward
        grad = grad.clone()
        if ctx.op == C.Sum:
            grad *= _set_size(ctx.ps)
        grad *= ctx.pre * ctx.post
        return C.allgather(grad, process_set=ctx.ps), None, None, None, None, None


def _check_scatterable(tensor: torch.Tensor, call: str) -> None:
    C._check_tensor(tensor, call)
    if tensor.dim() == 0:
        raise ValueError(f"{call} expects a tensor of at least one dimension (its rows are "
                         "scattered), found a scalar; reshape it with .reshape(1)")


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, compression: Any = None,
                  op: Optional[str] = C.Average, process_set: Any = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0
                  ) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and keep this rank's rows (Horovod's split).

    Args:
        tensor: at least 1-D; rows are split along dim 0, the first
            ``rows % size`` ranks getting one row more.
        name: label for error messages (and Horovod's timeline).
        compression: ``Compression.none`` or ``Compression.fp16``.
        op: Average (default), Sum, Min, Max or Product.
        process_set: the global set; others need horovodrun.
        prescale_factor: multiply before reducing.
        postscale_factor: multiply after reducing.

    Returns:
        This rank's rows of the reduction (differentiable).

    Raises:
        ValueError: a scalar tensor, or Adasum (not supported by reducescatter).
    """
    hvd = _horovod()
    if hvd is not None:
        return hvd.reducescatter(tensor, name=name, compression=_hcompression(hvd, compression),
                                 op=_hop(hvd, op), process_set=_set(process_set, hvd),
                                 prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor)
    _global_only(process_set, "reducescatter(process_set=...)")
    _check_scatterable(tensor, "reducescatter")
    op = C._resolve_op(op, None)
    spec = C._spec(compression)
    wire, ctx = spec.compress(tensor) if spec.name == "fp16" else (tensor, None)
    out = _Reducescatter.apply(wire, name, op, prescale_factor, postscale_factor, process_set)
    return spec.decompress(out, ctx) if ctx is not None else out


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None,
                        op: Optional[str] = C.Average, process_set: Any = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Start a ``reducescatter``; ``synchronize(handle)`` returns this rank's rows."""
    hvd = _horovod()
    if hvd is not None:
        return hvd.reducescatter_async(tensor, name=name, op=_hop(hvd, op),
                                       process_set=_set(process_set, hvd),
                                       prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor)
    _global_only(process_set, "reducescatter_async(process_set=...)")
    _check_scatterable(tensor, "reducescatter")
    full = C.allreduce_async(tensor.detach(), None, name, C._resolve_op(op, None),
                             prescale_factor, postscale_factor, process_set)
    rows = _scatter_rows(tensor.shape[0], _set_size(process_set))
    me = _set_rank(process_set)
    start = sum(rows[:me])
    return C._Handle(full._works, lambda: full.wait()[start:start + rows[me]].clone(),
                     f"reducescatter {name!r}" if name else "reducescatter")


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = None, op: Optional[str] = C.Average,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """``reducescatter`` of each tensor; returns this rank's rows of each."""
    hvd = _horovod()
    if hvd is not None:
        return hvd.grouped_reducescatter(
            list(tensors), name=name, compression=_hcompression(hvd, compression),
            op=_hop(hvd, op), process_set=_set(process_set, hvd),
            prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return [reducescatter(t, f"{name}.{i}" if name else None, compression, op, process_set,
                          prescale_factor, postscale_factor) for i, t in enumerate(tensors)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: Optional[str] = C.Average, process_set: Any = None,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Any:
    """Start a ``grouped_reducescatter``; ``synchronize(handle)`` returns the list."""
    hvd = _horovod()
    if hvd is not None:
        return hvd.grouped_reducescatter_async(
            list(tensors), name=name, op=_hop(hvd, op), process_set=_set(process_set, hvd),
            prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    outs = grouped_reducescatter([t.detach() for t in tensors], name, None, op, process_set,
                                 prescale_factor, postscale_factor)
    return C._Handle([], lambda: outs, "grouped_reducescatter")


# ----------------------------------------------------------------------- alltoall


def _alltoall_rows(tensor: torch.Tensor, splits: Optional[torch.Tensor], name: Optional[str],
                   process_set: Any = None):
    """(output, received splits): rows of ``tensor`` sent to each rank per ``splits``."""
    wire = C._Wire(process_set)
    n = wire.size
    what = f"alltoall {name!r}" if name else "alltoall"
    C._check_tensor(tensor, "alltoall")
    if tensor.dim() == 0:
        raise ValueError("alltoall expects a tensor of at least one dimension, found a scalar")
    rows = tensor.shape[0]
    if splits is None:
        if rows % n:
            raise ValueError(f"{what}: {rows} rows cannot be split equally over {n} ranks; "
                             "pass splits= (rows per rank)")
        send = [rows // n] * n
    else:
        if not isinstance(splits, torch.Tensor) or splits.dtype not in (torch.int32,
                                                                         torch.int64):
            raise ValueError(f"{what}: splits must be an int32 tensor, found "
                             f"{getattr(splits, 'dtype', type(splits).__name__)}")
        send = [int(s) for s in splits.reshape(-1).tolist()]
        if len(send) != n or any(s < 0 for s in send) or sum(send) != rows:
            raise ValueError(f"{what}: splits must hold {n} non-negative row counts summing "
                             f"to the tensor's {rows} rows, found {send}")
    rest = tuple(tensor.shape[1:])
    C._agree(wire, what, collective="alltoall", name=name, dtype=str(tensor.dtype),
             trailing_shape=list(rest))
    # row r: what the set's rank r sends
    matrix = C.allgather(torch.tensor([send], dtype=torch.int64), process_set=process_set)
    recv = [int(v) for v in matrix[:, _set_rank(process_set)].tolist()]
    # rows travel as their bytes: exact for every dtype, gloo's or not
    row_bytes = tensor.element_size() * math.prod(rest)
    src = tensor.detach().contiguous().reshape(-1).view(torch.uint8).reshape(rows, row_bytes)
    out = torch.empty(sum(recv), row_bytes, dtype=torch.uint8)
    import torch.distributed as dist

    work = dist.all_to_all_single(out, src, recv, send, group=wire.group, async_op=True)
    C._Handle([work], lambda: out, what).wait()
    result = out.reshape(-1).view(tensor.dtype).reshape((sum(recv),) + rest)
    return result, torch.tensor(recv, dtype=torch.int32)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, recv = _alltoall_rows(tensor, splits, name, process_set)
        ctx.recv, ctx.ps = recv, process_set
        ctx.mark_non_differentiable(recv)
        return out, recv

    @staticmethod
    def backward(ctx, grad, _dead):
        # horovod/torch/mpi_ops.py HorovodAlltoall.backward: back along the received splits
        back, _ = _alltoall_rows(grad.contiguous(), ctx.recv, None, ctx.ps)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Optional[torch.Tensor] = None,
             name: Optional[str] = None, process_set: Any = None) -> Any:
    """Send ``splits[r]`` rows of ``tensor`` to rank ``r``; gather what each rank sends.

    Args:
        tensor: at least 1-D, any dtype (rows travel as bytes).
        splits: int32 tensor of rows per destination rank; None: equal split.
        name: label for error messages.
        process_set: the global set; others need horovodrun.

    Returns:
        The received rows (rank order), and with ``splits`` given also the
        int32 tensor of rows received from each rank (as Horovod returns).

    Raises:
        ValueError: splits that are not int32, do not sum to the rows, or have
            not one entry per rank; rows not divisible without splits.
        CollectiveMismatchError: ranks disagree on dtype or trailing shape.
    """
    hvd = _horovod()
    if hvd is not None:
        return hvd.alltoall(tensor, splits=splits, name=name,
                            process_set=_set(process_set, hvd))
    _global_only(process_set, "alltoall(process_set=...)")
    out, recv = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, recv)


def alltoall_async(tensor: torch.Tensor, splits: Optional[torch.Tensor] = None,
                   name: Optional[str] = None, process_set: Any = None) -> Any:
    """Start an ``alltoall``; ``synchronize(handle)`` returns (output, received splits)."""
    hvd = _horovod()
    if hvd is not None:
        return hvd.alltoall_async(tensor, splits=splits, name=name,
                                  process_set=_set(process_set, hvd))
    _global_only(process_set, "alltoall_async(process_set=...)")
    res = _alltoall_rows(tensor, splits, name, process_set)
    return C._Handle([], lambda: res, f"alltoall {name!r}" if name else "alltoall")


# --------------------------------------------------------------- grouped forms


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: Any = None) -> List[torch.Tensor]:
    """``allgather`` of each tensor; returns the list of concatenations."""
    hvd = _horovod()
    if hvd is not None:
        return hvd.grouped_allgather(list(tensors), name=name,
                                     process_set=_set(process_set, hvd))
    _global_only(process_set, "grouped_allgather(process_set=...)")
    return [C.allgather(t, f"{name}.{i}" if name else None, process_set)
            for i, t in enumerate(tensors)]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: Any = None) -> Any:
    """Start a ``grouped_allgather``; ``synchronize(handle)`` returns the list."""
    hvd = _horovod()
    if hvd is not None:
        return hvd.grouped_allgather_async(list(tensors), name=name,
                                           process_set=_set(process_set, hvd))
    outs = grouped_allgather([t.detach() for t in tensors], name, process_set)
    return C._Handle([], lambda: outs, "grouped_allgather")


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[str] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None) -> C._Handle:
    """Start allreduces of every tensor into new tensors; ``synchronize`` returns the list."""
    handles = [C.allreduce_async(t, average, f"{name}.{i}" if name else None, op,
                                 prescale_factor, postscale_factor, process_set)
               for i, t in enumerate(tensors)]
    return C._Handle([], lambda: [h.wait() for h in handles], "grouped_allreduce")


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[str] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> C._Handle:
    """Start in-place allreduces of every tensor; ``synchronize`` returns the list."""
    handles = [C.allreduce_async_(t, average, f"{name}.{i}" if name else None, op,
                                  prescale_factor, postscale_factor, process_set)
               for i, t in enumerate(tensors)]
    return C._Handle([], lambda: [h.wait() for h in handles], "grouped_allreduce_")


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[str] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = None) -> List[torch.Tensor]:
    """In-place allreduce of every tensor (all in flight together); returns them."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                    postscale_factor, process_set).wait()


# ------------------------------------------------------------------------ sparse


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: Optional[str],
                           process_set: Any = None) -> Any:
    """Allreduce a sparse COO tensor as Horovod does: allgather its indices and values.

    ``synchronize(handle)`` (or ``handle()``, as with Horovod) returns the
    (uncoalesced) sparse sum, or average with ``op=Average``.
    """
    hvd = _horovod()
    if hvd is not None:
        return hvd.sparse_allreduce_async(tensor, name=name, op=_hop(hvd, op),
                                          process_set=_set(process_set, hvd))
    _global_only(process_set, "sparse_allreduce_async(process_set=...)")
    if not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async expects a sparse tensor, found layout "
                        f"{tensor.layout}; use allreduce for dense tensors")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = C.allgather(t.indices().transpose(0, 1).contiguous(), name=f"{name}.indices",
                          process_set=process_set)
    values = C.allgather(t.values(), name=f"{name}.values", process_set=process_set)
    if op in (None, C.Average):
        values = values / _set_size(process_set)

    def finish() -> torch.Tensor:
        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, t.size())

    return finish  # Horovod's sparse handle is a callable too (scripts call it)
