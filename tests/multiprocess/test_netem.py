"""The network-emulation harness: two namespaces, a 2-rank gloo exchange, teardown."""
import importlib.util
import os
import shutil
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
