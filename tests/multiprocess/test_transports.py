"""TorchDistTransport over gloo with real ranks on loopback (2, 3 and 4 ranks).

Each test checks many things inside the workers, because starting ranks
(importing torch) dominates the runtime; for the same reason the tests whose
ranks all return normally share one launch per world size (``shared_launch``:
``_shared(n)`` runs each of ``GROUPS[n]``'s workers in turn). The tests that make
a rank leave, stall, raise or time out launch their own.
"""
import functools
import glob
import os

import pytest
import torch
from shared_launch import ranks, run_shared  # tests/multiprocess is on sys.path (rootdir)

from hipress_like.casync.transport import PeerError, TransportError
from hipress_like.launch.launch import WorkerError, run_workers


def _payload(src: int, dst: int) -> torch.Tensor:
    # uneven per-peer sizes with zero-length messages (src == dst + 1) and a large one
    if src == dst + 1:
        return torch.empty(0, dtype=torch.uint8)
    n = 100_003 if (src, dst) == (0, 1) else (src * 3 + dst * 5) % 7 + 1
    return torch.arange(n, dtype=torch.int64).add(src * 10 + dst).to(torch.uint8)


def _collectives(ctx, bulk):
    from hipress_like.casync.transport import TorchDistTransport

    t, r, n = ctx.transport, ctx.rank, ctx.size
    if bulk != t.bulk:
        t = TorchDistTransport(bulk=bulk)
    assert (t.rank, t.size) == (r, n)
    for _ in range(2):  # twice: repeated calls on the same group must keep matching
        send = [_payload(r, p) for p in range(n)]
        out = t.alltoallv(send, [_payload(p, r).numel() for p in range(n)], timeout=30)
        for p in range(n):
            want = _payload(p, r)
            if want.numel() == 0:
                assert out[p] is None, (p, out[p])
            else:
                assert out[p].dtype == torch.uint8 and torch.equal(out[p], want), p
    nothing = t.alltoallv([None] * n, [0] * n, timeout=30)
    assert nothing == [None] * n
    g = t.allgather(torch.tensor([r, 2 * r], dtype=torch.int64), timeout=30)
    assert [x.tolist() for x in g] == [[p, 2 * p] for p in range(n)]
    assert t.allgather_bytes(b"ab" * r, timeout=30) == [b"ab" * p for p in range(n)]
    b = torch.full((5,), float(r)) if r == n - 1 else torch.zeros(5)
    t.broadcast(b, root=n - 1, timeout=30)
    assert b.tolist() == [float(n - 1)] * 5
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)[:, :2] * (r + 1)  # non-contiguous
    t.allreduce(x, timeout=30)
    assert torch.equal(x, torch.tensor([[0.0, 1.0], [3.0, 4.0]]) * (n * (n + 1) / 2))
    assert t.allreduce(torch.tensor([r]), op="max", timeout=30).item() == n - 1
    assert t.allreduce(torch.tensor([r]), op="min", timeout=30).item() == 0
    t.barrier(timeout=30)
    return r


COLLECTIVES = [(2, "p2p"), (3, "p2p"), (4, "p2p"), (3, "a2a")]


@pytest.mark.parametrize("nprocs,bulk", COLLECTIVES)
def test_gloo_collectives(nprocs, bulk):
    assert ranks(_shared(nprocs)[("collectives", bulk)]) == list(range(nprocs))


def _user_collectives_do_not_interleave(ctx):
    # The transport has its own group: a default-group all_reduce between
    # transport calls must not be matched with the transport's traffic.
    import torch.distributed as dist

    t = ctx.transport
    a = torch.ones(3)
    dist.all_reduce(a)
    b = t.allreduce(torch.full((2,), 2.0), timeout=30)
    return a.tolist(), b.tolist()


def test_own_process_group():
    res = ranks(_shared(2)["own group"])
    assert res == [([2.0] * 3, [4.0] * 2)] * 2


