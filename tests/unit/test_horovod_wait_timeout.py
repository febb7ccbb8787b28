"""``_HorovodWork.wait`` polls with the timeout instead of blocking in ``synchronize``.

Horovod is not installed in this environment, so Horovod's handle API
(``poll``/``synchronize``) is played by a small object following its
contract: ``synchronize`` blocks until the operation completes, so calling it
on one that never completes would hang this test (what happened under
horovodrun when ranks drifted into different collectives).
"""
import threading
from datetime import timedelta

import pytest
import torch

from hipress_like.adapters import collectives as C
from hipress_like.casync.transport import TransportError


class _HandleAPI:
    """Horovod's handle contract: poll() says done; synchronize() blocks until done."""

    def __init__(self, done_after_polls=None):
        self.polls = 0
        self.done_after = done_after_polls
        self.completed = threading.Event()

    def poll(self, h):
        self.polls += 1
        if self.done_after is not None and self.polls >= self.done_after:
            self.completed.set()
        return self.completed.is_set()

    def synchronize(self, h):
        if not self.completed.wait(timeout=30):
            raise AssertionError("synchronize called on an operation that never completes")
        return torch.tensor([1.0, 2.0])


def test_wait_raises_after_the_timeout_when_peers_never_join():
    api = _HandleAPI(done_after_polls=None)
    work = C._HorovodWork(api, object())
    with pytest.raises(TransportError, match=r"did not finish it within 0.3s"):
        work.wait(timeout=timedelta(seconds=0.3))
    assert api.polls > 1 and work.result is None


def test_handle_names_the_collective():
    api = _HandleAPI(done_after_polls=None)
    handle = C._Handle([C._HorovodWork(api, object())], lambda: None, "allgather 'metrics'")
    C_default = C.default_timeout
    try:
        C.default_timeout = lambda: 0.2
        with pytest.raises(TransportError, match=r"allgather 'metrics' failed: Horovod did"):
            handle.wait()
    finally:
        C.default_timeout = C_default


def test_wait_returns_the_result_once_done():
    api = _HandleAPI(done_after_polls=3)
    work = C._HorovodWork(api, object())
    work.wait(timeout=timedelta(seconds=30))
    assert work.result.tolist() == [1.0, 2.0] and api.polls == 3
    work.wait()  # idempotent
    assert work.is_completed()
