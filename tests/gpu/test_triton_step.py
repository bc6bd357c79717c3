"""The Triton backend's whole step against the reference executor (the oracle):
same IR, same inputs, every step's loss and parameters compared.
fp32 1e-4, tf32 5e-4, bf16 2e-2 relative, over 50 steps on the GPU."""

from __future__ import annotations

import copy

import pytest
import torch

import nova
from nova.models import GPT, MLPLM, MLPLMConfig, gpt_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL = {"fp32": 1e-4, "tf32": 5e-4, "bf16": 2e-2}


def _model(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return MLPLM(MLPLMConfig(vocab_size=256, block_size=32, n_layer=2, n_embd=64, hidden=128))
    return GPT(gpt_tiny(attention=kind, bias=False))


def compare(kind, precision, steps, device="cuda", B=4, T=32):
    ref = _model(kind).to(device)
    mine = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-3, weight_decay=0.1)
    oracle = nova.compile(ref, opt_ref, precision=precision, backend="reference")
    step = nova.compile(mine, opt, precision=precision, backend="triton")
    g = torch.Generator(device=device).manual_seed(1)
    worst = 0.0
    for i in range(steps):
        x = torch.randint(0, 256, (B, T), device=device, generator=g)
        y = torch.randint(0, 256, (B, T), device=device, generator=g)
        y[0, :2] = -1
        loss, ref_loss = step(x, y), oracle(x, y)
        errs = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())}
        for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
            errs[name] = ((p - q).norm() / q.norm()).item()
        worst = max(worst, *errs.values())
        bad = {k: f"{v:.2e}" for k, v in errs.items() if v > TOL[precision]}
        assert worst <= TOL[precision], f"step {i}: {worst:.3e} {bad}"
    return worst, step


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("kind", ["mlp", "manual", "sdpa"])
def test_triton_step_matches_reference(kind, precision):
    _, step = compare(kind, precision, steps=50)
    sources = step.kernel_sources()
    assert sources and all("@triton.jit" in s for s in sources.values())
    assert "#nova.lowering_config<" in step.explain()
