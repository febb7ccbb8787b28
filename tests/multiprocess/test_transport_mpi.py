"""MPITransport with real ranks under mpirun (Open MPI + mpi4py)."""
import shutil

import pytest
import torch

from hipress_like.casync.transport import PeerError, TransportError
from hipress_like.launch.launch import run_workers

pytestmark = pytest.mark.mpi

try:
    import mpi4py  # noqa: F401  (imported only to probe; MPI is initialised in the workers)

    _MPI4PY = True
except ImportError:
    _MPI4PY = False

if not _MPI4PY or shutil.which("mpirun") is None:
    pytest.skip("needs mpi4py and mpirun (apt-get install openmpi-bin libopenmpi-dev; "
                "pip install mpi4py)", allow_module_level=True)


def _payload(src: int, dst: int) -> torch.Tensor:
    if src == dst + 1:
        return torch.empty(0, dtype=torch.uint8)
    n = 70_001 if (src, dst) == (0, 1) else (src * 3 + dst * 5) % 7 + 1
    return torch.arange(n, dtype=torch.int64).add(src * 10 + dst).to(torch.uint8)


def _collectives(ctx):
    t, r, n = ctx.transport, ctx.rank, ctx.size
    assert ctx.backend == "mpi" and (t.rank, t.size) == (r, n)
    for _ in range(2):
        send = [_payload(r, p) for p in range(n)]
        out = t.alltoallv(send, [_payload(p, r).numel() for p in range(n)], timeout=30)
        for p in range(n):
            want = _payload(p, r)
            if want.numel() == 0:
                assert out[p] is None, (p, out[p])
            else:
                assert torch.equal(out[p], want), p
    assert t.alltoallv([None] * n, [0] * n, timeout=30) == [None] * n
    g = t.allgather(torch.tensor([[r, 2 * r]], dtype=torch.int64), timeout=30)
    assert [x.tolist() for x in g] == [[[p, 2 * p]] for p in range(n)]
    assert t.allgather_bytes(b"ab" * r, timeout=30) == [b"ab" * p for p in range(n)]
    b = torch.full((5,), float(r), dtype=torch.float64)
    t.broadcast(b, root=n - 1, timeout=30)
    assert b.tolist() == [float(n - 1)] * 5
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)[:, :2] * (r + 1)  # non-contiguous
    t.allreduce(x, timeout=30)
    assert torch.equal(x, torch.tensor([[0.0, 1.0], [3.0, 4.0]]) * (n * (n + 1) / 2))
    h = t.allreduce(torch.full((3,), 0.5, dtype=torch.float16), timeout=30)
    assert h.dtype == torch.float16 and h.tolist() == [0.5 * n] * 3
    assert t.allreduce(torch.tensor([r]), op="max", timeout=30).item() == n - 1
    assert t.allreduce(torch.tensor([r], dtype=torch.int32), op="min", timeout=30).item() == 0
    gen = torch.Generator().manual_seed(r)
    noisy = t.allreduce(torch.randn(10_000, generator=gen), timeout=30)
    t.barrier(timeout=30)
    return r, noisy


@pytest.mark.parametrize("nprocs", [2, 4])
def test_mpi_collectives(nprocs):
    res = run_workers(_collectives, nprocs, backend="mpi", timeout=120)
    assert [r for r, _ in res] == list(range(nprocs))
    for _, noisy in res[1:]:  # float sums are bitwise identical on every rank
        assert torch.equal(noisy, res[0][1])


def _stalls(ctx, stalled):
    if ctx.rank == stalled:
        return "skipped the collective"  # finalizes at exit, never joins the alltoallv
    t = ctx.transport
    try:
        t.alltoallv([torch.ones(4, dtype=torch.uint8)] * ctx.size, [4] * ctx.size, timeout=1.0)
    except PeerError as e:
        try:
            t.barrier(timeout=1.0)
        except TransportError as again:
            assert "unusable" in str(again)
        return list(e.ranks), str(e)
    raise AssertionError("collective completed without the stalled rank")


def test_mpi_missing_rank_is_named():
    res = run_workers(_stalls, 3, backend="mpi", args=(2,), timeout=120)
    assert res[2] == "skipped the collective"
    for ranks, msg in res[:2]:
        assert ranks == [2] and "rank(s) [2]" in msg, msg


def _aborts(ctx):
    """Rank 1 fails and aborts; rank 0 waits in a collective on the split channel
    with a long timeout, and must hear of it at once (not at its timeout)."""
    t = ctx.transport
    ch = t.split()
    if ctx.rank == 1:
        t.abort("ValueError: boom in encode")
        return "aborted"
    try:
        ch.alltoallv([torch.ones(4, dtype=torch.uint8)] * ctx.size, [4] * ctx.size, timeout=300)
    except PeerError as e:
        try:
            ch.barrier(timeout=1.0)
        except TransportError as again:
            assert "unusable" in str(again)
        return list(e.ranks), str(e)
    raise AssertionError("collective completed without the aborted rank")


def test_mpi_abort_reaches_a_peer_waiting_on_a_split_channel():
    res = run_workers(_aborts, 2, backend="mpi", timeout=120)
    assert res[1] == "aborted"
    ranks, msg = res[0]
    assert ranks == [1] and "rank 1 failed" in msg and "boom in encode" in msg, msg
    assert "timed out" not in msg
