"""Process setup for the PyTorch front end: ``init``, ``rank``, ``size`` (like horovod.torch).

``init()`` finds out how the job was launched and joins the other ranks
through torch.distributed, trying in order:

1. already initialised (``run_workers``, or the user called
   ``dist.init_process_group``): adopt the default group;
2. ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``):
   ``env://``; the launcher is read by ``launcher.detect``, which refuses an
   incomplete or contradictory environment;
3. ``mpirun`` (Open MPI, MPICH or PMIx variables): rank 0 opens a TCPStore
   on a free port and shares ``host:port`` over MPI (mpi4py); every rank
   joins that store, so MPI is only used for the rendezvous;
4. ``horovodrun`` (gloo or MPI mode): ``hvd.init()``, then the same store,
   its address shared by ``hvd.broadcast_object`` (``horovod_rendezvous``);
   the engines then run over Horovod itself (``engine_transport``);
5. a one-machine bpslaunch-style environment (``DMLC_WORKER_ID``,
   ``DMLC_NUM_WORKER``): gloo at ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``, where
   BytePS's scheduler would listen (no servers or scheduler run here);
6. none of these: one process (size 1) on a private in-memory store, so a
   Horovod script still runs unchanged with ``python train.py``.

The default group carries the user-facing collectives (``allreduce``,
``broadcast_parameters``, ...). Every ``DistributedOptimizer`` and DDP hook
state gets its own engine with its own transport (and process group), so
the engine's communication thread never interleaves with them.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import socket
import sys
import time
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Optional

from .. import heap
from ..errors import HipressError
from .launcher import LaunchError, detect

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "barrier", "mpi_built", "mpi_enabled", "gloo_built",
    "gloo_enabled", "nccl_built", "cuda_built", "rocm_built", "mpi_threads_supported",
    "default_timeout", "engine_transport", "check_timeout", "horovod_elastic", "reform",
]

log = logging.getLogger(__name__)

# Matches the transports' DEFAULT_TIMEOUT: a dead peer is reported within
# minutes, while a 1 GB exchange over a slow link still fits.
_DEFAULT_TIMEOUT = 300.0



@dataclass
class _Runtime:
    rank: int
    size: int
    local_rank: int
    local_size: int
    launcher: str  # "adopted", "torchrun", "mpirun", "horovodrun-gloo"/"-mpi", "single"
    owns_group: bool
    timeout: float
    store: Any = None  # the rendezvous store, when init opened one
    transport: str = "torch"  # the engines' transport unless HIPRESS_TRANSPORT says otherwise


_rt: Optional[_Runtime] = None

# horovodrun --mpi always runs ``mpirun -mca pml ob1 -mca btl ^openib ...``
# (horovod/runner/mpi_run.py, _OMPI_FLAGS) and Open MPI exports both to every
# rank; it sets no HOROVOD_* variable. Plain mpirun sets neither by default.
_HOROVODRUN_MPI_MARKERS = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "^openib"}
_closables: "weakref.WeakSet[Any]" = weakref.WeakSet()
_excepthook_installed = False


def default_timeout() -> float:
    """Seconds every blocking wait may take (``HIPRESS_TIMEOUT``, default 300)."""
    if _rt is not None:
        return _rt.timeout
    return check_timeout(os.environ.get("HIPRESS_TIMEOUT", _DEFAULT_TIMEOUT), "HIPRESS_TIMEOUT")


def check_timeout(timeout: Any, what: str = "timeout") -> Optional[float]:
    """``timeout`` as seconds (a float > 0), or None when it is None.

    Args:
        timeout: what the user passed (a number, or a numeric string as the
            environment gives).
        what: the parameter's name, for the error.

    Raises:
        ValueError: not a finite number of seconds > 0; the message names ``what``.

    Example:
        >>> check_timeout("30"), check_timeout(None)
        (30.0, None)
    """
    if timeout is None:
        return None
    try:
        seconds = float(timeout)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be a number of seconds > 0, found {timeout!r}; pass "
                         f"e.g. {what}=60") from e
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{what} must be a finite number of seconds > 0, found {timeout!r}")
    return seconds


def _backend() -> str:
    b = os.environ.get("HIPRESS_BACKEND")
    if b:
        return b
    import torch

    # gloo carries the CPU tensors (all our metadata); NCCL the CUDA ones.
    if not torch.cuda.is_available():
        return "gloo"
    local = _env_int("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                     default=1)
    gpus = torch.cuda.device_count()
    if local > gpus:  # NCCL refuses two ranks on one GPU ("Duplicate GPU detected")
        log.warning("%d local ranks share %d GPU(s): NCCL needs a GPU per rank, so gloo "
                    "carries every tensor (CUDA ones included); set HIPRESS_BACKEND to "
                    "choose another backend", local, gpus)
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def _env_int(*names: str, default: Optional[int] = None) -> Optional[int]:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return default


def _init_mpi(timeout: float) -> _Runtime:
    """Rendezvous through MPI: rank 0's TCPStore address travels by ``MPI.bcast``."""
    import torch.distributed as dist

    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RuntimeError(
            "this process was started by mpirun but mpi4py is not installed; "
            "pip install mpi4py (or launch with torchrun)") from e
    comm = MPI.COMM_WORLD
    r, n = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=r)
    lr, ls = local.Get_rank(), local.Get_size()
    local.Free()
    hosts = comm.allgather(socket.gethostname())
    if r == 0:
        addr = os.environ.get("MASTER_ADDR")
        if not addr:
            addr = ("127.0.0.1" if len(set(hosts)) == 1
                    else socket.gethostbyname(socket.gethostname()))
        try:
            # port 0: the OS picks a free port, no race with other jobs.
            store = dist.TCPStore(addr, int(os.environ.get("MASTER_PORT", 0)), n, True,
                                  timedelta(seconds=timeout), wait_for_workers=False)
            info = (addr, store.port, "")
        except Exception as e:  # tell the other ranks instead of leaving them in bcast
            info = (addr, 0, f"{type(e).__name__}: {e}")
        comm.bcast(info, root=0)
    else:
        info = comm.bcast(None, root=0)
    addr, port, err = info
    if err:
        raise RuntimeError(f"rank 0 could not open the rendezvous store on {addr}: {err}")
    if r != 0:
        store = dist.TCPStore(addr, port, n, False, timedelta(seconds=timeout))
    dist.init_process_group(_backend(), store=store, rank=r, world_size=n,
                            timeout=timedelta(seconds=timeout))
    return _Runtime(r, n, lr, ls, "mpirun", True, timeout)


