"""The network-emulation harness: two namespaces, a 2-rank gloo exchange, teardown."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.netem, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WORKER = """
import torch, torch.distributed as dist
from hipress_like.casync.transport import TorchDistTransport
dist.init_process_group("gloo")
t = TorchDistTransport()
r, n = t.rank, t.size
send = [torch.full((1000 * (r + 1),), r, dtype=torch.uint8) for _ in range(n)]
out = t.alltoallv(send, [1000 * (p + 1) for p in range(n)], timeout=60)
peer = 1 - r
assert out[peer].numel() == 1000 * (peer + 1) and int(out[peer].max()) == peer, out
assert t.allreduce(torch.ones(4), timeout=60).tolist() == [2.0] * 4
t.close()
dist.barrier()
dist.destroy_process_group()
"""


def _load_netem():
    spec = importlib.util.spec_from_file_location("netem", os.path.join(ROOT, "bench", "netem.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def netem():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs iproute2 (ip, tc)")
    mod = _load_netem()
    if mod._namespaces():
        pytest.skip(f"namespaces {mod._namespaces()} are in use by another run")
    yield mod
    mod.down()


def test_two_namespaces_gloo_exchange(netem):
    netem.up(2, "1gbit")
    names = netem._namespaces()
    assert {"h0", "h1", "hsw"} <= set(names)
    assert "10.77.0.2/24" in netem.status() and "tbf" in netem.status()
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rc = netem.run_in_namespaces(2, [sys.executable, "-c", _WORKER], env=env, timeout=120)
    assert rc == 0
    netem.down()
    assert netem._namespaces() == []


def test_up_refuses_to_clobber_and_validates(netem):
    with pytest.raises(ValueError, match="1gbit"):
        netem.up(2, "fast")
    netem.up(1, "100mbit")
    with pytest.raises(netem.NetemError, match="already exist"):
        netem.up(1, "100mbit")


_INTRUDER = """
import sys
sys.path.insert(0, {bench!r})
import netem
try:
    netem.up(2, "100mbit")
except netem.NetemError as e:
    print("refused:", e)
finally:
    netem.down()  # what every benchmark's cleanup does
"""


def test_a_second_session_waits_and_leaves_the_first_alone(netem):
    """Two benchmarks at once: the second waits for the first's session (here it gives up
    after 1 s) and its cleanup does not tear the first one's hosts down."""
    netem.up(2, "1gbit")
    env = dict(os.environ, HIPRESS_NETEM_LOCK_WAIT="1")
    code = _INTRUDER.format(bench=os.path.join(ROOT, "bench"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "refused: another network-emulation session" in out.stdout, out.stderr
    assert {"h0", "h1", "hsw"} <= set(netem._namespaces())
    netem.down()
    assert netem._namespaces() == []


_DRIVER = """
import os, sys
sys.path.insert(0, {bench!r})
import netem
netem.up(2, "100mbit")
try:
    netem.run_in_namespaces(2, [sys.executable, "-c", {rank!r}], timeout=600)
finally:
    netem.down()
"""
_SLEEPING_RANK = ("import os, time; open(os.environ['MARK'] + os.environ['RANK'], 'w')"
                  ".write(str(os.getpid())); time.sleep(600)")


def test_a_killed_benchmark_takes_its_ranks_and_namespaces_down(netem, tmp_path):
    # `pkill`/`timeout` send SIGTERM; it used to end the driver without running
    # its `finally: down()`, leaving the namespaces (the next run refused to
    # start) and the ranks, which live in their own process groups
    import signal
    import subprocess
    import time

    mark = str(tmp_path / "rank")
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER.format(bench=os.path.join(ROOT, "bench"),
                                              rank=_SLEEPING_RANK)],
        env=dict(os.environ, MARK=mark))
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f"{mark}{i}") for i in range(2)):
        assert driver.poll() is None and time.monotonic() < deadline, "ranks never started"
        time.sleep(0.1)
    time.sleep(0.2)  # let both ranks finish writing their pid
    pids = [int(open(f"{mark}{i}").read()) for i in range(2)]
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) == 128 + signal.SIGTERM
    assert netem._namespaces() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_ab_speed_runs_its_rows_over_emulated_links(netem, tmp_path):
    """bench/ab_speed.py's children take their own emulation sessions: the script
    must not hold one itself (it did, and every child then waited on its lock)."""
    out = tmp_path / "ab.json"
    env = dict(os.environ, HIPRESS_NETEM_LOCK_WAIT="60")  # a held lock fails in a minute
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab_speed.py"),
                        "--base", "HEAD", "--net", "1gbit", "--rounds", "1", "--sync-only", "",
                        "--train-configs", "hp-ps-onebit", "--nprocs", "2", "--steps", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=900,
                       cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "train vgg hp-ps-onebit" in out.read_text()
    assert netem._namespaces() == []
