"""simplify's cast canonicalization: IR in, IR out, and a whole bf16 step
bit-identical with and without it on the reference executor."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32

from nova import pipeline
from nova.config import SETTINGS
from nova.backends.reference import run_function
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, context, new_step, parse_module, print_module, set_results, step_func
from nova.ir.types import elem_of, tensor
from nova.models import GPT, gpt_tiny
from nova.transforms import simplify
from nova.transforms.simplify import Simplify

from step_inputs import step_args

# the step cache would hand a second compile of the same program the first one's IR
_NO_STEP_CACHE = dataclasses.replace(SETTINGS, step_cache=False) if hasattr(SETTINGS, "step_cache") else SETTINGS


def _step(*slots):
    module, fn = new_step(list(slots))
    return module, fn, OpBuilder(fn.body.block), fn.body.block.args


def _simplified(module) -> str:
    Simplify().apply(context(), module)
    module.verify()
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    return text


def _ops(module, cls) -> list:
    return [o for o in step_func(module).body.block.ops if isinstance(o, cls)]


def test_the_backward_cast_of_a_transpose_merges_with_the_forward_cast():
    # forward: cast(x) @ w; backward: cast(transpose(x)) @ g, as the bf16 policy writes them
    module, fn, b, (x, w, g) = _step(Slot("param", "x", tensor([8, 4], f32)), Slot("param", "w", tensor([4, 6], bf16)),
                                     Slot("param", "g", tensor([8, 6], bf16)))  # fmt: skip
    y = b.matmul(b.cast(x, bf16), w)
    dw = b.matmul(b.cast(b.transpose(x, [1, 0]), bf16), g)
    set_results(fn, [("loss", "y", y), ("grad", "w", dw)])
    assert len(_ops(module, nv.CastOp)) == 2
    _simplified(module)
    (cast,) = _ops(module, nv.CastOp)
    assert cast.operands[0] is x
    (t,) = _ops(module, nv.TransposeOp)
    assert t.operands[0] is cast.results[0] and t.results[0].type == tensor([4, 8], bf16)
    mm = _ops(module, nv.MatmulOp)
    assert mm[0].operands[0] is cast.results[0] and mm[1].operands[0] is t.results[0]


@pytest.mark.parametrize("layout", ["reshape", "broadcast_to"])
def test_a_cast_moves_above_reshape_and_broadcast(layout):
    module, fn, b, (x,) = _step(Slot("param", "x", tensor([1, 6], f32)))
    v = b.reshape(x, [2, 3]) if layout == "reshape" else b.broadcast_to(x, [4, 6])
    set_results(fn, [("loss", "y", b.cast(v, bf16))])
    text = _simplified(module)
    (cast,) = _ops(module, nv.CastOp)
    assert cast.operands[0] is x and cast.results[0].type == tensor([1, 6], bf16)
    assert f'"nova.{layout}"(%{0}' not in text  # the layout op now reads the cast
    (lay,) = [o for o in step_func(module).body.block.ops if o.name == f"nova.{layout}"]
    assert lay.operands[0] is cast.results[0] and elem_of(lay.results[0].type) == bf16


def test_a_chain_of_layout_ops_ends_in_a_cast_that_folds_with_its_widening():
    # the attention output: bf16 -> f32, transpose, reshape, then back to bf16 for c_proj
    module, fn, b, (x,) = _step(Slot("param", "x", tensor([2, 3, 4, 5], bf16)))
    wide = b.cast(x, f32)
    flat = b.reshape(b.transpose(wide, [0, 2, 1, 3]), [2, 4, 15])
    set_results(fn, [("loss", "y", b.cast(flat, bf16)), ("loss", "z", flat)])
    _simplified(module)
    casts = _ops(module, nv.CastOp)
    assert len(casts) == 1 and casts[0].operands[0] is x  # only the f32 result's own cast is left
    (t,) = [o for o in _ops(module, nv.TransposeOp) if elem_of(o.results[0].type) == bf16]
    assert t.operands[0] is x


def test_cast_of_cast_folds_only_through_an_exact_widening():
    module, fn, b, (x, y) = _step(Slot("param", "x", tensor([4], bf16)), Slot("param", "y", tensor([4], f32)))
    back = b.cast(b.cast(x, f32), bf16)  # bf16 -> f32 -> bf16: x
    rounded = b.cast(b.cast(y, bf16), f32)  # f32 -> bf16 -> f32 rounds: stays
    same = b.cast(y, f32)  # a cast to the value's own type: y
    set_results(fn, [("loss", "a", back), ("loss", "b", rounded), ("loss", "c", same)])
    _simplified(module)
    ret = step_func(module).body.block.last_op
    assert ret.operands[0] is x and ret.operands[2] is y
    assert isinstance(ret.operands[1].owner, nv.CastOp) and isinstance(ret.operands[1].owner.operands[0].owner, nv.CastOp)


def test_slices_that_cover_their_source_share_one_cast_a_lone_slice_keeps_its_own():
    module, fn, b, (x, z) = _step(Slot("param", "x", tensor([2, 12], f32)), Slot("param", "z", tensor([2, 12], f32)))
    parts = [b.cast(b.one(nv.SliceOp, [x], {"dim": 1, "start": s, "end": s + 4, "step": 1}), bf16) for s in (0, 4, 8)]
    lone = b.cast(b.one(nv.SliceOp, [z], {"dim": 1, "start": 0, "end": 4, "step": 1}), bf16)
    set_results(fn, [("loss", f"p{i}", p) for i, p in enumerate(parts)] + [("loss", "lone", lone)])
    _simplified(module)
    casts = _ops(module, nv.CastOp)
    assert sorted(str(c.results[0].type) for c in casts) == ["tensor<2x12xbf16>", "tensor<2x4xbf16>"]
    whole = next(c for c in casts if c.operands[0] is x)
    assert all(s.operands[0] is whole.results[0] for s in _ops(module, nv.SliceOp) if s.operands[0] is not z)
    assert next(c for c in casts if c is not whole).operands[0].owner.operands[0] is z


def test_a_cast_without_a_rule_is_left_alone():
    module, fn, b, (x,) = _step(Slot("param", "x", tensor([4], f32)))
    set_results(fn, [("loss", "y", b.cast(b.one(nv.ExpOp, [x]), bf16))])
    before = print_module(module)
    assert _simplified(module) == before


# ---------------------------------------------------------------------------
# a whole step


def tiny_gpt_step(precision: str = "bf16", n_layer: int = 2, **kw):
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=n_layer, block_size=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 17))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    return pipeline.run(pipeline.Compilation(model, batch, opt, precision, torch.float32, **kw))


def test_a_bf16_gpt_step_is_bit_identical_with_and_without_the_cast_rules(monkeypatch):
    # the step cache off: it would hand the second compile the first one's IR
    monkeypatch.setattr(pipeline, "SETTINGS", _NO_STEP_CACHE)
    with_rules = tiny_gpt_step()
    # what the rules save, seen before the fuse stage groups the casts with their neighbours
    # (a tiny model's peak is in the optimizer: the activations it frees show in the sum)
    stages = pipeline.STAGES
    monkeypatch.setattr(pipeline, "STAGES", [s for s in stages if s[0] != "fuse"])
    plain_with = tiny_gpt_step()
    monkeypatch.setattr(simplify, "canonicalize_casts", lambda block: None)
    plain_without = tiny_gpt_step()
    monkeypatch.setattr(pipeline, "STAGES", stages)
    without = tiny_gpt_step()
    n_with, n_without = (len(_ops(c.module, nv.CastOp)) for c in (plain_with, plain_without))
    assert n_with < n_without
    assert plain_with.memory.peak_bytes <= plain_without.memory.peak_bytes
    assert plain_with.memory.sum_bytes < plain_without.memory.sum_bytes
    a = run_function(step_func(with_rules.module), step_args(with_rules), "bf16")
    b = run_function(step_func(without.module), step_args(without), "bf16")
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