def _init_torchrun(launch: Any, timeout: float) -> None:
    """torchrun's ``env://`` rendezvous, with the ranks' ``WORLD_SIZE`` compared first.

    The store is the one ``env://`` would open (rank 0 hosts it at
    ``MASTER_ADDR:MASTER_PORT``, or torchrun's agent hosts it), but opened
    without waiting for ``WORLD_SIZE`` clients: a rank given another world size
    would otherwise make ``init_process_group`` fail after its whole timeout
    with a bare ``DistStoreError`` naming no rank (issue 46).
    """
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:  # env:// names what is missing
        dist.init_process_group(_backend(), init_method="env://",
                                timeout=timedelta(seconds=timeout))
        return
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(addr, int(port), None, launch.rank == 0 and not agent,
                          timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=True)
    if agent:  # the agent's store outlives a restart: keep the dead group's keys apart
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"hipress/attempt_{attempt}", store)
    _agree_on_world_size(store, launch.rank, launch.size, timeout, host=launch.rank == 0 and
                         not agent)
    dist.init_process_group(_backend(), store=store, rank=launch.rank, world_size=launch.size,
                            timeout=timedelta(seconds=timeout))


def _agree_on_world_size(store: Any, rank: int, size: int, timeout: float, host: bool) -> None:
    """Every rank posts its ``WORLD_SIZE`` and reads its peers' until it has all of
    them or finds one that differs (every rank that has both posted and read finds
    it; the store's host waits, the timeout at most, until as many ranks as the
    smallest world claimed have found it too).

    Raises:
        LaunchError: a peer has another world size (naming the ranks and sizes),
            or not every rank arrived within ``timeout``.
    """
    # a store that outlives a torchrun restart is already prefixed by the attempt
    # (_init_torchrun); the restart count itself differs on a host that joined later
    prefix = "hipress/world_size"
    store.set(f"{prefix}/{rank}", str(size))
    seen = {rank: size}
    deadline = time.monotonic() + timeout
    while True:
        # one rank beyond our world too: a rank that exists there has another size
        for r in range(size + 1):
            key = f"{prefix}/{r}"
            if r not in seen and store.check([key]):
                seen[r] = int(store.get(key))
        other = {r: n for r, n in seen.items() if n != size}
        if other:
            break
        if len(seen) == size:
            return
        if time.monotonic() > deadline:
            missing = sorted(set(range(size)) - set(seen))
            raise LaunchError(f"rank {rank}: WORLD_SIZE={size}, but rank(s) {missing} did not "
                              f"join within {timeout:g}s; start every rank (torchrun "
                              f"--nproc-per-node {size}), or check that they reach init()")
        time.sleep(0.01)
    store.add(f"{prefix}/told", 1)
    by_size: dict = {}
    for r, n in sorted(seen.items()):
        by_size.setdefault(n, []).append(r)
    if host:
        # Keep the store up until the ranks have read the difference, also those still
        # starting (a late rank found the store gone and failed naming nothing): as many
        # as the smallest world claimed, which certainly exist; at most the timeout.
        want = min(seen.values())
        until = time.monotonic() + timeout
        while time.monotonic() < until and int(store.add(f"{prefix}/told", 0)) < want:
            time.sleep(0.01)
    found = "; ".join(f"{n} on rank(s) {rs}" for n, rs in sorted(by_size.items()))
    raise LaunchError(f"rank {rank}: the ranks were started with different world sizes: "
                      f"WORLD_SIZE {found}. Expected the same WORLD_SIZE on every rank; start "
                      "them with one launcher command (torchrun --nproc-per-node N ...)")


