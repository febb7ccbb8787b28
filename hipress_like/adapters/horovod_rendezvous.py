"""Joining a ``horovodrun`` job (gloo or MPI mode) through Horovod's own rendezvous.

Under ``horovodrun`` the processes meet through Horovod: its gloo mode hands
every rank ``HOROVOD_RANK``/``HOROVOD_SIZE`` and the address of its
rendezvous server, its MPI mode starts them with ``mpirun``. Nothing else
(no ``MASTER_ADDR``, no mpi4py) may be assumed. So ``init`` does:

1. import ``horovod.torch`` (an error names the fix when Horovod is not
   installed in this Python, or was built without PyTorch support) and
   call ``hvd.init()`` unless the script already did;
2. check that Horovod's world is the launcher's (a mismatch means two
   launchers were mixed, e.g. ``torchrun`` variables inside ``horovodrun``);
3. open a ``TCPStore`` on rank 0 (port 0: the OS picks a free one) and hand
   its address to the other ranks with ``hvd.broadcast_object``; every
   rank then joins a torch.distributed group on that store. The group
   carries the user-facing collectives; the store lets the Horovod
   transport name a rank that never entered a collective.

In Horovod's elastic mode (``horovodrun --min-np/--max-np``, which exports
``HOROVOD_ELASTIC=1``) the rank and size come from the driver's rendezvous at
every ``hvd.init()``, not from the launch variables (those are the first
world's), so they are not compared; ``runtime.reform`` runs steps 1 and 3 again
when the driver re-forms the world.

The engine's transport is Horovod itself (``HorovodTransport``), chosen by
``runtime.engine_transport``; a script may keep calling ``horovod.torch``
directly in the same job, since Horovod matches operations by name and
this project's names (``hipress_like.t<k>...``) never collide with its.

Before ``hvd.init()``, the first rank of a host with no core to spare (no
more cores than ranks) logs a hint (``cycle_time_hint``): Horovod's
background thread negotiates every ``HOROVOD_CYCLE_TIME`` (1 ms by
default), busy or not, and without a spare core that CPU is taken from
training. The setting stays the user's (it also paces the script's own
``horovod.torch`` calls); the hint gives the measured trade.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import replace
from datetime import timedelta
from typing import Any, Mapping, Optional, Tuple

from .launcher import Launch, LaunchError

__all__ = ["import_horovod_torch", "join_horovod", "cycle_time_hint", "elastic", "FIX_INSTALL"]

log = logging.getLogger(__name__)

FIX_INSTALL = ("scripts/env_horovod.sh (builds horovod==0.28.1 with PyTorch, gloo and MPI "
               "into the project's .venv)")


def import_horovod_torch(why: str) -> Any:
    """``import horovod.torch``, or an error that names the fix.

    Args:
        why: what needs Horovod, for the message (e.g. "this process was
            started by horovodrun").

    Raises:
        LaunchError: Horovod is absent from this Python, or was built
            without its PyTorch extension.
    """
    try:
        import horovod  # noqa: F401
    except ImportError as e:
        raise LaunchError(
            f"{why}, but Horovod is not installed in this Python ({sys.executable}: {e}). "
            f"Fix: run {FIX_INSTALL}, and start the job with that environment's horovodrun "
            "and python; or launch with torchrun/mpirun instead") from e
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise LaunchError(
            f"{why}, but the installed Horovod was built without PyTorch support "
            f"(import horovod.torch: {str(e)[:200]}). Fix: pip uninstall -y horovod, then "
            f"{FIX_INSTALL}; it sets HOROVOD_WITH_PYTORCH=1 and builds against this torch") from e
    return hvd


def elastic(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process was started by horovodrun's elastic driver (``HOROVOD_ELASTIC=1``)."""
    env = os.environ if env is None else env
    return env.get("HOROVOD_ELASTIC", "") == "1"


def check_environment(launch: Launch, env: Mapping[str, str]) -> None:
    """Refuse a horovodrun environment Horovod could not rendezvous through.

    Raises:
        LaunchError: gloo mode without the rendezvous server's address
            (``HOROVOD_RANK``/``HOROVOD_SIZE`` set by hand), where Horovod
            would start every rank as a world of its own.
    """
    if launch.launcher == "horovodrun-gloo":
        missing = [v for v in ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT")
                   if not env.get(v)]
        if missing:
            raise LaunchError(
                f"HOROVOD_RANK={launch.rank} and HOROVOD_SIZE={launch.size} are set but "
                f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: these come "
                "from horovodrun in gloo mode, whose rendezvous server the ranks meet through. "
                "Fix: start the job with horovodrun (horovodrun -np N python script.py), or "
                "unset the HOROVOD_* variables and use torchrun")


def cycle_time_hint(launch: Launch, env: Mapping[str, str], cores: int) -> Optional[str]:
    """The advice to lengthen Horovod's cycle on a host with no spare core, or None.

    None when ``HOROVOD_CYCLE_TIME`` is set (the user chose), when the
    launcher does not say how many ranks share this host, or when the host
    has more cores than ranks (Horovod's threads then run on a spare one).
    Measured on a 2-core host, the VGG-style model at 1 Gbit/s (README, "As
    a Horovod plugin"): over Horovod's transport a step took 1.16-1.18x its
    time over gloo with the 1 ms default, 1.09-1.12x with 5 ms, with 4 ranks
    and with 2.

    Example:
        >>> cycle_time_hint(Launch("horovodrun-gloo", 0, 4, 0, 4), {}, 2)[:39]
        'horovodrun started 4 ranks on this host'
        >>> cycle_time_hint(Launch("horovodrun-gloo", 0, 4, 0, 4), {}, 8) is None
        True
    """
    ranks = launch.local_size
    if env.get("HOROVOD_CYCLE_TIME") or ranks is None or ranks < cores:
        return None
    return (f"horovodrun started {ranks} ranks on this host, which has {cores} core"
            f"{'s' if cores != 1 else ''}: no core is spare for Horovod's background thread, "
            "which negotiates every HOROVOD_CYCLE_TIME (1 ms by default) whether or not there "
            "is work, so its CPU is taken from training. Measured on a 2-core host: a step "
            "over Horovod took 1.16-1.18x its time over gloo at 1 ms, 1.09-1.12x at 5 ms. To "
            "trade a few ms of latency per collective for that CPU: horovodrun "
            "--cycle-time-ms 5 (or HOROVOD_CYCLE_TIME=5); setting it to 1 keeps Horovod's "
            "default and this hint quiet")


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _store_address(hvd: Any) -> str:
    hosts = hvd.allgather_object(socket.gethostname(), name="hipress_like.rdv.hosts")
    addr = os.environ.get("MASTER_ADDR")
    if addr:
        return addr
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def join_horovod(launch: Launch, timeout: float, backend: str,
                 env: Optional[Mapping[str, str]] = None) -> Tuple[int, int, int, int, Any]:
    """Join a horovodrun job: Horovod, then a torch.distributed group over a store.

    Args:
        launch: what ``launcher.detect`` found ("horovodrun-gloo" or
            "horovodrun-mpi").
        timeout: seconds the store and the group may block.
        backend: the torch.distributed backend of the group.
        env: the environment (default ``os.environ``).

    Returns:
        (rank, size, local_rank, local_size, store).

    Raises:
        LaunchError: Horovod missing or built without PyTorch, the
            rendezvous variables missing, or Horovod's world differs from
            the launcher's.
        RuntimeError: rank 0 could not open the store.
    """
    import torch.distributed as dist

    env = os.environ if env is None else env
    check_environment(launch, env)
    mode = "gloo" if launch.launcher == "horovodrun-gloo" else "MPI"
    hvd = import_horovod_torch(f"this process was started by horovodrun ({mode} mode) as rank "
                               f"{launch.rank} of {launch.size}")
    if not hvd.is_initialized():
        hint = cycle_time_hint(launch, env, _usable_cores()) if launch.local_rank in (0, None) \
            else None  # once per host
        if hint:
            log.warning(hint)
        hvd.init()
    r, n = hvd.rank(), hvd.size()
    if elastic(env):  # the driver assigns rank and size at each rendezvous
        launch = replace(launch, rank=r, size=n)
    if (launch.rank is not None and r != launch.rank) or (launch.size is not None
                                                          and n != launch.size):
        raise LaunchError(
            f"Horovod says rank {r} of {n} but the launcher's variables say rank {launch.rank} "
            f"of {launch.size} ({launch.launcher}); the job mixes launchers (e.g. torchrun or "
            "mpirun variables inside horovodrun, or HOROVOD_* variables left in the shell). "
            "Fix: start it with one launcher, and unset the other one's variables")
    if n == 1 and launch.size not in (None, 1):
        raise LaunchError(f"Horovod initialised a world of one under {launch.launcher}; refusing "
                          "to train alone. Fix: start the job with horovodrun -np N")
    addr = _store_address(hvd)
    if r == 0:
        try:
            store = dist.TCPStore(addr, int(env.get("MASTER_PORT", 0)), n, True,
                                  timedelta(seconds=timeout), wait_for_workers=False)
            info = (addr, store.port, "")
        except Exception as e:  # tell the other ranks instead of leaving them waiting
            info = (addr, 0, f"{type(e).__name__}: {e}")
        hvd.broadcast_object(info, root_rank=0, name="hipress_like.rdv.store")
    else:
        info = hvd.broadcast_object(None, root_rank=0, name="hipress_like.rdv.store")
    addr, port, err = info
    if err:
        raise RuntimeError(f"rank 0 could not open the rendezvous store on {addr}: {err}")
    if r != 0:
        store = dist.TCPStore(addr, port, n, False, timedelta(seconds=timeout))
    dist.init_process_group(backend, store=store, rank=r, world_size=n,
                            timeout=timedelta(seconds=timeout))
    log.info("joined horovodrun (%s mode): rank %d of %d, store %s:%d", mode, r, n, addr, port)
    return r, n, hvd.local_rank(), hvd.local_size(), store
