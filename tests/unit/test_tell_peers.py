"""Which errors a rank tells its peers by an abort, and what telling changes.

``rounds.tell_peers`` aborts the transport for an error that arose on this
rank inside its communication, never for one it learned from a peer or one
every rank finds alike (telling those would blame this rank for them); once
told, the metadata loop raises the error at once instead of reporting it in
a round the peers, gone, would not join.
"""
import pytest

from hipress_like.casync.config import EngineConfig
from hipress_like.casync.context import StepContext
from hipress_like.casync.errors import (
    ConfigMismatchError,
    GradientMismatchError,
    PeerFailureError,
    WireError,
)
from hipress_like.casync.rounds import Rounds, tell_peers
from hipress_like.casync.tasks import DeadlockError, TaskGraph
from hipress_like.casync.transport.base import PeerError, Transport, TransportError
from hipress_like.casync.transport.faulty import InjectedFault


class _Recorder(Transport):
    """Rank 0 of 2 that records aborts and refuses every collective."""

    def __init__(self, tells=True):
        self.rank, self.size, self.aborts, self.tells = 0, 2, [], tells

    def abort(self, reason):
        self.aborts.append(reason)
        return self.tells

    def _no(self, *a, **k):
        raise AssertionError("no collective may run once the peers were told")

    alltoallv = allgather = broadcast = allreduce = barrier = _no


def _ctx(tr):
    return StepContext(config=EngineConfig(timeout=5), rank=0, size=2, transport=tr,
                       graph=TaskGraph(lambda t: None))


@pytest.mark.parametrize("err", [
    WireError("rank 0: the bulk message from rank 1 ... fails its checksum", sender=1),
    InjectedFault("rank 0: injected exception"),
    ValueError("a bug on this rank"),
])
def test_an_error_of_this_rank_is_told_with_its_type_and_text(err):
    tr = _Recorder()
    ctx = _ctx(tr)
    tell_peers(ctx, err)
    assert tr.aborts == [f"{type(err).__name__}: {err}"] and ctx.told


@pytest.mark.parametrize("err", [
    PeerError("rank 1 died", ranks=[1]), TransportError("closed"),
    PeerFailureError("an error occurred on rank 1", ranks=[1]),
    GradientMismatchError("ranks submitted different gradients"),
    ConfigMismatchError("compressor differs"), DeadlockError([], "no progress"),
    KeyboardInterrupt(),
])
def test_errors_learned_from_peers_or_found_alike_are_not_told(err):
    tr = _Recorder()
    ctx = _ctx(tr)
    tell_peers(ctx, err)
    assert tr.aborts == [] and not ctx.told


def test_a_transport_that_cannot_tell_leaves_the_error_to_the_metadata_round():
    ctx = _ctx(_Recorder(tells=False))
    tell_peers(ctx, ValueError("x"))
    assert not ctx.told


def test_once_told_the_metadata_loop_raises_without_a_round():
    tr = _Recorder()
    ctx = _ctx(tr)
    err = ValueError("boom")
    tell_peers(ctx, err)
    with ctx.cv:
        ctx.record_error(err, -1)
    with pytest.raises(ValueError, match="boom"):
        Rounds(ctx).step()
