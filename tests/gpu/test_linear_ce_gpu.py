"""The fused LM head's merged loss-and-gradients lowering on the H200, at GPT-2's
vocabulary and width: bit for bit the forward and backward lowerings (compiled
kernels: FMA contraction and the compiler's choices are the device's, not the
interpreter's), and dw's in-place epilogue accumulation bit for bit the matmul's
f32 product added afterwards. (tests/kernels checks the same through the interpreter.)"""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32, i64

from nova.codegen.triton import matmul as mm
from nova.codegen.triton.linear_ce import (
    accumulate_into,
    lower_linear_cross_entropy,
    lower_linear_cross_entropy_backward,
    lower_linear_cross_entropy_with_grad,
)
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import tensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, D, V = 2 * 2048 + 100, 768, 50304  # two full chunks and a short one


def _bits(x):
    return x.reshape(-1).view({2: torch.int16, 4: torch.int32}[x.element_size()])


def _head_ops(props: dict, bias=None, elem=bf16):
    """The forward, backward and merged ops of a head [N, D] x [V, D] of ``elem`` (bf16
    unless given; an f32 loss)."""
    slots = [Slot("batch", "g", tensor([], f32)), Slot("param", "h", tensor([N, D], elem)),
             Slot("param", "w", tensor([V, D], elem)), Slot("batch", "t", tensor([N], i64))]
    slots += [Slot("param", "b", tensor([V], bias))] if bias else []
    _, fn = new_step(slots)
    b = OpBuilder(fn.body.block)
    g, *xs = fn.body.block.args
    return (b.create(nv.LinearCrossEntropyOp, xs, props, tensor([], f32)),
            b.create(nv.LinearCrossEntropyBackwardOp, [g, *xs], props),
            b.create(nv.LinearCrossEntropyWithGradOp, [g, *xs], props, tensor([], f32)))


@pytest.mark.parametrize("bias", [None, f32], ids=["no-bias", "f32-bias"])
def test_merged_lowering_is_the_pair_bit_for_bit(bias):
    props = {"ignore_index": -1, "reduction": "mean", "label_smoothing": 0.1, "chunk": 2048}
    fwd, bwd, both = _head_ops(props, bias)
    torch.manual_seed(0)
    h = torch.randn(N, D, device="cuda").bfloat16()
    w = (torch.randn(V, D, device="cuda") * 0.05).bfloat16()
    t = torch.randint(0, V, (N,), device="cuda")
    t[:50] = -1
    ins = [h, w, t, *([torch.randn(V, device="cuda")] if bias else [])]
    grad = torch.tensor(1.0, device="cuda")
    want = lower_linear_cross_entropy(fwd, None, precision="bf16").launch(ins)
    want += lower_linear_cross_entropy_backward(bwd, None, precision="bf16").launch([grad, *ins])
    got = lower_linear_cross_entropy_with_grad(both, None, precision="bf16").launch([grad, *ins])
    for name, x, y in zip(("loss", "dh", "dw", "dbias"), got, want):
        assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)), name


def test_dw_epilogue_accumulation_is_matmul_then_add_bit_for_bit():
    torch.manual_seed(1)
    d = torch.randn(2048, V, device="cuda").bfloat16()
    h = torch.randn(2048, D, device="cuda").bfloat16()
    acc = torch.randn(V, D, device="cuda")
    want = acc + mm.matmul(d.t(), h, out_dtype=torch.float32)  # the launcher's config (persistent, C by TMA)
    accumulate_into(acc, d.t(), h, "ieee")  # the epilogue kernel's (tile grid, pointer stores)
    assert torch.equal(_bits(acc), _bits(want))


def test_a_tf32_head_prerounding_its_logits_gradient_is_bit_for_bit(monkeypatch):
    """An f32 head under the tf32 policy at GPT-2's vocabulary: the row kernel writing d
    rounded to tf32 and dh's staged matmul reading it in place (``PREROUND_TF32``) give
    the bits of the lowering that copies d rounded for dh; fewer staging copies. Stream-K
    is off for fp32 operands here: the prerounded dh is configured persistent (configurator
    rule 8d), which keeps the split, and the copied one runs stream-K, whose sums follow its
    bands, not the split's K ranges; the bits compared are the rounding's."""
    from nova.codegen.triton import linear_ce

    monkeypatch.setattr(mm, "STREAM_K_F32", False)

    props = {"ignore_index": -1, "reduction": "mean", "label_smoothing": 0.0, "chunk": 2048}
    slots = [Slot("batch", "g", tensor([], f32)), Slot("param", "h", tensor([N, D], f32)),
             Slot("param", "w", tensor([V, D], f32)), Slot("batch", "t", tensor([N], i64))]
    _, fn = new_step(slots)
    b = OpBuilder(fn.body.block)
    g, *xs = fn.body.block.args
    both = b.create(nv.LinearCrossEntropyWithGradOp, [g, *xs], props, tensor([], f32))
    torch.manual_seed(1)
    ins = [torch.randn(N, D, device="cuda"), torch.randn(V, D, device="cuda") * 0.05,
           torch.randint(0, V, (N,), device="cuda")]  # fmt: skip
    grad = torch.tensor(1.0, device="cuda")
    copies = []
    real = mm.stage_tf32
    monkeypatch.setattr(mm, "stage_tf32", lambda src, dst, record=None: copies.append(tuple(src.shape)) or real(src, dst, record))
    outs, counts = [], []
    for early in (True, False):
        monkeypatch.setattr(linear_ce, "PREROUND_TF32", early)
        copies.clear()
        outs.append(lower_linear_cross_entropy_with_grad(both, None, precision="tf32").launch([grad, *ins]))
        counts.append(len(copies))
    for name, x, y in zip(("loss", "dh", "dw"), *outs):
        assert torch.equal(_bits(x), _bits(y)), name
    z, configs = torch.empty(2048, V, device="cuda"), linear_ce.Configs("tf32-rn")
    staged_a = sum("stage_a" in configs(z[: min(2048, N - r0)], ins[1], torch.float32).instruction
                   for r0 in range(0, N, 2048))  # fmt: skip
    assert counts[1] - counts[0] == staged_a, (counts, staged_a)  # one copy of d fewer where dh stages A


