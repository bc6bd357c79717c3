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
    for op in ["nova.softmax_backward", "nova.layer_norm_backward", "nova.linear_cross_entropy_backward",
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
