"""BytePS's own PyTorch examples, run with only their import line switched.

``example/pytorch/train_mnist_byteps.py`` and ``benchmark_byteps.py`` come
from a BytePS checkout (never copied into this project): set
``HIPRESS_BYTEPS_CHECKOUT`` to the checkout's directory, or (MNIST only)
``HIPRESS_BYTEPS_MNIST`` to the file itself; without either a test is skipped
and says so. Each script runs unchanged except for
``import byteps.torch as bps`` -> ``import hipress_like.byteps.torch as bps``.

The MNIST script's data is replaced by scikit-learn's digits (offline): ``datasets.MNIST``
yields the 8x8 digits resized to MNIST's 28x28 uint8 images (1500 to train,
297 to test). Without torchvision installed, the three pieces of it the
script uses (``datasets.MNIST``, ``transforms.Compose/ToTensor/Normalize``)
are supplied with torchvision's semantics for that input; with torchvision,
only ``datasets.MNIST`` is replaced. The benchmark makes its own synthetic
data; it takes ``getattr(torchvision.models, args.model)``: resnet18 with
torchvision, else a small CNN registered as ``digits_cnn`` (``_install_models``).
"""
import contextlib
import hashlib
import io
import os
import re
import sys
import types
from pathlib import Path

import pytest

from hipress_like.launch.launch import run_workers

SWITCH = ("import byteps.torch as bps", "import hipress_like.byteps.torch as bps")


def _script(name, var=None):
    f = os.environ.get(var) if var else None
    if not f and os.environ.get("HIPRESS_BYTEPS_CHECKOUT"):
        f = os.path.join(os.environ["HIPRESS_BYTEPS_CHECKOUT"], "example", "pytorch", name)
    if not f or not Path(f).is_file():
        pytest.skip(f"BytePS's example/pytorch/{name} is not here: set "
                    "HIPRESS_BYTEPS_CHECKOUT to a BytePS checkout (git clone "
                    "https://github.com/bytedance/byteps)"
                    + (f" or {var} to the file" if var else ""))
    return Path(f)


def _digits_as_mnist():
    """A ``datasets.MNIST`` class over scikit-learn's digits, 28x28 uint8 images."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    d = load_digits()
    imgs = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    imgs = F.interpolate(imgs, size=(28, 28), mode="bilinear", align_corners=False)
    imgs = (imgs[:, 0] * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    labels = d.target.astype(np.int64)

    class MNIST(torch.utils.data.Dataset):
        def __init__(self, root, train=True, transform=None, target_transform=None,
                     download=False):
            sl = slice(0, 1500) if train else slice(1500, None)
            self.data, self.targets = imgs[sl], labels[sl]
            self.transform = transform

        def __len__(self):
            return len(self.targets)

        def __getitem__(self, i):
            img = self.data[i]
            if self.transform is not None:
                img = self.transform(img)
            return img, int(self.targets[i])

    return MNIST


def _install_torchvision(mnist):
    try:
        import torchvision.datasets

        torchvision.datasets.MNIST = mnist
        return
    except ImportError:
        pass
    import torch

    class Compose:
        def __init__(self, ts):
            self.ts = ts

        def __call__(self, x):
            for t in self.ts:
                x = t(x)
            return x

    class ToTensor:  # an HxW uint8 array -> a 1xHxW float tensor in [0, 1]
        def __call__(self, a):
            return torch.from_numpy(a).to(torch.float32).div(255).unsqueeze(0)

    class Normalize:
        def __init__(self, mean, std):
            self.mean, self.std = torch.tensor(mean)[:, None, None], \
                torch.tensor(std)[:, None, None]

        def __call__(self, x):
            return (x - self.mean) / self.std

    tv = types.ModuleType("torchvision")
    tv.datasets = types.ModuleType("torchvision.datasets")
    tv.datasets.MNIST = mnist
    tv.transforms = types.ModuleType("torchvision.transforms")
    tv.transforms.Compose, tv.transforms.ToTensor, tv.transforms.Normalize = \
        Compose, ToTensor, Normalize
    sys.modules.update({"torchvision": tv, "torchvision.datasets": tv.datasets,
                        "torchvision.transforms": tv.transforms})


def _install_models():
    """torchvision's ``models`` when installed; else a module with one small CNN,
    ``digits_cnn(num_classes)``, for the benchmark's ``getattr(models, args.model)``."""
    try:
        import torchvision.models  # noqa: F401

        return "resnet18"
    except ImportError:
        pass
    import torch

    def digits_cnn(num_classes=1000):
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 7, stride=4), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(8),
            torch.nn.Flatten(), torch.nn.Linear(512, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, num_classes))

    tv = sys.modules["torchvision"]
    tv.models = types.ModuleType("torchvision.models")
    tv.models.digits_cnn = digits_cnn
    sys.modules["torchvision.models"] = tv.models
    return "digits_cnn"


def example_worker(ctx, path, argv):
    src = Path(path).read_text()
    assert src.count(SWITCH[0]) == 1, "the example's BytePS import line was not found"
    src = src.replace(SWITCH[0], SWITCH[1])
    _install_torchvision(_digits_as_mnist())
    if "--model" in argv:  # the benchmark: a model its getattr(models, ...) finds
        argv = [_install_models() if a == "MODEL" else a for a in argv]
    sys.argv = [str(path), *argv]
    g = {"__name__": "__main__", "__file__": str(path)}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(src, str(path), "exec"), g)  # noqa: S102 - the fetched example itself
    h = hashlib.sha256()
    for k, v in sorted(g["model"].state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    acc = [float(a) for a in re.findall(r"Accuracy: ([0-9.]+)%", out.getvalue())]
    acc += [float(a) for a in re.findall(r"Iter #\d+: ([0-9.]+) img/sec", out.getvalue())]
    g["bps"].shutdown()
    return {"digest": h.hexdigest(), "acc": acc, "log": out.getvalue()[-2000:]}


@pytest.mark.parametrize("extra", [[], ["--fp16-pushpull"]])
def test_byteps_mnist_example_trains_digits_with_the_import_switched(extra):
    path = _script("train_mnist_byteps.py", "HIPRESS_BYTEPS_MNIST")
    argv = ["--epochs", "8", "--lr", "0.05", "--log-interval", "1000", *extra]
    res = run_workers(example_worker, 2, args=(str(path), argv), timeout=400)
    assert res[0]["digest"] == res[1]["digest"]  # ranks bitwise identical
    acc = res[0]["acc"]  # rank 0 prints the averaged test accuracy once per epoch
    assert len(acc) == 8, res[0]["log"]
    assert acc[-1] >= 80.0, res[0]["log"]
    print("test accuracy per epoch", acc)


@pytest.mark.parametrize("extra", [[], ["--fp16-pushpull"]])
def test_byteps_benchmark_example_runs_with_the_import_switched(extra):
    """``benchmark_byteps.py`` on its own synthetic data; a tiny batch and few
    iterations (CPU), its model from torchvision when installed (resnet18), else
    the small ``digits_cnn`` (module docstring)."""
    path = _script("benchmark_byteps.py")
    argv = ["--no-cuda", "--model", "MODEL", "--batch-size", "2",
            "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2",
            *extra]
    res = run_workers(example_worker, 2, args=(str(path), argv), timeout=400)
    assert res[0]["digest"] == res[1]["digest"]  # ranks bitwise identical after its steps
    speeds = res[0]["acc"]  # rank 0 logs img/sec per iteration
    assert len(speeds) == 2 and all(v > 0 for v in speeds), res[0]["log"]
