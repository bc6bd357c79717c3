"""The fold stage: IR in, IR out. Static values (computed from shapes alone)
become ``folded.<n>`` buffer arguments holding their compile-time value; what
depends on the batch stays in the step."""

from __future__ import annotations

import torch
import torch.nn as nn
from xdsl.dialects.builtin import f32, i64

from nova import pipeline
from nova.backends.reference import run_function
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, arg_slots, new_step, set_results, step_func
from nova.ir.types import tensor
from nova.transforms import fold


def _step(*slots):
    module, fn = new_step(list(slots))
    return module, fn, OpBuilder(fn.body.block)


def _names(fn):
    return [op.name for op in fn.body.block.ops]


def _causal(b, t):
    rows = b.reshape(b.one(nv.ArangeOp, [], {"start": 0, "step": 1}, tensor([t], i64)), [t, 1])
    cols = b.reshape(b.one(nv.ArangeOp, [], {"start": 0, "step": 1}, tensor([t], i64)), [1, t])
    return b.one(nv.GeOp, [rows, cols])


def test_a_causal_mask_is_folded_and_the_batch_part_stays():
    module, fn, b = _step(Slot("batch", "x", tensor([2, 4, 4], f32)))
    x = fn.body.block.args[0]
    mask = b.broadcast_to(_causal(b, 4), [2, 4, 4])
    y = b.where(mask, x, b.full(0.0, (), f32))
    set_results(fn, [("loss", "loss", b.reduce_sum(y, [0, 1, 2]))])
    xv = torch.randn(2, 4, 4)
    before = run_function(fn, [xv])[0]
    buffers: dict[str, torch.Tensor] = {}
    names = fold.fold_static(module, buffers, torch.device("cpu"))
    module.verify()
    assert names == ["folded.0"]
    assert [s.role for s in arg_slots(fn)] == ["batch", "buffer"]
    # the compare is gone; the broadcast of the folded [4, 4] source stays a view in the step
    ops = _names(fn)
    assert "nova.ge" not in ops and "nova.arange" not in ops and "nova.broadcast_to" in ops
    assert torch.equal(buffers["folded.0"], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(run_function(fn, [xv, buffers["folded.0"]])[0], before)


def test_batch_dependent_values_and_cheap_constants_are_not_folded():
    module, fn, b = _step(Slot("batch", "ids", tensor([2, 5], i64)))
    ids = fn.body.block.args[0]
    shifted = b.sub(ids, b.full(1.0, (), i64))  # depends on the batch
    pos = b.one(nv.ArangeOp, [], {"start": 3, "step": 2}, tensor([5], i64))  # cheap: stays an op
    s = b.cast(b.add(shifted, pos), f32)
    set_results(fn, [("loss", "loss", b.reduce_sum(s, [0, 1]))])
    assert fold.fold_static(module, {}, torch.device("cpu")) == []
    assert "nova.arange" in _names(fn) and "nova.sub" in _names(fn)


def test_a_large_elementwise_constant_is_recomputed_from_its_folded_operands(monkeypatch):
    monkeypatch.setattr(fold, "MAX_FOLDED_ELEMENTS", 8)
    module, fn, b = _step(Slot("batch", "x", tensor([4, 2, 2], f32)))
    x = fn.body.block.args[0]
    mask = b.broadcast_to(_causal(b, 2), [4, 2, 2])
    # 16 elements > 8: the where is kept; its mask (4 elements) is folded
    bias = b.where(mask, b.full(0.0, (), f32), b.full(float("-inf"), (), f32))
    set_results(fn, [("loss", "loss", b.reduce_sum(b.add(x, bias), [0, 1, 2]))])
    buffers: dict[str, torch.Tensor] = {}
    fold.fold_static(module, buffers, torch.device("cpu"))
    assert "nova.where" in _names(fn) and "nova.ge" not in _names(fn)
    assert [t.dtype for t in buffers.values()] == [torch.bool]


class TrilInForward(nn.Module):
    """nanoGPT-style code that builds its mask in forward, from shapes only."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        t = x.shape[1]
        att = x @ self.w @ x.transpose(1, 2)
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return (att @ x).square().mean()


def test_the_pipeline_folds_a_mask_built_in_forward():
    model = TrilInForward()
    c = pipeline.Compilation(model, (torch.randn(2, 5, 6),), None, "fp32", torch.float32)
    pipeline.run(c, dump=True)
    folded = [n for n in c.captured.buffers if n.startswith("folded.")]
    assert len(folded) == 1 and c.captured.buffers[folded[0]].shape == (5, 5)
    assert "nova.arange" in c.stages["capture"] and "nova.arange" not in c.stages["fold"]
    fn = step_func(c.module)
    assert sum(1 for s in arg_slots(fn) if s.role == "buffer") == 1


def test_transformers_position_ids_and_causal_mask_are_folded():
    """transformers' Llama without an attention_mask: position ids and the causal
    mask come from shapes alone; after the fold stage no arange or compare is
    left in the step (the rotary cos/sin read the inv_freq buffer and stay)."""
    import re

    from hf_models import build

    class IdsOnly(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, labels):
            return self.m(input_ids=ids, labels=labels, use_cache=False).loss

    model = IdsOnly(build("llama", "eager", torch.float32).m)
    ids = torch.randint(0, 48, (2, 12))
    c = pipeline.Compilation(model, (ids, ids.clone()), None, "fp32", torch.float32)
    pipeline.run(c, dump=True)
    before, after = (set(re.findall(r'"(nova\.\w+)"', c.stages[s])) for s in ("capture", "fold"))
    assert {"nova.arange", "nova.le", "nova.lt"} <= before
    assert not {"nova.arange", "nova.le", "nova.lt", "nova.ge"} & after
    assert "nova.cos" in after
    shapes = [tuple(t.shape) for n, t in c.captured.buffers.items() if n.startswith("folded.")]
    assert any(s[-2:] == (12, 12) for s in shapes), shapes
