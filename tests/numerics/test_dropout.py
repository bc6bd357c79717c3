"""Dropout: Nova's counter-based RNG (nova.rng) has torch's distribution and
reproduces with torch.manual_seed, though not torch's bit stream."""

import torch

from nova import rng
import nova
from nova.models import GPT, gpt_tiny


def test_mask_statistics_and_scale():
    m = rng.dropout_scale(1234, 3, (200, 500), 0.25, torch.float64, "cpu")
    kept = m != 0
    assert abs(kept.double().mean().item() - 0.75) < 0.005
    assert torch.allclose(m[kept], torch.full_like(m[kept], 1 / 0.75))
    other = rng.dropout_scale(1235, 3, (200, 500), 0.25, torch.float64, "cpu")
    salted = rng.dropout_scale(1234, 4, (200, 500), 0.25, torch.float64, "cpu")
    assert (m != other).any() and (m != salted).any()
    assert torch.equal(m, rng.dropout_scale(1234, 3, (200, 500), 0.25, torch.float64, "cpu"))


def _train(seed):
    torch.manual_seed(0)
    model = GPT(gpt_tiny(dropout=0.2, attention="manual")).double()
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(seed)
    x = torch.randint(0, 256, (2, 32))
    return [step(x, x).item() for _ in range(3)]


def test_dropout_reproduces_with_manual_seed_and_varies_with_it():
    a, b, c = _train(1), _train(1), _train(2)
    assert a == b
    assert a != c


def test_dropout_gradient_uses_the_same_mask():
    # with dropout, the loss must still fall under SGD on a fixed batch
    losses = _train(3)
    assert losses[-1] < losses[0]
