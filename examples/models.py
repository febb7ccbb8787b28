"""Models shared by the examples and ``bench/train.py`` (no torchvision needed).

- ``vgg_style``: three 3x3 conv layers (32/64/512 channels, each followed by
  2x2 max-pooling) on 32x32 inputs and fully-connected layers
  8192 -> 2560 -> 2048 -> classes: 26.6M parameters, 99% of them in the FC
  layers, the shape of model where gradient compression pays off most
  (HiPress evaluates VGG19 for the same reason).
- ``resnet18``: the CIFAR-style ResNet-18 (BasicBlock x [2, 2, 2, 2],
  64-512 channels): 11.2M parameters spread over 62 tensors, most of them
  small.
"""
from torch import nn

__all__ = ["vgg_style", "resnet18", "MODELS"]


def vgg_style(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """The VGG-style CNN with large fully-connected layers (26.6M parameters)."""
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)]

    return nn.Sequential(
        *block(in_channels, 32), *block(32, 64), *block(64, 512), nn.Flatten(),
        nn.Linear(512 * 4 * 4, 2560), nn.ReLU(inplace=True),
        nn.Linear(2560, 2048), nn.ReLU(inplace=True),
        nn.Linear(2048, num_classes))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class _ResNet(nn.Module):
    def __init__(self, num_classes: int, in_channels: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(512, num_classes))

    def forward(self, x):
        return self.head(self.layers(self.stem(x)))


def resnet18(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
    """CIFAR-style ResNet-18 (11.2M parameters)."""
    return _ResNet(num_classes, in_channels)


MODELS = {"vgg": vgg_style, "resnet18": resnet18}
