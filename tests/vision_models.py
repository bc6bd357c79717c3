"""Small vision models for the tests: torchvision's ResNet layout at toy size (conv,
batch norm, max pooling, basic residual blocks, global average pooling)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())  # fmt: skip

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.down(x))


class TinyResNet(nn.Module):
    """torchvision's ResNet layout at toy size: conv 7x7 / 2, BN, ReLU, max pool 3 / 2, two
    stages of basic blocks, global average pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(3, stride=2, padding=1))  # fmt: skip
        self.stages = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(self.pool(self.stages(self.stem(x))).flatten(1)), y)


class TinyDecoder(nn.Module):
    """A VAE / UNet decoder's layers at toy size: conv, group norm, SiLU, a transposed
    convolution (x2), nearest upsampling (x2), average pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.up = nn.ConvTranspose2d(8, 8, 4, stride=2, padding=1)
        self.out = nn.Conv2d(8, 4, 3, padding=1)
        self.head = nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.up(F.silu(self.norm(self.conv(x))))
        h = self.out(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return F.cross_entropy(self.head(F.avg_pool2d(h, h.shape[-1]).flatten(1)), y)