def _horovodrun_mpi() -> bool:
    """True when Open MPI's ranks were started by ``horovodrun --mpi`` (not plain mpirun)."""
    return all(os.environ.get(k) == v for k, v in _HOROVODRUN_MPI_MARKERS.items())


def _init_horovod(launch: Any, timeout: float) -> _Runtime:
    """Rendezvous through Horovod (``horovod_rendezvous.join_horovod``)."""
    from .horovod_rendezvous import join_horovod

    r, n, lr, ls, store = join_horovod(launch, timeout, _backend())
    return _Runtime(r, n, lr, ls, launch.launcher, True, timeout, store=store,
                    transport="horovod")


def _init_bpslaunch(launch: Any, timeout: float) -> _Runtime:
    """Meet the other workers of a one-machine bpslaunch-style job (``DMLC_WORKER_ID``,
    ``DMLC_NUM_WORKER``) over gloo at the address BytePS's scheduler would use
    (``DMLC_PS_ROOT_URI``/``_PORT``); no servers or scheduler run here."""
    import torch.distributed as dist

    role = os.environ.get("DMLC_ROLE", "worker")
    if role != "worker":
        raise LaunchError(f"DMLC_ROLE={role!r}: hipress-like runs no BytePS servers or "
                          "scheduler (aggregation is co-located with the workers); start "
                          "only the workers")
    addr = os.environ.get("DMLC_PS_ROOT_URI") or os.environ.get("MASTER_ADDR")
    port = os.environ.get("DMLC_PS_ROOT_PORT") or os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise LaunchError("a bpslaunch-style environment (DMLC_WORKER_ID, DMLC_NUM_WORKER) "
                          "needs the address the workers meet at: set DMLC_PS_ROOT_URI and "
                          "DMLC_PS_ROOT_PORT (as bpslaunch does), e.g. 127.0.0.1 and a free "
                          f"port, or launch with torchrun (torchrun --nproc-per-node "
                          f"{launch.size} script.py)")
    dist.init_process_group(_backend(), init_method=f"tcp://{addr}:{int(port)}",
                            rank=launch.rank, world_size=launch.size,
                            timeout=timedelta(seconds=timeout))
    # one machine: the local ranks are the ranks
    return _Runtime(launch.rank, launch.size, launch.rank, launch.size, "bpslaunch", True,
                    timeout)


