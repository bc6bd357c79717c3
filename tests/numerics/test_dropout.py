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


def test_the_kernels_keep_test_on_the_whole_hash_is_the_reference_s():
    """The attention kernels compare the whole 32-bit hash with ``rng.keep_bits(p)``
    where the reference compares its top 24 bits with ``keep_threshold(p)``: the same
    decision for every hash, at the threshold's edges too; none kept where p is within
    2**-24 of 1 (the threshold past uint32)."""
    gen = torch.Generator().manual_seed(0)
    for p in (0.1, 0.25, 0.5, 0.9, 1 - 2**-23):
        t, bits = rng.keep_threshold(p), rng.keep_bits(p)
        x = torch.cat([torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64),
                       torch.tensor([t << 8, (t << 8) - 1, 0, 2**32 - 1])])
        assert bits is not None and torch.equal((x >> 8) >= t, x >= bits), p
    assert rng.keep_threshold(1 - 2**-30) == 2**24 and rng.keep_bits(1 - 2**-30) is None
