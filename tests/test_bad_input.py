"""Bad input: clear errors, raised before anything runs, with parameters and
optimizer state untouched; new batch shapes compile a new program."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nova
from nova.models import GPT, gpt_tiny


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(gpt_tiny(n_layer=1))


def batch(B=2, T=16, vocab=256):
    return torch.randint(0, vocab, (B, T)), torch.randint(0, vocab, (B, T))


def snapshot(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def assert_untouched(model, opt, snap):
    params, state = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    assert opt.state_dict()["state"].keys() == state["state"].keys()
    for i, st in state["state"].items():
        for k, v in st.items():
            assert torch.equal(opt.state_dict()["state"][i][k], v)


class Unsupported(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32)

    def forward(self, x, y):
        h = self.emb(x)
        h = torch.erfinv(torch.tanh(h))  # not in nova's op table, and no decomposition
        h = torch.sort(h, dim=-1).values  # nor this
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def test_unsupported_ops_listed_together_at_compile_time():
    model = Unsupported()
    opt = torch.optim.AdamW(model.parameters())
    snap = snapshot(model, opt)
    step = nova.compile(model, opt)
    with pytest.raises(nova.UnsupportedError) as e:
        step(*batch(vocab=32))
    msg = str(e.value)
    assert "erfinv" in msg and "sort" in msg, msg
    assert len(e.value.problems) == 2
    assert all("node" in where for _, where in e.value.problems)  # each with its location
    assert_untouched(model, opt, snap)


def test_unsupported_argument_named():
    class MaskedSDPA(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            q = (x @ self.w).view(1, 1, 4, 8)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).sum()

    model = MaskedSDPA()
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(nova.UnsupportedError, match="dropout_p"):
        step(torch.randn(4, 8))


def test_non_scalar_loss_is_an_error():
    class NotALoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    model = NotALoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = snapshot(model, opt)
    with pytest.raises(nova.CaptureError, match="0-d floating-point loss"):
        nova.compile(model, opt)(torch.randn(3, 4))
    assert_untouched(model, opt, snap)


def test_optimizer_over_foreign_tensors_is_an_error():
    model = tiny_gpt()
    stranger = nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([*model.parameters(), stranger])
    with pytest.raises(nova.CaptureError, match="not a parameter of the model"):
        nova.compile(model, opt)


def test_unsupported_optimizer_is_an_error():
    model = tiny_gpt()
    step = nova.compile(model, torch.optim.RMSprop(model.parameters()))
    with pytest.raises(nova.UnsupportedError, match="RMSprop"):
        step(*batch())


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda x, y: (x.float(), y), "dtype"),
        (lambda x, y: (x.unsqueeze(0), y), "rank"),
        (lambda x, y: (x, y.to("meta")), "meta"),
    ],
    ids=["dtype", "rank", "device"],
)
def test_bad_batch_after_compilation(bad, match):
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters())
    step = nova.compile(model, opt)
    step(*batch())
    snap = snapshot(model, opt)
    with pytest.raises(nova.BatchError, match=match):
        step(*bad(*batch()))
    assert_untouched(model, opt, snap)


def test_failing_step_leaves_parameters_and_state_as_they_were():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters())
    step = nova.compile(model, opt)
    step(*batch())
    snap = snapshot(model, opt)
    x, y = batch()
    x[0, 0] = 1000  # outside the embedding: the executor raises mid-step
    with pytest.raises(IndexError, match="out of range"):
        step(x, y)
    assert_untouched(model, opt, snap)


def test_new_batch_shape_compiles_a_new_program_with_correct_results():
    model = tiny_gpt().double()
    ref = copy.deepcopy(model)
    opt, opt_ref = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(ref.parameters())
    step = nova.compile(model, opt)
    for shape in [(2, 16), (3, 8), (2, 16)]:
        x, y = batch(*shape)
        loss = step(x, y)
        opt_ref.zero_grad()
        ref_loss = ref(x, y)
        ref_loss.backward()
        opt_ref.step()
        assert abs(loss.item() - ref_loss.item()) < 1e-10 * abs(ref_loss.item())
    assert step.num_programs == 2
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-12)


def test_bad_arguments_to_compile():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="precision"):
        nova.compile(model, opt, precision="fp8")
    with pytest.raises(ValueError, match="backend"):
        nova.compile(model, opt, backend="tpu")
