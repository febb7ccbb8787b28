"""Command line of the emulated network (``hipress_like.launch.netem``), for benchmarks.

The library lives in the package (the main job uses it too); this module
re-exports it for the benchmark scripts and tests that ``import netem``
with ``bench/`` on ``sys.path``, and adds the command line and a self-check.

CLI::

    python bench/netem.py up 4 1gbit [DELAY]
    python bench/netem.py status
    python bench/netem.py selfcheck [--nprocs 4] [--rate 1gbit] [--mb 64]
    python bench/netem.py down [N]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hipress_like.launch.netem import (  # noqa: E402,F401 (re-exported for benchmarks/tests)
    DEFAULT_PORT,
    LOCK_PATH,
    MASTER_ADDR,
    SUBNET,
    NetemError,
    _namespaces,
    down,
    host_address,
    run_in_namespaces,
    status,
    up,
)

__all__ = ["SUBNET", "MASTER_ADDR", "up", "down", "status", "run_in_namespaces",
           "host_address", "NetemError", "main"]


def _allreduce_worker(mb: int, iters: int) -> None:
    """Run inside each namespace: time gloo all_reduce of ``mb`` MB (rank 0 prints)."""
    import statistics

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    x = torch.ones(mb * (1 << 20) // 4)
    dist.all_reduce(x)  # warm-up: connections, allocator
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    if rank == 0:
        busbw = 2 * (n - 1) / n * x.numel() * 4 * 8 / med / 1e9  # nccl-tests' bus bandwidth
        print(f"gloo all_reduce {mb} MB x {n} ranks: median {med * 1e3:.0f} ms, "
              f"bus bandwidth {busbw:.3f} Gbit/s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _selfcheck(n: int, rate: str, mb: int, iters: int, timeout: float) -> int:
    created = not _namespaces()
    if created:
        up(n, rate)
    elif any(f"h{i}" not in _namespaces() for i in range(n)):
        raise NetemError("namespaces exist but fewer than --nprocs; run down first")
    print(f"self-check: {n} namespaces at {rate}" + ("" if created else " (already up)"),
          flush=True)
    try:
        return run_in_namespaces(
            n, [sys.executable, os.path.abspath(__file__), "_worker", str(mb), str(iters)],
            timeout=timeout)
    finally:
        if created:
            down()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point; see the module docstring."""
    ap = argparse.ArgumentParser(description="Network namespaces shaped with tc tbf.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="create h0..h{N-1}")
    p.add_argument("n", type=int)
    p.add_argument("rate", nargs="?", default="1gbit")
    p.add_argument("delay", nargs="?", default=None)
    p = sub.add_parser("down", help="delete every h<i> and hsw")
    p.add_argument("n", type=int, nargs="?")
    sub.add_parser("status", help="show addresses and qdiscs")
    p = sub.add_parser("selfcheck", help="measure gloo all_reduce bus bandwidth")
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600.0)
    p = sub.add_parser("_worker", help=argparse.SUPPRESS)
    p.add_argument("mb", type=int)
    p.add_argument("iters", type=int)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "up":
            up(a.n, a.rate, a.delay)
            print(f"up: h0..h{a.n - 1} {host_address(0)}-{host_address(a.n - 1)} rate={a.rate}"
                  f" delay={a.delay or 0}")
        elif a.cmd == "down":
            down(a.n, force=True)
            print("down")
        elif a.cmd == "status":
            print(status() or "(no namespaces)")
        elif a.cmd == "selfcheck":
            return _selfcheck(a.nprocs, a.rate, a.mb, a.iters, a.timeout)
        else:
            _allreduce_worker(a.mb, a.iters)
    except (NetemError, PermissionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
