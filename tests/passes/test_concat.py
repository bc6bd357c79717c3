"""The concat stage (nova.transforms.concat): IR in, IR out for each rule and its
no-match cases, the values on the reference executor before and after, and a
whole bf16 GPT step without a pad, its results equal to the step without the stage."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32

from nova import pipeline
from nova.backends.reference import run_function
from nova.config import SETTINGS
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, parse_module, print_module, set_results, step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.models import GPT, gpt_tiny
from nova.transforms.concat import concat

from step_inputs import step_args

_NO_STEP_CACHE = dataclasses.replace(SETTINGS, step_cache=False) if hasattr(SETTINGS, "step_cache") else SETTINGS


def _step(*types):
    module, fn = new_step([Slot("param", f"x{i}", t) for i, t in enumerate(types)])
    return module, fn, OpBuilder(fn.body.block), fn.body.block.args


def _ops(module, cls) -> list:
    return [o for o in step_func(module).body.block.ops if isinstance(o, cls)]


def _pad(b, x, dim, start, size, step=1):
    return b.one(nv.PadOp, [x], {"dim": dim, "start": start, "step": step, "size": size})


def _args(fn, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for a in fn.body.block.args:
        out.append(torch.randn(shape_of(a.type), generator=g, dtype=torch.float64).to(to_torch_dtype(elem_of(a.type))))
    return out


def _rewritten(module, args, expect_change=True):
    """Runs the pass; the results on the reference executor before and after (and
    the printed IR round-trips)."""
    fn = step_func(module)
    before = run_function(fn, [a.clone() for a in args], "fp32")
    n = concat(module)
    module.verify()
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    assert (n > 0) == expect_change
    after = run_function(step_func(module), [a.clone() for a in args], "fp32")
    return before, after


# ---------------------------------------------------------------------------
# pads -> cat


def test_three_pads_that_cover_their_axis_become_one_cat():
    # q, k, v = qkv.split(4, dim=1)'s backward: pad(dq) + pad(dk) + pad(dv)
    module, fn, b, (dq, dk, dv) = _step(*[tensor([2, 4], f32)] * 3)
    total = b.add(b.add(_pad(b, dv, 1, 8, 12), _pad(b, dk, 1, 4, 12)), _pad(b, dq, 1, 0, 12))
    set_results(fn, [("loss", "g", total)])
    args = _args(fn)
    args[1][0, 1] = -0.0
    before, after = _rewritten(module, args)
    assert _ops(module, nv.PadOp) == [] and _ops(module, nv.AddOp) == []
    (cat,) = _ops(module, nv.CatOp)
    assert list(cat.operands) == [dq, dk, dv] and cat.props() == {"dim": 1}
    assert torch.equal(before[0], after[0])
    assert torch.equal(after[0], torch.cat(args, 1))
    # the sum made +0.0 of the -0.0; the cat keeps it, as eager's cat and split backward do
    assert not torch.signbit(before[0][0, 5]) and torch.signbit(after[0][0, 5])


def test_a_gap_between_windows_is_a_broadcast_zero_piece():
    module, fn, b, (x, y) = _step(tensor([3, 2], f32), tensor([3, 1], f32))
    total = b.add(_pad(b, x, 1, 1, 6), _pad(b, y, 1, 4, 6))
    set_results(fn, [("loss", "g", total)])
    before, after = _rewritten(module, _args(fn))
    (cat,) = _ops(module, nv.CatOp)
    kinds = [type(v.owner).__name__ if v.owner is not fn.body.block else "arg" for v in cat.operands]
    assert kinds == ["BroadcastToOp", "arg", "BroadcastToOp", "arg", "BroadcastToOp"]
    assert [shape_of(v.type)[1] for v in cat.operands] == [1, 2, 1, 1, 1]
    assert torch.equal(before[0], after[0])


@pytest.mark.parametrize("case", ["overlap", "same_window", "step2", "not_a_pad", "two_dims"])
def test_no_match(case):
    module, fn, b, (x, y, z) = _step(tensor([2, 4], f32), tensor([2, 4], f32), tensor([2, 8], f32))
    if case == "overlap":
        total = b.add(_pad(b, x, 1, 0, 8), _pad(b, y, 1, 2, 8))
    elif case == "same_window":  # two taps' gradients of one pooling window: once a crash sorting the pads
        total = b.add(_pad(b, x, 1, 2, 8), _pad(b, y, 1, 2, 8))
    elif case == "step2":
        total = b.add(_pad(b, x, 1, 0, 8, step=2), _pad(b, y, 1, 1, 8, step=2))
    elif case == "not_a_pad":
        total = b.add(_pad(b, x, 1, 0, 8), z)
    else:  # pads along different dims
        total = b.add(_pad(b, x, 1, 0, 8), _pad(b, b.reshape(y, [1, 8]), 0, 1, 2))
    set_results(fn, [("loss", "g", total)])
    text = print_module(module)
    _rewritten(module, _args(fn), expect_change=False)
    assert print_module(module) == text and _ops(module, nv.CatOp) == []


def test_an_inner_sum_used_elsewhere_is_a_leaf_of_the_outer_one():
    # the outer tree stops at the inner add (its sum is needed on its own): the outer
    # add stays, and the inner one, a sum of two pads itself, is a cat with a zero gap
    module, fn, b, (x, y, z) = _step(tensor([2, 4], f32), tensor([2, 4], f32), tensor([2, 4], f32))
    inner = b.add(_pad(b, x, 1, 0, 12), _pad(b, y, 1, 4, 12))
    total = b.add(inner, _pad(b, z, 1, 8, 12))
    set_results(fn, [("loss", "g", total), ("loss", "inner", inner)])
    before, after = _rewritten(module, _args(fn))
    (cat,) = _ops(module, nv.CatOp)
    (add,) = _ops(module, nv.AddOp)
    assert add.operands[0] is cat.results[0] and isinstance(add.operands[1].owner, nv.PadOp)
    assert [shape_of(v.type)[1] for v in cat.operands] == [4, 4, 4]
    assert all(torch.equal(p, q) for p, q in zip(before, after, strict=True))


# ---------------------------------------------------------------------------
# cat of casts, cat of reshapes


def test_widened_pieces_under_layout_ops_become_one_widening_of_a_narrow_cat():
    module, fn, b, (a, c) = _step(tensor([2, 3, 4], bf16), tensor([2, 3, 4], bf16))
    pieces = [b.transpose(b.cast(v, f32), [0, 2, 1]) for v in (a, c)]  # [2, 4, 3] f32 each
    set_results(fn, [("loss", "g", b.one(nv.CatOp, pieces, {"dim": 2}))])
    before, after = _rewritten(module, _args(fn))
    (cast,) = _ops(module, nv.CastOp)
    cat = cast.operands[0].owner
    assert isinstance(cat, nv.CatOp) and elem_of(cat.results[0].type) == bf16
    assert [v.owner.operands[0] for v in cat.operands] == [a, c]
    assert torch.equal(before[0], after[0])


@pytest.mark.parametrize("case", ["rounding", "two_sources", "uncast_piece"])
def test_casts_that_do_not_lift(case):
    if case == "rounding":  # f32 -> bf16 rounds: the cat of rounded pieces stays
        module, fn, b, (a, c) = _step(tensor([2, 3], f32), tensor([2, 3], f32))
        pieces = [b.cast(a, bf16), b.cast(c, bf16)]
    elif case == "two_sources":
        from xdsl.dialects.builtin import f16

        module, fn, b, (a, c) = _step(tensor([2, 3], bf16), tensor([2, 3], f16))
        pieces = [b.cast(a, f32), b.cast(c, f32)]
    else:
        module, fn, b, (a, c) = _step(tensor([2, 3], bf16), tensor([2, 3], f32))
        pieces = [b.cast(a, f32), c]
    set_results(fn, [("loss", "g", b.one(nv.CatOp, pieces, {"dim": 1}))])
    text = print_module(module)
    _rewritten(module, _args(fn), expect_change=False)
    assert print_module(module) == text


def test_a_cat_of_reshapes_that_keep_the_leading_dims_reads_their_sources():
    # attention's [B, H, T, D] gradients transposed to [B, T, H, D], reshaped to [B, T, C]
    module, fn, b, (dq, dk) = _step(tensor([2, 3, 5, 4], f32), tensor([2, 3, 5, 4], f32))
    flats = [b.reshape(b.transpose(d, [0, 2, 1, 3]), [2, 5, 12]) for d in (dq, dk)]
    set_results(fn, [("loss", "g", b.one(nv.CatOp, flats, {"dim": 2}))])
    before, after = _rewritten(module, _args(fn))
    (cat,) = _ops(module, nv.CatOp)
    assert shape_of(cat.results[0].type) == (2, 5, 6, 4)
    assert all(isinstance(v.owner, nv.TransposeOp) for v in cat.operands)
    (reshape,) = _ops(module, nv.ReshapeOp)
    assert reshape.operands[0] is cat.results[0] and shape_of(reshape.results[0].type) == (2, 5, 24)
    assert torch.equal(before[0], after[0])


def test_a_reshape_across_the_leading_dims_stays():
    module, fn, b, (x, y) = _step(tensor([2, 6], f32), tensor([2, 6], f32))
    pieces = [b.reshape(x, [3, 4]), b.reshape(y, [3, 4])]  # moves elements across dim 0
    set_results(fn, [("loss", "g", b.one(nv.CatOp, pieces, {"dim": 1}))])
    text = print_module(module)
    _rewritten(module, _args(fn), expect_change=False)
    assert print_module(module) == text


# ---------------------------------------------------------------------------
# a whole step


def _gpt_step():
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=1, block_size=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 17))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    return pipeline.run(pipeline.Compilation(model, batch, opt, "bf16", torch.float32))


def test_a_bf16_gpt_step_has_no_pad_and_equals_the_step_without_the_stage(monkeypatch):
    monkeypatch.setattr(pipeline, "SETTINGS", _NO_STEP_CACHE)
    with_stage = _gpt_step()
    fn = step_func(with_stage.module)
    assert not any(isinstance(o, nv.PadOp) for o in fn.walk())
    cats = [o for o in fn.walk() if isinstance(o, nv.CatOp)]
    assert len(cats) == 1 and elem_of(cats[0].results[0].type) == bf16  # the split's backward, in bf16
    stages = pipeline.STAGES
    monkeypatch.setattr(pipeline, "STAGES", [s for s in stages if s[0] != "concat"])
    without = _gpt_step()
    a = run_function(fn, step_args(with_stage), "bf16")
    b = run_function(step_func(without.module), step_args(without), "bf16")
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)  # equal up to the sign of a zero
