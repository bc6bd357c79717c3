"""The whole step on the Triton backend, its kernels run by Triton's interpreter
on the CPU, against the reference executor: the same IR, the same inputs."""

from __future__ import annotations

import copy

import pytest
import torch

import nova
from nova.models import GPT, MLPLM, MLPLMConfig, GPTConfig

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs tests/gpu/test_triton_step.py instead")


def _model(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return MLPLM(MLPLMConfig(vocab_size=64, block_size=8, n_layer=1, n_embd=32, hidden=64))
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, attention=kind, bias=False))


@pytest.mark.parametrize("kind", ["mlp", "manual", "sdpa"])
def test_interpreted_triton_step_matches_reference(kind):
    ref = _model(kind)
    mine = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-3, weight_decay=0.1)
    oracle = nova.compile(ref, opt_ref, backend="reference")
    step = nova.compile(mine, opt, backend="triton")
    g = torch.Generator().manual_seed(1)
    for i in range(2):
        x = torch.randint(0, 64, (2, 8), generator=g)
        y = torch.randint(0, 64, (2, 8), generator=g)
        y[0, 0] = -1
        loss, ref_loss = step(x, y), oracle(x, y)
        assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item()), i
        for (n, p), q in zip(mine.named_parameters(), ref.parameters()):
            assert ((p - q).norm() / q.norm().clamp_min(1e-12)).item() <= 1e-4, (i, n)
    sources = step.kernel_sources()
    assert sources and all("@triton.jit" in s for s in sources.values())
    assert "  [matmul " in step.explain(ir=True)  # the short IR shows each kernel's schedule


def test_interpreted_tf32_step_rounds_matmul_operands():
    """precision="tf32" on the Triton backend rounds every fp32 matmul operand to
    nearest tf32 (cuBLAS's rounding; the interpreter's dot is then exact fp32), so the
    step stays within the tf32 tolerance of the fp32 reference (the CPU has no tf32)
    under SGD, whose update is linear in the gradient."""
    ref = _model("manual")
    mine = copy.deepcopy(ref)
    oracle = nova.compile(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), backend="reference")
    step = nova.compile(mine, torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9), precision="tf32",
                        backend="triton")  # fmt: skip
    g = torch.Generator().manual_seed(2)
    worst = 0.0
    for i in range(2):
        x = torch.randint(0, 64, (2, 8), generator=g)
        y = torch.randint(0, 64, (2, 8), generator=g)
        loss, ref_loss = step(x, y), oracle(x, y)
        worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        for p, q in zip(mine.parameters(), ref.parameters()):
            worst = max(worst, ((p - q).norm() / q.norm()).item())
    assert 1e-7 < worst <= 5e-4  # tf32 rounding happened, and stayed within tolerance
    assert any("0xFFFFE000" in s for s in step.kernel_sources().values())


def test_an_op_without_lowering_is_named_before_anything_runs(monkeypatch):
    """An op the Triton backend lacks is reported by name when the program is built,
    before any kernel runs: parameters and optimizer state stay as they were."""
    import nova.backends.triton  # noqa: F401  (registers the lowerings)
    from nova.codegen.triton import lowering as lw
    from nova.ir import dialect as nv

    model = _model("manual")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = nova.compile(model, opt, backend="triton")
    monkeypatch.delitem(lw.LOWERINGS, nv.LayerNormOp)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, 64, (2, 8))
    with pytest.raises(lw.NoLoweringError, match="no lowering for nova.layer_norm"):
        step(x, x)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and not opt.state


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("gpt2", "eager"), ("bert", "sdpa")])
def test_interpreted_triton_step_trains_transformers_models_like_the_reference(family, attn):
    """transformers' models (tests/numerics/test_hf_models.py: padding mask,
    rotary embeddings, grouped-query heads, RMSNorm, token types, label
    shifting) on the Triton backend against the reference executor. Key
    biases are left out: their true gradient is exactly 0, so each side's
    rounding noise becomes an Adam step of +-lr (see that file)."""
    from hf_models import build, key_bias_mask, make_batches

    ref = build(family, attn, torch.float32)
    mine = copy.deepcopy(ref)
    oracle = nova.compile(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), backend="reference")
    step = nova.compile(mine, torch.optim.AdamW(mine.parameters(), lr=1e-3), backend="triton")
    for i, batch in enumerate(make_batches(family, 2)):
        loss, ref_loss = step(*batch), oracle(*batch)
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), i
        for (n, p), q in zip(mine.named_parameters(), ref.parameters()):
            keep = ~key_bias_mask(n, p)
            diff = ((p - q)[keep].norm() / q[keep].norm().clamp_min(1e-12)).item()
            assert diff <= 1e-4, (i, n, diff)


@pytest.mark.parametrize("mode,smoothing,weighted", [("mean", 0.0, False), ("none", 0.1, False), ("mean", 0.1, True)])
def test_interpreted_triton_step_survives_a_batch_of_padding(mode, smoothing, weighted):
    """All targets ignore_index: the loss is NaN (0 / 0, as eager's) but the
    gradients are 0, so the parameters stay finite and equal to eager's; with class
    weights too (cross_entropy from plain ops, each its own kernel)."""
    import math

    from loss_cases import LM, loss_batches, run_both

    torch.manual_seed(0)
    losses, worst = run_both(LM(mode, smoothing, weighted), loss_batches(), "triton", torch.float32)
    if mode == "mean":
        assert math.isnan(losses[1][0]) and math.isnan(losses[1][1])
    for mine, theirs in (losses[0], losses[2]):
        assert abs(mine - theirs) <= 1e-5 * abs(theirs)
    assert worst < 1e-4, worst


@pytest.mark.parametrize("weighted,from_teacher", [(True, False), (False, True)])
def test_interpreted_triton_step_trains_class_probability_targets(weighted, from_teacher):
    """cross_entropy with [N, C] probabilities (plain ops, each its own kernel), given or a
    second head's softmax, against eager in float32."""
    from loss_cases import SoftLM, run_both, soft_batches

    torch.manual_seed(0)
    losses, worst = run_both(SoftLM("mean", 0.1, weighted, from_teacher), soft_batches(torch.float32), "triton",
                             torch.float32)
    for mine, theirs in losses:
        assert abs(mine - theirs) <= 1e-5 * abs(theirs)
    assert worst < 1e-4, worst
