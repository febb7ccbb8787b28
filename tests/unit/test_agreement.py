"""The collective-agreement records and the disagreement report (adapters/agreement.py)."""
import pytest

from hipress_like.adapters.agreement import (
    RECORD_BYTES,
    CollectiveMismatchError,
    disagreement,
    pack_call,
    unpack_call,
)


def test_record_round_trip_and_long_names_digest():
    rec = pack_call({"collective": "allreduce", "shape": [3, 4], "name": None})
    assert len(rec) == RECORD_BYTES
    assert unpack_call(rec) == {"collective": "allreduce", "shape": [3, 4], "name": None}
    a = unpack_call(pack_call({"collective": "x", "name": "n" * 1000}))
    b = unpack_call(pack_call({"collective": "x", "name": "n" * 1000}))
    c = unpack_call(pack_call({"collective": "x", "name": "n" * 999 + "m"}))
    assert a == b and a["name"].startswith("sha1:") and a != c
    assert a["collective"] == "x"


def test_foreign_record_is_refused():
    with pytest.raises(CollectiveMismatchError, match="unreadable"):
        unpack_call(bytes([200, 0]) + b"\xc1" * (RECORD_BYTES - 2))
    with pytest.raises(CollectiveMismatchError, match="unreadable"):
        unpack_call(bytes(RECORD_BYTES))


def test_disagreement_names_fields_values_and_minority_ranks():
    same = {"collective": "allreduce", "dtype": "torch.float32", "shape": [2]}
    assert disagreement("allreduce", [same, dict(same), dict(same)]) is None
    odd = dict(same, shape=[3])
    e = disagreement("allreduce 'loss'", [same, dict(same), odd])
    assert e.fields == ("shape",) and e.ranks == (2,)
    assert "shape: [2] on rank(s) [0, 1]; [3] on rank(s) [2]" in str(e)
    tie = disagreement("allreduce", [same, odd])
    assert tie.ranks == (0, 1)


def test_different_collectives_compare_only_what_they_share():
    e = disagreement("allgather", [
        {"collective": "allgather", "dtype": "torch.float32", "trailing_shape": []},
        {"collective": "allreduce", "dtype": "torch.float32", "shape": [2], "op": "sum"}])
    assert e.fields == ("collective",)
