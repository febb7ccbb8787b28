"""Emulated network: N hosts as network namespaces on one machine (root).

Each "host" is a network namespace ``h0..h{N-1}`` whose ``eth0`` (address
``10.77.0.{i+1}/24``) is a veth into a bridge ``br0`` inside namespace
``hsw``. Every link is shaped with ``tc tbf`` in both directions (switch ->
host on the bridge port, host -> switch on ``eth0``), so each host gets a
full-duplex link of the given rate. Nothing is added to the root namespace
and only addresses inside 10.77.0.0/24, which exist only in these
namespaces, are used: no traffic leaves the machine.

Facts (ENVIRONMENT.md, ../shared/netem): ``tbf`` reaches ~0.95 Gbit/s on a
1gbit link; this kernel has no ``sch_netem``, so ``delay`` works only on
kernels that have it (the error says so otherwise); gloo needs
``GLOO_SOCKET_IFNAME=eth0`` and ``lo`` up in every namespace. Needs root.

Used by the main job (``./run.sh``: its workers train over emulated links),
the benchmarks and the network tests; ``bench/netem.py`` is its command line
(up, down, status, selfcheck)::

    from hipress_like.launch import netem
    netem.up(4, "1gbit")
    rc = netem.run_in_namespaces(4, [sys.executable, "train.py"], env={...})
    netem.down()
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence

from ..errors import HipressError
from .procs import own_process_group  # a group, not a session

__all__ = ["SUBNET", "MASTER_ADDR", "up", "down", "status", "set_rate", "run_in_namespaces",
           "host_address", "rate_bits", "NetemError"]

log = logging.getLogger(__name__)

SUBNET = "10.77.0"  # /24; host i is SUBNET.{i+1}. Never any other address.
MASTER_ADDR = f"{SUBNET}.1"
SWITCH = "hsw"
MAX_HOSTS = 250
DEFAULT_PORT = 29700
_NS_RE = re.compile(r"^(h\d+|hsw)$")


class NetemError(HipressError, RuntimeError):
    """Setting up, using or tearing down the emulated network failed."""


def _require_root() -> None:
    if os.geteuid() != 0:
        raise PermissionError("network emulation needs root (ip netns / tc); run as root, "
                              "e.g. sudo python bench/netem.py up 4 1gbit")


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    log.debug("+ %s", " ".join(cmd))
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True)
    except FileNotFoundError as e:
        raise NetemError(f"{cmd[0]} not found; install iproute2 (apt-get install -y iproute2)"
                         ) from e
    if check and res.returncode != 0:
        raise NetemError(f"`{' '.join(cmd)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _ip(*args: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip"] + (["-n", ns] if ns else []) + list(args), check=check)


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", "netns", "exec", ns, "tc"] + list(args), check=check)


def rate_bits(rate: str) -> int:
    """Bits per second of a tc-style rate (``1gbit``, ``100mbit``); ValueError otherwise."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(gbit|mbit|kbit|bit)", rate.strip().lower())
    if not m:
        raise ValueError(f"rate must look like 1gbit, 100mbit, 500kbit; got {rate!r}")
    scale = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}[m.group(2)]
    return int(float(m.group(1)) * scale)


