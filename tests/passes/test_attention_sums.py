"""attention_sums: IR in, IR out. The column sum of the cat of an attention
backward's dq, dk, dv (a packed qkv projection's bias gradient) becomes a reshape
of the op's own sums; the other results bit for bit, the sum within rounding of
the reduction's (reference executor); where the rule does not hold, nothing
changes; then a small GPT's step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32, f64

from nova import pipeline
from nova.backends.reference import run_function
from nova.config import SETTINGS
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, parse_module, print_module, set_results, step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.models import GPT, gpt_tiny
from nova.transforms.attention_sums import attention_sums

from step_inputs import step_args

B, H, T, D = 2, 3, 8, 4


def _module(elem=bf16, order=(0, 1, 2), sum_elem=f32, dims=(0, 1), keepdim=False, cast_first=True):
    """An attention backward whose dq, dk, dv (in ``order``) are transposed to [B, T, H, D],
    joined along the heads, and summed over (B, T) as [B, T, 3 H D] in ``sum_elem``
    (widened from ``elem`` first where they differ; the cast before or after the
    reshape), beside a matmul reading the cat as the dX of the projection does."""
    q_t = tensor([B, H, T, D], elem)
    module, fn = new_step([Slot("batch", "g", q_t), Slot("batch", "q", q_t), Slot("batch", "k", q_t),
                           Slot("batch", "v", q_t), Slot("batch", "o", q_t),
                           Slot("batch", "lse", tensor([B, H, T], nv.stat_elem(q_t))),
                           Slot("param", "w", tensor([H * D * 3, 5], elem))])
    b = OpBuilder(fn.body.block, location="test.py:1")
    g, q, k, v, o, lse, w = fn.body.block.args
    grads = b.create(nv.AttentionBackwardOp, [g, q, k, v, o, lse], {"causal": True, "scale": 0.5}).results
    cat = b.one(nv.CatOp, [b.transpose(grads[i], [0, 2, 1, 3]) for i in order], {"dim": 2})
    heads = shape_of(cat.type)[2]
    flat = b.reshape(cat, [B, T, heads * D])
    if elem != sum_elem:
        x = b.reshape(b.cast(cat, sum_elem), [B, T, heads * D]) if cast_first else b.cast(flat, sum_elem)
    else:
        x = flat
    s = b.one(nv.ReduceSumOp, [x], {"dims": list(dims), "keepdim": keepdim})
    dx = b.matmul(b.reshape(flat, [B * T, heads * D]), w) if heads * D == w.type.get_shape()[0] else flat
    set_results(fn, [("grad", "bias", s), ("grad", "dx", dx)])
    return module, fn


def _args(fn, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for a in fn.body.block.args:
        t = torch.randn(shape_of(a.type), generator=g, dtype=torch.float64)
        out.append(t.to(to_torch_dtype(elem_of(a.type))))
    return out


@pytest.mark.parametrize("elem,cast_first", [(bf16, True), (bf16, False), (f32, True), (f64, True)],
                         ids=["bf16", "bf16-cast-after-reshape", "f32", "f64"])
def test_the_column_sum_becomes_the_attention_backwards_sums(elem, cast_first):
    module, fn = _module(elem, sum_elem=f64 if elem == f64 else f32, cast_first=cast_first)
    args = _args(fn)
    before = run_function(fn, args)
    assert attention_sums(module) == 1
    module.verify()
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    after = run_function(fn, args)
    assert torch.equal(before[1], after[1])  # the cat's other reader: the same gradients
    tol = 1e-12 if elem == f64 else 1e-6
    assert torch.allclose(after[0], before[0], rtol=tol, atol=tol * before[0].abs().max().item())
    ops = [o for o in fn.body.block.ops if o.name != "func.return"]
    (a,) = [o for o in ops if isinstance(o, nv.AttentionBackwardOp)]
    assert a.props()["sums"] and len(a.results) == 4 and shape_of(a.results[3].type) == (3, H, D)
    assert not any(isinstance(o, (nv.ReduceSumOp, nv.CastOp)) for o in ops)  # the sum and its widening gone
    ret = fn.body.block.last_op
    assert isinstance(ret.operands[0].owner, nv.ReshapeOp) and ret.operands[0].owner.operands[0] is a.results[3]
    assert attention_sums(module) == 0  # once


@pytest.mark.parametrize("case", ["order", "subset", "bf16-sum", "dims", "keepdim"])
def test_where_the_rule_does_not_hold_nothing_changes(case):
    kw = {"order": {"order": (1, 0, 2)}, "bf16-sum": {"sum_elem": bf16}, "dims": {"dims": (1,)},
          "keepdim": {"dims": (0, 1), "keepdim": True}, "subset": {"order": (0, 1)}}[case]
    module, fn = _module(**kw)
    text = print_module(module)
    assert attention_sums(module) == 0
    assert print_module(module) == text


_NO_STEP_CACHE = dataclasses.replace(SETTINGS, step_cache=False)
_STAGES = list(pipeline.STAGES)


def _gpt_step(monkeypatch, with_stage: bool, precision: str):
    monkeypatch.setattr(pipeline, "SETTINGS", _NO_STEP_CACHE)
    monkeypatch.setattr(pipeline, "STAGES", [s for s in _STAGES if with_stage or s[0] != "attention_sums"])
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=2, block_size=64))
    x = torch.randint(0, 256, (4, 64))
    c = pipeline.Compilation(model, (x, x), torch.optim.AdamW(model.parameters(), lr=1e-3), precision, torch.float32)
    return pipeline.run(c)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_gpt_steps_qkv_bias_gradients_come_from_the_attention_backward(monkeypatch, precision):
    """gpt_tiny: each layer's c_attn bias gradient is its attention backward's sums,
    the step's results (the updated parameters, the optimizer state, the loss) as the
    step without the stage's to within the sum's rounding."""
    plain = _gpt_step(monkeypatch, False, precision)
    with monkeypatch.context() as m:
        summed = _gpt_step(m, True, precision)
    ops = list(step_func(summed.module).body.block.walk())
    attn = [o for o in ops if isinstance(o, nv.AttentionBackwardOp)]
    assert len(attn) == 2 and all(a.props()["sums"] for a in attn)
    assert not any(isinstance(o, nv.AttentionBackwardOp) and o.props()["sums"] for o in plain.module.walk())
    a = run_function(step_func(plain.module), step_args(plain), precision)
    b = run_function(step_func(summed.module), step_args(summed), precision)
    worst = max(((x.double() - y.double()).abs().max() / x.double().abs().max().clamp_min(1e-30)).item()
                for x, y in zip(a, b, strict=True) if x.is_floating_point() and x.numel())
    assert worst < 1e-5, worst
