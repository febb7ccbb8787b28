"""Synthetic-data training throughput with hipress_like.torch (after Horovod's benchmark).

Random images and labels, so only compute and synchronisation are timed::

    torchrun --nproc_per_node=4 examples/pytorch_synthetic_benchmark.py --model vgg \\
        --compression onebit --strategy ps

Prints images/sec per worker and in total, mean +- 1.96 std over the
timed iterations. ``--compression none`` gives the uncompressed baseline.
"""
import argparse
import os
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import hipress_like.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MODELS  # noqa: E402


def get_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vgg", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, default=8, help="images per worker")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-warmup-batches", type=int, default=3)
    p.add_argument("--num-batches-per-iter", type=int, default=3)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--compression", default="onebit")
    p.add_argument("--strategy", default="ps", choices=["ps", "ring"])
    p.add_argument("--plan", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    return p.parse_args()


def main():
    args = get_args()
    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = MODELS[args.model]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.get(args.compression), strategy=args.strategy,
        plan=args.plan)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 10, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    n_params = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({n_params / 1e6:.1f}M parameters), batch size "
        f"{args.batch_size}, {hvd.size()} workers, compression {args.compression}, "
        f"strategy {args.strategy}, plan {args.plan}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{x}: {img_sec:.1f} img/sec per worker")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per worker: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} worker(s): {hvd.size() * mean:.1f} "
        f"+-{hvd.size() * conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
