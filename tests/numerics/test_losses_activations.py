"""Losses and activations built on log1p, expm1, isnan and the vector norm (capture:
``nova.log1p`` and ``nova.expm1``, accurate near 0 as torch's; isnan / isinf / isfinite as
compares; the 1- and 2-norm, whose gradient at a zero vector is 0 as torch's): each trains 3
SGD steps like eager in float64 on the reference backend, a few through the interpreted
Triton kernels in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nova
from train_like_eager import assert_trains_like_eager

CASES = {  # name: loss of (h, y), h [6, 4] from a linear layer, y [6, 4] random
    "bce-with-logits": lambda h, y: F.binary_cross_entropy_with_logits(h, (y > 0).to(h.dtype)),
    "bce-with-logits-pos-weight": lambda h, y: F.binary_cross_entropy_with_logits(
        h * 8, (y > 0).to(h.dtype), pos_weight=torch.full((4,), 3.0, dtype=h.dtype)),
    "bce": lambda h, y: F.binary_cross_entropy(torch.sigmoid(h), (y > 0).to(h.dtype)),
    "softplus": lambda h, y: F.softplus(h * 30, beta=0.5).mean(),  # both sides of the threshold
    "logsigmoid": lambda h, y: F.logsigmoid(h * 10).mean(),
    "mish": lambda h, y: F.mish(h).square().mean(),
    "elu": lambda h, y: F.elu(h, alpha=0.7).square().mean(),
    "selu": lambda h, y: F.selu(h).square().mean(),
    "celu": lambda h, y: F.celu(h, alpha=2.0).square().mean(),
    "expm1-log1p": lambda h, y: (torch.expm1(h * 1e-3) + torch.log1p(h.abs() * 1e-4)).sum() * 1e3,
    "kl-div": lambda h, y: F.kl_div(F.log_softmax(h, -1), F.softmax(y, -1), reduction="batchmean"),
    "cosine": lambda h, y: 1 - F.cosine_similarity(h, y).mean(),
    "normalize-zero-row": lambda h, y: (F.normalize(h * (y[:, :1] > -0.5), dim=-1) * y).sum(),
    "norm-1": lambda h, y: torch.linalg.vector_norm(h - y, ord=1, dim=0).mean(),
    "isfinite-mask": lambda h, y: torch.where(torch.isfinite(torch.log(h)), h, 0).mean() + torch.isinf(h).sum(),
}


class Head(nn.Module):
    def __init__(self, loss):
        super().__init__()
        self.lin = nn.Linear(5, 4)
        self.loss = loss

    def forward(self, x, y):
        return self.loss(self.lin(x), y)


def _trains_like_eager(name: str, backend: str) -> None:
    torch.manual_seed(0)
    dtype = torch.float64 if backend == "reference" else torch.float32
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 5, generator=g, dtype=dtype), torch.randn(6, 4, generator=g, dtype=dtype))
               for _ in range(3)]  # fmt: skip
    tol = None if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    assert_trains_like_eager(Head(CASES[name]).to(dtype), batches, backend, tol,
                             lambda params: torch.optim.SGD(params, lr=0.1))  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_trains_like_eager(name):
    _trains_like_eager(name, "reference")


@pytest.mark.parametrize("name", ["bce-with-logits-pos-weight", "mish", "elu", "normalize-zero-row"])
def test_trains_like_eager_through_triton(name):
    _trains_like_eager(name, "triton")


def test_vector_norm_of_another_order_is_refused():
    model = Head(lambda h, y: torch.linalg.vector_norm(h, ord=3))
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(nova.UnsupportedError, match="vector_norm with ord=3"):
        step(torch.randn(6, 5), torch.randn(6, 4))