def engine_transport(timeout: float) -> Any:
    """The transport an engine of this process gets (collective: every rank calls it).

    ``HIPRESS_TRANSPORT`` (``torch``, ``mpi``, ``horovod``) chooses when set;
    otherwise jobs started by horovodrun run their engines over Horovod and
    all others over torch.distributed. ``HIPRESS_FAULT`` (set only by the fault
    suite) wraps it in ``transport.faulty.FaultyTransport``.

    Raises:
        ValueError: an unknown ``HIPRESS_TRANSPORT``.
        hipress_like.casync.transport.TransportError: ``horovod`` asked for in a
            job whose Horovod world is not this job's (not started by horovodrun).
    """
    from ..casync.transport import make_transport

    rt = _require()
    backend = os.environ.get("HIPRESS_TRANSPORT") or rt.transport
    kwargs: dict = {}
    if backend.lower() == "horovod":
        kwargs = {"store": rt.store, "expected": (rt.rank, rt.size, rt.launcher)}
        if rt.launcher not in ("horovodrun-gloo", "horovodrun-mpi"):
            # let a Horovod world of one say what is wrong, instead of training alone
            try:
                import torch.distributed as dist

                kwargs["store"] = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: S110 - the store only improves error messages
                pass
    transport = make_transport(backend, timeout=timeout, **kwargs)
    if os.environ.get("HIPRESS_FAULT"):  # the fault suite's injected fault (tests/faults)
        from ..casync.transport.faulty import wrap_from_env

        transport = wrap_from_env(transport)
    return transport


def init(comm: Any = None, process_sets: Any = None, timeout: Optional[float] = None) -> None:
    """Join the other ranks (idempotent), like ``horovod.torch.init``.

    Args:
        comm: accepted for Horovod compatibility; only ``None`` (all ranks,
            or ``MPI.COMM_WORLD``) is supported.
        process_sets: accepted for compatibility; only ``None``.
        timeout: seconds any collective may block before failing (default
            ``HIPRESS_TIMEOUT`` or 300).

    Raises:
        ValueError: a sub-communicator or process sets were requested.
        RuntimeError: started by mpirun without mpi4py, or the rendezvous failed.
        LaunchError: the launcher environment is incomplete or contradictory,
            or names a launcher this front end cannot rendezvous through
            (the message names the fix); never a silent world of one.

    Example:
        >>> import hipress_like.torch as hpt
        >>> hpt.init(); hpt.rank(), hpt.size()
        (0, 1)
    """
    global _rt
    if _rt is not None:
        return
    if comm is not None:
        try:
            from mpi4py import MPI
            whole = comm == MPI.COMM_WORLD or comm == [] or comm == list(range(comm.Get_size()))
        except Exception:
            whole = isinstance(comm, list) and not comm
        if not whole:
            raise ValueError("init(comm=...) with a sub-communicator is not supported; "
                             "start only the ranks that train, or pass comm=None")
    if process_sets:
        raise ValueError("process sets are not supported; every rank trains together")
    import torch.distributed as dist

    t = check_timeout(timeout, "init(timeout=...)") if timeout is not None else check_timeout(
        os.environ.get("HIPRESS_TIMEOUT", _DEFAULT_TIMEOUT), "HIPRESS_TIMEOUT")
    if dist.is_initialized():
        n, r = dist.get_world_size(), dist.get_rank()
        _rt = _Runtime(r, n, _env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", default=0),
                       _env_int("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", default=n),
                       "adopted", False, t)
        log.info("hipress_like.torch: rank %d of %d adopted from torch.distributed", r, n)
        heap.settle()
        return
    launch = detect()  # LaunchError on an incomplete or contradictory environment
    if launch.launcher == "torchrun":
        _init_torchrun(launch, t)
        n, r = dist.get_world_size(), dist.get_rank()
        _rt = _Runtime(r, n, _env_int("LOCAL_RANK", default=0),
                       _env_int("LOCAL_WORLD_SIZE", default=n), "torchrun", True, t)
    elif launch.launcher == "mpirun" and _horovodrun_mpi():
        _rt = _init_horovod(replace(launch, launcher="horovodrun-mpi"), t)
    elif launch.launcher == "mpirun":
        _rt = _init_mpi(t)
    elif launch.launcher in ("horovodrun-gloo", "horovodrun-mpi"):
        _rt = _init_horovod(launch, t)
    elif launch.launcher == "bpslaunch":
        _rt = _init_bpslaunch(launch, t)
    else:
        dist.init_process_group(_backend(), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=t))
        _rt = _Runtime(0, 1, 0, 1, "single", True, t)
    log.info("hipress_like.torch: rank %d of %d (local %d of %d) via %s",
             _rt.rank, _rt.size, _rt.local_rank, _rt.local_size, _rt.launcher)
    # what the script imported is alive for good: keep the collector off it (heap.py)
    heap.settle()
    _install_excepthook()


