"""One rank of a digits training job, for the Horovod-tier tests (any launcher).

The data, model and loop are examples/pytorch_digits.py's (its ``Net``, the
same split, sampler and SGD), so a run under torchrun, ``horovodrun --gloo``
or ``horovodrun --mpi`` trains the same replicas; each rank prints one line
``RESULT {json}`` with its test accuracy and a digest of its parameters, so
the test can check that ranks are bitwise identical.

Options beyond the example's: ``--kill-rank R --kill-step S`` makes rank R
stop at step S (``--how kill``: SIGKILL itself; ``--how stop``: SIGSTOP, a
stalled rank), and ``--mixed`` also calls ``horovod.torch`` directly every
step (an allreduce of the loss and a broadcast, between backward and step,
named) and every epoch (an unnamed allreduce after step), beside
hipress_like.torch. Horovod names an unnamed call by a per-process handle
counter that the engine's own concurrent calls also advance, so calls made
while gradients are in flight must be named (as Horovod's own optimizer
names every gradient).
"""
import argparse
import hashlib
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hipress_like.torch as hpt

ROOT = Path(__file__).resolve().parents[2]


def _example_net():
    spec = importlib.util.spec_from_file_location("pytorch_digits",
                                                  ROOT / "examples" / "pytorch_digits.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Net


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--compression", default="onebit")
    p.add_argument("--strategy", default="ps")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=3)
    p.add_argument("--how", default="kill", choices=["kill", "stop"])
    p.add_argument("--mixed", action="store_true")
    args = p.parse_args()

    hpt.init()
    hvd = None
    if args.mixed:
        import horovod.torch as hvd
        hvd.init()  # already initialised by hpt.init(): a no-op
        assert (hvd.rank(), hvd.size()) == (hpt.rank(), hpt.size())
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    digits = load_digits()
    x = torch.from_numpy(digits.images.astype("float32") / 16.0).unsqueeze(1)
    xtr, xte, ytr, yte = train_test_split(x, torch.from_numpy(digits.target).long(),
                                          test_size=0.2, random_state=0, stratify=digits.target)
    train = torch.utils.data.TensorDataset(xtr, ytr)
    sampler = torch.utils.data.distributed.DistributedSampler(
        train, num_replicas=hpt.size(), rank=hpt.rank(), seed=args.seed)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler,
                                         drop_last=True)
    model = _example_net()()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    hpt.broadcast_optimizer_state(opt, root_rank=0)
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hpt.Compression.get(args.compression),
                                   strategy=args.strategy, plan=None)
    step, t0 = 0, time.perf_counter()
    mixed_sum = 0.0
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        for data, target in loader:
            if hpt.rank() == args.kill_rank and step == args.kill_step:
                print(f"rank {hpt.rank()} stopping itself ({args.how}) at step {step}",
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL if args.how == "kill" else signal.SIGSTOP)
            opt.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            if hvd is not None:  # Horovod's own collectives while the engine runs: named
                total = hvd.allreduce(loss.detach(), op=hvd.Sum, name=f"user.loss.{step}")
                token = hvd.broadcast(torch.tensor([float(step)]), root_rank=0,
                                      name=f"user.step.{step}")
                assert int(token.item()) == step
                mixed_sum += float(total)
            opt.step()
            step += 1
        if hvd is not None:  # unnamed is fine once step() returned: the engine is idle
            mixed_sum += float(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum))
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean()
    acc = hpt.allreduce(acc, name="test_accuracy").item() * 100
    digest = hashlib.sha256(b"".join(
        t.detach().numpy().tobytes() for t in model.state_dict().values())).hexdigest()[:16]
    print("RESULT " + json.dumps({"rank": hpt.rank(), "size": hpt.size(), "acc": acc,
                                  "digest": digest, "steps": step, "seconds": seconds,
                                  "mixed_sum": mixed_sum,
                                  "transport": type(opt.engine.transport).__name__}),
          flush=True)
    hpt.shutdown()


if __name__ == "__main__":
    sys.exit(main())
