"""BytePS's own PyTorch example, run with only its import line switched.

``example/pytorch/train_mnist_byteps.py`` comes from a BytePS checkout (never
copied into this project): set ``HIPRESS_BYTEPS_CHECKOUT`` to the checkout's
directory, or ``HIPRESS_BYTEPS_MNIST`` to the file itself; without either the
test is skipped and says so. The script runs unchanged except for
``import byteps.torch as bps`` -> ``import hipress_like.byteps.torch as bps``.

Its data is replaced by scikit-learn's digits (offline): ``datasets.MNIST``
yields the 8x8 digits resized to MNIST's 28x28 uint8 images (1500 to train,
297 to test). Without torchvision installed, the three pieces of it the
script uses (``datasets.MNIST``, ``transforms.Compose/ToTensor/Normalize``)
are supplied with torchvision's semantics for that input; with torchvision,
only ``datasets.MNIST`` is replaced.
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


def _mnist_script():
    f = os.environ.get("HIPRESS_BYTEPS_MNIST")
    if not f and os.environ.get("HIPRESS_BYTEPS_CHECKOUT"):
        f = os.path.join(os.environ["HIPRESS_BYTEPS_CHECKOUT"], "example", "pytorch",
                         "train_mnist_byteps.py")
    return Path(f) if f else None


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


def example_worker(ctx, path, argv):
    src = Path(path).read_text()
    assert src.count(SWITCH[0]) == 1, "the example's BytePS import line was not found"
    src = src.replace(SWITCH[0], SWITCH[1])
    _install_torchvision(_digits_as_mnist())
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
    g["bps"].shutdown()
    return {"digest": h.hexdigest(), "acc": acc, "log": out.getvalue()[-2000:]}


@pytest.mark.parametrize("extra", [[], ["--fp16-pushpull"]])
def test_byteps_mnist_example_trains_digits_with_the_import_switched(extra):
    path = _mnist_script()
    if path is None or not path.is_file():
        pytest.skip("BytePS's example/pytorch/train_mnist_byteps.py is not here: set "
                    "HIPRESS_BYTEPS_CHECKOUT to a BytePS checkout (git clone "
                    "https://github.com/bytedance/byteps) or HIPRESS_BYTEPS_MNIST to the file")
    argv = ["--epochs", "8", "--lr", "0.05", "--log-interval", "1000", *extra]
    res = run_workers(example_worker, 2, args=(str(path), argv), timeout=400)
    assert res[0]["digest"] == res[1]["digest"]  # ranks bitwise identical
    acc = res[0]["acc"]  # rank 0 prints the averaged test accuracy once per epoch
    assert len(acc) == 8, res[0]["log"]
    assert acc[-1] >= 80.0, res[0]["log"]
    print("test accuracy per epoch", acc)