def _install_excepthook() -> None:
    """Tell the peers when this process dies of an uncaught exception (once per process).

    An exception outside the engine (the script's forward or backward, a data
    error) ends this rank between two of its collectives, where nothing of the
    engine sees it: the peers learned of it only when its exit closed its
    connections, or at their timeout. The hook aborts every engine's transport
    with the exception's text first (``Transport.abort``: the peers raise naming
    this rank and why at once), then calls the hook it replaced. The library's
    own errors (``HipressError``, and what they caused) are not told again: an
    engine tells its peers of its own failures, and the rest were learned from
    the peers or found alike on every rank (telling would blame this rank).
    """
    global _excepthook_installed
    if _excepthook_installed:
        return
    _excepthook_installed = True
    previous = sys.excepthook

    def ours(value: Any) -> bool:
        seen = 0
        while value is not None and seen < 20:  # the chain of causes, bounded
            if isinstance(value, HipressError):
                return True
            value, seen = value.__cause__ or value.__context__, seen + 1
        return False

    def hook(kind: Any, value: Any, tb: Any) -> None:
        try:
            reason = f"{kind.__name__} (uncaught, the process exits): {value}"
            for obj in [] if ours(value) else list(_closables):
                eng = getattr(obj, "engine", None)
                transport = getattr(eng, "transport", None)
                if transport is not None:
                    transport.abort(reason)
        except Exception as e:  # telling is best effort: the traceback comes next anyway
            log.debug("could not tell the peers of the uncaught exception: %s", e)
        previous(kind, value, tb)

    sys.excepthook = hook


def _require() -> _Runtime:
    if _rt is None:
        raise ValueError("hipress_like.torch has not been initialized; "
                         "call hipress_like.torch.init() first")
    return _rt


def _track(obj: Any) -> None:
    """Close ``obj`` (an optimizer or hook state owning an engine) at shutdown."""
    _closables.add(obj)


def shutdown() -> None:
    """Close every engine, then leave the process group if ``init`` created it."""
    global _rt
    for obj in list(_closables):
        try:
            obj.close()
        except Exception as e:  # shutting down: report, keep going
            log.warning("closing %r failed: %s", obj, e)
    _closables.clear()
    if _rt is None:
        return
    rt, _rt = _rt, None
    if rt.owns_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def horovod_elastic() -> bool:
    """Whether this job runs under horovodrun's elastic driver (``--min-np``/``--max-np``),
    where a failed or added host re-forms the world in the running processes."""
    from .horovod_rendezvous import elastic

    return _rt is not None and _rt.launcher == "horovodrun-gloo" and elastic()


