"""Run N local worker processes: the launcher behind tests, benchmarks, examples.

``run_workers(fn, nprocs)`` starts ``nprocs`` fresh Python processes, calls
the module-level function ``fn(ctx, *args)`` in each with a ready
``Transport`` (``ctx.transport``), and returns every rank's return value.

How it works:

1. The parent writes a spec (which function, its args, the backend) into a
   private temporary directory.
2. It starts the ranks: for ``"gloo"`` one process per rank with the
   ``env://`` variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
   a free ``MASTER_PORT``); for ``"mpi"`` one ``mpirun -np N`` (root-safe
   flags set). Each worker process gets its own session so that the whole
   tree can be killed.
3. Each worker initialises the backend, builds the transport, runs ``fn``,
   and writes its result (or its traceback text) to ``rank<i>.result`` /
   ``rank<i>.error`` in that directory. On success it tears down cleanly
   (barrier on the default group, then ``destroy_process_group``); on
   failure it exits at once (``os._exit``) so a pending collective cannot
   hang the exit.
4. The parent polls. When a rank fails it waits ``grace`` seconds for the
   others to report (usually ``PeerError`` naming the culprit), kills the
   rest and raises ``WorkerError``. A global ``timeout`` kills everything.

Results and args travel through files in that private directory written
with ``torch.save`` and read with ``torch.load(weights_only=True)``: plain
data only (numbers, strings, lists, dicts, tuples, tensors), never pickle.
Workers default to ``OMP_NUM_THREADS=1`` (4 ranks share 2 cores here).

CLI (prints each rank's return value; ``cli_launch.py``)::

    python -m hipress_like.launch.cli_launch --nprocs 4 [--backend gloo] module:function [arg ...]
"""
from __future__ import annotations

import importlib
import importlib.util
import io
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ..casync.transport.base import Transport
from ..errors import HipressError
from .procs import LAUNCHER_PID_ENV, die_with_launcher, own_process_group

__all__ = ["WorkerContext", "WorkerError", "run_workers", "BACKENDS", "free_port",
           "mpirun_command", "own_process_group"]

log = logging.getLogger(__name__)


BACKENDS = ("gloo", "mpi")
_POLL = 0.05


@dataclass(frozen=True)
class WorkerContext:
    """What a worker function receives as its first argument.

    Attributes:
        rank: this worker's rank in ``[0, size)``.
        size: number of workers.
        backend: ``"gloo"`` or ``"mpi"``.
        transport: a ready ``Transport`` (``TorchDistTransport`` for gloo,
            with torch.distributed's default group initialised too;
            ``MPITransport`` for mpi).
    """

    rank: int
    size: int
    backend: str
    transport: Transport


class WorkerError(HipressError, RuntimeError):
    """One or more worker ranks failed.

    Attributes:
        failures: rank -> traceback text (or a description of how it died).
        results: rank -> return value for the ranks that finished.
    """

    def __init__(self, message: str, failures: Mapping[int, str],
                 results: Optional[Mapping[int, Any]] = None):
        details = "\n".join(f"--- rank {r} ---\n{t.rstrip()}" for r, t in sorted(failures.items()))
        super().__init__(f"{message}\n{details}" if details else message)
        self.failures: Dict[int, str] = dict(failures)
        self.results: Dict[int, Any] = dict(results or {})


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpirun_command(nprocs: int) -> List[str]:
    """``mpirun`` prefix for ``nprocs`` local ranks (root-safe, oversubscribed).

    Raises:
        FileNotFoundError: ``mpirun`` is not on ``PATH``.
    """
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise FileNotFoundError("mpirun not found on PATH; install Open MPI "
                                "(apt-get install -y openmpi-bin libopenmpi-dev)")
    return [mpirun, "-np", str(nprocs), "--allow-run-as-root", "--oversubscribe",
            "--bind-to", "none",
            # CMA single-copy needs ptrace rights that containers often deny.
            "--mca", "btl_vader_single_copy_mechanism", "none"]


