"""Checkpoint files are whole or refused (adapters.checkpoint_io, hpt.save_checkpoint).

A file cut short at any byte, with a byte changed, with bytes appended, or
that is not a checkpoint is refused with an error naming the file and what
is wrong; a failed write leaves the previous file as it was; what is loaded
is never unpickled as arbitrary objects. (A writer SIGKILLed mid-save:
tests/multiprocess/test_checkpoint_atomic.py.)
"""
import os
import pickle

import pytest
import torch

import hipress_like.torch as hpt
from hipress_like.adapters.checkpoint_io import (
    FOOTER,
    CheckpointError,
    read_verified,
    temp_path,
    write_atomic,
)


def _payload(n=3000):
    return bytes((i * 7 + 3) % 251 for i in range(n))


def test_round_trip_and_no_temporary_file_left(tmp_path):
    p = str(tmp_path / "a.ck")
    write_atomic(p, _payload())
    assert read_verified(p) == _payload()
    assert os.listdir(tmp_path) == ["a.ck"]
    assert os.path.getsize(p) == len(_payload()) + FOOTER


@pytest.mark.parametrize("cut", [0, 1, FOOTER - 1, FOOTER, 1500, 3000, 3000 + FOOTER - 1])
def test_a_file_cut_short_anywhere_is_refused_naming_it(tmp_path, cut):
    p = str(tmp_path / "a.ck")
    write_atomic(p, _payload())
    with open(p, "r+b") as f:
        f.truncate(cut)
    with pytest.raises(CheckpointError, match="a.ck is (incomplete|damaged)"):
        read_verified(p)


def test_a_changed_byte_or_appended_bytes_are_refused(tmp_path):
    p = str(tmp_path / "a.ck")
    write_atomic(p, _payload())
    blob = bytearray(open(p, "rb").read())
    blob[1234] ^= 0x10
    open(p, "wb").write(bytes(blob))
    with pytest.raises(CheckpointError, match="corrupted: the SHA-256"):
        read_verified(p)
    blob[1234] ^= 0x10
    open(p, "wb").write(bytes(blob) + b"x")
    with pytest.raises(CheckpointError, match="incomplete or not a hipress-like"):
        read_verified(p)


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    p = str(tmp_path / "a.ck")
    write_atomic(p, b"old")

    def boom(done, total):
        assert os.path.exists(temp_path(p))  # staged beside it, not over it
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(p, _payload(3 << 20), progress=boom)
    assert read_verified(p) == b"old"
    assert os.listdir(tmp_path) == ["a.ck"]


def test_progress_counts_every_byte(tmp_path):
    seen = []
    write_atomic(str(tmp_path / "a.ck"), _payload((5 << 20) // 2),
                 progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == ((5 << 20) // 2, (5 << 20) // 2) and len(seen) == 3
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_save_and_load_checkpoint_single_process(tmp_path):
    model, p = _model(), str(tmp_path / "ck.pt")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert hpt.save_checkpoint(p, model, opt, epoch=4, note="x") == p
    other = _model()
    with torch.no_grad():
        for q in other.parameters():
            q.zero_()
    opt2 = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    assert hpt.load_checkpoint(p, other, opt2) == {"epoch": 4, "note": "x"}
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"],
                       opt2.state_dict()["state"][0]["momentum_buffer"])


def test_load_checkpoint_names_a_truncated_file_and_a_missing_one(tmp_path):
    p = str(tmp_path / "ck.pt")
    hpt.save_checkpoint(p, _model())
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(hpt.CheckpointError, match=r"ck\.pt is incomplete"):
        hpt.load_checkpoint(p, _model())
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nope.pt"):
        hpt.load_checkpoint(str(tmp_path / "nope.pt"), _model())


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_pickled_object_inside_a_valid_footer_is_never_unpickled(tmp_path):
    """Even a file with a good footer (written by anyone) is loaded weights-only."""
    p = str(tmp_path / "ck.pt")
    blob = {"format": "hipress-like-checkpoint", "version": 1, "model": {}, "optimizer": None,
            "extra": {"x": _Evil()}}
    write_atomic(p, pickle.dumps(blob, protocol=2))
    with pytest.raises(hpt.CheckpointError, match="never unpickled"):
        hpt.load_checkpoint(p)


def test_another_format_is_refused(tmp_path):
    import io

    p = str(tmp_path / "ck.pt")
    buf = io.BytesIO()
    torch.save({"model": {}}, buf)
    write_atomic(p, buf.getvalue())
    with pytest.raises(hpt.CheckpointError, match="not a checkpoint this version reads"):
        hpt.load_checkpoint(p, _model())


def test_extra_that_loading_would_refuse_is_refused_before_writing(tmp_path):
    p = str(tmp_path / "ck.pt")
    with pytest.raises(TypeError, match=r"save_checkpoint: bad=_Evil cannot be loaded back"):
        hpt.save_checkpoint(p, _model(), epoch=1, bad=_Evil())
    assert not os.listdir(tmp_path)
