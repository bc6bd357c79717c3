"""Batch norm (the converters in ``nova/capture/aten.py``, ``_batch_norm``) trains
like eager: the output and gradients from the batch's statistics in training mode, the running
statistics and ``num_batches_tracked`` written into the model's buffers by the step (the
step's ``buffer`` results, written in place like the parameters), the running statistics
used in eval mode; 1-D and 2-D, with and without affine weights, momentum None refused.
Each case trains 3 steps like eager, loss, every parameter and every buffer, in float64
on the reference backend and float32 through the interpreted Triton kernels."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nova
from train_like_eager import assert_trains_like_eager


class BNNet(nn.Module):
    def __init__(self, norm: nn.Module, conv: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1) if conv else nn.Linear(6, 4)
        self.bn = norm
        self.out = nn.Linear(4, 3)

    def forward(self, x, y):
        h = F.relu(self.bn(self.conv(x)))
        if h.dim() == 4:
            h = h.mean((2, 3))
        return F.cross_entropy(self.out(h), y)


CASES = {  # name: (norm, conv, input shape, mode)
    "2d-train": (lambda: nn.BatchNorm2d(4), True, (3, 3, 5, 4), "train"),
    "1d-train-no-affine": (lambda: nn.BatchNorm1d(4, affine=False, momentum=0.3), False, (5, 6), "train"),
    "1d-train-no-running-stats": (lambda: nn.BatchNorm1d(4, track_running_stats=False), False, (5, 6), "train"),
    "2d-eval": (lambda: nn.BatchNorm2d(4), True, (3, 3, 5, 4), "eval"),
}


def _trains_like_eager(case: str, backend: str) -> None:
    make, conv, shape, mode = CASES[case]
    torch.manual_seed(0)
    dtype = torch.float64 if backend == "reference" else torch.float32
    eager = BNNet(make(), conv).to(dtype)
    with torch.no_grad():  # running statistics that are not the defaults, so eval mode reads something
        for name, buf in eager.bn.named_buffers():
            if buf.is_floating_point():
                buf.copy_(torch.rand_like(buf) + (0.5 if name == "running_var" else -0.5))
    getattr(eager, mode)()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(shape, generator=g, dtype=dtype) * 2 + 1, torch.randint(0, 3, (shape[0],), generator=g))
               for _ in range(3)]  # fmt: skip
    assert_trains_like_eager(eager, batches, backend)


@pytest.mark.parametrize("case", list(CASES))
def test_batch_norm_trains_like_eager(case):
    _trains_like_eager(case, "reference")


@pytest.mark.parametrize("case", ["2d-train", "2d-eval"])
def test_batch_norm_trains_like_eager_through_triton(case):
    _trains_like_eager(case, "triton")


def test_batch_norm_buffers_are_written_in_place():
    """The step writes the running statistics into the model's own tensors (a state_dict or a
    reference taken before the step sees the new values), as eager's forward does."""
    torch.manual_seed(0)
    model = BNNet(nn.BatchNorm1d(4), False)
    mean, count = model.bn.running_mean, model.bn.num_batches_tracked
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="reference")
    step(torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1]))
    assert model.bn.running_mean is mean and model.bn.num_batches_tracked is count
    assert int(count) == 1 and bool((mean != 0).all())


def test_cumulative_moving_average_is_refused():
    """momentum=None divides by num_batches_tracked, read on the host in eager: refused, not
    traced with the count it had at capture."""
    model = BNNet(nn.BatchNorm1d(4, momentum=None), False)
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="reference")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(nova.CaptureError, match="data-dependent"):
        step(torch.randn(5, 6), torch.tensor([0, 1, 2, 0, 1]))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class EmbedBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 3)

    def forward(self, ids, y):
        return F.cross_entropy(self.out(self.bn(self.emb(ids))), y)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_failed_step_leaves_the_running_statistics_as_they_were(backend):
    """An out-of-range id makes the step write nothing: the running statistics and the
    batch count are gated like the parameters (the guard stage)."""
    torch.manual_seed(0)
    model = EmbedBN()
    step = nova.compile(model, torch.optim.AdamW(model.parameters()), backend=backend)
    y = torch.tensor([0, 1, 2, 0])
    step(torch.tensor([1, 2, 3, 4]), y)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(IndexError, match="out of range"):
        step(torch.tensor([1, 2, 30, 4]), y)  # the reference raises at the call
        step.check()  # the Triton step when the device's counts are read
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    step(torch.tensor([1, 2, 3, 4]), y)
    step.check()
    assert int(model.bn.num_batches_tracked) == 2


class Counting(nn.Module):
    """Buffers the forward writes in place by hand: a count of the rows seen and an
    exponential average of the hidden state's mean (detached), read back by the loss."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x, y):
        h = self.lin(x)
        self.seen.add_(x.shape[0])
        self.ema.mul_(0.9).add_(0.1 * h.mean(0).detach())
        return F.cross_entropy(h + self.ema, y)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_buffers_written_in_place_by_the_forward_are_written_by_the_step(backend):
    torch.manual_seed(0)
    dtype = torch.float64 if backend == "reference" else torch.float32
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=g, dtype=dtype), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    assert_trains_like_eager(Counting().to(dtype), batches, backend)  # the count and the average among the buffers
