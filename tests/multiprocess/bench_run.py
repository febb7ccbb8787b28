"""Run a script of bench/ as a user would: a fresh interpreter, in a scratch directory."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(script, args, cwd, timeout):
    """``python bench/<script> <args>`` in ``cwd``; asserts it exits 0, returns the result."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p
