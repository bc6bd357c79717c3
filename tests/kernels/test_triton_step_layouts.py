"""A bf16 GPT step on the Triton backend (kernels in Triton's interpreter) with the
memory plan's layouts: attention's o in [B, T, H, D] memory (its [B, T, C]
reshape a view, no copy launch) and dq, dk, dv written into their windows of the
cat buffer (no cat launch). Against the reference executor, and bit for bit
against the same step planned without layouts (the same bytes: the kernels
only store through other strides)."""

from __future__ import annotations

import copy

import pytest
import torch

import nova
from nova.models import GPT, GPTConfig
from nova.transforms import plan_memory as pm

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs tests/gpu/test_triton_step.py instead")


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, attention="sdpa", bias=False))


def _train(model, backend, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    step = nova.compile(model, opt, precision="bf16", backend=backend)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 8), generator=g)
        y = torch.randint(0, 64, (2, 8), generator=g)
        losses.append(step(x, y).clone())
    return step, losses


def test_bf16_step_with_layouts_matches_the_reference_and_the_dense_plan_bit_for_bit(monkeypatch):
    base = _model()
    ref, dense, mine = copy.deepcopy(base), copy.deepcopy(base), base
    _, ref_losses = _train(ref, "reference")
    step, losses = _train(mine, "triton")
    with monkeypatch.context() as m:
        m.setattr(pm, "plan_layouts", lambda fn: pm.Layouts())  # the plan without permuted buffers or windows
        dense_step, dense_losses = _train(dense, "triton")

    exe, dense_exe = step._last.executable, dense_step._last.executable
    names, dense_names = [la.name for la in exe.launches], [la.name for la in dense_exe.launches]
    assert "nova.cat" in dense_names and "nova.cat" not in names
    assert names.count("nova.reshape") == dense_names.count("nova.reshape") - 1  # attention's [B, T, C] copy
    (attn,) = [la for la in exe.launches if la.name == "nova.attention"]
    o = attn.outs[0]
    assert not o.is_contiguous() and o.permute(0, 2, 1, 3).is_contiguous()  # [B, T, H, D] memory
    (bwd,) = [la for la in exe.launches if la.name == "nova.attention_backward"]
    base_ptr, elem = bwd.outs[0].data_ptr(), bwd.outs[0].element_size()
    # dq, dk, dv: windows of one [B, T, 3H, D] buffer, H * D elements apart along a row
    assert [(t.data_ptr() - base_ptr) // elem for t in bwd.outs] == [0, 32, 64]
    assert all(t.stride() == (8 * 96, 16, 96, 1) for t in bwd.outs)

    for a, b in zip(losses, dense_losses, strict=True):
        assert torch.equal(a, b)
    for (n, p), q in zip(mine.named_parameters(), dense.parameters(), strict=True):
        assert torch.equal(p, q), n
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a.item() - b.item()) <= 2e-2 * abs(b.item())
    for (n, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
        assert ((p.float() - q.float()).norm() / q.float().norm().clamp_min(1e-12)).item() <= 2e-2, n
    text = step.explain()
    assert "1 buffers permuted" in text and "1 cats assembled from 3 windows" in text