def _one_rank_leaves(ctx, leaver, how):
    t = ctx.transport
    t.barrier(timeout=30)
    if ctx.rank == leaver:
        if how == "crash":
            os._exit(7)
        return "left"
    try:
        t.alltoallv([torch.ones(4, dtype=torch.uint8)] * ctx.size, [4] * ctx.size, timeout=2)
    except PeerError as e:
        msg = str(e)
        try:
            t.barrier(timeout=5)
        except TransportError as again:
            assert "unusable" in str(again)
        else:
            raise AssertionError("transport still usable after a PeerError")
        return list(e.ranks), msg
    raise AssertionError("alltoallv completed without the leaving rank")


@pytest.mark.parametrize("how", ["return", "crash"])
def test_rank_leaving_early_is_named(how):
    leaver = 1
    try:
        res = run_workers(_one_rank_leaves, 3, args=(leaver, how), timeout=120)
    except WorkerError as e:
        assert how == "crash" and set(e.failures) == {leaver}, e
        res = [e.results.get(r) for r in range(3)]
    for r in (0, 2):
        ranks, msg = res[r]
        assert ranks == [leaver], msg
        assert f"[{leaver}]" in msg or f"rank {leaver}" in msg, msg


def _death_relayed(ctx):
    import signal
    import time

    t, r = ctx.transport, ctx.rank
    t.barrier(timeout=30)
    if r == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # posts nothing: no abort, no closed key
    if r == 1:  # waits on rank 2 only, finds it dead, then stays (no closed connection)
        try:
            t.alltoallv([None] * 3, [0, 0, 4], timeout=30)
        except PeerError as e:
            time.sleep(8)
            return list(e.ranks), str(e)
        raise AssertionError("exchange with a dead rank completed")
    try:  # rank 0 waits on rank 1 only, which never sends: only the relay can end it
        t.alltoallv([None] * 3, [0, 4, 0], timeout=60)
    except PeerError as e:
        return list(e.ranks), str(e)
    raise AssertionError("exchange completed without rank 1's message")


def test_dead_rank_found_by_one_survivor_is_named_by_all():
    # Rank 0 never talks to the killed rank 2, and rank 1 (which rank 0 waits for)
    # stays alive: rank 0 learns of the death from rank 1's diagnosis (the relay),
    # not from a closed connection or its own 60 s timeout.
    with pytest.raises(WorkerError) as info:
        run_workers(_death_relayed, 3, timeout=120)
    assert set(info.value.failures) == {2}, info.value
    res = info.value.results
    ranks1, msg1 = res[1]
    assert ranks1 == [2] and "stopped heartbeating" in msg1, msg1
    ranks0, msg0 = res[0]
    assert ranks0 == [2] and "found by a peer" in msg0 and "rank 1's diagnosis" in msg0, msg0


def _released_at_exit(ctx, flag):
    import time

    from hipress_like.casync.transport import torch_dist, waiter

    t = ctx.transport
    t.barrier(timeout=30)
    if ctx.rank == 0:  # as after a failure: the exit hooks release the group
        torch_dist._failed_here.set()
        time.sleep(1.0)  # rank 1 is inside its exchange by now
        waiter.join_waiters_at_exit()
        released = (t.group is None, t._broken)
        time.sleep(10)  # alive: only the released group can end rank 1's wait
        open(flag, "w").close()
        return released
    try:
        t.alltoallv([None, None], [4, 0], timeout=60)
    except TransportError as e:
        return str(e), os.path.exists(flag)
    raise AssertionError("exchange completed without rank 0's message")


def test_exit_hooks_release_the_group_so_a_peers_abandoned_wait_ends(tmp_path):
    flag = str(tmp_path / "rank0-done")
    res = run_workers(_released_at_exit, 2, args=(flag,), timeout=120)
    assert res[0] == (True, "its group was released at exit"), res[0]
    msg, rank0_done = res[1]
    assert "Connection closed" in msg or "Connection reset" in msg, msg
    assert not rank0_done, "rank 1's wait ended only when rank 0 was done"


def _stalls(ctx):
    import time

    if ctx.rank == 0:
        time.sleep(3.5)  # alive and heartbeating, but never joins the barrier
        return None
    try:
        ctx.transport.barrier(timeout=1.0)
    except PeerError as e:
        return list(e.ranks), str(e)


