"""Digits with BytePS's PyTorch API: BytePS's MNIST example, one import line changed.

The script is written the way BytePS's ``example/pytorch/train_mnist_byteps.py``
is (``bps.init``, ``bps.DistributedOptimizer(..., named_parameters=...,
compression_params={...})``, ``bps.broadcast_parameters``,
``bps.broadcast_optimizer_state``, metric averaging with ``bps.declare`` and
``bps.push_pull_inplace``), on scikit-learn's bundled digits so that it runs
offline. Only the import line differs from a BytePS script::

    torchrun --nproc_per_node 4 examples/byteps_digits.py --compressor onebit --ef vanilla
    # a one-machine bpslaunch-style environment works too:
    DMLC_WORKER_ID=0 DMLC_NUM_WORKER=2 DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=9000 \\
        python examples/byteps_digits.py &   # and DMLC_WORKER_ID=1 likewise
"""
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn, optim

import hipress_like.byteps.torch as bps  # was: import byteps.torch as bps


class Net(nn.Module):
    """A small CNN for 8x8 digits."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=16, help="input batch size per worker")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.02, help="learning rate per worker")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--compressor", default="onebit",
                   help="onebit, topk, randomk, dithering, or none")
    p.add_argument("--ef", default="vanilla", help="error feedback: vanilla or ''")
    p.add_argument("--k", type=float, default=None, help="topk/randomk ratio or count, "
                   "dithering levels")
    p.add_argument("--fp16-pushpull", action="store_true", help="fp16 push_pull without "
                   "compression_params")
    return p.parse_args(argv)


def main(argv=None):
    """Train and test; returns the test accuracy and a digest of the parameters."""
    args = parse_args(argv)
    bps.init()
    torch.manual_seed(args.seed)

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test_idx, train_idx = perm[:360], perm[360:]
    shard = train_idx[bps.rank()::bps.size()]  # DistributedSampler's split

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * bps.size(),
                          momentum=args.momentum)
    compression = bps.Compression.fp16 if args.fp16_pushpull else bps.Compression.none
    compression_params = None
    if args.compressor != "none":
        compression_params = {"compressor": args.compressor, "ef": args.ef, "k": args.k,
                              "seed": args.seed}
    optimizer = bps.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         compression_params=compression_params)
    bps.broadcast_parameters(model.state_dict(), root_rank=0)
    bps.broadcast_optimizer_state(optimizer, root_rank=0)

    def metric_average(val, name):
        tensor = torch.tensor([float(val)])
        bps.declare(name)
        bps.push_pull_inplace(tensor, average=False, name=name)
        return tensor.item() / bps.size()

    steps = len(shard) // args.batch_size
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = shard[torch.randperm(len(shard),
                                     generator=torch.Generator().manual_seed(epoch))]
        for i in range(steps):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.nll_loss(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            mine = test_idx[bps.rank()::bps.size()]
            correct = (model(x[mine]).argmax(1) == y[mine]).sum().item()
        acc = 100.0 * metric_average(correct, f"correct.{epoch}") * bps.size() / len(test_idx)
        if bps.rank() == 0:
            print(f"epoch {epoch}  loss {loss.item():.4f}  test accuracy {acc:.1f}%")
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    bps.shutdown()
    return {"acc": acc, "digest": digest}


if __name__ == "__main__":
    main()
