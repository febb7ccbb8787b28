"""``Transport.abort`` over torch.distributed: a rank's abort ends its peers' waits.

Two ranks started as torchrun starts them (``env_ranks``), gloo on loopback,
a ``TorchDistTransport`` and the data channel it ``split()``s, a 120 s
timeout on every call. Rank 1 aborts with a reason and never enters the
exchange rank 0 waits in. Rank 0 must raise ``PeerError`` naming rank 1 and
carrying its reason, on the split channel too: that text can only come from
the abort (a timeout would say "timed out", after 120 s), so no timing is
asserted. Rank 1's own wait in a collective its peer never joins ends as
well, with an error that blames no peer. The same holds when rank 0's waits
are polled, as NCCL's are (``_poll``; run here on gloo's works, since NCCL
needs a GPU per rank).
"""
import pytest
from env_ranks import result, run_env_ranks

pytestmark = pytest.mark.faults

_SCRIPT = r'''
import json, time, torch, torch.distributed as dist
from hipress_like.casync.transport.base import PeerError, TransportError
from hipress_like.casync.transport.torch_dist import TorchDistTransport
dist.init_process_group("gloo")
tr = TorchDistTransport()
data = tr.split()
rank = tr.rank
out = {}
if rank == 1:
    time.sleep(0.5)  # rank 0 is inside its exchange by now
    out["told"] = tr.abort("ValueError: boom in rank 1's exchange")
    try:  # rank 0 never joins this one
        tr.allgather(torch.ones(2), timeout=120)
        out["own"] = "returned"
    except TransportError as e:
        out["own"] = [type(e).__name__, list(getattr(e, "ranks", ())), str(e)]
else:
    for name, t in (("data", data), ("main", tr)):
        try:
            t.alltoallv([None, torch.ones(8, dtype=torch.uint8)], [0, 8], timeout=120)
            out[name] = "returned"
        except TransportError as e:
            out[name] = [type(e).__name__, list(getattr(e, "ranks", ())), str(e)]
print("RESULT " + json.dumps(out), flush=True)
time.sleep(1.0)  # let the peer read what it needs from the store (rank 0 hosts it)
'''


def test_an_abort_ends_every_peer_wait_naming_the_rank_and_its_reason():
    rcs, outs = run_env_ranks(_SCRIPT, 2, timeout=100)
    r0, r1 = result(outs[0]), result(outs[1])
    assert r1["told"] is True, outs[1][-2000:]
    for name in ("data", "main"):
        kind, ranks, text = r0[name]
        assert kind == "PeerError" and ranks == [1], r0
        assert "boom in rank 1's exchange" in text and "timed out" not in text, text
    kind, ranks, text = r1["own"]
    assert ranks == [] and "this rank failed and told its peers" in text, r1


_EXIT_TOGETHER = _SCRIPT.replace(
    'time.sleep(1.0)  # let the peer read what it needs from the store (rank 0 hosts it)',
    'time.sleep(1.0)\ndist.barrier()  # then both exit at once, each with a wait it gave up on')


def test_ranks_exit_cleanly_with_waits_they_gave_up_on():
    """After an abort, each rank's waiter thread is still inside a gloo wait that only
    ends when the peer exits. Both ranks then leave together: each must exit 0, not be
    killed by ``std::terminate`` (status 134) when that wait returns while its
    interpreter finalises (``transport.waiter.join_waiters_at_exit``)."""
    for _ in range(2):
        rcs, outs = run_env_ranks(_EXIT_TOGETHER, 2, timeout=100)
        assert all("RESULT" in o for o in outs), outs
        assert rcs == [0, 0], [o[-1500:] for o in outs]
        assert not any("terminate called" in o for o in outs), outs


_POLLED = _SCRIPT.replace("rank = tr.rank\n", "rank = tr.rank\ntr._polls = data._polls = True\n")


def test_an_abort_ends_polled_waits_too():
    assert _POLLED != _SCRIPT
    rcs, outs = run_env_ranks(_POLLED, 2, timeout=100)
    r0 = result(outs[0])
    for name in ("data", "main"):
        kind, ranks, text = r0[name]
        assert kind == "PeerError" and ranks == [1], r0
        assert "boom in rank 1's exchange" in text and "timed out" not in text, text