def test_row_statistics_from_the_logits_epilogue_on_the_device(monkeypatch):
    """ROW_STATS_FROM_LOGITS at GPT-2's vocabulary with the step's config of the logits (the
    configurator's, warp-specialized on the H200): the merged lowering bit for bit the pair
    (the same statistics), within f32 rounding of the two-pass row kernel (the target's logit
    read before the row is overwritten: the program's barrier), and the same logits."""
    from nova.codegen.triton import linear_ce
    from nova.schedule.configurator import configure_matmul

    props = {"ignore_index": -1, "reduction": "mean", "label_smoothing": 0.0, "chunk": 2048}
    fwd, bwd, both = _head_ops(props)
    torch.manual_seed(2)
    h = torch.randn(N, D, device="cuda").bfloat16()
    w = (torch.randn(V, D, device="cuda") * 0.05).bfloat16()
    t = torch.randint(0, V, (N,), device="cuda")
    t[:50] = -1
    ins, grad = [h, w, t], torch.tensor(1.0, device="cuda")
    cfg = configure_matmul(2048, V, D, 1, torch.bfloat16, torch.bfloat16, torch.bfloat16, "bf16", "row", "col", False,
                           mm.device_spec(h.device))  # fmt: skip
    monkeypatch.setattr(linear_ce, "ROW_STATS_FROM_LOGITS", False)
    two_pass = lower_linear_cross_entropy_with_grad(both, cfg, precision="bf16").launch([grad, *ins])
    monkeypatch.setattr(linear_ce, "ROW_STATS_FROM_LOGITS", True)
    want = lower_linear_cross_entropy(fwd, cfg, precision="bf16").launch(ins)
    want += lower_linear_cross_entropy_backward(bwd, cfg, precision="bf16").launch([grad, *ins])
    kernel = lower_linear_cross_entropy_with_grad(both, cfg, precision="bf16")
    assert "statistics of" in kernel.source
    got = kernel.launch([grad, *ins])
    for name, x, y in zip(("loss", "dh", "dw"), got, want, strict=True):
        assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)), name
    torch.testing.assert_close(got[0], two_pass[0], rtol=1e-6, atol=0)
    for name, x, y in zip(("dh", "dw"), got[1:], two_pass[1:], strict=True):
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=1e-5, msg=name)


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_d_formed_in_the_matmuls_prologues_on_the_device(monkeypatch, precision):
    """D_PROLOGUE at GPT-2's vocabulary with the step's config of the logits: the merged
    lowering with d formed by dh's and dw's prologues (compiled for the device: exp, the
    target's compare and the rounding in registers before the wgmma) bit for bit the one
    whose row kernel writes d over the logits. Stream-K off in both (the prologue's launch
    runs the split)."""
    from nova.codegen.triton import linear_ce
    from nova.schedule.configurator import configure_matmul

    props = {"ignore_index": -1, "reduction": "mean", "label_smoothing": 0.0, "chunk": 2048}
    dt, elem = (torch.bfloat16, bf16) if precision == "bf16" else (torch.float32, f32)
    _, _, both = _head_ops(props, elem=elem)
    torch.manual_seed(3)
    h = torch.randn(N, D, device="cuda").to(dt)
    w = (torch.randn(V, D, device="cuda") * 0.05).to(dt)
    t = torch.randint(0, V, (N,), device="cuda")
    t[:50] = -1
    ins, grad = [h, w, t], torch.tensor(1.0, device="cuda")
    prec = "bf16" if precision == "bf16" else "tf32-rn"
    cfg = configure_matmul(2048, V, D, 1, dt, dt, dt, prec, "row", "col", False, mm.device_spec(h.device),
                           prerounded=() if precision == "bf16" else ("b",))  # fmt: skip
    monkeypatch.setattr(mm, "STREAM_K_SPLIT", False)
    want = lower_linear_cross_entropy_with_grad(both, cfg, precision=precision).launch([grad, *ins])
    monkeypatch.setattr(linear_ce, "D_PROLOGUE", True)
    monkeypatch.setattr(linear_ce, "D_PROLOGUE_F32", True)
    kernel = lower_linear_cross_entropy_with_grad(both, cfg, precision=precision)
    assert linear_ce.uses_d_prologue(both, cfg)
    got = kernel.launch([grad, *ins])
    assert any("A from a prologue" in open(p).read() for p in kernel.extra["matmul_sources"] if p != "tf32_stage")
    for name, x, y in zip(("loss", "dh", "dw"), got, want, strict=True):
        assert x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)), name
