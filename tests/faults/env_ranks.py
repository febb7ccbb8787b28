"""Ranks started the way torchrun starts them (env://), for the fault tests that need
a bare script per rank rather than the harness's training job."""
import json
import os
import socket
import subprocess
import sys


def free_port():
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env_ranks(script, n, timeout=180):
    """Start ``n`` ranks of ``script`` as torchrun would (env://); their exit codes and
    outputs (every rank is killed once ``timeout`` seconds have passed)."""
    port = free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs


def result(out):
    """The JSON a rank printed on its last ``RESULT `` line."""
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("RESULT "):])
