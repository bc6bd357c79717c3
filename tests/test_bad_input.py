"""Bad input: clear errors, with parameters and optimizer state untouched; new
batch shapes compile a new program. Ids and targets out of range are found on the
device (the guard stage) and make the step write nothing: the reference backend
raises at the call, the Triton backend at ``step.check()`` or the next call."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

# (without a GPU the Triton steps below run in Triton's interpreter: tests/conftest.py)
import torch.nn as nn
import torch.nn.functional as F

import nova
from nova.models import GPT, GPTConfig, gpt_tiny


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
            return F.scaled_dot_product_attention(q, q, q, dropout_p=1.0).sum()

    model = MaskedSDPA()
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(nova.UnsupportedError, match="dropout_p 1.0"):
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


def _poison(where: str, x, y):
    x, y = x.clone(), y.clone()
    if where == "id":
        x[0, 0] = 1000  # outside the embedding
    else:
        y[1, 3] = 256  # a class the head does not have (-1, the ignore_index, would be fine)
    return x, y


MESSAGES = {
    "id": r"step 2 of this compiled step failed: nova\.embedding: index out of range \[0, 256\) \(min \d+, max 1000; 1 id",
    "target": r"step 2 of this compiled step failed: nova\.linear_cross_entropy: 1 target id\(s\) out of range "
              r"\[0, 256\) \(min \d+, max 256; ignore_index -1\)",
}  # fmt: skip


@pytest.mark.parametrize("where", ["id", "target"])
def test_failing_step_leaves_parameters_and_state_as_they_were(where):
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters())
    step = nova.compile(model, opt, backend="reference")
    step(*batch())
    snap = snapshot(model, opt)
    with pytest.raises(IndexError, match=MESSAGES[where]) as e:  # at the call: the reference reads the status then
        step(*_poison(where, *batch()))
    assert "It wrote nothing" in str(e.value)
    assert_untouched(model, opt, snap)
    step(*batch())  # and the step goes on
    step.check()  # the reference checked every call already


def test_a_failed_first_step_creates_no_optimizer_state():
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters())
    step = nova.compile(model, opt, backend="reference")
    snap = snapshot(model, opt)
    with pytest.raises(IndexError, match="step 1 of this compiled step failed"):
        step(*_poison("id", *batch()))
    assert_untouched(model, opt, snap) and not opt.state


def small_gpt():
    # small enough for the interpreter (the kernels run element by element on the CPU)
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, bias=False))


def small_batch(g):
    return torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu runs the compiled Triton steps")
@pytest.mark.parametrize("where", ["id", "target"])
@pytest.mark.parametrize("reported", ["check", "next call"])
def test_triton_step_reports_a_bad_id_later_and_writes_nothing(where, reported):
    model = small_gpt()
    opt = torch.optim.AdamW(model.parameters())
    step = nova.compile(model, opt, backend="triton")
    g = torch.Generator().manual_seed(0)
    step(*small_batch(g))
    snap = snapshot(model, opt)
    x, y = small_batch(g)
    if where == "id":
        x[1, 2] = 64
    else:
        y[0, 5] = -3
    step(x, y)  # no host read of the device's counts: nothing is raised yet
    assert_untouched(model, opt, snap)  # the gate kept every device value
    message = (r"step 2 of this compiled step failed: nova\.embedding: index out of range \[0, 64\)" if where == "id"
               else r"step 2 of this compiled step failed: nova\.linear_cross_entropy: 1 target id\(s\) out of range")
    good = small_batch(g)
    if reported == "check":
        with pytest.raises(IndexError, match=message + r".*reported at check\(\)"):
            step.check()
    else:
        with pytest.raises(IndexError, match=message + r".*this call did not run either"):
            step(*good)
    assert_untouched(model, opt, snap)
    step.check()  # reported once
    step(*good)
    step.check()
    assert opt.state[next(model.parameters())]["step"].item() == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu runs the compiled Triton steps")
def test_steps_launched_before_a_failure_is_read_write_nothing_either(monkeypatch):
    """The host reads a step's guard only once the device has finished it; a step
    launched before then is gated on the device by the sticky guard::failed. Here
    no step counts as finished until check(), as on a device running behind."""
    from nova import api

    model = small_gpt()
    opt = torch.optim.AdamW(model.parameters())
    step = nova.compile(model, opt, backend="triton")
    g = torch.Generator().manual_seed(0)
    step(*small_batch(g))  # creates the optimizer state: read before the next step runs
    monkeypatch.setattr(api._Pending, "ready", lambda self: False)
    snap = snapshot(model, opt)
    x, y = small_batch(g)
    x[0, 3] = 64
    step(x, y)  # step 2 fails on the device
    for _ in range(2):
        step(*small_batch(g))  # steps 3 and 4: good ids, launched before step 2 was read
    assert len(step._pending) == 3
    assert_untouched(model, opt, snap)
    with pytest.raises(IndexError, match=r"step 2 of this compiled step failed: nova\.embedding.*steps 3, 4, launched "
                                         r"before this was read, wrote nothing either"):
        step.check()
    assert_untouched(model, opt, snap)
    step(*small_batch(g))  # the device forgot the failure: this step takes effect
    step.check()
    assert opt.state[next(model.parameters())]["step"].item() == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu runs the compiled Triton steps")
def test_triton_failed_first_step_takes_its_new_state_out_again():
    model = small_gpt()
    opt = torch.optim.AdamW(model.parameters())
    step = nova.compile(model, opt, backend="triton")
    g = torch.Generator().manual_seed(0)
    x, y = small_batch(g)
    x[0, 0] = -1
    snap = snapshot(model, opt)
    step(x, y)
    with pytest.raises(IndexError, match="step 1 of this compiled step failed"):
        step.check()
    assert not opt.state and snap[1]["state"] == {}
    assert_untouched(model, opt, snap)


# --- skip_nonfinite ---------------------------------------------------------


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, y):
        return F.mse_loss(self.net(x).squeeze(-1), y)


def regression_batches():
    g = torch.Generator().manual_seed(3)
    good = [(torch.randn(6, 4, generator=g), torch.randn(6, generator=g)) for _ in range(2)]
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    y[2] = float("inf")  # a corrupt label: the loss is inf and the gradients NaN
    return good, (x, y)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("first", [False, True], ids=["after-a-step", "first-step"])
def test_skip_nonfinite_writes_nothing_and_training_goes_on(backend, first, caplog):
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("tests/gpu runs the compiled Triton steps")
    model, eager = Regression(), Regression()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    step = nova.compile(model, opt, backend=backend, skip_nonfinite=True)
    (good1, good2), bad = regression_batches()

    def eager_step(x, y):
        opt_eager.zero_grad()
        eager(x, y).backward()
        opt_eager.step()

    if not first:
        step(*good1)
        eager_step(*good1)
    snap = snapshot(model, opt)
    with caplog.at_level(logging.WARNING, logger="nova.api"):
        loss = step(*bad)
        assert not torch.isfinite(loss)
        assert step.skipped_steps == 1  # reading it waits for the step
    assert "non-finite" in caplog.text and "skipped" in caplog.text
    assert_untouched(model, opt, snap)
    assert bool(opt.state) is not first
    loss = step(*good2)  # a good step trains as eager, which never took the bad one
    eager_step(*good2)
    step.check()
    assert step.skipped_steps == 1
    assert torch.isfinite(loss)
    tol = 1e-6 if backend == "reference" else 1e-5  # f32 rounding (mse's reduction order differs from eager's)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert ((p - q).norm() / q.norm()).item() <= tol, n
    for p, q in zip(model.parameters(), eager.parameters()):
        assert opt.state[p]["step"].item() == opt_eager.state[q]["step"].item() == (1 if first else 2)


def test_without_skip_nonfinite_a_non_finite_step_is_written_as_eager_does():
    model = Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = nova.compile(model, opt, backend="reference")
    _, bad = regression_batches()
    step(*bad)
    assert step.skipped_steps == 0
    assert not all(torch.isfinite(p).all() for p in model.parameters())


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
