"""Batch norm and the vision layers on the GPU (tests/numerics/test_batch_norm.py and
test_vision_layers.py on the CPU): a small conv net with BatchNorm2d, a tiny ResNet
(max pooling, residual blocks) and a tiny decoder (group norm, a transposed convolution,
nearest upsampling), the Triton backend against the reference executor on CUDA,
fp32 and bf16, 5 SGD-with-momentum steps in training mode, then 2 in eval mode: the loss,
every parameter and the running statistics (written into the buffers in place by both)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nova
from vision_models import TinyDecoder, TinyResNet

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {"fp32": 1e-4, "bf16": 2e-2}


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x, y):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("model", ["convbn", "resnet", "decoder"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_triton_step_trains_batch_norm_like_the_reference(precision, model):
    torch.manual_seed(0)
    ref = {"convbn": ConvBN, "resnet": TinyResNet, "decoder": TinyDecoder}[model]().cuda()
    mine = copy.deepcopy(ref)
    oracle = nova.compile(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), precision=precision,
                          backend="reference")  # fmt: skip
    step = nova.compile(mine, torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9), precision=precision,
                        backend="triton")  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(1)
    for i in range(7):
        if i == 5:
            ref.eval(), mine.eval()
        x = torch.randn(16, 3, 16, 16, device="cuda", generator=g) * 2 + 0.5
        y = torch.randint(0, 4, (16,), device="cuda", generator=g)
        loss, ref_loss = step(x, y), oracle(x, y)
        assert abs(loss.item() - ref_loss.item()) <= TOL[precision] * abs(ref_loss.item()), i
        vectors = []  # bf16: 1-D parameters as one vector (below)
        for (n, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
            if precision == "bf16" and p.dim() == 1:
                vectors.append((p.detach().flatten(), q.detach().flatten()))
                continue
            assert _rel(p.detach(), q.detach()) <= TOL[precision], (i, n)
        if vectors:
            # a batch norm bias's gradient is a sum over the batch that cancels down to bf16's noise:
            # alone, each differs between two bf16 runs as much as autocast's from fp32 (0.05-0.4
            # relative after 3 steps of TinyResNet on the CPU); together with the norm weights they are held
            assert _rel(torch.cat([p for p, _ in vectors]), torch.cat([q for _, q in vectors])) <= TOL[precision], i
        for (n, p), q in zip(mine.named_buffers(), ref.buffers(), strict=True):
            assert (_rel(p, q) <= TOL[precision]) if p.is_floating_point() else torch.equal(p, q), (i, n)
    step.check()
    assert all(int(b) == 5 for n, b in mine.named_buffers() if n.endswith("num_batches_tracked"))
