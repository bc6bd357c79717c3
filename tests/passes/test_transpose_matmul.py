"""transpose_matmul: ``transpose(a @ b)`` becomes ``transpose(b) @ transpose(a)``
(through one cast), so every ``nn.Linear`` weight gradient is a product in the
parameter's own layout; the reference executor's step agrees with the step without
the stage; and what must stay, stays."""

from __future__ import annotations

import torch
from xdsl.dialects.builtin import f32, f64

from nova import pipeline
from nova.backends.reference import run_function
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, set_results, step_func
from nova.ir.types import shape_of, tensor
from nova.models import GPT, gpt_tiny
from nova.transforms import transpose_matmul as tm

from step_inputs import step_args


def _gpt(precision: str, dtype=torch.float32):
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=2, block_size=8)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 256, (2, 9))
    return pipeline.Compilation(model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), opt, precision, dtype)


def _to(c, stage: str):
    for name, fn in pipeline.STAGES:
        fn(c)
        if name == stage:
            return c
    raise AssertionError(stage)


def _products_transposed(fn) -> int:
    """Transposes (last two dims) of a matmul's result, directly or through a cast."""
    n = 0
    for op in fn.body.block.ops:
        if isinstance(op, nv.TransposeOp) and tm._swaps_last_two(op.props()["perm"]):
            v = op.operands[0]
            if isinstance(v.owner, nv.CastOp):
                v = v.owner.operands[0]
            n += isinstance(v.owner, nv.MatmulOp)
    return n


def test_the_switch_is_off_by_default():
    """Off until the step is measured with it on a device (the constant's comment)."""
    c = _to(_gpt("fp32"), "simplify")
    assert tm.ENABLED is False and tm.transpose_matmul(c.module) == 0


def test_linear_weight_gradients_are_products_in_the_parameters_layout():
    for precision in ("fp32", "bf16"):
        c = _to(_gpt(precision), "simplify")
        fn = step_func(c.module)
        before = _products_transposed(fn)
        assert before >= 8, "each of the 2 layers' 4 Linear weights: transpose(x^T @ dy)"
        assert tm.transpose_matmul(c.module, enabled=True) == before
        c.module.verify()
        assert _products_transposed(fn) == 0
        weights = {tuple(shape_of(v.type)) for n, v in c.grads.items() if len(shape_of(v.type)) == 2 and ".h." in n}
        products = {shape_of(op.results[0].type) for op in fn.body.block.ops if isinstance(op, nv.MatmulOp)}
        assert weights <= products, (weights, products)


