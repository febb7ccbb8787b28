"""The point-to-point collectives (casync/collectives.py) over gloo between processes:
exact sums, bitwise-equal results, top-k by all three collectives, a measured link
every rank agrees on, and a peer that never arrives named within the timeout."""
import time

import pytest
import torch

from hipress_like.casync import collectives as col
from hipress_like.casync.transport.base import TransportError
from hipress_like.launch.launch import run_workers
from hipress_like.tuning.link import measure_link


def _data(rank, numel):
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-50, 50, (numel,), generator=g).float()


def _work(ctx, numel):
    tr = ctx.transport
    x = lambda: _data(tr.rank, numel).clone()  # noqa: E731
    g = torch.randn(4000, generator=torch.Generator().manual_seed(100 + tr.rank))
    return {"ring": col.ring_allreduce(tr, x(), 30), "tree": col.tree_allreduce(tr, x(), 30),
            "bcast": col.tree_broadcast(tr, x(), 1, 30),
            "gather": col.bruck_allgather(tr, x(), 30),
            "topk": {c: col.topk_sync(tr, g, 0.01, c, owner=2, timeout=30)
                     for c in ("allgather", "art_ring", "art_tree")},
            "link": tuple(vars(measure_link(tr, sizes=(1 << 10, 1 << 18), repeats=3,
                                            timeout=30, steps=3)[0]).values())}


def test_p2p_collectives_over_gloo():
    n, numel = 3, 1001
    res = run_workers(_work, n, args=(numel,), timeout=240)
    want = sum(_data(r, numel) for r in range(n))
    for r in range(n):
        assert torch.equal(res[r]["ring"], want)
        assert torch.equal(res[r]["tree"], want)
        assert torch.equal(res[r]["bcast"], _data(1, numel))
        assert all(torch.equal(t, _data(j, numel)) for j, t in enumerate(res[r]["gather"]))
        for c, t in res[r]["topk"].items():
            assert torch.equal(t, res[0]["topk"][c])  # ranks agree bitwise
        assert res[r]["link"] == res[0]["link"]
    grads = [torch.randn(4000, generator=torch.Generator().manual_seed(100 + r))
             for r in range(n)]
    idx = grads[2].abs().topk(40).indices
    want_art = torch.zeros(4000)
    want_art[idx] = sum(g[idx] for g in grads) / n
    torch.testing.assert_close(res[0]["topk"]["art_ring"], want_art, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(res[0]["topk"]["art_tree"], want_art, rtol=1e-6, atol=1e-7)
    assert int((res[0]["topk"]["allgather"] != 0).sum()) >= 40
    latency, bandwidth = res[0]["link"]
    assert latency >= 0 and bandwidth > 1e3


def _absent(ctx):
    """Rank 1 never enters the ring allreduce; rank 0 must be told within its timeout."""
    if ctx.rank == 1:
        time.sleep(6.0)
        return None
    t0 = time.monotonic()
    try:
        col.ring_allreduce(ctx.transport, torch.ones(1000), timeout=2.0)
    except TransportError as e:
        return time.monotonic() - t0, str(e)
    return None


def test_a_missing_peer_is_an_error_within_the_timeout():
    res = run_workers(_absent, 2, timeout=120)
    assert res[0] is not None, "the allreduce returned without its peer"
    took, msg = res[0]
    assert took < 10.0
    assert "1" in msg


@pytest.mark.parametrize("n", [2, 4])
def test_tree_and_ring_agree_with_the_backend(n):
    res = run_workers(_agree, n, timeout=240)
    for r in range(n):
        assert torch.equal(res[r][0], res[r][1]) and torch.equal(res[r][1], res[r][2])


def _agree(ctx):
    tr = ctx.transport
    x = _data(tr.rank, 777)
    return tuple(col.allreduce_by(a, tr, x.clone(), 30) for a in ("ring", "tree", "backend"))
