"""norm_recompute: IR in, IR out. remat's LayerNorm recompute for a weight gradient
becomes the formula on the forward's statistics, its matmul reader moves after the
LayerNorm backward that reads the same row, every result bit-identical (reference
executor); where the rewrite would not be exact or the backward is not that
LayerNorm's, nothing changes; then a small GPT's step, and its fused form: the
recompute in the backward's kernel (``fuse``'s row sides)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from xdsl.dialects.builtin import StringAttr, bf16, f32

from nova import pipeline
from nova.backends.reference import run_function
from nova.config import SETTINGS
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, parse_module, print_module, set_results, step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.models import GPT, gpt_tiny
from nova.transforms.norm_recompute import norm_recompute

from step_inputs import step_args


def _block(elem=f32, stats_read=False, other_w=False, backward_reads_y=False):
    """A block's LayerNorm F, its remat clone R (bf16 output for the weight gradient
    dW = y^T @ g), and F's backward B reading the same x and w and F's statistics."""
    module, fn = new_step([Slot("batch", "x", tensor([2, 4, 16], elem)), Slot("param", "w", tensor([16], elem)),
                           Slot("param", "b", tensor([16], elem)), Slot("batch", "g", tensor([8, 24], bf16)),
                           Slot("batch", "dy", tensor([2, 4, 16], elem)), Slot("param", "w2", tensor([16], elem))])
    b = OpBuilder(fn.body.block, location="test.py:1")
    x, w, lb, g, dy, w2 = fn.body.block.args
    y, mean, rstd = b.create(nv.LayerNormOp, [x, w, lb], {"eps": 1e-5}).results
    fwd = b.cast(y, bf16)
    r = b.create(nv.LayerNormOp, [x, w, lb], {"eps": 1e-5})
    r.attributes["nova.remat"] = StringAttr("default")
    y16 = b.cast(r.results[0], bf16)
    y16.owner.attributes["nova.remat"] = StringAttr("default")
    dw = b.cast(b.matmul(b.transpose(b.reshape(y16, [8, 16]), [1, 0]), g), f32)
    grad = b.add(dy, b.cast(y16, elem)) if backward_reads_y else dy
    bw = b.create(nv.LayerNormBackwardOp, [grad, x, w2 if other_w else w, mean, rstd], {})
    out = [("loss", "fwd", fwd), ("grad", "dw", dw), ("grad", "dx", bw.results[0]), ("grad", "w", bw.results[1])]
    if stats_read:
        out.append(("loss", "m", r.results[1]))
    set_results(fn, out)
    return module, fn


def _args(fn, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape_of(a.type), generator=g, dtype=torch.float64).to(to_torch_dtype(elem_of(a.type)))
            for a in fn.body.block.args]  # fmt: skip


def _ops(fn):
    return [o for o in fn.body.block.ops if o.name != "func.return"]


def test_the_recompute_is_the_formula_on_the_forward_statistics_and_its_matmul_moves_after_the_backward():
    module, fn = _block()
    args = _args(fn)
    before = run_function(fn, args)
    assert norm_recompute(module) == 1
    module.verify()
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    for x, y in zip(before, run_function(fn, args), strict=True):
        assert torch.equal(x, y)
    ops = _ops(fn)
    norms = [o for o in ops if isinstance(o, nv.LayerNormOp)]
    assert len(norms) == 1 and "nova.remat" not in norms[0].attributes  # the forward's only
    names = [o.name for o in ops]
    back = names.index("nova.layer_norm_backward")
    assert names.index("nova.matmul") > back  # the weight gradient after the backward
    formula = [o for o in ops if "nova.remat" in o.attributes and o.name != "nova.cast"]
    assert [o.name for o in formula] == ["nova.reshape", "nova.reshape", "nova.sub", "nova.mul", "nova.mul",
                                         "nova.add"]  # fmt: skip
    assert all(names.index(o.name) < back for o in formula)
    assert formula[0].operands[0] is norms[0].results[1] and formula[1].operands[0] is norms[0].results[2]


def test_collectives_after_a_moved_one_move_too_and_keep_their_order():
    """data_parallel: the bucket all-reduce reading the weight gradient moves after the
    backward with it, and so does a later all-reduce that does not read it (the
    collectives, which no pass may reorder, keep their order)."""
    module, fn = _block()
    block = fn.body.block
    ops = _ops(fn)
    dw = next(o for o in ops if isinstance(o, nv.CastOp) and str(o.results[0].type) == "tensor<16x24xf32>")
    back = next(o for o in ops if isinstance(o, nv.LayerNormBackwardOp))
    b = OpBuilder(block, before=back, location="test.py:1")
    first = b.create(nv.AllReduceOp, [dw.results[0]], {"world_size": 2, "bucket": 0, "average": True})
    second = b.create(nv.AllReduceOp, [fn.body.block.args[4]], {"world_size": 2, "bucket": 1, "average": True})
    for o in (first, second):
        for u in list(o.operands[0].uses):
            if u.operation.name == "func.return":
                u.operation.operands[u.index] = o.results[0]
    assert norm_recompute(module) == 1
    module.verify()
    order = _ops(fn)
    assert order.index(back) < order.index(first) < order.index(second)


@pytest.mark.parametrize("case", ["stats-read", "bf16", "other-weight", "backward-reads-y"])
def test_where_the_rewrite_would_not_be_exact_or_not_the_same_rows_nothing_changes(case):
    module, fn = _block(elem=bf16 if case == "bf16" else f32, stats_read=case == "stats-read",
                        other_w=case == "other-weight", backward_reads_y=case == "backward-reads-y")  # fmt: skip
    text = print_module(module)
    assert norm_recompute(module) == 0
    assert print_module(module) == text


_NO_STEP_CACHE = dataclasses.replace(SETTINGS, step_cache=False)
_STAGES = list(pipeline.STAGES)


def _gpt_step(monkeypatch, stages):
    monkeypatch.setattr(pipeline, "SETTINGS", _NO_STEP_CACHE)
    monkeypatch.setattr(pipeline, "STAGES", [s for s in _STAGES if s[0] in stages or s[0] not in
                                             ("norm_recompute", "fuse")])  # fmt: skip
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=2, block_size=64))
    x = torch.randint(0, 256, (8, 64))
    c = pipeline.Compilation(model, (x, x), torch.optim.AdamW(model.parameters(), lr=1e-3), "bf16", torch.float32)
    return pipeline.run(c)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_a_gpt_steps_recomputes_are_rewritten_bit_for_bit(monkeypatch, fused):
    """gpt_tiny in bf16: remat recomputes its four LayerNorm outputs for the weight
    gradients; every one becomes the formula (no layer_norm left in the backward),
    the step's results bit-identical to the step without the stage; fused, each is
    computed in its backward's kernel (no elementwise kernel of its own)."""
    extra = {"fuse"} if fused else set()
    plain = _gpt_step(monkeypatch, extra)
    with monkeypatch.context() as m:
        rewritten = _gpt_step(m, extra | {"norm_recompute"})
    a = run_function(step_func(plain.module), step_args(plain), "bf16")
    b = run_function(step_func(rewritten.module), step_args(rewritten), "bf16")
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    walk = list(rewritten.module.walk())
    assert not any(isinstance(o, nv.LayerNormOp) and "nova.remat" in o.attributes for o in walk)
    assert sum(isinstance(o, nv.LayerNormOp) and "nova.remat" in o.attributes for o in plain.module.walk()) == 4
    if fused:
        groups = [o for o in step_func(rewritten.module).body.block.ops if isinstance(o, nv.FusedOp)]
        with_sides = [g for g in groups if g.prologue_sides()]
        assert len(with_sides) == 4
        assert all(isinstance(g.reduction(), nv.LayerNormBackwardOp) for g in with_sides)
        assert not any(g.props()["kind"] == "elementwise" and any(isinstance(o, nv.SubOp) and "nova.remat" in
                       o.attributes for o in g.inner_ops()) for g in groups)  # fmt: skip
