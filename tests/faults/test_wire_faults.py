"""Damage inside the bulk exchange is caught where it lands, and told to the peers at once.

Issue 46, item 6 (wire safety) and the exception inside the exchange: real
ranks (``fault_job.py`` through ``harness.run_trial``), one fault injected
by the transport wrapper (``casync/transport/faulty.py``) on rank 1.

- ``flip-data``: one bit of a payload's data flipped on arrival at rank 1.
  Rank 1 rejects the message by its checksum (``casync/wire.py``), naming
  the sender (rank 0) and the gradient the payload belongs to; rank 0 learns
  it from rank 1's abort, with rank 1's reason.
- ``flip-header``: the frame's magic damaged: rank 1 names the sender.
- ``raise``: an exception inside rank 1's exchange. Rank 0, blocked waiting
  for rank 1's message, raises from rank 1's abort with rank 1's own
  exception text, not from its timeout: the cause can only reach rank 0
  through the abort, so that text is the proof it did not wait the timeout
  out (no timing threshold in the assertion; the times go to the table).
"""
import pytest
from harness import CATALOG, logs_of, run_trial

pytestmark = pytest.mark.faults


def _run(name, fault_trials):
    trial = run_trial(CATALOG[name])
    fault_trials.append(trial)
    assert trial.fault_seen, "the fault never fired:\n" + logs_of(trial)
    assert trial.hangs == 0 and trial.left_behind == 0, logs_of(trial)
    for s in trial.survivors:
        assert s.rc not in (0, None) and s.error_s is not None, logs_of(trial)
    return {s.rank: s for s in trial.survivors}


def test_a_flipped_data_bit_is_rejected_naming_sender_and_gradient_and_told_to_the_sender(
        fault_trials):
    by = _run("flip-data/exchange", fault_trials)
    receiver, sender = by[1], by[0]
    assert receiver.kind == "WireError", receiver.error
    assert "from rank 0" in receiver.error and "fails its checksum" in receiver.error
    assert "gradient '" in receiver.error and receiver.named == [0]
    assert sender.named == [1], sender.error
    assert "fails its checksum" in sender.error, sender.error  # rank 1's reason, via its abort


@pytest.mark.slow
def test_a_damaged_frame_header_names_the_sender(fault_trials):
    by = _run("flip-header/exchange", fault_trials)
    assert by[1].kind == "WireError" and "from rank 0" in by[1].error, by[1].error
    assert by[1].named == [0] and by[0].named == [1], (by[0].error, by[1].error)


def test_an_exception_inside_the_exchange_reaches_the_peer_with_its_cause(fault_trials):
    by = _run("raise/exchange", fault_trials)
    peer = by[0]
    assert peer.named == [1], peer.error
    assert "injected exception" in peer.error and "told their peers" in peer.error, peer.error
    assert "timed out" not in peer.error, peer.error
