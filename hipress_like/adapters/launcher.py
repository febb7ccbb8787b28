"""Which launcher started this process, read from the environment (framework-neutral).

Every face (PyTorch, and the TensorFlow, MXNet, Horovod- and BytePS-style
faces to come) asks the same question at ``init``: how many ranks are
there, which one is this, and how do the ranks meet? The launchers answer
through environment variables:

==================  ==========================================================
torchrun            ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
                    (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``)
mpirun              Open MPI ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_*``,
                    or MPICH/PMIx/MVAPICH ``PMI_RANK``, ``PMIX_RANK``, ...
horovodrun (gloo)   ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
                    ``HOROVOD_LOCAL_SIZE``, ``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``PORT``
horovodrun (MPI)    Open MPI's variables, plus ``HOROVOD_*`` hints
bpslaunch-style     ``DMLC_WORKER_ID``, ``DMLC_NUM_WORKER`` (one machine)
none                a single process
==================  ==========================================================

``detect`` reads them and returns a ``Launch``; an environment that is
incomplete or contradicts itself (a rank outside the world, torchrun and
horovodrun disagreeing) is an error naming the variables, never a silent
world of one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from ..errors import HipressError

__all__ = ["Launch", "LaunchError", "detect", "MPI_RANK_VARS"]

MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


class LaunchError(HipressError, RuntimeError):
    """The launcher environment is incomplete or inconsistent."""


@dataclass(frozen=True)
class Launch:
    """What the launcher said about this process.

    Attributes:
        launcher: "torchrun", "mpirun", "horovodrun-gloo", "horovodrun-mpi",
            "bpslaunch" or "single".
        rank, size: this process's rank and the world size (None where only
            the rendezvous can tell: mpirun without a size variable).
        local_rank, local_size: the same on this machine (None if unknown).
    """

    launcher: str
    rank: Optional[int]
    size: Optional[int]
    local_rank: Optional[int] = None
    local_size: Optional[int] = None


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    v = env.get(name)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise LaunchError(f"{name}={v!r} is not an integer; the launcher environment is "
                          "corrupt (unset it, or start the job with torchrun, mpirun or "
                          "horovodrun)") from None


def _first(env: Mapping[str, str], *names: str) -> Optional[int]:
    for n in names:
        v = _int(env, n)
        if v is not None:
            return v
    return None


def _check(launcher: str, rank: Optional[int], size: Optional[int], what: str) -> None:
    if size is not None and size < 1:
        raise LaunchError(f"{launcher}: world size {size} ({what}) must be >= 1")
    if rank is not None and (rank < 0 or (size is not None and rank >= size)):
        raise LaunchError(f"{launcher}: rank {rank} is outside a world of {size} ({what})")


def _pair(env: Mapping[str, str], launcher: str, rank_var: str, size_var: str,
          fix: str) -> Optional[Tuple[int, int]]:
    """(rank, size) from a launcher's two variables, None if neither is set."""
    if rank_var not in env and size_var not in env:
        return None
    r, n = _int(env, rank_var), _int(env, size_var)
    if r is None or n is None:
        raise LaunchError(f"{launcher} environment with only one of {rank_var} and {size_var} "
                          f"(no {size_var if r is not None else rank_var}); {fix}")
    _check(launcher, r, n, f"{rank_var}, {size_var}")
    return r, n


def detect(env: Optional[Mapping[str, str]] = None) -> Launch:
    """Read the launcher from ``env`` (default ``os.environ``).

    Raises:
        LaunchError: half a launcher's variables (``RANK`` without
            ``WORLD_SIZE``, ``HOROVOD_RANK`` without ``HOROVOD_SIZE``), a
            rank outside the world, a non-integer value, or two launchers
            that disagree about the rank or the size.
    """
    env = os.environ if env is None else env
    found = []
    pair = _pair(env, "torchrun", "RANK", "WORLD_SIZE",
                 "they come together, with MASTER_ADDR and MASTER_PORT; set both or neither")
    if pair is not None:
        found.append(Launch("torchrun", *pair, _int(env, "LOCAL_RANK"),
                            _int(env, "LOCAL_WORLD_SIZE")))
    under_mpi = any(v in env for v in MPI_RANK_VARS)
    pair = _pair(env, "horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE",
                 "start the job with horovodrun, or unset them")
    if pair is not None:
        found.append(Launch("horovodrun-mpi" if under_mpi else "horovodrun-gloo", *pair,
                            _int(env, "HOROVOD_LOCAL_RANK"), _int(env, "HOROVOD_LOCAL_SIZE")))
    elif under_mpi:
        r, n = _first(env, *MPI_RANK_VARS), _first(env, *_MPI_SIZE_VARS)
        _check("mpirun", r, n, "the MPI launcher's rank and size variables")
        found.append(Launch("mpirun", r, n, _first(env, "OMPI_COMM_WORLD_LOCAL_RANK",
                                                   "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK"),
                            _first(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                                   "MV2_COMM_WORLD_LOCAL_SIZE")))
    pair = _pair(env, "bpslaunch", "DMLC_WORKER_ID", "DMLC_NUM_WORKER",
                 "set both (one machine: DMLC_NUM_WORKER workers)")
    if pair is not None:
        found.append(Launch("bpslaunch", *pair, *pair))
    if not found:
        return Launch("single", 0, 1, 0, 1)
    first = found[0]
    for other in found[1:]:
        for field in ("rank", "size"):
            a, b = getattr(first, field), getattr(other, field)
            if a is not None and b is not None and a != b:
                raise LaunchError(f"{first.launcher} and {other.launcher} disagree about the "
                                  f"{field} ({a} against {b}); the job was started by one "
                                  "launcher inside another: unset the outer one's variables")
    # torchrun's variables win: horovodrun and mpirun export theirs too when they
    # start torchrun-style scripts; the checks above made sure they agree
    return first
