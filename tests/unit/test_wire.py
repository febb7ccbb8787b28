"""The bulk message frame (``casync/wire.py``): every damage is caught and names the sender.

Each test builds a real frame, damages it the way a link (or a foreign
process) could, and checks that ``unframe`` raises ``WireError`` naming the
sender (and the payload, for a checksum), or returns the exact payloads when
nothing was damaged.
"""
import random
import struct

import pytest
import torch

from hipress_like.casync.errors import EngineError, WireError
from hipress_like.casync.wire import HEADER_NBYTES, WIRE_VERSION, frame, frame_nbytes, unframe
from hipress_like.errors import HipressError

SIZES = [3, 16, 9]


def _payloads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (s,), dtype=torch.uint8, generator=g) for s in SIZES]


def _unframe(buf, **kw):
    args = dict(src=2, dst=1, step=11, label=lambda i: f"payload-{i}")
    args.update(kw)
    return unframe(buf, SIZES, **args)


def test_a_frame_round_trips_its_payloads_exactly():
    ps = _payloads()
    msg = frame(ps, src=2, dst=1, step=11)
    assert msg.numel() == frame_nbytes(SIZES) == HEADER_NBYTES + 8 * 3 + 8 + 16 + 16
    out = _unframe(msg)
    assert [o.tolist() for o in out] == [p.tolist() for p in ps]
    assert msg[1] == ord("P") and msg[4] == WIRE_VERSION


def test_without_checksums_the_frame_is_shorter_and_still_round_trips():
    ps = _payloads()
    msg = frame(ps, src=2, dst=1, step=11, check=False)
    assert msg.numel() == frame_nbytes(SIZES, check=False) == HEADER_NBYTES + 40
    assert [o.tolist() for o in _unframe(msg)] == [p.tolist() for p in ps]


@pytest.mark.parametrize("byte", range(0, frame_nbytes(SIZES)))
def test_every_single_bit_flip_anywhere_in_a_frame_is_caught(byte):
    """Padding included: the sums cover it, so no byte of the message is unchecked."""
    msg = frame(_payloads(), src=2, dst=1, step=11)
    for bit in (0, 7):
        bad = msg.clone()
        bad[byte] ^= 1 << bit
        with pytest.raises(WireError) as e:
            _unframe(bad)
        assert e.value.sender == 2 and e.value.ranks == (2,)
        assert "from rank 2" in str(e.value)


def test_a_flipped_data_bit_names_the_payload_it_damaged():
    msg = frame(_payloads(), src=2, dst=1, step=11)
    body1 = HEADER_NBYTES + 24 + 8  # the second payload starts after the first's 8 bytes
    msg[body1 + 5] ^= 0x10
    with pytest.raises(WireError, match="payload-1 .*fails its checksum") as e:
        _unframe(msg)
    assert e.value.payload == "payload-1"


def test_a_flipped_header_bit_says_the_header_was_corrupted():
    msg = frame(_payloads(), src=2, dst=1, step=11)
    msg[20] ^= 1
    with pytest.raises(WireError, match="header's CRC-32"):
        _unframe(msg)


@pytest.mark.parametrize("cut", [0, 5, HEADER_NBYTES - 1, HEADER_NBYTES + 3, -1])
def test_a_truncated_frame_is_rejected_as_truncated(cut):
    msg = frame(_payloads(), src=2, dst=1, step=11)
    with pytest.raises(WireError, match="truncated"):
        _unframe(msg[:cut])


def test_a_frame_meant_for_another_step_rank_or_plan_is_rejected_by_field():
    msg = frame(_payloads(), src=2, dst=1, step=11)
    with pytest.raises(WireError, match="step 12, expected 11|step 11, expected 12"):
        _unframe(msg, step=12)
    with pytest.raises(WireError, match="receiver 1, expected 3"):
        _unframe(msg, dst=3)
    with pytest.raises(WireError, match="sender 2, expected 0"):
        _unframe(msg, src=0)
    with pytest.raises(WireError, match="payload count"):
        unframe(msg, SIZES[:2], src=2, dst=1, step=11)


def test_another_wire_version_is_refused_with_how_to_fix():
    msg = frame(_payloads(), src=2, dst=1, step=11)
    msg[4] = WIRE_VERSION + 1
    with pytest.raises(WireError, match="version 1, found 2.*same hipress-like version"):
        _unframe(msg)


def test_random_bytes_are_never_accepted_and_raise_only_wire_errors():
    rng = random.Random(46)
    n = frame_nbytes(SIZES)
    for _ in range(300):
        junk = torch.tensor(list(rng.randbytes(rng.choice([n, rng.randrange(0, 2 * n)]))),
                            dtype=torch.uint8)
        with pytest.raises(WireError):
            _unframe(junk)


def test_random_bytes_behind_a_valid_magic_and_version_are_still_rejected():
    rng = random.Random(7)
    n = frame_nbytes(SIZES)
    for _ in range(300):
        junk = bytearray(rng.randbytes(n))
        junk[:5] = b"HPWM" + bytes([WIRE_VERSION])
        with pytest.raises(WireError):
            _unframe(torch.tensor(list(junk), dtype=torch.uint8))


def test_wire_error_is_an_engine_error_and_a_hipress_error():
    assert issubclass(WireError, EngineError) and issubclass(WireError, HipressError)


def test_a_forged_header_with_a_valid_crc_but_wrong_sums_names_the_payload():
    """A frame re-built by hand with the right header CRC but data of another
    payload: only the sums can catch it, and they do."""
    good = frame(_payloads(0), src=2, dst=1, step=11)
    other = frame(_payloads(1), src=2, dst=1, step=11)
    forged = torch.cat([good[:HEADER_NBYTES + 24], other[HEADER_NBYTES + 24:]])
    with pytest.raises(WireError, match="fails its checksum"):
        _unframe(forged)
    assert struct.unpack_from("<I", bytes(good[36:40].numpy()))[0] != 0
