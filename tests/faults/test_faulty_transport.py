"""The fault suite's transport wrapper does exactly the one fault it is given, once.

In-process ranks (threads), so each property is checked byte for byte without
starting processes: untouched exchanges pass through unchanged; ``truncate`` and
``flip`` damage only the chosen message at the chosen exchange; ``drop`` never
sends the chosen message (the peer's transport reports it, naming the sender);
``raise`` raises inside the exchange; and a bad ``HIPRESS_FAULT`` is refused.
"""
import pytest
import torch

from hipress_like.casync.transport import PeerError, TransportError
from hipress_like.casync.transport.faulty import (
    FaultSpec,
    FaultyTransport,
    InjectedFault,
    parse_fault,
    wrap_from_env,
)
from hipress_like.casync.transport.inproc import run_threads

pytestmark = pytest.mark.faults


def _exchange(t, spec_for_rank1, calls=3, timeout=5.0):
    if t.rank == 1:
        t = FaultyTransport(t, spec_for_rank1, mark="")
    out = []
    for c in range(calls):
        msg = torch.arange(8, dtype=torch.uint8) + 16 * t.rank + c
        send = [msg if p != t.rank else None for p in range(t.size)]
        got = t.alltoallv(send, [0 if p == t.rank else 8 for p in range(t.size)], timeout)
        out.append([None if g is None else g.tolist() for g in got])
    return out


def _clean(rank, c, size=2):
    """What ``rank`` receives at exchange ``c`` when nothing is damaged."""
    return [None if p == rank else [x + 16 * p + c for x in range(8)] for p in range(size)]


def test_truncate_and_flip_damage_only_the_chosen_message_once():
    res = run_threads(lambda t: _exchange(t, FaultSpec("truncate", call=1, peer=0)), 2)
    assert res[0] == [_clean(0, c) for c in range(3)]
    assert res[1][0] == _clean(1, 0) and res[1][2] == _clean(1, 2)
    assert res[1][1][0] == _clean(1, 1)[0][:4]
    res = run_threads(lambda t: _exchange(t, FaultSpec("flip", call=2, peer=0, byte=-1,
                                                        bit=7)), 2)
    want = _clean(1, 2)[0]
    want[-1] ^= 0x80
    assert res[1][2][0] == want and res[1][:2] == [_clean(1, c) for c in range(2)]


def test_a_dropped_message_fails_the_peer_naming_the_sender():
    # the in-process transport sees the whole exchange, so it finds the missing bytes at
    # once; over gloo the peer waits for them until its timeout
    with pytest.raises(TransportError) as e:
        run_threads(lambda t: _exchange(t, FaultSpec("drop", call=0, peer=0), calls=1,
                                        timeout=1.0), 2, timeout=30)
    assert "from rank 1 but rank 1 sent 0" in str(e.value)


def test_raise_fires_inside_the_exchange():
    with pytest.raises((InjectedFault, PeerError)):
        run_threads(lambda t: _exchange(t, FaultSpec("raise", call=1), timeout=2.0), 2,
                    timeout=30)


def test_the_spec_parses_and_a_bad_one_is_refused(monkeypatch):
    assert parse_fault("kill:call=4") == FaultSpec("kill", call=4)
    assert parse_fault("flip:call=3,peer=1,byte=-1,bit=2") == FaultSpec("flip", 3, 1, -1, 2)
    for bad in ("explode:call=1", "drop:when=3", "drop:call=x", "flip:bit=9"):
        with pytest.raises(ValueError):
            parse_fault(bad)
    monkeypatch.setenv("HIPRESS_FAULT", "drop:when=3")
    with pytest.raises(TransportError, match="HIPRESS_FAULT"):
        run_threads(wrap_from_env, 1)
    monkeypatch.delenv("HIPRESS_FAULT")
    assert run_threads(lambda t: type(wrap_from_env(t)).__name__, 1) == ["InProcTransport"]