def test_the_reference_step_agrees_with_the_transposed_products(monkeypatch):
    """float64, the reference executor, the whole step (loss, gradients, SGD update):
    with and without the stage within rounding (the same K products, summed by
    another matmul call)."""
    outs = {}
    for enabled in (False, True):
        monkeypatch.setattr(tm, "ENABLED", enabled)
        c = pipeline.run(_gpt("fp32", torch.float64))
        outs[enabled] = run_function(step_func(c.module), step_args(c))
    assert len(outs[False]) == len(outs[True])
    for x, y in zip(outs[False], outs[True], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def _single(shape_a, shape_b, perm, cast=None, extra_reader=False):
    module, fn = new_step([Slot("batch", "a", tensor(shape_a, f64)), Slot("batch", "b", tensor(shape_b, f64))])
    b = OpBuilder(fn.body.block)
    a_, b_ = fn.body.block.args
    m = b.matmul(a_, b_)
    v = b.cast(m, cast) if cast is not None else m
    t = b.transpose(v, perm)
    results = [("loss", "loss", b.reduce_sum(t, list(range(len(perm)))))]
    if extra_reader:
        results.append(("loss", "other", b.reduce_sum(m, list(range(len(perm))))))
    set_results(fn, results)
    return module, fn


def test_what_is_rewritten_and_what_stays():
    cases = [
        (((4, 3), (3, 5), (1, 0), None, False), 1),
        (((4, 3), (3, 5), (1, 0), f32, False), 1),  # through a cast
        (((2, 4, 3), (2, 3, 5), (0, 2, 1), None, False), 1),  # batched, the batch dims equal
        (((2, 4, 3), (1, 3, 5), (0, 2, 1), None, False), 0),  # broadcast batch dims
        (((2, 4, 3), (2, 3, 5), (1, 0, 2), None, False), 0),  # a transpose of other dims
        (((4, 3), (3, 5), (1, 0), None, True), 0),  # the product has another reader
    ]
    for (sa, sb, perm, cast, extra), want in cases:
        module, fn = _single(sa, sb, perm, cast, extra)
        a = torch.randn(sa, dtype=torch.float64)
        b = torch.randn(sb, dtype=torch.float64)
        before = run_function(fn, [a, b])
        assert tm.transpose_matmul(module, enabled=True) == want, (sa, sb, perm, cast, extra)
        module.verify()
        after = run_function(fn, [a, b])
        for x, y in zip(before, after, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
        if want:
            (mm,) = [op for op in fn.body.block.ops if isinstance(op, nv.MatmulOp)]
            assert shape_of(mm.results[0].type)[-2:] == (sb[-1], sa[-2])
            # the operands' own transposes: one each, added (a and b are arguments)
            assert all(isinstance(o.owner, nv.TransposeOp) for o in mm.operands)


def test_an_operands_own_transpose_is_undone_not_doubled():
    """transpose(transpose(x) @ y) -> transpose(y) @ x: x is read as it is."""
    module, fn = new_step([Slot("batch", "x", tensor([3, 4], f64)), Slot("batch", "y", tensor([3, 5], f64))])
    b = OpBuilder(fn.body.block)
    x, y = fn.body.block.args
    t = b.transpose(b.matmul(b.transpose(x, (1, 0)), y), (1, 0))
    set_results(fn, [("loss", "loss", b.reduce_sum(t, [0, 1]))])
    assert tm.transpose_matmul(module, enabled=True) == 1
    (mm,) = [op for op in fn.body.block.ops if isinstance(op, nv.MatmulOp)]
    assert mm.operands[1] is x and mm.operands[0].owner.operands[0] is y
    assert not any(isinstance(op, nv.TransposeOp) and op.operands[0] is x for op in fn.body.block.ops)


def _weight_gradient(t: int, d_in: int, d_out: int, elt=f32):
    """transpose(x^T @ dy) for x [t, d_in], dy [t, d_out], both row-major: a Linear's weight gradient."""
    module, fn = new_step([Slot("batch", "x", tensor([t, d_in], elt)), Slot("batch", "dy", tensor([t, d_out], elt))])
    b = OpBuilder(fn.body.block)
    x, dy = fn.body.block.args
    w = b.transpose(b.matmul(b.transpose(x, (1, 0)), dy), (1, 0))
    set_results(fn, [("loss", "loss", b.reduce_sum(w, [0, 1]))])
    return module, fn


def test_tf32_rewrites_the_products_whose_staged_b_gets_smaller():
    """Switch off, under tf32: x^T @ dy stages dy (row-major as B: not K-major), dy^T @ x stages x;
    rewritten only where x is the smaller (out > in), and only f32 products."""
    assert tm.ENABLED is False and tm.TF32_STAGE_SMALLER is True
    for d_in, d_out, want in [(4, 16, 1), (16, 4, 0), (8, 8, 0)]:
        module, fn = _weight_gradient(32, d_in, d_out)
        assert tm.transpose_matmul(module, precision="fp32") == 0
        assert tm.transpose_matmul(module, precision="tf32") == want, (d_in, d_out)
        (mm,) = [op for op in fn.body.block.ops if isinstance(op, nv.MatmulOp)]
        assert shape_of(mm.results[0].type) == ((d_out, d_in) if want else (d_in, d_out))
    module, _ = _weight_gradient(32, 4, 16, f64)
    assert tm.transpose_matmul(module, precision="tf32") == 0  # not an f32 product


def test_tf32_gpt_step_rewrites_the_widening_weights_gradients():
    """GPT's qkv (d -> 3d) and fc (d -> 4d) weight gradients are rewritten under tf32; the
    attention and MLP projections (3d... -> d, d -> d) keep x^T @ dy."""
    c = _to(_gpt("tf32"), "simplify")
    fn = step_func(c.module)
    before = _products_transposed(fn)
    assert tm.transpose_matmul(c.module, precision="tf32") == 4  # 2 layers x (qkv, fc)
    c.module.verify()
    assert _products_transposed(fn) == before - 4
