"""A checkpoint writer killed mid-save leaves the previous checkpoint intact, and the
partial file is detected on load (hpt.save_checkpoint, adapters.checkpoint_io).

Two real deaths, and a failed write: a process saving a large checkpoint is
SIGKILLed from outside after its first MiB (the ``progress`` hook announces it
and sleeps, so the kill lands mid-write); rank 0 of a 2-rank job dies by
SIGKILL inside its save, while rank 1 waits in the save's exchange of
outcomes and fails instead of hanging; a write that fails on rank 0 (a
missing directory) is raised on rank 1 too, naming rank 0.
"""
import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import hipress_like.torch as hpt
from hipress_like.launch.launch import WorkerError, run_workers


def _model(fill, width=1024):
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(fill)
    return model


_WRITER = """
import sys, time, pathlib
import hipress_like.torch as hpt
from test_checkpoint_atomic import _model

path, marker = sys.argv[1], sys.argv[2]

def progress(done, total):
    if done < total:  # past the first MiB, not done: announce, then stall mid-file
        pathlib.Path(marker).write_text(f"{done} {total}")
        time.sleep(120)

hpt.save_checkpoint(path, _model(2.0), step=2, progress=progress)
"""


def _check_after_death(path):
    """The old checkpoint loads with its content; the dead writer's file is refused."""
    model = _model(0.0)
    assert hpt.load_checkpoint(path, model) == {"step": 1}
    assert all(bool((p == 1.0).all()) for p in model.parameters()), "old checkpoint changed"
    (partial,) = glob.glob(os.path.join(os.path.dirname(path), ".ck.pt.tmp-*"))
    assert 0 < os.path.getsize(partial) < 2 * os.path.getsize(path)
    with pytest.raises(hpt.CheckpointError, match=r"\.ck\.pt\.tmp-\d+ is incomplete"):
        hpt.load_checkpoint(partial, _model(0.0))


def test_writer_sigkilled_mid_save_keeps_old_checkpoint_and_partial_is_detected(tmp_path):
    path, marker = str(tmp_path / "ck.pt"), str(tmp_path / "marker")
    hpt.save_checkpoint(path, _model(1.0), step=1)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, *sys.path]))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, path, marker], env=env)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            assert proc.poll() is None, f"the writer exited early ({proc.returncode})"
            assert time.monotonic() < deadline, "the writer never reached its first MiB"
            time.sleep(0.05)
        done, total = map(int, open(marker).read().split())
        assert 0 < done < total
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    _check_after_death(path)


def dying_rank0_worker(ctx, path):
    hpt.init()
    hpt.save_checkpoint(path, _model(1.0), step=1)

    def die(done, total):
        if ctx.rank == 0 and done < total:
            os.kill(os.getpid(), signal.SIGKILL)  # the host's rank dies mid-write

    hpt.save_checkpoint(path, _model(2.0), step=2, progress=die)
    return "saved"


def test_rank0_killed_mid_save_fails_the_job_and_keeps_old_checkpoint(tmp_path):
    path = str(tmp_path / "ck.pt")
    with pytest.raises(WorkerError) as err:
        run_workers(dying_rank0_worker, 2, args=(path,), timeout=120,
                    env={"HIPRESS_TIMEOUT": "20"})
    assert 0 in err.value.failures, "rank 0's death was not reported"
    assert "saved" not in err.value.results.values(), "a rank went on past the save"
    _check_after_death(path)


def failing_write_worker(ctx, path):
    hpt.init()
    try:
        hpt.save_checkpoint(path, _model(1.0, width=8), step=1)
    except OSError as e:
        return str(e)
    return "saved"


def test_a_write_that_fails_on_rank0_is_raised_on_every_rank_naming_it(tmp_path):
    path = str(tmp_path / "missing-dir" / "ck.pt")  # only rank 0 writes: only it fails
    res = run_workers(failing_write_worker, 2, args=(path,), timeout=120)
    assert "No such file or directory" in res[0]
    assert res[1].startswith("save_checkpoint: rank(s) [0] could not write the checkpoint")
    assert "FileNotFoundError" in res[1] and "keeps its previous content" in res[1]
