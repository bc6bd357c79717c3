"""The nova dialect: verification, printing and parsing back."""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import f32, i64
from xdsl.utils.exceptions import VerifyException

import nova
from nova import pipeline
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, parse_module, print_module, set_results
from nova.ir.types import tensor
from nova.models import GPT, gpt_tiny


def test_gpt_step_ir_round_trips():
    torch.manual_seed(0)
    model = GPT(gpt_tiny(dropout=0.1, attention="manual"))
    step = nova.compile(model, torch.optim.AdamW(model.parameters()), precision="bf16")
    x = torch.randint(0, 256, (2, 32))
    step(x, x)
    last = step._last.compilation  # every stage's generic IR, as pipeline.run(dump=True) keeps it
    c = pipeline.Compilation(model, last.batch, step.optimizer, step.precision, last.step_dtype)
    pipeline.run(c, dump=True)
    assert list(c.stages) == [name for name, _ in pipeline.STAGES]
    for ir in c.stages.values():
        module = parse_module(ir)
        module.verify()
        assert print_module(module).strip() == ir.strip()
    final = c.stages["plan_memory"]
    for op in ["nova.softmax_backward", "nova.layer_norm_backward", "nova.linear_cross_entropy_with_grad",
               "nova.embedding_backward", "nova.gelu_backward", "nova.dropout_mask", "bf16"]:  # fmt: skip
        assert op in final, op


def _fn_with(op_builder):
    module, fn = new_step([Slot("param", "a", tensor([2, 3], f32)), Slot("param", "b", tensor([3, 4], f32))])
    b = OpBuilder(fn.body.block)
    out = op_builder(b, *fn.body.block.args)
    set_results(fn, [("loss", "loss", out)])
    return module


def test_shape_errors_are_caught_by_inference():
    with pytest.raises(VerifyException, match="contraction sizes differ"):
        _fn_with(lambda b, a, w: b.matmul(w, a))
    with pytest.raises(ValueError, match="do not broadcast"):
        _fn_with(lambda b, a, w: b.add(a, w))


def test_verifier_rejects_a_wrong_result_type():
    module = _fn_with(lambda b, a, w: b.matmul(a, w))
    mm = next(op for op in module.walk() if isinstance(op, nv.MatmulOp))
    text = print_module(module).replace("-> tensor<2x4xf32>", "-> tensor<2x5xf32>", 1)
    with pytest.raises(Exception):
        parse_module(text).verify()
    assert mm is not None


def test_linear_cross_entropy_with_grad_verifier():
    """The merged LM head op checks what its two ops check, naming itself; its
    results are the forward's loss (of the creator's type) and the backward's gradients."""
    from xdsl.dialects.builtin import bf16

    def build(h_elem=f32, g_shape=(), loss=f32, bias=None):
        slots = [Slot("batch", "g", tensor(list(g_shape), f32)), Slot("param", "h", tensor([6, 4], h_elem)),
                 Slot("param", "w", tensor([5, 4], h_elem)), Slot("batch", "t", tensor([6], i64))]
        slots += [Slot("param", "b", tensor([5], bias))] if bias else []
        _, fn = new_step(slots)
        props = {"ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0, "chunk": 4}
        return OpBuilder(fn.body.block).create(nv.LinearCrossEntropyWithGradOp, list(fn.body.block.args), props,
                                               tensor([], loss))

    op = build(bf16, bias=f32)
    assert [str(r.type) for r in op.results] == ["tensor<f32>", "tensor<6x4xbf16>", "tensor<5x4xbf16>", "tensor<5xf32>"]
    op.verify_()
    with pytest.raises(VerifyException, match="nova.linear_cross_entropy_with_grad: grad must be a 0-d float"):
        build(g_shape=(1,))
    with pytest.raises(VerifyException, match="nova.linear_cross_entropy_with_grad: the loss must be f32"):
        build(loss=bf16)
    with pytest.raises(VerifyException, match="nova.linear_cross_entropy_with_grad: bias must be"):
        build(bias=bf16)


def test_every_op_is_registered_and_documented():
    assert len(nv.NOVA_OPS) == len(nv.OP_BY_NAME)
    for op in nv.NOVA_OPS:
        assert op.name.startswith("nova.")


def test_int_and_bool_tensors():
    module, fn = new_step([Slot("batch", "ids", tensor([4], i64)), Slot("param", "w", tensor([10, 3], f32))])
    b = OpBuilder(fn.body.block)
    ids, w = fn.body.block.args
    e = b.one(nv.EmbeddingOp, [w, ids])
    mask = b.one(nv.GtOp, [e, b.full(0.0, (), f32)])
    out = b.reduce_sum(b.where(mask, e, b.full(0.0, (), f32)), [0, 1])
    set_results(fn, [("loss", "loss", out)])
    module.verify()
    assert "i1" in print_module(module)
