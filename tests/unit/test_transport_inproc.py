"""The in-process transport: collectives, determinism, and failures naming the peer."""
import threading
import time

import pytest
import torch

from hipress_like.casync.transport import (
    InProcGroup,
    PeerError,
    TransportError,
    make_transport,
    run_threads,
)


def _payload(src: int, dst: int) -> torch.Tensor:
    # uneven sizes, including zero-length messages (src == dst + 1)
    n = (src * 3 + dst * 5) % 7 if (src != dst + 1) else 0
    return torch.arange(n, dtype=torch.int64).add(src * 10 + dst).to(torch.uint8)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_collectives(size):
    def body(t):
        r = t.rank
        send = [_payload(r, p) for p in range(size)]
        out = t.alltoallv(send, [_payload(p, r).numel() for p in range(size)], timeout=5)
        for p in range(size):
            want = _payload(p, r)
            if p == r:
                assert out[p] is send[p] or (out[p] is None and want.numel() == 0)
            elif want.numel() == 0:
                assert out[p] is None
            else:
                assert torch.equal(out[p], want)
        g = t.allgather(torch.tensor([r, r * r]), timeout=5)
        assert [x.tolist() for x in g] == [[p, p * p] for p in range(size)]
        assert t.allgather_bytes(b"x" * r, timeout=5) == [b"x" * p for p in range(size)]
        b = torch.full((3,), float(r))
        t.broadcast(b, root=size - 1, timeout=5)
        assert b.tolist() == [float(size - 1)] * 3
        s = t.allreduce(torch.tensor([float(r + 1)]), timeout=5)
        m = t.allreduce(torch.tensor([r]), op="max", timeout=5)
        n = t.allreduce(torch.tensor([r]), op="min", timeout=5)
        t.barrier(timeout=5)
        return s.item(), m.item(), n.item()

    res = run_threads(body, size, timeout=30)
    assert res == [(size * (size + 1) / 2, size - 1, 0)] * size


def test_allreduce_is_bitwise_identical_on_every_rank():
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(1000, generator=gen) for _ in range(4)]
    res = run_threads(lambda t: t.allreduce(data[t.rank].clone(), timeout=5), 4)
    for r in res[1:]:
        assert torch.equal(r, res[0])


def test_sender_may_overwrite_after_return():
    # rank 0 returns first and scribbles on its input; rank 1 must still see the original
    def body(t):
        x = torch.full((4,), float(t.rank + 1))
        out = t.allgather(x, timeout=5)
        x.fill_(-1)
        if t.rank == 1:
            time.sleep(0.05)
        return [o.tolist() for o in out]

    res = run_threads(body, 2)
    assert res[0] == res[1] == [[1.0] * 4, [2.0] * 4]


def test_raising_rank_is_named_and_reraised():
    seen = {}

    def body(t):
        if t.rank == 2:
            raise ValueError("bad gradient")
        try:
            t.barrier(timeout=10)
        except PeerError as e:
            seen[t.rank] = e
            raise

    start = time.monotonic()
    with pytest.raises(ValueError, match="bad gradient") as info:
        run_threads(body, 3, timeout=20)
    assert info.value.rank == 2
    assert time.monotonic() - start < 5  # woken by the failure, not by the 10 s timeout
    assert set(seen) == {0, 1}
    for e in seen.values():
        assert e.ranks == (2,) and "rank 2" in str(e)


def test_rank_that_returns_early_is_named():
    def body(t):
        if t.rank == 0:
            return "left"
        try:
            t.allreduce(torch.ones(1), timeout=10)
        except PeerError as e:
            return e.ranks, str(e)

    res = run_threads(body, 3)
    assert res[0] == "left"
    for ranks, msg in res[1:]:
        assert ranks == (0,) and "rank 0" in msg


def test_stalled_rank_is_named_after_timeout():
    release = threading.Event()

    def body(t):
        if t.rank == 1:
            release.wait(5)  # alive but not participating
            return None
        try:
            t.alltoallv([None] * 3, [0] * 3, timeout=0.3)
        except PeerError as e:
            return e.ranks
        finally:
            if t.rank == 0:
                release.set()

    res = run_threads(body, 3)
    assert res[0] == res[2] == (1,)


def test_transport_unusable_after_failure():
    group = InProcGroup(2)
    t0 = group[0]
    with pytest.raises(PeerError):
        t0.barrier(timeout=0.05)
    with pytest.raises(TransportError, match="unusable"):
        t0.barrier(timeout=0.05)


def test_collective_mismatch_and_size_mismatch():
    def body(t):
        if t.rank == 0:
            return t.allgather(torch.zeros(1), timeout=2)
        return t.barrier(timeout=2)

    with pytest.raises(TransportError, match="mismatch"):
        run_threads(body, 2)

    def wrong_sizes(t):
        send = [torch.zeros(3, dtype=torch.uint8)] * 2
        return t.alltoallv(send, [3, 2] if t.rank == 0 else [3, 3], timeout=2)

    with pytest.raises(TransportError, match="expected 2 bytes from rank 1"):
        run_threads(wrong_sizes, 2)


def test_bad_arguments():
    t = InProcGroup(2)[0]
    with pytest.raises(ValueError, match="available: sum, max, min"):
        t.allreduce(torch.ones(1), op="prod")
    with pytest.raises(TypeError, match="uint8"):
        t.alltoallv([torch.ones(2), None], [0, 0])
    with pytest.raises(ValueError, match="root"):
        t.broadcast(torch.ones(1), root=5)


def test_make_transport_unknown_name_lists_known():
    with pytest.raises(ValueError, match="available: gloo, horovod, mpi, nccl, torch"):
        make_transport("tcp")
    with pytest.raises(ValueError, match="InProcGroup"):
        make_transport("inproc")


def test_package_import_is_lazy():
    import subprocess
    import sys

    code = ("import sys, hipress_like.casync.transport as t; "
            "assert 'mpi4py' not in sys.modules and 'horovod' not in sys.modules; "
            "t.InProcGroup; assert 'mpi4py' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_horovod_absent_gives_clear_import_error():
    import importlib.util

    if importlib.util.find_spec("horovod") is not None:
        pytest.skip("horovod is installed here")
    from hipress_like.casync.transport import HorovodTransport

    with pytest.raises(ImportError, match="HOROVOD_WITH_PYTORCH=1"):
        HorovodTransport()
    with pytest.raises(ImportError, match="make_transport\\('gloo'\\)"):
        make_transport("horovod")


def test_torch_backend_needs_initialised_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    with pytest.raises(TransportError, match="init_process_group"):
        make_transport("gloo")


def test_closing_a_split_channel_leaves_the_parent_and_new_channels_usable():
    # an engine closes the channel it split off; the same transport then serves the
    # next engine (the profiler builds one engine per timed point)
    def body(t):
        for _ in range(3):
            ch = t.split()
            assert ch.allreduce(torch.ones(2), timeout=10).tolist() == [2.0, 2.0]
            ch.close()
        return t.allreduce(torch.ones(1), timeout=10).item()

    assert run_threads(body, 2, timeout=30) == [2.0, 2.0]


def test_a_rank_that_leaves_is_gone_from_its_split_channels_too():
    def body(t):
        ch = t.split()
        if t.rank == 1:
            return "left"  # run_threads marks rank 1 exited on the parent group
        with pytest.raises(PeerError, match="rank 1"):
            ch.allreduce(torch.ones(1), timeout=10)
        return "raised"

    assert run_threads(body, 2, timeout=30) == ["raised", "left"]
