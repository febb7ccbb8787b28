"""A launcher killed from outside takes its ranks with it.

Workers run in process groups of their own (``launch.procs.own_process_group``),
so nothing tied them to the launcher's life: a launcher killed with SIGKILL (a
CI job's timeout, ``kill -9``) left its ranks running until their own timeouts.
``die_with_launcher`` arms Linux's parent-death signal in each worker. Here a
launcher process starts two ranks that sleep for minutes, is killed once both
have written their pids, and both ranks must be gone soon after (polled for up
to 30 s: a bound on a wait, not a timing claim).
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal is Linux's")

_LAUNCHER = r'''
import sys
from hipress_like.launch.launch import run_workers
from tests.multiprocess.test_launcher_death import sleeper
run_workers(sleeper, 2, args=(sys.argv[1],), timeout=600)
'''


def sleeper(ctx, folder):
    """A rank that writes its pid, then sleeps far longer than the test waits."""
    Path(folder, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    time.sleep(300)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has died; only its parent has not reaped it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ranks_die_with_a_launcher_killed_from_outside(tmp_path):
    root = Path(__file__).resolve().parents[2]
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path)], cwd=root,
                                env=dict(os.environ, PYTHONPATH=str(root)))
    pids = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
            pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid") if p.read_text()]
        assert len(pids) == 2, f"the ranks did not start (launcher exit {launcher.poll()})"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if _alive(p)]
        assert not left, f"ranks {left} outlived their launcher"
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()
