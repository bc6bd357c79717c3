"""The Triton backend's whole step against the reference executor (the oracle):
same IR, same inputs, every step's loss and parameters compared over 50 steps on
the GPU: fp32 1e-4, tf32 5e-4, bf16 2e-2 relative (tf32 under AdamW: gpu_steps.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import nova

from gpu_steps import TOL, make_model, make_optimizer, param_tolerance, step_errors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def compare(kind, precision, optimizer, steps, device="cuda", B=4, T=32):
    ref = make_model(kind).to(device)
    mine = copy.deepcopy(ref)
    oracle = nova.compile(ref, make_optimizer(optimizer, ref.parameters()), precision=precision, backend="reference")
    step = nova.compile(mine, make_optimizer(optimizer, mine.parameters()), precision=precision, backend="triton")
    g = torch.Generator(device=device).manual_seed(1)
    ptol = param_tolerance(precision, optimizer)
    worst = {"loss": 0.0, "params": 0.0}
    for i in range(steps):
        x = torch.randint(0, 256, (B, T), device=device, generator=g)
        y = torch.randint(0, 256, (B, T), device=device, generator=g)
        y[0, :2] = -1
        errs = step_errors(step(x, y), oracle(x, y), mine, ref)
        worst["loss"] = max(worst["loss"], errs.pop("loss"))
        worst["params"] = max(worst["params"], *errs.values())
        assert worst["loss"] <= TOL[precision], f"step {i}: loss {worst['loss']:.3e}"
        bad = {k: f"{v:.2e}" for k, v in errs.items() if v > ptol}
        assert not bad, f"step {i}: parameters {bad}"
    return worst, step


@pytest.mark.parametrize(
    "precision,optimizer", [("fp32", "adamw"), ("tf32", "sgd"), ("tf32", "adamw"), ("bf16", "adamw")]
)
@pytest.mark.parametrize("kind", ["mlp", "manual", "sdpa"])
def test_triton_step_matches_reference(kind, precision, optimizer):
    worst, step = compare(kind, precision, optimizer, steps=50)
    print(f"{kind} {precision} {optimizer}: worst loss {worst['loss']:.2e}, parameters {worst['params']:.2e}")
    sources = step.kernel_sources()
    assert sources and all("@triton.jit" in s for s in sources.values())
    assert "  [matmul " in step.explain(ir=True)  # the short IR shows each kernel's schedule


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_triton_step_with_attention_dropout_matches_reference(precision):
    """SDPA's dropout_p (and the residual and embedding dropouts) on the device's
    kernels: the same seed a step (torch.manual_seed before each call, one draw a
    step) gives the reference's masks bit for bit, so the steps agree as without
    dropout, over 20 AdamW steps."""
    from nova.models import GPT, gpt_tiny

    torch.manual_seed(0)
    ref = GPT(gpt_tiny(attention="sdpa", bias=False, dropout=0.1)).cuda().train()
    mine = copy.deepcopy(ref)
    oracle = nova.compile(ref, make_optimizer("adamw", ref.parameters()), precision=precision, backend="reference")
    step = nova.compile(mine, make_optimizer("adamw", mine.parameters()), precision=precision, backend="triton")
    g = torch.Generator(device="cuda").manual_seed(1)
    for i in range(20):
        x = torch.randint(0, 256, (4, 32), device="cuda", generator=g)
        torch.manual_seed(100 + i)
        got = step(x, x)
        torch.manual_seed(100 + i)
        errs = step_errors(got, oracle(x, x), mine, ref)
        assert errs.pop("loss") <= TOL[precision], i
        bad = {k: f"{v:.2e}" for k, v in errs.items() if v > TOL[precision]}
        assert not bad, f"step {i}: parameters {bad}"


def test_a_tensor_the_forward_creates_on_the_cpu_is_moved_to_the_step_s_device():
    """``torch.tensor(...)`` in a forward (transformers' T5 with sdpa) makes a 0-d
    CPU tensor that eager lets meet CUDA tensors. torch.export lifts it as a
    constant; the step's copy of it lives on the parameters' device, so the
    Triton launches bind it, and the step matches the reference."""

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x, y):
            h = self.lin(x) * torch.tensor(0.5) + torch.tensor(-1.0)
            return torch.nn.functional.mse_loss(h, y)

    torch.manual_seed(0)
    ref = Scaled().cuda()
    mine = copy.deepcopy(ref)
    oracle = nova.compile(ref, make_optimizer("adamw", ref.parameters()), backend="reference")
    step = nova.compile(mine, make_optimizer("adamw", mine.parameters()), backend="triton")
    for _ in range(3):
        x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 16, device="cuda")
        errs = step_errors(step(x, y), oracle(x, y), mine, ref)
        assert max(errs.values()) <= TOL["fp32"], errs
