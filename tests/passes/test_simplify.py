"""simplify: CSE merges identical pure ops, DCE drops unused ones."""

from xdsl.dialects.builtin import f32

from nova.ir.builder import OpBuilder
from nova.ir.dialect import ExpOp
from nova.ir.module import Slot, context, new_step, parse_module, print_module, set_results
from nova.ir.types import tensor
from nova.transforms.simplify import Simplify


def test_cse_and_dce():
    module, fn = new_step([Slot("param", "x", tensor([4], f32))])
    b = OpBuilder(fn.body.block)
    (x,) = fn.body.block.args
    e1 = b.one(ExpOp, [x])
    e2 = b.one(ExpOp, [x])  # the same op again
    b.mul(x, x)  # unused
    out = b.reduce_sum(b.add(e1, e2), [0])
    set_results(fn, [("loss", "loss", out)])
    before = print_module(module)
    assert before.count('"nova.exp"') == 2 and before.count('"nova.mul"') == 1
    Simplify().apply(context(), module)
    after = print_module(module)
    module.verify()
    assert after.count('"nova.exp"') == 1 and '"nova.mul"' not in after
    assert print_module(parse_module(after)) == after


def test_ops_differing_in_properties_are_kept_apart():
    module, fn = new_step([Slot("param", "x", tensor([4, 4], f32))])
    b = OpBuilder(fn.body.block)
    (x,) = fn.body.block.args
    s0, s1 = b.reduce_sum(x, [0]), b.reduce_sum(x, [1])
    set_results(fn, [("loss", "loss", b.reduce_sum(b.add(s0, s1), [0]))])
    Simplify().apply(context(), module)
    assert print_module(module).count('"nova.reduce_sum"') == 3