def _fn_ref(fn: Callable) -> Dict[str, Optional[str]]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module is None or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"run_workers needs a module-level function (importable by name), got "
                         f"{fn!r}; define it at the top level of a module")
    mod = sys.modules.get(module)
    return {"module": module, "qualname": qualname, "file": getattr(mod, "__file__", None)}


def _resolve(ref: Dict[str, Optional[str]]) -> Callable:
    module, path = ref["module"], ref["file"]
    if module in ("__main__", "__mp_main__") or module is None:
        if not path:
            raise ImportError("cannot re-import a function defined interactively in __main__")
        spec = importlib.util.spec_from_file_location("__hipress_main__", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["__hipress_main__"] = mod
        spec.loader.exec_module(mod)  # __name__ != "__main__": its main block does not run
    else:
        mod = importlib.import_module(module)
    obj: Any = mod
    for part in ref["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def run_workers(fn: Callable[..., Any], nprocs: int, backend: str = "gloo",
                args: Sequence[Any] = (), timeout: float = 120.0,
                env: Optional[Mapping[str, str]] = None, *, grace: float = 10.0,
                netns: bool = False) -> List[Any]:
    """Run ``fn(ctx, *args)`` in ``nprocs`` local worker processes.

    Args:
        fn: a module-level function; called as ``fn(ctx, *args)`` with a
            ``WorkerContext``.
        nprocs: number of ranks (>= 1).
        backend: ``"gloo"`` (torch.distributed over loopback, env://) or
            ``"mpi"`` (mpi4py under ``mpirun``).
        args: extra positional arguments (picklable; passed via a local file).
        timeout: seconds for the whole run, start-up included; then every
            worker is killed and ``TimeoutError`` is raised.
        env: extra environment variables for the workers (override the
            defaults, e.g. ``{"OMP_NUM_THREADS": "2"}``).
        grace: after the first rank fails, seconds to wait for the others to
            report their own errors before killing them.
        netns: run rank i inside network namespace ``h{i}`` of an emulated
            network (``netem.up(nprocs, rate)`` first; gloo only), meeting at
            ``netem.MASTER_ADDR`` over the shaped links.

    Returns:
        Each rank's return value, index = rank.

    Raises:
        WorkerError: a rank raised or died; ``.failures`` maps rank to its
            traceback text.
        TimeoutError: the run exceeded ``timeout``.
        ValueError: bad arguments (unknown backend, non-importable ``fn``).

    Example:
        >>> def work(ctx, x):          # at module level
        ...     return ctx.transport.allreduce(torch.tensor([x])).item()
        >>> run_workers(work, 4, args=(1.0,))
        [4.0, 4.0, 4.0, 4.0]
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown launch backend {backend!r}; available: {', '.join(BACKENDS)}")
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    ref = _fn_ref(fn)
    workdir = tempfile.mkdtemp(prefix="hipress-launch-")
    try:
        _write_atomic(os.path.join(workdir, "spec.pt"), _dumps(
            {"fn": ref, "args": tuple(args), "backend": backend, "timeout": float(timeout)}))
        base_env = dict(os.environ)
        base_env["OMP_NUM_THREADS"] = "1"
        base_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        base_env.pop(LAUNCHER_PID_ENV, None)  # a launch from inside a worker: not its own
        base_env.update(env or {})
        cmd_tail = [sys.executable, "-c",
                    "from hipress_like.launch.launch import _worker_main; _worker_main()",
                    workdir]
        procs: List[subprocess.Popen] = []
        if netns and backend != "gloo":
            raise ValueError("netns=True runs gloo ranks in network namespaces; the mpi "
                             "backend cannot")
        if backend == "gloo":
            port, addr = str(free_port()), "127.0.0.1"
            if netns:  # h0's address on the emulated links; gloo must use their eth0
                from . import netem

                addr, port = netem.MASTER_ADDR, str(netem.DEFAULT_PORT)
                base_env["GLOO_SOCKET_IFNAME"] = "eth0"
            for r in range(nprocs):
                e = dict(base_env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nprocs),
                         LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR=addr, MASTER_PORT=port)
                e[LAUNCHER_PID_ENV] = str(os.getpid())  # the worker dies with this process
                cmd = ["ip", "netns", "exec", f"h{r}", *cmd_tail] if netns else cmd_tail
                procs.append(subprocess.Popen(cmd, env=e, **own_process_group()))
        else:
            e = dict(base_env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            forward: List[str] = []
            for k in sorted(set(env or {}) | {"OMP_NUM_THREADS", "PYTHONPATH"}):
                forward += ["-x", k]
            procs.append(subprocess.Popen(mpirun_command(nprocs) + forward + cmd_tail, env=e,
                                          **own_process_group()))
        return _supervise(procs, nprocs, backend, workdir, timeout, grace)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill(procs: Sequence[subprocess.Popen]) -> List[bool]:
    """SIGKILL every process (group) still running; return which ones were running."""
    alive = [p.poll() is None for p in procs]
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker's own process group: its whole tree
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            log.warning("worker pid %s did not die after SIGKILL", p.pid)
    return alive


def _mtime(path: Optional[str]) -> float:
    try:
        return os.path.getmtime(path) if path else float("inf")
    except OSError:
        return float("inf")


def _describe_exit(rc: Optional[int]) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with status {rc}"


def _supervise(procs: List[subprocess.Popen], nprocs: int, backend: str, workdir: str,
               timeout: float, grace: float) -> List[Any]:
    deadline = time.monotonic() + timeout
    first_failure: Optional[float] = None
    failure_order: List[int] = []  # ranks in the order their failure was seen

    def files(kind: str) -> Dict[int, str]:
        return {r: os.path.join(workdir, f"rank{r}.{kind}") for r in range(nprocs)
                if os.path.exists(os.path.join(workdir, f"rank{r}.{kind}"))}

    while True:
        done, failed = files("result"), files("error")
        rcs = [p.poll() for p in procs]
        if backend == "gloo":
            crashed = {r for r, rc in enumerate(rcs) if rc is not None
                       and (rc != 0 or r not in done) and r not in failed}
        else:
            crashed = set(range(nprocs)) - set(done) - set(failed) if rcs[0] is not None else set()
        finished = set(done) | set(failed) | crashed
        all_exited = all(rc is not None for rc in rcs)
        for r in sorted(set(failed) | crashed, key=lambda r: _mtime(failed.get(r))):
            if r not in failure_order:
                failure_order.append(r)
        if failure_order and first_failure is None:
            first_failure = time.monotonic()
        if all_exited or len(finished) == nprocs and not (failed or crashed):
            break
        if first_failure is not None and time.monotonic() - first_failure > grace:
            break
        if time.monotonic() > deadline:
            _kill(procs)
            raise TimeoutError(
                f"run_workers: {nprocs} {backend} workers exceeded the {timeout:.0f}s timeout; "
                f"finished: {sorted(done)}, failed: {sorted(failed)}, running: "
                f"{sorted(set(range(nprocs)) - finished)}; all were killed")
        time.sleep(_POLL)
    # Give successful ranks a moment to finish their clean teardown.
    if not (failed or crashed):
        end = min(deadline, time.monotonic() + 30.0)
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(_POLL)
    killed = _kill(procs)
    done, failed = files("result"), files("error")
    results: Dict[int, Any] = {}
    for r, path in done.items():
        results[r] = _loads(path)
    failures: Dict[int, str] = {}
    for r, path in failed.items():
        with open(path, encoding="utf-8", errors="replace") as f:
            failures[r] = f.read()
    first = failure_order[0] if failure_order else None
    for r in range(nprocs):
        if r in results or r in failures:
            continue
        if backend == "gloo":
            why = (f"killed after rank {first} failed" if killed[r] and first is not None
                   else _describe_exit(procs[r].returncode))
        else:  # mpirun ends the whole job when one rank exits abnormally
            why = f"mpirun {_describe_exit(procs[0].returncode)}" + (
                f" after rank {first} failed" if first is not None and first != r else "")
        failures[r] = f"rank {r} reported no result: {why}"
    if failures:
        first = first if first is not None else min(failures)
        raise WorkerError(f"{len(failures)} of {nprocs} {backend} worker(s) failed; the first "
                          f"to fail was rank {first}", failures, results)
    return [results[r] for r in range(nprocs)]


# -- inside a worker process ------------------------------------------------------

def _dumps(obj: Any) -> bytes:
    """Serialise plain data (what ``torch.load(weights_only=True)`` accepts)."""
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(path: str) -> Any:
    """Read what ``_dumps`` wrote; refuses anything but plain data and tensors."""
    import torch
    with open(path, "rb") as f:
        return torch.load(f, weights_only=True)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _worker_main() -> None:
    """Entry point of one worker process (argv[1] = the launch directory)."""
    die_with_launcher()
    workdir = sys.argv[1]
    spec = _loads(os.path.join(workdir, "spec.pt"))
    backend = spec["backend"]
    rank = int(os.environ.get("RANK", "-1"))
    transport: Optional[Transport] = None
    try:
        if backend == "mpi":
            from mpi4py import MPI

            from ..casync.transport.mpi import MPITransport
            rank = MPI.COMM_WORLD.Get_rank()
            transport = MPITransport()
        else:
            import torch.distributed as dist

            from ..casync.transport.torch_dist import TorchDistTransport
            dist.init_process_group("gloo", init_method="env://",
                                    timeout=timedelta(seconds=spec["timeout"]))
            transport = TorchDistTransport()
        ctx = WorkerContext(rank=transport.rank, size=transport.size, backend=backend,
                            transport=transport)
        fn = _resolve(spec["fn"])
        result = fn(ctx, *spec["args"])
        _write_atomic(os.path.join(workdir, f"rank{rank}.result"), _dumps(result))
    except BaseException:  # noqa: B036 - report anything, including KeyboardInterrupt
        text = traceback.format_exc()
        try:
            _write_atomic(os.path.join(workdir, f"rank{rank}.error"), text.encode())
            sys.stderr.write(f"[hipress launch] rank {rank} failed:\n{text}")
            if backend == "gloo" and transport is not None:
                _finish_gloo(rank, transport.size)
        finally:
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)  # a collective may be pending: never wait on it at exit
    _teardown(backend, transport, spec["timeout"])


# After a failure, the store host (rank 0) waits this long for the other
# ranks to finish diagnosing: they read heartbeats from its TCPStore, and if
# it exited first they could only blame rank 0.
_STORE_LINGER = 5.0
_FINISHED_KEY = "hipress/launch/finished"


def _finish_gloo(rank: int, size: int) -> None:
    """Post 'finished' to the store; rank 0 then waits for the others (bounded)."""
    import threading

    import torch.distributed as dist

    def post_and_wait() -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            store.add(_FINISHED_KEY, 1)
            end = time.monotonic() + _STORE_LINGER
            while rank == 0 and time.monotonic() < end and store.add(_FINISHED_KEY, 0) < size:
                time.sleep(_POLL)
        except Exception as e:  # the store host is gone: nothing to wait for
            log.debug("could not post the finished key: %s", e)

    t = threading.Thread(target=post_and_wait, daemon=True)
    t.start()
    t.join(_STORE_LINGER + 2.0)


def _teardown(backend: str, transport: Transport, timeout: float) -> None:
    transport.close()
    if backend != "gloo":
        return  # mpi4py finalizes MPI at exit
    import torch.distributed as dist
    try:
        work = dist.barrier(async_op=True)
        work.wait(timeout=timedelta(seconds=min(timeout, 60.0)))
        dist.destroy_process_group()
    except Exception as e:  # a peer already died: nothing left to tear down cleanly
        log.debug("teardown barrier failed: %s", e)
        _finish_gloo(transport.rank, transport.size)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
