"""CLI of the local launcher: run ``module:function(ctx, *args)`` on N ranks and print results.

    python -m hipress_like.launch.cli_launch --nprocs 4 [--backend gloo|mpi] module:function [args]
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from .launch import BACKENDS, WorkerError, run_workers

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: ``python -m hipress_like.launch.cli_launch --nprocs N module:function [args]``."""
    ap = argparse.ArgumentParser(prog="python -m hipress_like.launch.cli_launch",
                                 description="Run module:function(ctx, *args) on N local ranks.")
    ap.add_argument("--nprocs", "-n", type=int, required=True)
    ap.add_argument("--backend", default="gloo", choices=BACKENDS)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("target", help="module:function, called as function(ctx, *args)")
    ap.add_argument("args", nargs="*", help="string arguments passed to the function")
    ns = ap.parse_args(argv)
    module, _, name = ns.target.partition(":")
    if not module or not name:
        ap.error(f"target must look like package.module:function, got {ns.target!r}")
    sys.path.insert(0, os.getcwd())
    fn = getattr(importlib.import_module(module), name)
    try:
        results = run_workers(fn, ns.nprocs, ns.backend, args=ns.args, timeout=ns.timeout)
    except (WorkerError, TimeoutError) as e:
        print(e, file=sys.stderr)
        return 1
    for r, res in enumerate(results):
        print(f"rank {r}: {res!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
