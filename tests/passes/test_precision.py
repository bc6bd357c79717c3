"""precision: bf16 puts contractions on bf16 operands, everything else stays f32."""

import pytest
from xdsl.dialects.builtin import f32

from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, context, new_step, parse_module, print_module, set_results
from nova.ir.types import tensor
from nova.transforms.precision import PrecisionPass


def _module():
    module, fn = new_step([Slot("param", "a", tensor([8, 4], f32)), Slot("param", "w", tensor([4, 2], f32))])
    b = OpBuilder(fn.body.block)
    a, w = fn.body.block.args
    y = b.matmul(a, w)
    set_results(fn, [("loss", "loss", b.reduce_sum(b.mul(y, y), [0, 1]))])
    return module


def test_bf16_casts_matmul_operands_and_result():
    module = _module()
    PrecisionPass("bf16").apply(context(), module)
    module.verify()
    text = print_module(module)
    assert "(tensor<8x4xbf16>, tensor<4x2xbf16>) -> tensor<8x2xbf16>" in text
    assert text.count('"nova.cast"') == 3  # two operands in, one result out
    assert '"nova.mul"(%' in text and "tensor<8x2xf32>, tensor<8x2xf32>" in text
    assert 'nova.precision = "bf16"' in text
    assert print_module(parse_module(text)) == text


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_fp32_and_tf32_change_no_op(precision):
    module = _module()
    before = print_module(module)
    PrecisionPass(precision).apply(context(), module)
    after = print_module(module)
    assert '"nova.cast"' not in after and "bf16" not in after
    assert [l for l in after.splitlines() if "nova." in l and "precision" not in l] == [
        l for l in before.splitlines() if "nova." in l
    ]
    assert f'nova.precision = "{precision}"' in after


def test_unknown_precision_rejected():
    with pytest.raises(ValueError, match="precision"):
        PrecisionPass("fp8").apply(context(), _module())


def test_bf16_lm_head_ops_keep_their_statistics_f32():
    """The fused LM head's three ops under bf16: h and w become bf16, the loss's
    cotangent and the bias stay f32 (the loss too), the gradients are cast back."""
    from xdsl.dialects.builtin import i64

    from nova.ir import dialect as nv
    from nova.ir.types import elem_of

    slots = [Slot("param", "h", tensor([6, 4], f32)), Slot("param", "w", tensor([5, 4], f32)),
             Slot("param", "b", tensor([5], f32)), Slot("batch", "t", tensor([6], i64))]
    module, fn = new_step(slots)
    bld = OpBuilder(fn.body.block)
    h, w, bias, t = fn.body.block.args
    props = {"ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0, "chunk": 4}
    g = bld.full(1.0, (), f32)
    op = bld.create(nv.LinearCrossEntropyWithGradOp, [g, h, w, t, bias], props, tensor([], f32))
    loss, dh, dw, db = op.results
    total = bld.add(loss, bld.add(bld.reduce_sum(dh, [0, 1]), bld.add(bld.reduce_sum(dw, [0, 1]), bld.reduce_sum(db, [0]))))
    set_results(fn, [("loss", "loss", total)])
    PrecisionPass("bf16").apply(context(), module)
    module.verify()
    (new,) = [o for o in fn.body.block.ops if isinstance(o, nv.LinearCrossEntropyWithGradOp)]
    assert [str(elem_of(v.type)) for v in new.operands] == ["f32", "bf16", "bf16", "i64", "f32"]
    assert [str(elem_of(r.type)) for r in new.results] == ["f32", "bf16", "bf16", "f32"]
    assert all(elem_of(u.operation.results[0].type) == f32 for r in new.results[1:3] for u in r.uses)  # cast back