def test_stalled_rank_is_named():
    res = run_workers(_stalls, 2, timeout=120)
    ranks, msg = res[1]
    assert ranks == [0] and "rank(s) [0]" in msg and "never entered" in msg, msg


def _raises(ctx):
    if ctx.rank == 1:
        raise ValueError("worker 1 broke")
    ctx.transport.barrier(timeout=30)


def _session_and_group(ctx):
    ctx.transport.barrier(timeout=30)
    return os.getsid(0), os.getpgid(0)


def test_workers_share_the_callers_session_but_not_its_process_group():
    """Linux autogroup schedules each session as one group: workers in a session of
    their own would wait behind their own group's CPU turn for every coordination
    round (measured 30-40 ms per allgather on 2 cores). Each worker gets its own
    process group instead, so the supervisor can still kill its whole tree."""
    res = ranks(_shared(2)["session"])
    for sid, pgid in res:
        assert sid == os.getsid(0)
        assert pgid != os.getpgid(0)
    assert res[0][1] != res[1][1]


def test_worker_error_carries_traceback():
    with pytest.raises(WorkerError) as info:
        run_workers(_raises, 2, timeout=120, grace=3)
    assert "ValueError: worker 1 broke" in info.value.failures[1]
    assert "first to fail was rank 1" in str(info.value)


def _sleep_forever(ctx):
    import time

    time.sleep(600)


def test_global_timeout_kills_everything():
    with pytest.raises(TimeoutError, match="timeout"):
        run_workers(_sleep_forever, 2, timeout=5)


def _engines_free_their_groups(ctx):
    # Each engine opens a process group of its own (transport.split()); closing it
    # must destroy that group, or a process building many engines (the profiler,
    # benchmarks) piles up gloo groups, connections and memory, and slows down.
    import time

    import torch.distributed as dist

    from hipress_like.casync.engine import Engine

    def groups():
        return len(dist.distributed_c10d._world.pg_map)

    def loops():  # gloo's event-loop threads: one per live group's device
        return sum(1 for t in glob.glob("/proc/self/task/*/comm")
                   if _read(t) == "gloo_tcp_loop")

    before, loops_before = groups(), loops()
    # Closed engines stay referenced (as a cycle would hold them until a full garbage
    # collection, which a training loop may never run): closing alone must release
    # the group's thread. plan="auto"'s trial engines once left eight such threads,
    # each waking about 100 times a second for the rest of the run.
    closed = []
    for i in range(4):
        eng = Engine(ctx.transport, compressor="identity", timeout=30)
        eng.register([("w", (64,), torch.float32)])
        eng.submit("w", torch.full((64,), float(ctx.rank)))
        eng.synchronize()
        if ctx.rank == 1 and i == 2:
            time.sleep(1.0)  # a late rank: the others wait for it, then free
        eng.close()
        closed.append(eng)
    after, loops_after = groups(), loops()
    # a split whose peer never frees it is kept (not destroyed under its feet)
    split = ctx.transport.split()
    kept = split.free(timeout=0.5) if ctx.rank == 0 else None
    ctx.transport.barrier(timeout=30)
    if ctx.rank != 0:
        split.close()
    return before, after, kept, loops_before, loops_after


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:  # the thread ended meanwhile
        return ""


def test_engine_close_destroys_its_process_group_and_its_threads():
    res = ranks(_shared(2)["engines free"])
    for before, after, _, loops_before, loops_after in res:
        assert after == before, res
        assert loops_before > 0 and loops_after == loops_before, res
    assert res[0][2] is False


# -- the shared launches: the workers above whose ranks all return, per world size ------

GROUPS = {n: {("collectives", bulk): (_collectives, (bulk,)) for m, bulk in COLLECTIVES
              if m == n} for n in (2, 3, 4)}
GROUPS[2].update({"own group": (_user_collectives_do_not_interleave, ()),
                  "session": (_session_and_group, ()),
                  "engines free": (_engines_free_their_groups, ())})


@functools.lru_cache(maxsize=None)
def _shared(n):
    """{key of GROUPS[n]: each rank's ("returned"|"raised", ...)}: one launch of n ranks."""
    return dict(zip(GROUPS[n], run_shared(n, list(GROUPS[n].values()), timeout=300)))
