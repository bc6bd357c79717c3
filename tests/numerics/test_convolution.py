"""Convolutions as matmuls over their patches (capture's im2col, ``aten_data._convolution``):
1-, 2- and 3-D, stride, zero padding, dilation, groups (depthwise too), with and without
a bias, and the patch embedding's reshape; transposed ones (stride, padding, cropping,
output_padding, dilation, groups) as the plain convolution of their spread input. Each trains
3 SGD steps like eager in float64 (loss and every parameter), on the reference backend and
the interpreted Triton kernels."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nova

CASES = {  # name: (conv, input shape)
    "1d-pad-stride": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1), (2, 4, 9)),  # Whisper's second conv
    "2d-dilation-groups": (lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2), (2, 4, 7, 6)),
    "2d-depthwise-no-bias": (lambda: nn.Conv2d(4, 4, (3, 2), stride=(1, 2), groups=4, bias=False), (2, 4, 5, 7)),
    "2d-patches": (lambda: nn.Conv2d(3, 5, 4, stride=4), (2, 3, 10, 9)),  # a reshape; the tail pixels left out
    "3d": (lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1), padding=(1, 0, 0)), (1, 2, 3, 4, 3)),
    # transposed: the input gradient's convolution (a decoder's upsampling)
    "t1d-stride-outpad": (lambda: nn.ConvTranspose1d(4, 3, 3, stride=2, padding=1, output_padding=1), (2, 4, 5)),
    "t2d-x2": (lambda: nn.ConvTranspose2d(4, 6, 4, stride=2, padding=1), (2, 4, 3, 4)),  # DCGAN's, a VAE decoder's
    "t2d-groups-dilation": (lambda: nn.ConvTranspose2d(4, 6, 3, stride=(2, 1), padding=(0, 2), dilation=2, groups=2,
                                                       bias=False), (2, 4, 3, 5)),
    "t2d-crop": (lambda: nn.ConvTranspose2d(3, 2, 2, padding=2), (1, 3, 6, 5)),  # padding past the kernel crops
    "t3d": (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (1, 2, 2, 3, 2)),
}


class ConvNet(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv
        self.out = nn.LazyLinear(3)

    def forward(self, x, y):
        h = F.gelu(self.conv(x))
        return F.cross_entropy(self.out(h.flatten(1)), y)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_convolution_trains_like_eager(case, backend):
    make, shape = CASES[case]
    torch.manual_seed(0)
    dtype = torch.float64 if backend == "reference" else torch.float32
    x = torch.randn(shape, dtype=dtype)
    eager = ConvNet(make()).to(dtype)
    eager(x, torch.zeros(shape[0], dtype=torch.long))  # sizes the lazy head
    ours = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    step = nova.compile(ours, torch.optim.SGD(ours.parameters(), lr=0.1), backend=backend)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(shape, generator=g, dtype=dtype)
        y = torch.randint(0, 3, (shape[0],), generator=g)
        opt_e.zero_grad()
        want = eager(x, y)
        want.backward()
        opt_e.step()
        torch.testing.assert_close(step(x, y), want.detach(), **tol)
        for (name, a), b in zip(ours.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), **tol, msg=name)