def reform() -> None:
    """Leave this world and join the next one horovodrun's elastic driver forms, in process.

    ``hpt.elastic.run`` calls it after a peer failure or a host update. Every
    engine holder that can (``DistributedOptimizer``) drops its engine (a failed
    engine waits for no peer), the process group and Horovod are left,
    ``hvd.init()`` joins the driver's next rendezvous (the new rank and size come
    from there; a new host's first ``init`` meets it), a new store and group are
    opened over it, and the holders build new engines on it. Compressor state
    starts fresh in the new engines (``hpt.elastic.TorchState.restore`` says how
    it is treated).

    Raises:
        ValueError: not initialised, or not a horovodrun elastic job.
    """
    global _rt
    rt = _require()
    if not horovod_elastic():
        raise ValueError(f"reform() re-forms a horovodrun elastic job in process; this job "
                         f"was started by {rt.launcher}, whose launcher restarts the "
                         "processes instead (hpt.elastic.run handles both)")
    holders = [o for o in list(_closables) if hasattr(o, "_hp_detach")]
    for o in holders:
        o._hp_detach()
    import torch.distributed as dist

    from .horovod_rendezvous import import_horovod_torch

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:  # peers are gone: nothing to leave cleanly
            log.debug("leaving the old process group: %s", e)
    hvd = import_horovod_torch("an elastic horovodrun job re-forms its world")
    hvd.shutdown()
    from ..casync.transport.horovod import restart_channel_numbers

    restart_channel_numbers()  # as a new process's: the world may hold new ones
    from ..casync.transport.torch_dist import forget_failures

    forget_failures()  # the old world's deaths name ranks the new one numbers afresh
    _rt = None
    _rt = _init_horovod(detect(), rt.timeout)
    log.warning("hipress_like: the elastic driver re-formed the world: rank %d of %d "
                "(was rank %d of %d)", _rt.rank, _rt.size, rt.rank, rt.size)
    for o in holders:
        o._hp_reattach()


def _close_engines_at_exit() -> None:
    for obj in list(_closables):
        try:
            obj.close()
        except Exception:  # noqa: S110 - the interpreter is exiting
            pass


atexit.register(_close_engines_at_exit)


def is_initialized() -> bool:
    """True after ``init()`` (and before ``shutdown()``)."""
    return _rt is not None


def rank() -> int:
    """This process's rank in ``[0, size())``."""
    return _require().rank


def size() -> int:
    """Number of ranks."""
    return _require().size


def local_rank() -> int:
    """Rank among the processes on this host (pick the GPU with it)."""
    return _require().local_rank


def local_size() -> int:
    """Number of ranks on this host."""
    return _require().local_size


def cross_rank() -> int:
    """Index of this host (rank // local_size on a homogeneous cluster)."""
    rt = _require()
    return rt.rank // max(1, rt.local_size)


def cross_size() -> int:
    """Number of hosts."""
    rt = _require()
    return max(1, rt.size // max(1, rt.local_size))


def barrier() -> None:
    """Wait until every rank arrives (times out after ``default_timeout()``)."""
    import torch.distributed as dist

    _require()
    work = dist.barrier(async_op=True)
    work.wait(timeout=timedelta(seconds=default_timeout()))


def mpi_built() -> bool:
    """True when mpi4py is importable (used only for the mpirun rendezvous)."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True when this job was started by mpirun (or horovodrun in MPI mode)."""
    return _rt is not None and _rt.launcher in ("mpirun", "horovodrun-mpi")


def gloo_built() -> bool:
    """Always True: gloo ships with torch."""
    return True


def gloo_enabled() -> bool:
    """True when the default group uses gloo (CPU tensors)."""
    return True


def nccl_built() -> bool:
    """True when this torch build has NCCL."""
    import torch.distributed as dist

    return bool(dist.is_nccl_available())


def cuda_built() -> bool:
    """True when this torch build has CUDA."""
    import torch

    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """True when this torch build targets ROCm."""
    import torch

    return getattr(torch.version, "hip", None) is not None


def mpi_threads_supported() -> bool:
    """Horovod compatibility: whether MPI was initialised with thread support."""
    if not mpi_built():
        return False
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE
