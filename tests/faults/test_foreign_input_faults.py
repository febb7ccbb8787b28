"""Foreign bytes sent to a job's ports from another process never crash a rank.

Issue 46, item 6: a malformed, truncated or foreign message sent to the
rendezvous store's port and to the ranks' transport (gloo) ports from
another process on loopback is rejected, and never crashes a rank or
executes anything. Two real ranks train (``fault_job.py``, no fault) while
this test, a third process, finds every port they listen on (``/proc``:
their listening TCP sockets) and keeps sending each: random bytes of
several lengths, a connection closed at once, and a truncated header (the
first bytes of a bulk frame, ``casync/wire.py``). Both ranks must finish
every step and exit 0; nothing the library receives is unpickled (the
store keeps bytes, the engine reads fixed binary layouts and msgpack).
Loopback only: nothing leaves the host.
"""
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import JOB, ROOT, free_port

from hipress_like.casync.wire import MAGIC, WIRE_VERSION

pytestmark = pytest.mark.faults


def _listening_ports(pid):
    """TCP ports ``pid`` listens on (IPv4 and IPv6), from /proc."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def _junk(rng):
    """One foreign message: random bytes, nothing, or a truncated bulk frame header."""
    kind = rng.choice(["random", "random", "empty", "frame"])
    if kind == "random":
        return rng.randbytes(rng.choice([1, 7, 64, 1500, 70000]))
    if kind == "frame":
        return MAGIC + bytes([WIRE_VERSION]) + rng.randbytes(rng.randrange(0, 30))
    return b""


def _send(port, data):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.settimeout(0.2)
            if data:
                s.sendall(data)
            try:
                s.recv(4096)  # whatever the rank answers (or its closing the connection)
            except OSError:
                pass
        return True
    except OSError:
        return False


def test_foreign_bytes_to_the_store_and_transport_ports_change_nothing(tmp_path):
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", JOB_TIMEOUT="8", JOB_STEPS="400", JOB_SAVE_EVERY="1000",
                   JOB_CKPT_DIR=str(tmp_path),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        for k in ("HIPRESS_FAULT", "FAULT_ACTION", "FAULT_PHASE", "FAULT_STEP", "FAULT_MISMATCH",
                  "HIPRESS_FAULT_MARK"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, str(JOB)], env=env,
                                      stdout=open(tmp_path / f"rank{r}.log", "w"),
                                      stderr=subprocess.STDOUT))
    rng = random.Random(46)
    hit = {}  # port -> messages delivered
    deadline = time.time() + 240
    try:
        while any(p.poll() is None for p in procs) and time.time() < deadline:
            ports = {port} | set().union(*(_listening_ports(p.pid) for p in procs))
            for q in sorted(ports):
                if _send(q, _junk(rng)):
                    hit[q] = hit.get(q, 0) + 1
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(2)]
    results = []
    for log in logs:
        lines = [ln for ln in log.splitlines() if ln.startswith("RESULT ")]
        assert lines, log[-3000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    assert hit.get(port, 0) >= 5, f"the store port was hardly reached: {hit}"
    assert len(hit) >= 2, f"no transport port of the ranks was found to send to: {hit}"
    assert all(res["ok"] for res in results), results
    assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
