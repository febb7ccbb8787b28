"""One rank of the handed-to-Horovod checks (run by test_horovod_calls.py under horovodrun).

Through ``hipress_like.torch`` only, the calls this project hands to Horovod
(``adapters/horovod_calls.py``) must give Horovod's results, appear in
Horovod's timeline, and run on process sets; prints ``CHECK <name> ok`` or
``CHECK <name> FAIL <why>`` per check (every check is collective, so all
ranks run them in the same order). argv[1]: a directory for the timeline.
"""
import json
import os
import sys

import torch
from check_runner import run_checks

import hipress_like.torch as hvd

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


@check
def reducescatter_and_alltoall_are_horovods():
    import horovod.torch as real

    r, n = hvd.rank(), hvd.size()
    t = torch.arange(n * 3 * 2, dtype=torch.float32).reshape(n * 3, 2) * (r + 1)
    ours = hvd.reducescatter(t, op=hvd.Sum)
    theirs = real.reducescatter(t, op=real.Sum)
    assert torch.equal(ours, theirs), (ours, theirs)
    rows = torch.cat([torch.full((q + 1,), 10 * r + q, dtype=torch.int16) for q in range(n)])
    got, recv = hvd.alltoall(rows, torch.tensor([q + 1 for q in range(n)], dtype=torch.int32))
    assert recv.tolist() == [r + 1] * n and got.tolist() == sum(
        ([10 * q + r] * (r + 1) for q in range(n)), []), (got, recv)
    h = hvd.reducescatter_async(torch.ones(n * 2), op=hvd.Sum)
    assert hvd.synchronize(h).tolist() == [float(n)] * 2
    assert hvd.grouped_allgather([torch.tensor([r])])[0].tolist() == list(range(n))


@check
def handed_calls_appear_in_horovods_timeline():
    path = os.path.join(sys.argv[1], "timeline.json")
    hvd.start_timeline(path, mark_cycles=False)
    hvd.reducescatter(torch.ones(hvd.size() * 2), name="probe.reducescatter")
    hvd.alltoall(torch.ones(hvd.size()), name="probe.alltoall")
    hvd.stop_timeline()
    if hvd.rank() == 0:  # Horovod's coordinator writes the timeline
        text = open(path).read()
        for name in ("probe.reducescatter", "probe.alltoall"):
            assert name in text, f"{name} not in Horovod's timeline ({len(text)} bytes)"
        json.loads(text.rstrip().rstrip(",") + ("]" if not text.rstrip().endswith("]")
                                                else ""))


@check
def process_sets_are_horovods():
    r, n = hvd.rank(), hvd.size()
    sets = [hvd.add_process_set([q]) for q in range(n)]  # on every rank, in the same order
    mine = sets[r]
    assert mine.included() and mine.size() == 1
    out = hvd.allreduce(torch.full((2,), float(r + 1)), op=hvd.Sum, process_set=mine)
    assert out.tolist() == [float(r + 1)] * 2, out  # only this rank's set
    got = hvd.allgather(torch.tensor([r]), process_set=mine)
    assert got.tolist() == [r], got
    hvd.barrier(process_set=mine)
    for s in sets:
        hvd.remove_process_set(s)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).tolist() == [float(n)]


def main():
    run_checks(hvd, CHECKS)


if __name__ == "__main__":
    main()
