"""Call counters published off the caller's thread (transport/counters.py)."""
from __future__ import annotations

import doctest
import threading
import time

import torch.distributed as dist

from hipress_like.casync.transport import counters
from hipress_like.casync.transport.counters import CounterPublisher, settled_counts


def test_doctests():
    assert doctest.testmod(counters).failed == 0


def test_bumps_from_many_threads_all_land_once():
    store, pub = dist.HashStore(), CounterPublisher()

    def bump(key):
        for _ in range(500):
            pub.bump(store, key)

    threads = [threading.Thread(target=bump, args=(f"seq/{i % 2}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pub.flush(10.0)
    assert [int(store.add(f"seq/{i}", 0)) for i in range(2)] == [1000, 1000]
    assert pub.error is None


class _Broken:
    def add(self, key, delta):
        raise ConnectionError("store host gone")


def test_a_dead_store_is_remembered_and_other_stores_still_get_their_bumps():
    good, pub = dist.HashStore(), CounterPublisher()
    pub.bump(_Broken(), "seq/0")
    pub.bump(good, "seq/0", 3)
    assert pub.flush(10.0)
    assert int(good.add("seq/0", 0)) == 3 and "store host gone" in pub.error


def test_a_push_in_flight_is_waited_for_but_a_missing_rank_is_not_forever():
    store = dist.HashStore()
    store.add("seq/1", 4)
    late = threading.Timer(0.05, lambda: store.add("seq/1", 1))
    late.start()
    read = lambda: {1: int(store.add("seq/1", 0)), 2: int(store.add("seq/2", 0))}  # noqa: E731
    got = settled_counts(read, lambda c: [r for r, v in c.items() if v <= 4 and r == 1],
                         settle=5.0)
    assert got[1] == 5
    t0 = time.monotonic()
    got = settled_counts(read, lambda c: [r for r, v in c.items() if v <= 4], settle=0.2)
    assert got[2] == 0 and time.monotonic() - t0 >= 0.2   # rank 2 never pushed