def _burst_bytes(rate: str) -> int:
    # 2 ms worth of the rate, at least 32 KB: smaller buckets starve TCP at Gbit rates.
    return max(rate_bits(rate) // 4000, 32768)


def host_address(rank: int) -> str:
    """Address of host ``h{rank}`` (``10.77.0.{rank+1}``)."""
    if not 0 <= rank < MAX_HOSTS:
        raise ValueError(f"host index must be in [0, {MAX_HOSTS}), got {rank}")
    return f"{SUBNET}.{rank + 1}"


def _namespaces() -> List[str]:
    out = _ip("netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if _NS_RE.match(n)]


def _have_netem() -> bool:
    probe = f"netemprobe{os.getpid()}"
    _ip("netns", "add", probe)
    try:
        return _tc(probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                   check=False).returncode == 0
    finally:
        _ip("netns", "del", probe, check=False)


def _tbf(ns: str, dev: str, rate: str, parent: Sequence[str] = ("root",)) -> None:
    _tc(ns, "qdisc", "replace", "dev", dev, *parent, "tbf", "rate", rate,
        "burst", str(_burst_bytes(rate)), "latency", "20ms")


# One emulation session at a time: the namespaces have fixed names, so a second
# benchmark or test would otherwise tear down the first one's hosts in its cleanup.
LOCK_PATH = os.environ.get("HIPRESS_NETEM_LOCK", "/run/lock/hipress-netem.lock")
LOCK_WAIT = float(os.environ.get("HIPRESS_NETEM_LOCK_WAIT", "7200"))
_lock_fd: Optional[int] = None


def _acquire_session(wait: float = LOCK_WAIT) -> None:
    """Hold the session lock (an flock, released by the kernel if this process dies);
    wait up to ``wait`` seconds for another session to end, saying so once."""
    global _lock_fd
    if _lock_fd is not None:
        return
    os.makedirs(os.path.dirname(LOCK_PATH), exist_ok=True)
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o644)
    deadline, told = time.monotonic() + wait, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise NetemError(f"another network-emulation session has held {LOCK_PATH} "
                                 f"for over {wait:.0f} s; wait for it to finish or stop it"
                                 ) from None
            if not told:
                log.warning("another network-emulation session is running (lock %s); "
                            "waiting for it to finish", LOCK_PATH)
                told = True
            time.sleep(1.0)
    _lock_fd = fd


def _release_session() -> None:
    global _lock_fd
    if _lock_fd is not None:
        os.close(_lock_fd)  # closing the descriptor drops the flock
        _lock_fd = None


def up(n: int, rate: str = "1gbit", delay: Optional[str] = None, *, mtu: int = 1500) -> None:
    """Create hosts ``h0..h{n-1}`` on a switch, each link shaped to ``rate``.

    Args:
        n: number of hosts (1..250).
        rate: link rate in tc syntax (``1gbit``, ``100mbit``).
        delay: optional one-way delay added host -> switch (tc syntax, ``1ms``);
            needs ``sch_netem`` in the kernel.
        mtu: MTU of every link.

    Raises:
        PermissionError: not root.
        NetemError: this process already brought them up (``down`` first),
            another process's session outlasted ``HIPRESS_NETEM_LOCK_WAIT``
            seconds, the kernel lacks netem for ``delay``, or an ``ip``/``tc``
            command failed (the partial setup is removed).

    Sessions queue: ``up`` holds a lock (``LOCK_PATH``) until ``down``, so a
    second benchmark or test waits for the first instead of tearing its hosts
    down; namespaces found while holding it are a dead run's and are removed.

    From then on SIGTERM raises ``SystemExit`` in the main thread (unless the
    program set its own handler), so a caller's ``finally: down()`` runs
    when the benchmark is killed.
    """
    _require_root()
    if not 1 <= n <= MAX_HOSTS:
        raise ValueError(f"n must be in [1, {MAX_HOSTS}], got {n}")
    rate_bits(rate)
    if _lock_fd is not None and _namespaces():
        raise NetemError(f"namespaces {_namespaces()} already exist: this process brought "
                         "them up; call down() first")
    _acquire_session()
    existing = _namespaces()
    if existing:  # this process holds the session: they are a dead run's leftovers
        log.warning("removing leftover namespaces %s of an earlier run", existing)
        for ns in existing:
            _ip("netns", "del", ns, check=False)
    if delay and not _have_netem():
        raise NetemError(f"delay={delay!r} needs sch_netem, which this kernel lacks; run without "
                         "delay (tbf rate shaping works), or use ../shared/netem's NFQUEUE "
                         "fallback for experiments")
    try:
        _ip("netns", "add", SWITCH)
        _ip("link", "set", "lo", "up", ns=SWITCH)
        _ip("link", "add", "br0", "mtu", str(mtu), "type", "bridge", ns=SWITCH)
        _ip("link", "set", "br0", "up", ns=SWITCH)
        for i in range(n):
            h = f"h{i}"
            _ip("netns", "add", h)
            _ip("link", "set", "lo", "up", ns=h)  # gloo needs lo inside each namespace
            _ip("link", "add", "eth0", "netns", h, "mtu", str(mtu), "type", "veth",
                "peer", "name", f"p{i}", "netns", SWITCH, "mtu", str(mtu))
            _ip("link", "set", f"p{i}", "master", "br0", ns=SWITCH)
            _ip("link", "set", f"p{i}", "up", ns=SWITCH)
            _ip("addr", "add", f"{host_address(i)}/24", "dev", "eth0", ns=h)
            _ip("link", "set", "eth0", "up", ns=h)
            _tbf(SWITCH, f"p{i}", rate)  # switch -> host
            if delay:  # host -> switch: delay, then the rate limit under it
                _tc(h, "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "netem",
                    "delay", delay, "limit", "100000")
                _tbf(h, "eth0", rate, parent=("parent", "1:1", "handle", "10:"))
            else:
                _tbf(h, "eth0", rate)
    except BaseException:
        down()
        raise
    _exit_on_sigterm()
    log.info("netem up: h0..h%d at %s-%s, rate %s, delay %s", n - 1, host_address(0),
             host_address(n - 1), rate, delay or "none")


def down(n: Optional[int] = None, *, force: bool = False) -> None:
    """Delete the hosts and the switch (their veths and bridge go with them) and end
    this process's session.

    Args:
        n: accepted for symmetry with ``up``; every ``h<i>`` and ``hsw`` is
            removed regardless.
        force: remove them even when another process's session owns them (the
            command line's ``down``); otherwise a process that never brought them
            up (its ``up`` failed or waited) leaves them alone.
    """
    _require_root()
    del n
    if _lock_fd is None and not force:
        return
    try:
        for ns in _namespaces():
            _ip("netns", "del", ns, check=False)
    finally:
        _release_session()


def set_rate(n: int, rate: str) -> None:
    """Change every link of a running emulated network to ``rate`` (both directions),
    as ``up`` shapes them; the ranks' connections stay open (``tc qdisc replace``),
    so a running job sees its link change (``bench/adaptive.py``).

    Raises:
        NetemError: a namespace is missing (``up(n)`` first) or ``tc`` failed.
    """
    _require_root()
    rate_bits(rate)
    missing = [f"h{i}" for i in range(n) if f"h{i}" not in _namespaces()]
    if missing:
        raise NetemError(f"namespaces {missing} do not exist; bring them up first "
                         f"(netem.up({n}, ...))")
    for i in range(n):
        _tbf(SWITCH, f"p{i}", rate)  # switch -> host
        _tbf(f"h{i}", "eth0", rate)  # host -> switch (replaces up()'s delay, if any)
    log.info("netem: every link of h0..h%d now at %s", n - 1, rate)


def status() -> str:
    """Human-readable addresses and qdiscs of every namespace (empty if down)."""
    lines = []
    for ns in _namespaces():
        lines.append(f"== {ns}")
        lines.append(_ip("-br", "addr", ns=ns, check=False).stdout.rstrip())
        qd = _tc(ns, "qdisc", "show", check=False).stdout
        lines.extend(q for q in qd.splitlines() if "noqueue" not in q)
    return "\n".join(lines)


def run_in_namespaces(n: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
                      *, port: int = DEFAULT_PORT, timeout: Optional[float] = None) -> int:
    """Run ``argv`` as rank i inside namespace ``h{i}`` for i < n; wait for all.

    Each rank gets ``RANK``, ``LOCAL_RANK=0``, ``WORLD_SIZE``,
    ``MASTER_ADDR=10.77.0.1`` (h0), ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME=eth0``
    and ``OMP_NUM_THREADS=1`` on top of this process's environment and ``env``
    (``env`` wins). stdout/stderr are inherited.

    Args:
        n: number of ranks (namespaces h0..h{n-1} must exist: ``up(n)``).
        argv: the command, e.g. ``[sys.executable, "train.py", "--steps", "8"]``.
        env: extra environment variables.
        port: rendezvous port on h0.
        timeout: seconds before every rank is killed (``None``: wait forever).

    Returns:
        0 if every rank exited with 0, else the first non-zero exit code
        (in rank order); -9 for ranks killed at the timeout.

    Raises:
        NetemError: the namespaces are missing.
    """

    _require_root()
    missing = [f"h{i}" for i in range(n) if f"h{i}" not in _namespaces()]
    if missing:
        raise NetemError(f"namespaces {missing} do not exist; create them with "
                         f"python bench/netem.py up {n} 1gbit")
    procs = []
    for i in range(n):
        e: Dict[str, str] = dict(os.environ)
        e.update(RANK=str(i), LOCAL_RANK="0", WORLD_SIZE=str(n), LOCAL_WORLD_SIZE="1",
                 MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0",
                 OMP_NUM_THREADS="1")
        e.update(env or {})
        procs.append(subprocess.Popen(["ip", "netns", "exec", f"h{i}", *argv], env=e,
                                      **own_process_group()))
    deadline = None if timeout is None else time.monotonic() + timeout
    rcs: List[Optional[int]] = [None] * n
    try:
        while any(rc is None for rc in rcs):
            rcs = [p.poll() for p in procs]
            if deadline is not None and time.monotonic() > deadline:
                _kill(procs)
                rcs = [p.wait() for p in procs]
                log.warning("run_in_namespaces: killed after %ss", timeout)
                break
            time.sleep(0.05)
    except BaseException:  # Ctrl-C, or SIGTERM turned into SystemExit by up()
        _kill(procs)  # the ranks have their own process groups: they would outlive us
        raise
    return next((rc for rc in rcs if rc), 0)


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL every still-running rank's process group and reap it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
    for p in procs:
        p.wait()


def _exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit in the main thread, so ``finally: down()`` runs.

    Python's default SIGTERM action ends the process without unwinding, which
    left the namespaces behind when a benchmark was killed (``pkill``,
    ``timeout``); the next run then refused to start. Only the default
    handler is replaced, and only from the main thread (where handlers live).
    """
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


# -- self-check: gloo all_reduce bus bandwidth across the namespaces ----------------
