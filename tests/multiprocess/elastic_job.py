"""A digits training job for tests/multiprocess/test_elastic.py, started by torchrun, and
for the elastic tests of tests/frameworks/test_horovodrun.py, started by horovodrun's
elastic driver (the surviving processes re-form the world in place: the rank and the
world size are read at every step).

Every step trains on one global batch of ``BATCH`` images chosen by the
step number alone, split evenly over the ranks of the current world, so
the averaged gradient is the global batch's whatever the world size: a
run re-formed with fewer ranks follows the uninterrupted run's path.

Environment (besides torchrun's and ``HIPRESS_ELASTIC_CHECKPOINT``):

- ``JOB_OUT``: a directory; each process writes ``events.jsonl`` lines
  there (start, first step of a process, kill, end), and ``end.<rank>.json``.
- ``JOB_STEPS``, ``JOB_COMMIT_EVERY``, ``JOB_COMPRESSOR``.
- ``JOB_KILL``: ``"<step>:<rank>:<what>"``: at that step (on the first
  start only) that rank records the time and kills ``worker`` (itself) or
  ``node`` (its torchrun agent, then itself) with SIGKILL; ``<rank>`` may be
  ``agent<pid>``: the rank whose torchrun agent has that pid.
- ``JOB_WAIT_AT``: ``"<step>:<file>"``: every rank of the first start waits
  at that step until ``file`` exists, two minutes at most (the test starts
  a joining host meanwhile).
- ``JOB_KILL_HOST`` (horovodrun): ``"<step>:<host>"``: at that step the worker
  whose ``HOROVOD_HOSTNAME`` is ``host`` records the time and kills itself
  (once per job: a file in ``JOB_OUT`` remembers it).
- ``JOB_ADD_HOST`` (horovodrun): ``"<step>:<file>"``: at that step rank 0
  creates ``file``, which makes the test's discovery script list one more
  host; until the world has grown, each step then sleeps 0.2 s (the new
  worker's start takes seconds, the job's steps milliseconds).
"""
import hashlib
import json
import os
import signal
import time

import torch

import hipress_like.torch as hpt
from hipress_like.demo.cli_digits import evaluate, load_digits_split

BATCH = 48  # divisible by 1, 2, 3 and 4 ranks: equal shards, so the mean is the batch's


def _event(out, **fields):
    fields.update(t=time.time(), pid=os.getpid(),
                  restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")


def _digest(model, opt):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for s in opt.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main():
    out = os.environ["JOB_OUT"]
    steps = int(os.environ.get("JOB_STEPS", "200"))
    every = int(os.environ.get("JOB_COMMIT_EVERY", "10"))
    kill = os.environ.get("JOB_KILL", "")
    wait_at = os.environ.get("JOB_WAIT_AT", "")
    kill_host = os.environ.get("JOB_KILL_HOST", "")
    add_host = os.environ.get("JOB_ADD_HOST", "")
    torch.set_num_threads(1)
    hpt.init(timeout=float(os.environ.get("JOB_TIMEOUT", "20")))
    r, n = hpt.rank(), hpt.size()
    _event(out, what="start", rank=r, size=n)
    xtr, ytr, xte, yte = load_digits_split(0)
    xtr, xte = xtr.flatten(1), xte.flatten(1)
    torch.manual_seed(0)  # the same initial model everywhere (sync() makes sure)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=os.environ.get("JOB_COMPRESSOR", "powersgd"),
                                   plan=None)
    state = hpt.elastic.TorchState(model, opt, step=0)

    @hpt.elastic.run
    def train(state):
        first = True
        while state.step < steps:
            r, n = hpt.rank(), hpt.size()  # horovodrun's elastic driver re-forms in place
            g = torch.Generator().manual_seed(1000 + state.step)
            idx = torch.randperm(len(xtr), generator=g)[:BATCH]
            mine = idx[r * BATCH // n:(r + 1) * BATCH // n]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xtr[mine]), ytr[mine]).backward()
            opt.step()
            state.step += 1
            if first:
                _event(out, what="first_step", rank=r, size=n, step=state.step,
                       resumed_from=state.restored_from is not None)
                first = False
            if state.step % every == 0:
                state.commit()
            # faults and waits on the first start only: a resumed process read a checkpoint
            if wait_at and state.restored_from is None:
                at, flag = wait_at.split(":", 1)
                if state.step == int(at):
                    _event(out, what="waiting", rank=r, step=state.step)
                    until = time.monotonic() + 120  # the test fails on the world size then
                    while not os.path.exists(flag) and time.monotonic() < until:
                        time.sleep(0.05)
            if kill_host:
                at, host = kill_host.split(":", 1)
                once = os.path.join(out, "killed")
                if (state.step == int(at) and os.environ.get("HOROVOD_HOSTNAME") == host
                        and not os.path.exists(once)):
                    open(once, "w").close()
                    _event(out, what="kill", rank=r, step=state.step, target="worker")
                    os.kill(os.getpid(), signal.SIGKILL)
            if add_host:
                at, flag = add_host.split(":", 1)
                if r == 0 and state.step == int(at) and not os.path.exists(flag):
                    _event(out, what="add_host", rank=r, step=state.step)
                    open(flag, "w").close()
                elif n == 1 and os.path.exists(flag):
                    time.sleep(0.2)  # the new host starts: slow steps until it has joined
            if kill and state.restored_from is None:
                at, who, what = kill.split(":")
                if state.step == int(at) and who in ("any", str(r)):
                    _event(out, what="kill", rank=r, step=state.step, target=what)
                    if what == "node":
                        os.kill(os.getppid(), signal.SIGKILL)
                    os.kill(os.getpid(), signal.SIGKILL)
        return evaluate(model, xte, yte)

    acc = train(state)
    r, n = hpt.rank(), hpt.size()
    end = dict(rank=r, size=n, acc=acc, step=state.step, digest=_digest(model, opt),
               restored_from=state.restored_from, commits=state.commits)
    _event(out, what="end", **end)
    with open(os.path.join(out, f"end.{r}.json"), "w") as f:
        json.dump(end, f)
    hpt.shutdown()


if __name__ == "__main__":
    main()
