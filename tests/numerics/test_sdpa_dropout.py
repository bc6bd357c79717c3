"""SDPA's dropout_p, end to end: a step whose attention drops probabilities trains
exactly what torch trains with the same multiplier on them (``nova.rng``'s bits:
Nova's own, so eager gets them from ``rng.dropout_scale`` with the step's seed and
the op's salt), in float64 on the reference backend and through the interpreted
Triton kernels."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nova
from nova import rng

P = 0.25


class Attention(nn.Module):
    """One causal self-attention layer and a regression loss; ``mask`` replaces
    SDPA's dropout by an explicit multiplier on the probabilities (the eager twin)."""

    def __init__(self, d=16, heads=2, learned_bias=False):
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads
        # a learned additive score bias (as ALiBi-like models train): its gradient is built from plain
        # ops, the dropout multiplier among them (autodiff's _attention_dbias)
        self.bias = nn.Parameter(0.1 * torch.randn(1, heads, 8, 8)) if learned_bias else None

    def forward(self, x, y, mask=None):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, 2))
        causal = ~torch.ones(t, t, dtype=torch.bool).tril()
        bias = None if self.bias is None else self.bias.masked_fill(causal, float("-inf"))
        if mask is None:
            p = P if self.training else 0.0
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p, is_causal=bias is None)
        else:
            s = (q @ k.transpose(-1, -2)) * (c // self.heads) ** -0.5
            s = s.masked_fill(causal, float("-inf")) if bias is None else s + bias
            o = (torch.softmax(s, -1) * mask) @ v
        return F.mse_loss(self.proj(o.transpose(1, 2).reshape(b, t, c)), y)


def _seed(n: int) -> int:
    """The seed Nova draws for its step after ``torch.manual_seed(n)`` (one draw of
    torch's default generator a step: ``nova.api``)."""
    torch.manual_seed(n)
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))


@pytest.mark.parametrize("learned_bias", [False, True], ids=["causal", "learned-bias"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_sdpa_dropout_step_matches_torch_with_the_same_mask(backend, learned_bias):
    dtype = torch.float64 if backend == "reference" else torch.float32
    torch.manual_seed(0)
    model = Attention(learned_bias=learned_bias).to(dtype)
    twin = Attention(learned_bias=learned_bias).to(dtype)
    twin.load_state_dict(model.state_dict())
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), backend=backend)
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    for i in range(3):
        x, y = (torch.randn(2, 8, 16, generator=gen, dtype=dtype) for _ in range(2))
        mask = rng.dropout_scale(_seed(100 + i), 1, (2, 2, 8, 8), P, dtype, "cpu")  # the model's one dropout: salt 1
        assert 0 < (mask == 0).sum() < mask.numel()
        torch.manual_seed(100 + i)
        loss = step(x, y)
        opt.zero_grad()
        want = twin(x, y, mask)
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach(), **tol)
        for (name, a), b in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), **tol, msg=name)


def test_sdpa_dropout_off_in_eval_and_masks_vary_by_step():
    torch.manual_seed(0)
    model = Attention().double()
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.0))
    x, y = torch.randn(2, 8, 16, dtype=torch.float64), torch.randn(2, 8, 16, dtype=torch.float64)
    a, b = step(x, y).item(), step(x, y).item()
    assert a != b  # lr 0: only the masks differ
    model.eval()
    with torch.no_grad():
        eager = model(x, y).item()
    assert step(x, y).item() == pytest.approx(eager, rel=1e-12)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_transformers_default_dropout_configs_train(family):
    """GPT-2 and BERT as transformers configures them by default (attention
    dropout 0.1, passed to SDPA in training) compile, carry the config's dropout
    into every attention op, and train: finite losses that fall on a fixed batch."""
    transformers = pytest.importorskip("transformers")
    from nova.ir import dialect as nv

    from hf_models import V, CausalLM, MaskedLM, make_batches

    torch.manual_seed(0)
    if family == "gpt2":
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2,
                                                                 n_head=4))  # fmt: skip
        p, model = m.config.attn_pdrop, CausalLM
    else:
        m = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=V, num_hidden_layers=2, num_attention_heads=4,
                                                                 hidden_size=32, intermediate_size=48,
                                                                 max_position_embeddings=32))  # fmt: skip
        p, model = m.config.attention_probs_dropout_prob, MaskedLM
    assert p > 0
    m.config._attn_implementation = "sdpa"
    model = model(m.train())
    step = nova.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    batch = make_batches(family, 1)[0]
    losses = [step(*batch).item() for _ in range(8)]
    attention = [op for op in step._last.fn.body.block.ops if isinstance(op, nv.AttentionOp)]
    assert len(attention) == 2 and all(op.props()["dropout"] == pytest.approx(p) for op in attention)
    assert len({op.props()["salt"] for op in attention}) == 2  # each layer its own bits
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
