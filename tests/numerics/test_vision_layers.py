"""The layers of convolutional networks beside convolutions and batch norm, each from plain
ops in capture (``nova/capture/aten_data.py``, "pooling"; ``aten.py``: group norm): max
pooling (its indices too, ties to the first maximum as eager), average pooling (eager's
divisors: padding counted or not, ceil mode, divisor_override), adaptive average pooling
(eager's windows, of unequal lengths too), nearest and (bi-, tri-)linear upsampling (eager's source indices
and weights, align_corners or not), group norm; and a small ResNet and a small decoder built
of them. Each trains 3 SGD steps like eager in float64 on the reference backend (loss, every
parameter and buffer); some through the interpreted Triton kernels in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nova
from train_like_eager import assert_trains_like_eager
from vision_models import TinyDecoder, TinyResNet

LAYERS = {  # name: (layer, input shape)
    "max2d": (lambda: nn.MaxPool2d(2), (2, 3, 6, 5)),
    "max2d-stem": (lambda: nn.MaxPool2d(3, stride=2, padding=1), (2, 3, 7, 7)),  # ResNet's
    "max2d-ceil-dilation": (lambda: nn.MaxPool2d(2, stride=2, dilation=2, ceil_mode=True), (2, 3, 8, 7)),
    "max1d": (lambda: nn.MaxPool1d(3, stride=2, padding=1, ceil_mode=True), (2, 3, 10)),
    "max3d": (lambda: nn.MaxPool3d(2), (1, 2, 4, 4, 4)),
    "avg2d": (lambda: nn.AvgPool2d(3, stride=2, padding=1), (2, 3, 7, 6)),
    "avg2d-exclude-pad-ceil": (lambda: nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                               (2, 3, 8, 7)),
    "avg2d-ceil": (lambda: nn.AvgPool2d(2, ceil_mode=True), (2, 3, 5, 5)),
    "avg2d-divisor": (lambda: nn.AvgPool2d(2, divisor_override=3), (2, 3, 6, 4)),
    "avg1d": (lambda: nn.AvgPool1d(4, stride=3, padding=2), (2, 3, 11)),
    "adaptive-avg2d": (lambda: nn.AdaptiveAvgPool2d((2, 3)), (2, 3, 6, 6)),
    "adaptive-avg2d-uneven": (lambda: nn.AdaptiveAvgPool2d((3, 5)), (2, 3, 7, 9)),  # windows of unequal lengths
    "adaptive-avg1d-up": (lambda: nn.AdaptiveAvgPool1d(5), (2, 3, 3)),  # more outputs than inputs: windows overlap
    "upsample-x2": (lambda: nn.Upsample(scale_factor=2), (2, 3, 3, 4)),
    "upsample-size": (lambda: nn.Upsample(size=(5, 7)), (2, 3, 3, 4)),
    "upsample-x1.5": (lambda: nn.Upsample(scale_factor=1.5), (2, 3, 4, 3)),
    "groupnorm": (lambda: nn.GroupNorm(3, 6), (2, 6, 4, 3)),
    "bilinear-x2": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), (2, 3, 3, 4)),
    "bilinear-align-size": (lambda: nn.Upsample(size=(5, 7), mode="bilinear", align_corners=True), (2, 3, 3, 4)),
    "bilinear-x1.7": (lambda: nn.Upsample(scale_factor=1.7, mode="bilinear"), (2, 3, 4, 3)),
    "linear1d-down": (lambda: nn.Upsample(size=3, mode="linear"), (2, 3, 7)),
    "trilinear": (lambda: nn.Upsample(scale_factor=(1, 2, 1.5), mode="trilinear"), (1, 2, 2, 3, 2)),
}


class Around(nn.Module):
    """conv -> the layer -> a head, so the layer sees values and gradients of its own."""

    def __init__(self, layer, channels: int, rank: int):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[rank]
        self.conv = conv(channels, channels, 1)
        self.layer = layer
        self.head = nn.LazyLinear(4)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.layer(self.conv(x)).flatten(1)), y)


def _trains_like_eager(make, shape, backend: str, steps: int = 3, ints: bool = False) -> None:
    torch.manual_seed(0)
    dtype = torch.float64 if backend == "reference" else torch.float32
    eager = make().to(dtype)
    g = torch.Generator().manual_seed(1)

    def batch():
        x = torch.randint(-3, 4, shape, generator=g).to(dtype) if ints else torch.randn(shape, generator=g, dtype=dtype)
        return x, torch.randint(0, 4, (shape[0],), generator=g)

    eager(*batch())  # sizes the lazy head
    assert_trains_like_eager(eager, [batch() for _ in range(steps)], backend)


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_trains_like_eager(name):
    make, shape = LAYERS[name]
    _trains_like_eager(lambda: Around(make(), shape[1], len(shape) - 2), shape, "reference")


@pytest.mark.parametrize("name", ["max2d-stem", "avg2d-exclude-pad-ceil", "upsample-x1.5", "groupnorm", "bilinear-x1.7",
                                  "adaptive-avg2d-uneven"])
def test_layer_trains_like_eager_through_triton(name):
    make, shape = LAYERS[name]
    _trains_like_eager(lambda: Around(make(), shape[1], len(shape) - 2), shape, "triton", steps=2)


class Ties(nn.Module):
    """Max pooling of integer-valued inputs, so windows hold equal maxima: eager gives the
    whole gradient to the first of them in the window's row-major order, and so must Nova."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3, 1, 1))
        self.head = nn.Linear(3 * 3 * 3, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.head(F.max_pool2d(x * self.scale, 3, stride=2, padding=1).flatten(1)), y)


def test_max_pool_ties_go_to_the_first_maximum():
    _trains_like_eager(Ties, (2, 3, 6, 6), "reference", ints=True)


def test_max_pool_indices_are_eagers():
    """return_indices=True: the flat index of each maximum in its input plane, ties included."""

    class WithIndices(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x, y):
            out, idx = F.max_pool2d(x * self.w, 3, stride=2, padding=1, return_indices=True)
            return (out * (idx.to(out.dtype) + 1)).mean() + 0 * y.sum()

    _trains_like_eager(WithIndices, (2, 3, 7, 6), "reference", ints=True)


def test_a_tiny_resnet_trains_like_eager():
    _trains_like_eager(TinyResNet, (4, 3, 16, 16), "reference")


def test_a_tiny_decoder_trains_like_eager():
    _trains_like_eager(TinyDecoder, (2, 3, 6, 6), "reference")


class InPlaceDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.drop = nn.Dropout(0.25, inplace=True)

    def forward(self, x):
        return self.drop(x * self.w).sum()


def test_in_place_dropout_keeps_three_quarters_scaled():
    """nn.Dropout(inplace=True): PyTorch draws it on the CPU as bernoulli(1 - p), divided by
    1 - p and multiplied in; Nova's bernoulli is its dropout mask's draw. Each element is 0 or
    x / 0.75 exactly, about 3/4 of them kept, and the gradient of w is the kept x's sum / 0.75."""
    model = InPlaceDropout()
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=1.0), backend="reference")
    x = torch.rand(200, 200) + 1.0
    loss = step(x)
    kept_sum = (loss / 1.0).item()  # the loss is the kept elements' sum / 0.75 (w = 1)
    kept = kept_sum * 0.75 / x.mean().item() / x.numel()
    assert 0.72 < kept < 0.78, kept
    assert torch.allclose(model.w.detach(), torch.tensor(1.0 - kept_sum), rtol=1e-5)  # SGD: w -= grad, grad = loss
