"""Train a CNN on scikit-learn's digits with hipress_like.torch (a Horovod-style script).

Real data (1797 8x8 images, bundled with scikit-learn), an 80/20
train/test split, test accuracy per epoch. Launch with torchrun::

    torchrun --nproc_per_node=4 examples/pytorch_digits.py --compression onebit

or with Open MPI (rendezvous over MPI; mpi4py required)::

    mpirun -np 4 --allow-run-as-root --oversubscribe --bind-to none \\
        -x OMP_NUM_THREADS=1 python examples/pytorch_digits.py --compression dgc

A plain ``python examples/pytorch_digits.py`` trains on one process. Where
CUDA is available each rank trains on GPU ``local_rank % device_count``
(``--no-cuda`` keeps it on the CPU), as Horovod's example does; ``--compll
FILE`` registers a CompLL program at run time and compresses with it. Apart
from the import line and the ``strategy``/``plan``/``--compll`` arguments,
this is the shape of Horovod's ``pytorch_mnist.py``.
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
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="images per worker per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--compression", default="onebit",
                   help="none, fp16, onebit, terngrad, dgc, powersgd, ...")
    p.add_argument("--strategy", default="ps", choices=["ps", "ring"])
    p.add_argument("--plan", default="auto",
                   help="'auto' (the cost model decides per gradient; on a fast link it may "
                        "send everything uncompressed), 'size' (the engine's size rule: "
                        "gradients from 1 MB up are compressed) or a plan JSON file")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU even with a GPU")
    p.add_argument("--compll", default=None,
                   help="a CompLL program (.compll) to register and compress with")
    return p.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 512)
        self.fc2 = nn.Linear(512, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main():
    args = get_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    cuda = not args.no_cuda and torch.cuda.is_available()
    dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count()) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    compression = hvd.Compression.get(args.compression)
    if args.compll:  # a CompLL program, registered on every rank alike
        import os

        import hipress_like as hp
        name = os.path.splitext(os.path.basename(args.compll))[0] + "_dsl"
        hp.compressors.register_dsl(args.compll, name=name, replace=True)
        compression = hvd.Compression.get(name)

    digits = load_digits()
    x = torch.from_numpy(digits.images.astype("float32") / 16.0).unsqueeze(1)
    xtr, xte, ytr, yte = train_test_split(x, torch.from_numpy(digits.target).long(),
                                          test_size=0.2, random_state=0,
                                          stratify=digits.target)
    train = torch.utils.data.TensorDataset(xtr, ytr)
    sampler = torch.utils.data.distributed.DistributedSampler(
        train, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler,
                                         drop_last=True)

    xte, yte = xte.to(dev), yte.to(dev)
    model = Net().to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=compression, strategy=args.strategy,
        plan=None if args.plan == "size" else args.plan)

    for epoch in range(1, args.epochs + 1):
        model.train()
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        for data, target in loader:
            data, target = data.to(dev), target.to(dev)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
        seconds = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean()
        acc = hvd.allreduce(acc, name="test_accuracy").item() * 100  # equal on every rank
        images = len(loader) * args.batch_size * hvd.size()
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  {dev.type}  loss {loss.item():.4f}  test accuracy "
                  f"{acc:5.1f}%  {images / seconds:7.0f} images/s", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
