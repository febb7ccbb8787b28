"""Train on digits with a straggling rank, with or without partial aggregation.

One rank (``--slow-rank``) sleeps ``--sleep`` seconds in one step of every
``--every``, as a preempted or overloaded worker would. With ``--quorum
0.75`` a step closes once 3 of 4 ranks contributed (THC Sec. 6.1, 8.3);
with ``--quorum 1`` every rank is waited for. Launch with torchrun::

    torchrun --nproc_per_node=4 examples/pytorch_stragglers.py --quorum 0.75
    torchrun --nproc_per_node=4 examples/pytorch_stragglers.py --quorum 1

The loop counts steps with ``optimizer.steps``: a late rank applies the
steps that closed without it instead of computing them, so its counter can
jump, and each step's batch is chosen by that counter.
"""
import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import hipress_like.torch as hvd


def get_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32, help="images per worker per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--compression", default="thc", help="thc, onebit, none, ...")
    p.add_argument("--quorum", type=float, default=0.75,
                   help="fraction of ranks a step waits for (1: all)")
    p.add_argument("--slow-rank", type=int, default=-1, help="-1: the last rank")
    p.add_argument("--sleep", type=float, default=0.3)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


def main():
    args = get_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    slow = args.slow_rank if args.slow_rank >= 0 else size - 1

    digits = load_digits()
    x = torch.from_numpy(digits.images.astype("float32") / 16.0).reshape(-1, 64)
    xtr, xte, ytr, yte = train_test_split(x, torch.from_numpy(digits.target).long(),
                                          test_size=0.2, random_state=0,
                                          stratify=digits.target)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.get(args.compression),
        stragglers=hvd.Quorum(fraction=args.quorum))

    order = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(args.seed))
    per_step = args.batch_size * size
    hvd.barrier()
    t0 = time.perf_counter()
    while optimizer.steps < args.steps:
        s = optimizer.steps
        lo = (s * per_step + rank * args.batch_size) % (len(xtr) - args.batch_size)
        data, target = xtr[order[lo:lo + args.batch_size]], ytr[order[lo:lo + args.batch_size]]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        if rank == slow and s % args.every == args.every - 1:
            time.sleep(args.sleep)
        loss.backward()
        optimizer.step()
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
    counters = optimizer.stragglers()
    print(f"rank {rank}: {args.steps} steps in {seconds:.2f} s, test accuracy {acc:.1f}%, "
          f"contributed {counters['contributed']}, dropped {counters['dropped']}, "
          f"sat out {counters['sat_out']}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
