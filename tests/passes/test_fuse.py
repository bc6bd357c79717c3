"""fuse: IR in, IR out, one test per grouping rule (vertical, views, horizontal,
scalars recomputed inside, no cycle, a matmul's epilogue and what stays out of
it, a reduction's prologue and a row-wise reduction's epilogue, singletons),
each checked to verify, print and parse back, and to compute the
same values bit for bit as the IR before it on the reference executor; then
whole steps (the MLP LM and small GPTs) fused against unfused."""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import StringAttr, bf16, f32, f64, i1, i64

from nova import pipeline
from nova.backends.reference import run_function
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, parse_module, print_module, set_results, step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.models import GPT, MLPLM, MLPLMConfig, gpt_tiny
from nova.transforms import fuse as fz

from step_inputs import step_args


def _step(*slots):
    module, fn = new_step(list(slots))
    return module, fn, OpBuilder(fn.body.block, location="test.py:1")


def _args(fn, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for a in fn.body.block.args:
        dt = to_torch_dtype(elem_of(a.type))
        out.append((torch.rand(shape_of(a.type), generator=g, dtype=torch.float64) + 0.5).to(dt))
    return out


def _fused(module, **expect_same):
    """Fuses ``module`` in place, checking that it verifies, round-trips through text
    and computes what it computed before; returns the top-level ops."""
    fn = step_func(module)
    args = _args(fn)
    before = run_function(fn, args)
    fz.fuse(module)
    module.verify()
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    after = run_function(fn, args)
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x, y)
    return [op for op in fn.body.block.ops if op.name != "func.return"]


def _inner(op):
    return [o.name for o in op.inner_ops()]


@pytest.fixture
def gelu_backward_in_epilogues(monkeypatch):
    """Room in the epilogue's budget for GELU's backward (12 FLOPs an element, past the
    shipped budget: it goes to the bias gradient's sum or a kernel of its own), so that
    the epilogue rules (the column sum, the shared recompute) run on the costliest
    epilogue value a step holds; a cheaper one (ReLU's backward) takes them as is."""
    monkeypatch.setattr(fz, "EPILOGUE_MAX_FLOPS", 13)


def test_a_vertical_chain_is_one_group_reading_a_broadcast_operand():
    module, fn, b = _step(Slot("param", "x", tensor([4, 8], f32)), Slot("param", "bias", tensor([8], f32)))
    x, bias = fn.body.block.args
    y = b.cast(b.mul(b.one(nv.ExpOp, [x]), bias), bf16)
    set_results(fn, [("loss", "y", y)])
    (op,) = _fused(module)
    assert isinstance(op, nv.FusedOp) and _inner(op) == ["nova.exp", "nova.mul", "nova.cast"]
    assert list(op.operands) == [x, bias] and [str(r.type) for r in op.results] == ["tensor<4x8xbf16>"]
    assert op.props()["kind"] == "elementwise" and op.iteration_shape() == (4, 8)
    # inner ops keep their locations
    assert all(o.attributes["nova.loc"].data == "test.py:1" for o in op.inner_ops())


def test_a_group_reads_a_view_it_cannot_absorb_and_a_view_below_a_producer_sinks():
    module, fn, b = _step(Slot("param", "x", tensor([4, 8], f32)))
    (x,) = fn.body.block.args
    a = b.one(nv.ExpOp, [x])
    kept = b.add(a, a)  # a is read twice: it stays a value, and its transpose a view of it
    t = b.neg(b.transpose(a, [1, 0]))
    s = b.neg(b.transpose(b.one(nv.SqrtOp, [x]), [1, 0]))  # sqrt's only reader is the view: it moves below it
    set_results(fn, [("loss", "k", kept), ("loss", "t", t), ("loss", "s", s)])
    ops = _fused(module)
    groups = [o for o in ops if isinstance(o, nv.FusedOp)]
    assert [_inner(g) for g in groups] == [["nova.exp", "nova.add"], ["nova.sqrt", "nova.neg"]]
    # -t reads exp's output through its transpose: a strided view outside any group
    neg = next(o for o in ops if isinstance(o, nv.NegOp))
    assert isinstance(neg.operands[0].owner, nv.TransposeOp) and neg.operands[0].owner.operands[0].owner is groups[0]
    # sqrt reads x transposed, inside the group of the [8, 4] neg
    view = groups[1].operands[0].owner
    assert isinstance(view, nv.TransposeOp) and view.operands[0] is x and groups[1].iteration_shape() == (8, 4)


def test_readers_of_one_value_close_by_are_one_multi_output_group():
    module, fn, b = _step(Slot("param", "x", tensor([4, 8], f32)), Slot("param", "w", tensor([8, 8], f32)))
    x, w = fn.body.block.args
    e = b.one(nv.ExpOp, [x])
    n = b.neg(x)
    m = b.matmul(x, w)  # far enough apart: not merged
    for _ in range(fz.HORIZONTAL_WINDOW):
        m = b.matmul(m, w)
    far = b.one(nv.SqrtOp, [x])
    set_results(fn, [("loss", "e", e), ("loss", "n", n), ("loss", "m", m), ("loss", "far", far)])
    ops = _fused(module)
    (g,) = [o for o in ops if isinstance(o, nv.FusedOp)]
    assert _inner(g) == ["nova.exp", "nova.neg"] and len(g.results) == 2 and list(g.operands) == [x]
    assert sum(isinstance(o, nv.SqrtOp) for o in ops) == 1


def test_scalars_are_recomputed_in_each_group_and_dropped():
    module, fn, b = _step(Slot("hyper", "lr", tensor([], f64)), Slot("param", "x", tensor([4, 8], f32)),
                          Slot("param", "v", tensor([8], f32)))  # fmt: skip
    lr, x, v = fn.body.block.args
    c = b.cast(b.neg(b.mul(lr, b.scalar(2.0, lr))), f32)  # -2 lr in f32: a scalar from a scalar
    y = b.mul(x, c)
    z = b.add(v, c)
    set_results(fn, [("loss", "y", y), ("loss", "z", z)])
    ops = _fused(module)
    assert all(isinstance(o, nv.FusedOp) for o in ops) and len(ops) == 2  # no kernel of its own for the scalars
    for g in ops:
        assert _inner(g)[:4] == ["nova.full", "nova.mul", "nova.neg", "nova.cast"] and g.operands[0] is lr


def test_a_returned_scalar_is_computed_once_and_read():
    module, fn, b = _step(Slot("hyper", "lr", tensor([], f64)), Slot("param", "x", tensor([4, 8], f64)))
    lr, x = fn.body.block.args
    c = b.neg(lr)
    y = b.mul(x, c)
    set_results(fn, [("loss", "c", c), ("loss", "y", y)])
    ops = _fused(module)
    assert [o.name for o in ops] == ["nova.neg", "nova.mul"]  # two singletons: nothing to recompute


def test_a_long_scalar_chain_is_cut_into_kernels():
    module, fn, b = _step(Slot("hyper", "lr", tensor([], f64)), Slot("param", "x", tensor([4], f64)))
    lr, x = fn.body.block.args
    c = lr
    for _ in range(fz.SCALAR_CONE + 4):
        c = b.neg(c)
    y = b.mul(x, c)
    set_results(fn, [("loss", "y", y)])
    ops = _fused(module)
    for g in ops:
        if isinstance(g, nv.FusedOp):
            assert len(g.inner_ops()) <= fz.SCALAR_CONE + 1


def test_no_group_feeds_and_reads_an_outside_op():
    module, fn, b = _step(Slot("param", "x", tensor([8, 8], f32)), Slot("param", "w", tensor([8, 8], f32)))
    x, w = fn.body.block.args
    a = b.one(nv.ExpOp, [x])
    m = b.matmul(a, w)
    y = b.add(a, m)  # a and y in one group would both feed and read the matmul: y joins its epilogue
    r = b.reduce_sum(a, [1], keepdim=True)
    z = b.neg(a)  # z joins a's group, placed before the reduction (it reads no outside value after a)
    set_results(fn, [("loss", "y", y), ("loss", "r", r), ("loss", "z", z)])
    ops = _fused(module)
    assert [o.name for o in ops] == ["nova.fused", "nova.fused", "nova.reduce_sum"]
    assert _inner(ops[0]) == ["nova.exp", "nova.neg"] and _inner(ops[1]) == ["nova.matmul", "nova.add"]
    assert ops[0].results[0] in ops[1].operands


def test_an_f32_matmul_takes_its_bias_gelu_and_cast():
    """fp32 too (the FMA dot keeps its explicit fma with contraction off: matmul.py)."""
    module, fn, b = _step(Slot("param", "x", tensor([4, 8], f32)), Slot("param", "w", tensor([8, 8], f32)),
                          Slot("param", "bias", tensor([8], f32)))  # fmt: skip
    x, w, bias = fn.body.block.args
    h = b.add(b.matmul(x, w), bias)
    y = b.cast(b.one(nv.GeluOp, [h], {"approximate": "tanh"}), bf16)
    set_results(fn, [("loss", "y", y)])
    (op,) = _fused(module)
    assert _inner(op) == ["nova.matmul", "nova.add", "nova.gelu", "nova.cast"]


# ----------------------------------------------------------------------------
# output fusion: a contraction with its epilogue


def _linear(n_out=96, x_dtype=bf16, w_dtype=bf16):
    """x [16, 32] @ w [32, n_out] read as [2, 8, n_out], plus a bias over rows, the
    shape of a GPT linear layer's forward in bf16 (the matmul's result cast to f32)."""
    module, fn, b = _step(Slot("param", "x", tensor([16, 32], x_dtype)), Slot("param", "w", tensor([32, n_out], w_dtype)),
                          Slot("param", "bias", tensor([n_out], f32)), Slot("param", "res", tensor([2, 8, n_out], f32)))  # fmt: skip
    x, w, bias, res = fn.body.block.args
    mm = b.matmul(x, w)
    pre = b.add(b.cast(b.reshape(mm, [2, 8, n_out]), f32), bias)
    return module, fn, b, mm, pre, res


def test_a_matmul_takes_its_bias_gelu_and_cast_and_yields_the_pre_activation_too():
    """GPT's fc layer: bias add, GELU, bf16 cast in the matmul's epilogue, through
    the reshape of its rows; the pre-activation (which the backward reads) and the
    GELU output are both outputs, written from the tile."""
    module, fn, b, mm, pre, _ = _linear()
    out = b.cast(b.one(nv.GeluOp, [pre], {"approximate": "tanh"}), bf16)
    set_results(fn, [("loss", "pre", pre), ("loss", "out", out)])
    (op,) = _fused(module)
    assert isinstance(op, nv.FusedOp) and op.props()["kind"] == "contraction"
    assert _inner(op) == ["nova.matmul", "nova.reshape", "nova.cast", "nova.add", "nova.gelu", "nova.cast"]
    assert op.iteration_shape() == (2, 8, 96) and isinstance(op.contraction(), nv.MatmulOp)
    assert [str(r.type) for r in op.results] == ["tensor<2x8x96xf32>", "tensor<2x8x96xbf16>"]
    assert list(op.operands) == list(fn.body.block.args[:3])  # x, w (the matmul's), the bias (the epilogue's)


def test_a_residual_add_joins_and_reads_a_second_full_tensor():
    module, fn, b, mm, pre, res = _linear(32)
    set_results(fn, [("loss", "y", b.add(res, pre))])
    (op,) = _fused(module)
    assert _inner(op) == ["nova.matmul", "nova.reshape", "nova.cast", "nova.add", "nova.add"]
    assert op.operands[3] is res and [str(r.type) for r in op.results] == ["tensor<2x8x32xf32>"]


def _fc_backward(with_bias_sum: bool = True):
    """The backward of the fc layer: dy @ w^T is GELU's incoming gradient (bf16,
    widened), GELU's backward reads the saved f32 pre-activation; its bf16 cast for
    the next matmuls, and (``with_bias_sum``) the bias gradient's column sum."""
    module, fn, b = _step(Slot("param", "dy", tensor([16, 32], bf16)), Slot("param", "w", tensor([128, 32], bf16)),
                          Slot("param", "pre", tensor([2, 8, 128], f32)))  # fmt: skip
    dy, w, pre = fn.body.block.args
    g = b.cast(b.reshape(b.matmul(dy, b.transpose(w, [1, 0])), [2, 8, 128]), f32)
    d = b.one(nv.GeluBackwardOp, [g, pre], {"approximate": "tanh"})
    sums = [("loss", "bias_grad", b.reduce_sum(d, [0, 1]))] if with_bias_sum else []
    set_results(fn, [*sums, ("loss", "d", b.cast(d, bf16))])
    return module, pre


def test_gelu_backward_is_computed_in_the_bias_gradients_sum_which_stores_it():
    """GELU's backward (12 FLOPs an element) is past the epilogue's budget, and the
    bias gradient's column sum stores its prologue's values (``PROLOGUE_STORES``):
    the matmul stays bare and writes its bf16 result; one reduce kernel widens it,
    computes GELU's backward from the saved pre-activation, sums it into the bias
    gradient and writes its bf16 cast for the next matmuls. The f32 value is never
    written."""
    module, pre = _fc_backward()
    ops = _fused(module)
    assert [o.name for o in ops] == ["nova.transpose", "nova.matmul", "nova.reshape", "nova.fused"]
    op = ops[3]
    assert isinstance(_reduction(op), nv.ReduceSumOp)
    assert _inner(op) == ["nova.cast", "nova.gelu_backward", "nova.reduce_sum", "nova.cast"]
    assert [str(r.type) for r in op.results] == ["tensor<128xf32>", "tensor<2x8x128xbf16>"]
    assert elem_of(op.operands[0].type) == bf16 and pre in op.operands


def test_gelu_backward_without_a_bias_gradient_is_a_kernel_of_its_own():
    """No column sum to compute it in: GELU's backward is one elementwise kernel after
    the bare matmul (measured on the H200, GPT-2 batch 32: the bare matmul 0.233 ms and
    such a kernel 0.243 ms against 0.535 ms with GELU's backward in the epilogue,
    bench/results/runs/epilogue_variants_nobackward_00dabef.json)."""
    module, _ = _fc_backward(with_bias_sum=False)
    ops = _fused(module)
    assert [o.name for o in ops] == ["nova.transpose", "nova.matmul", "nova.reshape", "nova.fused"]
    assert ops[3].props()["kind"] == "elementwise"
    assert _inner(ops[3]) == ["nova.cast", "nova.gelu_backward", "nova.cast"]


def test_a_matmul_result_read_outside_is_one_more_output():
    """The matmul's own result is also kept (here returned, as remat keeps a bf16
    matmul output to recompute from): it is written from the tile too."""
    module, fn, b, mm, pre, _ = _linear()
    set_results(fn, [("loss", "mm", mm), ("loss", "pre", pre)])
    (op,) = _fused(module)
    assert [str(r.type) for r in op.results] == ["tensor<16x96xbf16>", "tensor<2x8x96xf32>"]
    assert op.body.block.last_op.operands[0] is op.contraction().results[0]


def test_a_scale_a_2d_cast_and_a_dropout_mask_join_without_a_reshape():
    """No reshape (the epilogue runs over the matmul's own shape): a cast to f32 (a
    backward dx matmul feeding a LayerNorm backward), a 0-d scale, and a dropout
    mask, which reads the flat index of the iteration shape."""
    module, fn, b = _step(Slot("param", "x", tensor([16, 32], bf16)), Slot("param", "w", tensor([32, 24], bf16)),
                          Slot("seed", "seed", tensor([], i64)))  # fmt: skip
    x, w, seed = fn.body.block.args
    y = b.scale(b.cast(b.matmul(x, w), f32), 0.5)
    mask = b.one(nv.DropoutMaskOp, [seed], {"p": 0.1, "salt": 3}, tensor([16, 24], f32))
    set_results(fn, [("loss", "y", b.mul(y, mask))])
    (op,) = _fused(module)
    assert op.iteration_shape() == (16, 24)
    assert _inner(op) == ["nova.matmul", "nova.cast", "nova.full", "nova.mul", "nova.dropout_mask", "nova.mul"]


def test_what_stays_outside_an_epilogue():
    """A transpose between the matmul and its reader, a reshape that changes the last
    dim, a broadcast to a larger shape, a reduction, a second matmul (one
    accumulator per kernel: the add of both joins the first, the second's cast its
    own epilogue) and a cast feeding the matmul (no operand prologue): each stays
    outside; the ops that can join do."""
    module, fn, b = _step(Slot("param", "x", tensor([16, 32], f32)), Slot("param", "w", tensor([32, 24], bf16)),
                          Slot("param", "big", tensor([3, 16, 24], f32)))  # fmt: skip
    x, w, big = fn.body.block.args
    xb = b.cast(x, bf16)  # the operand's cast: its own kernel
    m1 = b.matmul(xb, w)
    t = b.neg(b.transpose(m1, [1, 0]))  # through a transpose: outside
    r = b.neg(b.reshape(m1, [16, 2, 12]))  # the last dim changes: outside
    m2 = b.matmul(xb, w)
    both = b.add(b.cast(m1, f32), b.cast(m2, f32))  # joins m1's epilogue, reads m2's result
    wide = b.add(both, big)  # [3, 16, 24]: another shape, outside
    s = b.reduce_sum(both, [1])
    set_results(fn, [("loss", "t", t), ("loss", "r", r), ("loss", "wide", wide), ("loss", "s", s)])
    ops = _fused(module)
    g1, g2 = [o for o in ops if isinstance(o, nv.FusedOp) and o.contraction() is not None]
    # m1 with its cast, its result yielded for the views; the add cannot join it (it
    # reads m2's cast, made after those views read m1): it joins m2's epilogue
    assert _inner(g1) == ["nova.matmul", "nova.cast"] and len(g1.results) == 2
    assert _inner(g2) == ["nova.matmul", "nova.cast", "nova.add"] and g1.results[1] in g2.operands
    assert isinstance(xb.owner, nv.CastOp) and xb.owner in ops  # no prologue
    assert sum(isinstance(o, (nv.TransposeOp, nv.ReshapeOp)) for o in ops) == 2  # both views stay views
    assert any(isinstance(o, nv.ReduceSumOp) for o in ops)
    wide_op = next(o for o in ops if o is not g2 and any(str(r.type) == "tensor<3x16x24xf32>" for r in o.results))
    assert wide_op.name in ("nova.add", "nova.fused")


def test_the_optimizers_update_stays_out_of_a_weight_gradients_epilogue(monkeypatch):
    """A weight gradient in its parameter's layout (the transpose_matmul stage) could
    take Adam's moment updates as its epilogue, but those would then be computed ahead
    of the guard's gate and kept for it (weight-sized temporaries): no contraction's
    group reads the optimizer's state or hyperparameters, and the gradient's widening
    cast, read by the update alone, goes with the update (the matmul writes the bf16
    product, one output). The plan's arena is the one without the stage."""
    from nova.ir.module import arg_slots
    from nova.transforms import transpose_matmul as tm

    arenas = {}
    for enabled in (True, False):
        monkeypatch.setattr(tm, "ENABLED", enabled)
        torch.manual_seed(0)
        model = GPT(gpt_tiny(n_layer=1, block_size=16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 256, (2, 17))
        c = pipeline.run(pipeline.Compilation(model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), opt,
                                              "bf16", torch.float32))  # fmt: skip
        arenas[enabled] = c.memory.arena_bytes
        if not enabled:
            continue
        fn = step_func(c.module)
        optimizer_args = {a for s_, a in zip(arg_slots(fn), fn.body.block.args, strict=True)
                          if s_.role in ("state", "hyper")}  # fmt: skip
        weight_grads = 0
        for op in fn.body.block.ops:
            if isinstance(op, nv.FusedOp) and op.contraction() is not None:
                assert not optimizer_args & set(op.operands), [o.name for o in op.inner_ops()]
            product = isinstance(op, nv.MatmulOp) or isinstance(op, nv.FusedOp) and op.contraction() is not None
            if product and shape_of(op.results[0].type) in {
                    (64, 256), (256, 64), (192, 64), (64, 64)}:  # the weights' gradients, [out, in]
                weight_grads += 1
                assert len(op.results) == 1 and elem_of(op.results[0].type) == bf16, op.name
        assert weight_grads == 4
    assert arenas[True] == arenas[False]


def test_an_epilogue_never_feeds_its_own_matmul():
    """exp(x) feeds the matmul and its epilogue's add: the add joins the matmul and
    reads exp(x) from outside; exp stays with the other reader of x's group."""
    module, fn, b = _step(Slot("param", "x", tensor([8, 8], bf16)), Slot("param", "w", tensor([8, 8], bf16)))
    x, w = fn.body.block.args
    a = b.one(nv.ExpOp, [x])
    y = b.add(a, b.matmul(a, w))
    set_results(fn, [("loss", "y", y)])
    ops = _fused(module)
    assert [o.name for o in ops] == ["nova.exp", "nova.fused"]
    assert ops[1].contraction() is not None and ops[0].results[0] in ops[1].operands


def test_a_batched_matmul_takes_a_scale_and_a_broadcast_mask():
    """Manual attention's scores: q k^T [B, H, T, T] times a 0-d scale, masked by a
    [T, T] condition broadcast over B and H: the mask is read at each row's (t, s)."""
    module, fn, b = _step(Slot("param", "q", tensor([2, 2, 8, 16], bf16)), Slot("param", "k", tensor([2, 2, 8, 16], bf16)),
                          Slot("param", "keep", tensor([8, 8], i1)))  # fmt: skip
    q, k, keep = fn.body.block.args
    s = b.scale(b.cast(b.matmul(q, b.transpose(k, [0, 1, 3, 2])), f32), 0.25)
    y = b.where(keep, s, b.full(float("-inf"), [], f32))
    set_results(fn, [("loss", "y", b.one(nv.SoftmaxOp, [y], {"dim": 3}))])
    ops = _fused(module)
    (g,) = [o for o in ops if isinstance(o, nv.FusedOp)]
    assert g.contraction() is not None and g.iteration_shape() == (2, 2, 8, 8) and keep in g.operands
    assert _inner(g)[-1] == "nova.where"


@pytest.mark.parametrize("budget", [fz.EPILOGUE_MAX_FLOPS, 20])
def test_a_recompute_stays_in_the_backward_and_joins_the_epilogue_within_its_budget(budget, monkeypatch):
    """The remat stage's GELU recompute (``nova.remat``) reads the saved pre-activation
    late: it is not pulled up into the forward matmul's group (that would compute it
    early and keep it). GELU's backward (12) passes the epilogue's budget (11): the
    backward matmul stays bare, and the recompute joins GELU's backward, its
    horizontal partner (both read the pre-activation), in one elementwise kernel.
    With a budget of 20 both join the backward matmul's epilogue."""
    monkeypatch.setattr(fz, "EPILOGUE_MAX_FLOPS", budget)
    module, fn, b = _step(Slot("param", "x", tensor([16, 32], f32)), Slot("param", "w", tensor([32, 64], f32)),
                          Slot("param", "bias", tensor([64], f32)), Slot("param", "dy", tensor([16, 32], f32)))  # fmt: skip
    module.attributes["nova.precision"] = StringAttr("tf32")
    x, w, bias, dy = fn.body.block.args
    pre = b.add(b.matmul(x, w), bias)
    y = b.matmul(b.one(nv.GeluOp, [pre], {"approximate": "tanh"}), b.transpose(w, [1, 0]))  # the forward reader
    dpre = b.matmul(dy, w)  # GELU's incoming gradient, in the backward
    again = b.one(nv.GeluOp, [pre], {"approximate": "tanh"})
    again.owner.attributes["nova.remat"] = StringAttr("default")
    dgelu = b.one(nv.GeluBackwardOp, [dpre, pre], {"approximate": "tanh"})
    set_results(fn, [("loss", "y", y), ("loss", "again", again), ("loss", "dgelu", dgelu)])
    ops = _fused(module)
    forward, *backward = [o for o in ops if isinstance(o, nv.FusedOp) and o.contraction() is not None]
    assert _inner(forward) == ["nova.matmul", "nova.add", "nova.gelu"]
    assert all("nova.remat" not in o.attributes for o in forward.inner_ops())
    if budget >= 20:
        assert _inner(backward[0]) == ["nova.matmul", "nova.gelu", "nova.gelu_backward"]
        assert "nova.remat" in backward[0].inner_ops()[1].attributes
    else:
        assert backward == []
        (both,) = [o for o in ops if isinstance(o, nv.FusedOp) and o.props()["kind"] == "elementwise"]
        assert _inner(both) == ["nova.gelu", "nova.gelu_backward"]
        assert "nova.remat" in both.inner_ops()[0].attributes
        assert ops.index(both) > ops.index(forward)


def test_the_contraction_group_verifies_its_structure():
    module, fn, b, mm, pre, _ = _linear()
    set_results(fn, [("loss", "pre", pre)])
    (op,) = _fused(module)
    text = print_module(module)
    # the first op must be a contraction that takes an epilogue
    bad = text.replace('"nova.matmul"', '"nova.add"', 1)
    with pytest.raises(Exception):
        parse_module(bad).verify()
    # a reshape must keep the last dim
    bad = text.replace("tensor<2x8x96xbf16>", "tensor<2x4x192xbf16>").replace(
        "tensor<2x8x96xf32>", "tensor<2x4x192xf32>")
    with pytest.raises(Exception, match="keep its last dim|do not|broadcast|shape"):
        parse_module(bad).verify()
    # an elementwise op may not be of another shape than the epilogue's
    inner = OpBuilder(op.body.block, before=op.body.block.last_op)
    other = inner.cast(op.contraction().results[0], f32)  # [16, 96], beside the [2, 8, 96] reshape
    op.body.block.last_op.operands[0] = other
    with pytest.raises(Exception):
        module.verify()


def test_a_group_of_one_op_stays_that_op():
    module, fn, b = _step(Slot("param", "x", tensor([4, 8], f32)), Slot("param", "w", tensor([8, 8], f32)))
    x, w = fn.body.block.args
    y = b.scale(b.one(nv.ExpOp, [b.matmul(x, w)]), 2.0)  # exp, then mul by a 0-d constant: the epilogue
    z = b.matmul(b.one(nv.ExpOp, [x]), w)  # exp alone (no prologue), the matmul alone (no epilogue)
    set_results(fn, [("loss", "y", y), ("loss", "z", z)])
    ops = _fused(module)
    assert [o.name for o in ops] == ["nova.fused", "nova.exp", "nova.matmul"]
    assert _inner(ops[0]) == ["nova.matmul", "nova.exp", "nova.full", "nova.mul"]
    # alone with a constant: no wrapper, the 0-d constant stays as it is (no kernel)
    module, fn, b = _step(Slot("param", "x", tensor([4, 8], f32)))
    set_results(fn, [("loss", "y", b.scale(fn.body.block.args[0], 2.0))])
    assert [o.name for o in _fused(module)] == ["nova.full", "nova.mul"]


def test_the_fused_op_verifies_its_structure():
    module, fn, b = _step(Slot("param", "x", tensor([4, 8], f32)))
    (x,) = fn.body.block.args
    set_results(fn, [("loss", "y", b.neg(b.one(nv.ExpOp, [x])))])
    (op,) = _fused(module)
    text = print_module(module)
    with pytest.raises(Exception, match="kind must be one of"):
        parse_module(text.replace('kind = "elementwise"', 'kind = "matmul"')).verify()
    inner = OpBuilder(op.body.block, before=op.body.block.last_op)
    good = op.body.block.last_op.operands[0]
    op.body.block.last_op.operands[0] = inner.cast(good, f64)
    with pytest.raises(Exception, match="do not match the results"):
        module.verify()
    op.body.block.last_op.operands[0] = good
    module.verify()
    # an op of another category inside: refused, naming it
    sm = inner.one(nv.SoftmaxOp, [op.body.block.args[0]], {"dim": 1})
    op.body.block.last_op.operands[0] = sm
    with pytest.raises(Exception, match="nova.softmax, which is not of category elementwise"):
        module.verify()


# ----------------------------------------------------------------------------
# reductions: prologues (input fusion) and row epilogues


def _reduction(op):
    assert isinstance(op, nv.FusedOp) and op.props()["kind"] == "reduction"
    return op.reduction()


def _ln(b, x, w, bias):
    return b.create(nv.LayerNormOp, [x, w, bias], {"eps": 1e-5}).results


def test_a_column_sum_reads_bf16_and_widens_in_its_prologue():
    """The qkv bias gradient: the bf16 [B, T, 3H, D] gradient widened, reshaped to
    [B, T, 3C] and summed over tokens; the reshape moves above the cast, which joins
    the sum: one kernel reading the bf16 values through a view."""
    module, fn, b = _step(Slot("batch", "g", tensor([2, 4, 6, 8], bf16)))
    (g,) = fn.body.block.args
    wide = b.reshape(b.cast(g, f32), [2, 4, 48])
    s = b.create(nv.ReduceSumOp, [wide], {"dims": (0, 1), "keepdim": False}).results[0]
    set_results(fn, [("grad", "bias", s)])
    view, op = _fused(module)
    assert isinstance(_reduction(op), nv.ReduceSumOp) and _inner(op) == ["nova.cast", "nova.reduce_sum"]
    assert isinstance(view, nv.ReshapeOp) and view.operands[0] is g
    assert str(view.results[0].type) == "tensor<2x4x48xbf16>"
    assert list(op.operands) == [view.results[0]] and op.iteration_shape() == (2, 4, 48)
    assert [str(r.type) for r in op.results] == ["tensor<48xf32>"]


def test_a_chain_only_the_reduction_reads_is_its_prologue_and_a_shared_value_is_stored_from_it():
    """A reduce kernel computes each prologue element once (``PROLOGUE_STORES``): the
    exp the return also reads is computed in the prologue and stored from it."""
    module, fn, b = _step(Slot("batch", "x", tensor([4, 8], f32)), Slot("param", "s", tensor([8], f32)))
    x, sc = fn.body.block.args
    e = b.one(nv.ExpOp, [x])  # also returned
    sq = b.mul(b.add(e, sc), b.add(e, sc))
    m = b.create(nv.ReduceMaxOp, [sq], {"dims": (1,), "keepdim": True}).results[0]
    set_results(fn, [("loss", "m", m), ("loss", "e", e)])
    ops = _fused(module)
    (op,) = ops
    assert _inner(op) == ["nova.exp", "nova.add", "nova.add", "nova.mul", "nova.reduce_max"]
    assert isinstance(_reduction(op), nv.ReduceMaxOp) and list(op.operands) == [x, sc]
    assert [str(r.type) for r in op.results] == ["tensor<4x8xf32>", "tensor<4x1xf32>"]


def test_a_layer_norm_stores_a_prologue_value_read_elsewhere():
    """A LayerNorm's kernel stores prologue values in its first pass over a row
    (``PROLOGUE_ROW_STORES``): an op the return also reads is computed in its
    prologue and stored, not a kernel of its own whose result the LayerNorm reads
    back; the switch off, it stays outside and is read."""
    def build():
        module, fn, b = _step(Slot("batch", "x", tensor([4, 8], f32)), Slot("param", "w", tensor([8], f32)),
                              Slot("param", "lb", tensor([8], f32)))  # fmt: skip
        x, w, lb = fn.body.block.args
        e = b.one(nv.ExpOp, [x])
        y = _ln(b, b.add(e, e), w, lb)[0]
        set_results(fn, [("loss", "y", y), ("loss", "e", e)])
        return module, x, e

    module, x, e = build()
    (op,) = _fused(module)
    assert _inner(op) == ["nova.exp", "nova.add", "nova.layer_norm"] and list(op.operands)[0] is x
    assert [str(r.type) for r in op.results] == ["tensor<4x8xf32>", "tensor<4x8xf32>"]  # y, e
    fz.ROW_PROLOGUE_STORES = False
    try:
        module, x, e = build()
        ops = _fused(module)
    finally:
        fz.ROW_PROLOGUE_STORES = True
    (op,) = [o for o in ops if isinstance(o, nv.FusedOp)]
    assert _inner(op) == ["nova.add", "nova.layer_norm"] and op.operands[0] is e and e.owner in ops


def _residual_ln(mm_dtype):
    """A GPT block's projection and the next LayerNorm: h = r + (x @ w + bias), the
    matmul's result widened first where it is bf16, LayerNorm(h) in bf16 for the next
    matmul, h read again (the next residual add, the backward): returned."""
    module, fn, b = _step(Slot("param", "x", tensor([16, 32], mm_dtype)), Slot("param", "w", tensor([32, 32], mm_dtype)),
                          Slot("param", "bias", tensor([32], f32)), Slot("param", "res", tensor([2, 8, 32], f32)),
                          Slot("param", "ln_w", tensor([32], f32)), Slot("param", "ln_b", tensor([32], f32)))  # fmt: skip
    x, w, bias, res, ln_w, ln_b = fn.body.block.args
    mm = b.matmul(x, w)
    out = b.reshape(mm, [2, 8, 32])
    h = b.add(res, b.add(b.cast(out, f32) if mm_dtype == bf16 else out, bias))
    y = b.cast(_ln(b, h, ln_w, ln_b)[0], bf16)
    set_results(fn, [("loss", "y", y), ("loss", "h", h)])
    return module, fn, mm, h


def test_a_residual_sum_of_a_bf16_matmul_is_computed_in_the_layer_norms_prologue_and_stored():
    """The residual stream's sum after a bf16 projection (the ``row stores`` rule):
    in the projection's epilogue it makes the matmul read the f32 residual and write
    the f32 sum while its tensor cores idle; in the LayerNorm's prologue the matmul
    writes its bf16 result and the memory-bound row kernel reads it with the
    residual, and stores the sum for its other readers."""
    module, fn, mm, h = _residual_ln(bf16)
    ops = _fused(module)
    assert isinstance(mm.owner, nv.MatmulOp) and mm.owner in ops  # no epilogue: it writes bf16
    (op,) = [o for o in ops if isinstance(o, nv.FusedOp)]
    assert isinstance(_reduction(op), nv.LayerNormOp)
    assert _inner(op) == ["nova.cast", "nova.add", "nova.add", "nova.layer_norm", "nova.cast"]
    assert sorted(str(r.type) for r in op.results) == ["tensor<2x8x32xbf16>", "tensor<2x8x32xf32>"]  # y, h


def test_a_residual_sum_of_an_f32_matmul_stays_in_its_epilogue():
    """An f32 matmul (tf32) computes the bias and residual adds in its epilogue at no
    wider store; in the LayerNorm's prologue the row kernel would read its f32 result
    back (``_keeps_epilogue``): they stay in the epilogue."""
    module, fn, mm, h = _residual_ln(f32)
    ops = _fused(module)
    contraction, row = [o for o in ops if isinstance(o, nv.FusedOp)]
    assert _inner(contraction) == ["nova.matmul", "nova.reshape", "nova.add", "nova.add"]
    assert _inner(row) == ["nova.layer_norm", "nova.cast"] and row.operands[0] is contraction.results[0]


def test_layer_norm_writes_its_epilogue_instead_of_its_f32_output():
    module, fn, b = _step(Slot("batch", "x", tensor([2, 3, 8], f32)), Slot("param", "w", tensor([8], f32)),
                          Slot("param", "b", tensor([8], f32)))  # fmt: skip
    y, mean, rstd = _ln(b, *fn.body.block.args)
    set_results(fn, [("loss", "y", b.cast(y, bf16)), ("loss", "mean", mean), ("loss", "rstd", rstd)])
    (op,) = _fused(module)
    assert isinstance(_reduction(op), nv.LayerNormOp) and _inner(op) == ["nova.layer_norm", "nova.cast"]
    # mean, rstd and the bf16 output: the f32 output has no reader outside, so no store
    assert [str(r.type) for r in op.results] == ["tensor<2x3xf32>", "tensor<2x3xf32>", "tensor<2x3x8xbf16>"]
    assert op.iteration_shape() == (2, 3, 8)


def test_a_layer_norm_output_read_elsewhere_is_one_more_output_and_its_stats_stay_outside():
    module, fn, b = _step(Slot("batch", "x", tensor([4, 8], f32)), Slot("param", "w", tensor([8], f32)),
                          Slot("param", "b", tensor([8], f32)))  # fmt: skip
    y, mean, rstd = _ln(b, *fn.body.block.args)
    z = b.mul(b.neg(y), y)
    r = b.one(nv.SqrtOp, [rstd])  # of the stats' shape: not the rows' epilogue
    set_results(fn, [("loss", "z", z), ("loss", "y", y), ("loss", "r", r)])
    ops = _fused(module)
    (op,) = [o for o in ops if isinstance(o, nv.FusedOp)]
    # y, rstd (mean has no reader: not stored) and z
    assert _inner(op) == ["nova.layer_norm", "nova.neg", "nova.mul"]
    assert [str(r.type) for r in op.results] == ["tensor<4x8xf32>", "tensor<4xf32>", "tensor<4x8xf32>"]
    assert any(isinstance(o, nv.SqrtOp) for o in ops)


def _ln_backward_step(dy_elem=bf16, summed=None):
    """A LayerNorm backward as a GPT block's: dy from a matmul (a widening cast of its
    bf16 result between), the residual gradient added, the sum cast to bf16."""
    module, fn, b = _step(Slot("batch", "h", tensor([6, 16], bf16)), Slot("param", "wt", tensor([16, 8], bf16)),
                          Slot("batch", "x", tensor([2, 3, 8], f32)), Slot("param", "w", tensor([8], f32)),
                          Slot("batch", "mean", tensor([2, 3], f32)), Slot("batch", "rstd", tensor([2, 3], f32)),
                          Slot("batch", "res", tensor([2, 3, 8], f32)))  # fmt: skip
    h, wt, x, w, mean, rstd, res = fn.body.block.args
    mm = b.matmul(h, wt)
    dy = b.reshape(b.cast(mm, f32), [2, 3, 8])
    dx, dw, db = b.create(nv.LayerNormBackwardOp, [dy, x, w, mean, rstd], {}).results
    total = b.add(res, dx)
    sums = []  # ``summed``: a column sum of the residual gradient ("total"), of dx ("dx"), over batch only ("rows")
    if summed is not None:
        sums = [("grad", "proj_bias", b.reduce_sum(dx if summed == "dx" else total, [0] if summed == "rows" else [0, 1]))]
    set_results(fn, [("grad", "w", dw), ("grad", "b", db), ("loss", "total", total),
                     ("loss", "t16", b.cast(total, bf16)), ("loss", "mm", mm), *sums])  # fmt: skip
    return module, fn, mm


def test_a_layer_norm_backward_widens_its_gradient_and_adds_the_residual_gradient():
    module, fn, mm = _ln_backward_step()
    ops = _fused(module)
    (op,) = [o for o in ops if isinstance(o, nv.FusedOp)]
    assert isinstance(_reduction(op), nv.LayerNormBackwardOp)
    # the cast left the matmul's epilogue for the prologue: the matmul writes bf16, the kernel widens
    assert _inner(op) == ["nova.cast", "nova.layer_norm_backward", "nova.add", "nova.cast"]
    assert isinstance(mm.owner, nv.MatmulOp) and mm.owner in ops
    assert [str(r.type) for r in op.results] == ["tensor<8xf32>", "tensor<8xf32>", "tensor<2x3x8xf32>",
                                                  "tensor<2x3x8xbf16>"]  # fmt: skip


@pytest.mark.parametrize("case", ["epilogue-value", "head-result", "over-some-rows"])
def test_a_column_sum_of_a_layer_norm_backwards_epilogue_value_joins_it(case):
    """The projection's bias gradient (the residual gradient summed over tokens) joins
    the LayerNorm backward's group whose epilogue adds that gradient, though the value
    is read outside too (``EPILOGUE_SUMS``); so does a sum of the head's own result
    where an epilogue reads it (the final LayerNorm's backward: its input gradient is
    the last projection's residual gradient); a sum over only some of the rows stays
    a reduce kernel of its own."""
    module, fn, mm = _ln_backward_step(summed={"epilogue-value": "total", "head-result": "dx",
                                               "over-some-rows": "rows"}[case])  # fmt: skip
    ops = _fused(module)
    (op,) = [o for o in ops if isinstance(o, nv.FusedOp)]
    joined = case != "over-some-rows"
    assert [o.name for o in op.epilogue_sums()] == (["nova.reduce_sum"] if joined else [])
    assert any(isinstance(o, nv.ReduceSumOp) for o in ops) != joined
    if joined:  # the weight, bias and projection bias gradients; the summed value still written for its readers
        types = [str(r.type) for r in op.results]
        assert types.count("tensor<8xf32>") == 3 and "tensor<2x3x8xf32>" in types


def test_a_column_sum_of_a_layer_norm_backwards_result_no_epilogue_reads_stays_out():
    """No epilogue (the kernel's ``qin``) to sum the head's result from: the sum stays a
    reduce kernel of its own."""
    module, fn, b = _step(Slot("batch", "g", tensor([2, 3, 8], bf16)), Slot("batch", "x", tensor([2, 3, 8], f32)),
                          Slot("param", "w", tensor([8], f32)), Slot("batch", "mean", tensor([2, 3], f32)),
                          Slot("batch", "rstd", tensor([2, 3], f32)))  # fmt: skip
    g, x, w, mean, rstd = fn.body.block.args
    dx, dw, db = b.create(nv.LayerNormBackwardOp, [b.cast(g, f32), x, w, mean, rstd], {}).results
    set_results(fn, [("grad", "w", dw), ("grad", "b", db), ("loss", "dx", dx), ("grad", "s", b.reduce_sum(dx, [0, 1]))])
    ops = _fused(module)
    (op,) = [o for o in ops if isinstance(o, nv.FusedOp)]
    assert op.epilogue_sums() == [] and any(isinstance(o, nv.ReduceSumOp) for o in ops)


def test_the_layer_norm_backward_group_verifies_its_column_sums():
    from xdsl.utils.exceptions import VerifyException

    module, fn, mm = _ln_backward_step(summed="total")
    fz.fuse(module)
    (op,) = [o for o in fn.body.block.ops if isinstance(o, nv.FusedOp)]
    op.verify()
    (red,) = op.epilogue_sums()
    block = op.body.block
    x = red.operands[0]  # an epilogue op reading the sum (broadcast over the rows): finished only after every row
    back = nv.AddOp.create(operands=[x, red.results[0]], result_types=[x.type])
    block.insert_op_before(back, block.last_op)
    with pytest.raises(VerifyException, match="is read inside the group"):
        op.verify()
    block.erase_op(back)
    red.operands[0] = block.args[-1]  # a block argument (the residual gradient read in), no epilogue value
    with pytest.raises(VerifyException, match="must be a column sum of an epilogue value"):
        op.verify()


def test_a_narrowing_cast_stays_in_the_epilogue_of_the_matmul_before_a_reduction():
    module, fn, b = _step(Slot("batch", "a", tensor([4, 8], f32)), Slot("param", "w", tensor([8, 8], f32)))
    mm = b.matmul(*fn.body.block.args)
    s = b.create(nv.ReduceSumOp, [b.cast(mm, bf16)], {"dims": (0,), "keepdim": False}).results[0]
    set_results(fn, [("loss", "s", s)])
    (group,) = _fused(module)  # the narrow value in the epilogue, and its column sum with it
    assert group.contraction() is not None and _inner(group) == ["nova.matmul", "nova.cast", "nova.reduce_sum"]
    assert [str(r.type) for r in group.results] == ["tensor<8xbf16>"]


# ----------------------------------------------------------------------------
# a column sum in a contraction's epilogue


def _gelu_backward(batched=False):
    """The fc layer's backward (GPT-2's shape, small): dy @ w^T as [2, 8, 40], the
    GELU backward with the saved pre-activation, its bf16 cast; with ``batched`` the
    same per batch ([2, 8, 24] @ [2, 24, 40])."""
    if batched:
        module, fn, b = _step(Slot("param", "dy", tensor([2, 8, 24], bf16)), Slot("param", "w", tensor([2, 24, 40], bf16)),
                              Slot("param", "pre", tensor([2, 8, 40], f32)))  # fmt: skip
        dy, w, pre = fn.body.block.args
        g = b.cast(b.matmul(dy, w), f32)
    else:
        module, fn, b = _step(Slot("param", "dy", tensor([16, 24], bf16)), Slot("param", "w", tensor([24, 40], bf16)),
                              Slot("param", "pre", tensor([2, 8, 40], f32)))  # fmt: skip
        dy, w, pre = fn.body.block.args
        g = b.cast(b.reshape(b.matmul(dy, w), [2, 8, 40]), f32)
    d = b.one(nv.GeluBackwardOp, [g, pre], {"approximate": "tanh"})
    return module, fn, b, d


@pytest.mark.parametrize("batched", [False, True], ids=["rows-relabelled", "batched"])
@pytest.mark.usefixtures("gelu_backward_in_epilogues")
def test_a_column_sum_of_an_epilogue_value_joins_the_contraction(batched):
    """The c_fc bias gradient: the sum of GELU's backward over every dim but the last
    joins the matmul's group (over batch x rows when batched); the f32 value it sums
    is no longer an output; its [N] sum is (the bf16 cast is, whichever comes first)."""
    module, fn, b, d = _gelu_backward(batched)
    s = b.reduce_sum(d, [0, 1])
    set_results(fn, [("grad", "bias", s), ("loss", "d", b.cast(d, bf16))])
    (op,) = [o for o in _fused(module) if isinstance(o, nv.FusedOp)]
    assert op.contraction() is not None and "nova.reduce_sum" in _inner(op)
    assert [str(r.type) for r in op.results] == ["tensor<40xf32>", "tensor<2x8x40xbf16>"]
    assert not any(isinstance(o, nv.ReduceSumOp) for o in fn.body.block.ops)
    assert nv.column_sum(next(o for o in op.inner_ops() if isinstance(o, nv.ReduceSumOp)))


def test_a_column_sum_of_an_f64_epilogue_value_joins_and_a_widening_cast_stays_its_prologue():
    """An f64 value of the epilogue (the matmul's result widened, which is also
    returned, times an f64 operand) summed over its rows joins; the widened result
    summed alone does not: the widening cast waits for the sum's prologue (the
    prologue rule), so the matmul writes the narrow value and the sum widens it."""
    module, fn, b = _step(Slot("param", "x", tensor([12, 8], f32)), Slot("param", "w", tensor([8, 20], f32)),
                          Slot("param", "z", tensor([12, 20], f64)))  # fmt: skip
    x, w, z = fn.body.block.args
    y = b.cast(b.matmul(x, w), f64)
    set_results(fn, [("loss", "y", y), ("loss", "s", b.reduce_sum(b.mul(y, z), [0]))])
    (op,) = _fused(module)
    assert _inner(op) == ["nova.matmul", "nova.cast", "nova.mul", "nova.reduce_sum"]
    assert [str(r.type) for r in op.results] == ["tensor<12x20xf64>", "tensor<20xf64>"]
    module, fn, b = _step(Slot("param", "x", tensor([12, 8], f32)), Slot("param", "w", tensor([8, 20], f32)))
    x, w = fn.body.block.args
    set_results(fn, [("loss", "s", b.reduce_sum(b.cast(b.matmul(x, w), f64), [0]))])
    mm, op = _fused(module)
    assert isinstance(mm, nv.MatmulOp) and _inner(op) == ["nova.cast", "nova.reduce_sum"]


@pytest.mark.parametrize("case", ["last-dim", "one-leading-dim", "keepdim", "max", "read-outside", "operand",
                                  "read-inside", "beside-the-reshape"])  # fmt: skip
@pytest.mark.usefixtures("gelu_backward_in_epilogues")
def test_what_column_sum_stays_outside_the_contraction(case):
    """A reduction over the last dim, over only some leading dims, with keepdim, a
    maximum, the sum of a value something outside also reads (it is written anyway),
    of the matmul's operand, a sum an epilogue op reads back (finished only after
    every tile), the matmul's [16, 40] result summed beside its reshape: each stays
    outside the contraction group."""
    module, fn, b, d = _gelu_backward()
    dy = fn.body.block.args[0]
    mm = d.owner.operands[0].owner.operands[0].owner.operands[0]  # gelu_backward <- cast <- reshape <- matmul
    extra = []
    if case == "last-dim":
        s = b.reduce_sum(d, [2])
    elif case == "one-leading-dim":
        s = b.reduce_sum(d, [1])
    elif case == "keepdim":
        s = b.reduce_sum(d, [0, 1], keepdim=True)
    elif case == "max":
        s = b.one(nv.ReduceMaxOp, [d], {"dims": (0, 1), "keepdim": False})
    elif case == "read-outside":
        s = b.reduce_sum(d, [0, 1])
        extra = [("loss", "t", b.transpose(d, [0, 2, 1]))]  # a view's reader: the value is an output
    elif case == "operand":
        s = b.reduce_sum(b.cast(dy, f32), [0])
    elif case == "read-inside":
        s = b.reduce_sum(d, [0, 1])
        extra = [("loss", "centred", b.sub(d, s))]  # broadcast over the rows: after every tile
    else:
        s = b.reduce_sum(b.cast(mm, f32), [0])
    set_results(fn, [("grad", "s", s), ("loss", "d", b.cast(d, bf16)), *extra])
    ops = _fused(module)
    (group,) = [o for o in ops if isinstance(o, nv.FusedOp) and o.contraction() is not None]
    assert not any(o.CATEGORY == "reduction" for o in group.inner_ops())
    sums = [o for o in ops if o.name in ("nova.reduce_sum", "nova.reduce_max")
            or isinstance(o, nv.FusedOp) and o.reduction() is not None]  # fmt: skip
    assert len(sums) == 1
    if case in ("last-dim", "one-leading-dim", "keepdim", "max", "read-outside", "read-inside"):
        assert str(group.results[0].type) == "tensor<2x8x40xf32>"  # the value it sums is written


@pytest.mark.usefixtures("gelu_backward_in_epilogues")
def test_the_column_sum_in_a_contraction_group_verifies_its_structure():
    module, fn, b, d = _gelu_backward()
    set_results(fn, [("grad", "s", b.reduce_sum(d, [0, 1])), ("loss", "d", b.cast(d, bf16))])
    (op,) = [o for o in _fused(module) if isinstance(o, nv.FusedOp)]
    module.verify()
    block = op.body.block
    red = next(o for o in op.inner_ops() if isinstance(o, nv.ReduceSumOp))
    inner = OpBuilder(block, before=block.last_op)
    # read inside the group: refused (the sum is finished after every tile)
    neg = inner.neg(red.results[0])
    with pytest.raises(Exception, match="is read inside the group"):
        module.verify()
    block.erase_op(neg.owner)
    module.verify()
    # the sum of a block argument (the saved pre-activation): no value of the epilogue
    red.operands[0] = block.args[2]
    with pytest.raises(Exception, match="must sum an inner value"):
        module.verify()


def test_what_stays_outside_a_reduction_group():
    module, fn, b = _step(Slot("batch", "g", tensor([8], f32)), Slot("batch", "x", tensor([8], f32)),
                          Slot("param", "w", tensor([8], f32)), Slot("batch", "m", tensor([], f32)),
                          Slot("batch", "r", tensor([], f32)), Slot("hyper", "seed", tensor([], i64)))  # fmt: skip
    g, x, w, m, r, seed = fn.body.block.args
    dx, dw, db = b.create(nv.LayerNormBackwardOp, [g, x, w, m, r], {}).results
    both = b.add(dx, dw)  # reads the weight gradient, finished only after every row: not an epilogue
    mask = b.one(nv.DropoutMaskOp, [seed], {"p": 0.5, "salt": 3}, tensor([8], f32))  # its flat index
    s = b.create(nv.ReduceSumOp, [b.mul(mask, x)], {"dims": (0,), "keepdim": False}).results[0]
    set_results(fn, [("loss", "both", both), ("loss", "db", db), ("loss", "s", s)])
    ops = _fused(module)
    assert isinstance(ops[0], nv.LayerNormBackwardOp) and isinstance(both.owner, nv.AddOp) and both.owner in ops
    (op,) = [o for o in ops if isinstance(o, nv.FusedOp)]  # the mul joins the sum; the mask stays outside
    assert _inner(op) == ["nova.mul", "nova.reduce_sum"] and isinstance(op.operands[0].owner, nv.DropoutMaskOp)


def _recomputed_residual(remat: bool):
    """remat's residual-stream recompute x = r + (cast(p) + bias), read by a
    LayerNorm recompute and by the LayerNorm's backward."""
    module, fn, b = _step(Slot("batch", "p", tensor([2, 3, 8], bf16)), Slot("param", "bias", tensor([8], f32)),
                          Slot("batch", "r", tensor([2, 3, 8], f32)), Slot("param", "w", tensor([8], f32)),
                          Slot("param", "lb", tensor([8], f32)), Slot("batch", "g", tensor([2, 3, 8], f32)),
                          Slot("batch", "mean", tensor([2, 3], f32)), Slot("batch", "rstd", tensor([2, 3], f32)))  # fmt: skip
    p, bias, r, w, lb, g, mean, rstd = fn.body.block.args
    chain = [b.cast(p, f32)]
    chain.append(b.add(chain[-1], bias))
    chain.append(b.add(r, chain[-1]))
    if remat:
        for v in chain:
            v.owner.attributes["nova.remat"] = StringAttr("default")
    y = b.cast(_ln(b, chain[-1], w, lb)[0], bf16)
    dx, dw, db = b.create(nv.LayerNormBackwardOp, [g, chain[-1], w, mean, rstd], {}).results
    set_results(fn, [("loss", "y", y), ("loss", "dx", dx), ("grad", "w", dw), ("grad", "b", db)])
    return module


def test_a_remat_recompute_only_reductions_read_is_recomputed_in_each_prologue():
    ops = _fused(_recomputed_residual(remat=True))
    assert [type(_reduction(o)) for o in ops] == [nv.LayerNormOp, nv.LayerNormBackwardOp]
    for o in ops:  # the chain in both, reading the bf16 projection and the residual: x is never written
        assert [n for n in _inner(o) if n != o.reduction().name][:3] == ["nova.cast", "nova.add", "nova.add"]
    assert ops[0].operands[0] is ops[1].operands[0]


def test_a_chain_the_remat_stage_did_not_make_is_computed_once_for_its_readers():
    """Computed once, in the LayerNorm's prologue, which stores it for the backward
    (``PROLOGUE_ROW_STORES``); the switch off, in a kernel of its own."""
    ops = _fused(_recomputed_residual(remat=False))
    assert isinstance(_reduction(ops[0]), nv.LayerNormOp)
    assert _inner(ops[0]) == ["nova.cast", "nova.add", "nova.add", "nova.layer_norm", "nova.cast"]
    assert isinstance(ops[1], nv.LayerNormBackwardOp) and ops[1].operands[1].owner is ops[0]
    fz.ROW_PROLOGUE_STORES = False
    try:
        ops = _fused(_recomputed_residual(remat=False))
    finally:
        fz.ROW_PROLOGUE_STORES = True
    assert isinstance(ops[0], nv.FusedOp) and ops[0].props()["kind"] == "elementwise"
    assert _inner(ops[0]) == ["nova.cast", "nova.add", "nova.add"]
    assert isinstance(_reduction(ops[1]), nv.LayerNormOp) and isinstance(ops[2], nv.LayerNormBackwardOp)
    assert ops[1].operands[0] is ops[2].operands[1] is ops[0].results[0]


def _recomputed_pre_activation(remat: bool, narrow: bool = False):
    """remat's GELU recompute in the backward: pre = cast(mm) + bias (mm bf16, the
    forward matmul's saved result), read by GELU (its output the weight gradient's
    operand) and by GELU's backward in the backward matmul's epilogue. ``narrow``:
    the chain narrows instead (an f32 value cast to bf16, plus a bf16 tensor of its
    shape: 6 bytes read for 2 written)."""
    module, fn, b = _step(Slot("batch", "mm", tensor([2, 4, 32], f32 if narrow else bf16)),
                          Slot("param", "bias", tensor([2, 4, 32], bf16) if narrow else tensor([32], f32)),
                          Slot("batch", "dy", tensor([8, 16], bf16)), Slot("param", "w", tensor([16, 32], bf16)))  # fmt: skip
    mm, bias, dy, w = fn.body.block.args
    chain = [b.cast(mm, bf16 if narrow else f32)]
    chain.append(b.add(chain[-1], bias))
    if remat:
        for v in chain:
            v.owner.attributes["nova.remat"] = StringAttr("default")
    pre = chain[-1]
    gelu = b.one(nv.GeluOp, [pre], {"approximate": "tanh"})
    gelu.owner.attributes["nova.remat"] = StringAttr("default")
    dpre = b.reshape(b.matmul(dy, w), [2, 4, 32])
    dpre = dpre if narrow else b.cast(dpre, f32)
    dgelu = b.one(nv.GeluBackwardOp, [dpre, pre], {"approximate": "tanh"})
    set_results(fn, [("loss", "gelu", b.cast(gelu, bf16)), ("loss", "dgelu", dgelu)])
    return module


def _proj_backward(bias_sum: bool = True):
    """One GPT block's MLP backward in the autodiff's order: dh = g @ wp (the c_proj
    input gradient, first), then remat's recompute of pre = cast(mm) + bias and of
    GELU's bf16 output h, the weight gradient h^T @ g reading it, then GELU's backward
    of dh (read through a reshape placed just before it) with pre, its bf16 cast and
    (``bias_sum``) the c_fc bias gradient's sum."""
    module, fn, b = _step(Slot("batch", "mm", tensor([2, 4, 32], bf16)), Slot("param", "bias", tensor([32], f32)),
                          Slot("batch", "g", tensor([8, 16], bf16)), Slot("param", "wp", tensor([16, 32], bf16)))  # fmt: skip
    mm, bias, g, wp = fn.body.block.args
    dh = b.matmul(g, wp)
    pre = b.add(b.cast(mm, f32), bias)
    h = b.cast(b.one(nv.GeluOp, [pre], {"approximate": "tanh"}), bf16)
    for v in (pre.owner.operands[0], pre, h.owner.operands[0], h):
        v.owner.attributes["nova.remat"] = StringAttr("default")
    dwp = b.matmul(b.transpose(b.reshape(h, [8, 32]), [1, 0]), g)
    d = b.one(nv.GeluBackwardOp, [b.cast(b.reshape(dh, [2, 4, 32]), f32), pre], {"approximate": "tanh"})
    sums = [("grad", "bias", b.reduce_sum(d, [0, 1]))] if bias_sum else []
    set_results(fn, [("grad", "wp", dwp), *sums, ("loss", "d", b.cast(d, bf16))])
    return module, fn


@pytest.mark.parametrize("bias_sum", [True, False], ids=["bias-gradient", "no-bias"])
def test_gelu_and_its_backward_are_one_kernel_before_the_weight_gradient(bias_sum):
    """The pre-activation remat recomputes is not cloned (its readers, GELU and GELU's
    backward, are one kernel: ``_one_kernel_for_readers``), dh's reshape moves up to
    its matmul (``hoist_views``), and the kernel goes before the weight gradient that
    reads GELU's output: with the bias gradient one reduce kernel storing GELU's bf16
    output and its backward's bf16 cast, else one elementwise kernel."""
    module, fn = _proj_backward(bias_sum)
    ops = _fused(module)
    (group,) = [o for o in ops if isinstance(o, nv.FusedOp)]
    inner = _inner(group)
    assert inner.count("nova.add") == 1 and {"nova.gelu", "nova.gelu_backward"} <= set(inner)
    assert group.props()["kind"] == ("reduction" if bias_sum else "elementwise")
    assert sorted(str(r.type) for r in group.results) == sorted(
        ["tensor<2x4x32xbf16>", "tensor<2x4x32xbf16>", *(["tensor<32xf32>"] if bias_sum else [])])
    weight_grad = [o for o in ops if isinstance(o, nv.MatmulOp)][1]
    assert ops.index(group) < ops.index(weight_grad)
    assert not any(isinstance(o, nv.AddOp) for o in ops)  # the f32 pre-activation is computed once, inside


def test_views_of_a_kernels_result_move_up_to_it():
    """hoist_views: a reshape of a matmul's result placed after other ops moves to just
    after the matmul; a view of a block argument and a view of a view stay."""
    module, fn, b = _step(Slot("batch", "x", tensor([8, 16], f32)), Slot("param", "w", tensor([16, 4], f32)))
    x, w = fn.body.block.args
    y = b.matmul(x, w)
    e = b.one(nv.ExpOp, [x])
    r = b.reshape(y, [2, 4, 4])
    t = b.transpose(r, [0, 2, 1])
    xt = b.transpose(x, [1, 0])
    set_results(fn, [("loss", "e", e), ("loss", "t", t), ("loss", "xt", xt)])
    block = fn.body.block
    assert fz.hoist_views(block) == 1
    names = [o.name for o in block.ops]
    assert names == ["nova.matmul", "nova.reshape", "nova.exp", "nova.transpose", "nova.transpose", "func.return"]
    assert fz.hoist_views(block) == 0


def _last_mlp():
    """GPT-2's last MLP as the fuse stage sees it, nothing remat's: mm = x @ w1 (bf16),
    pre = cast(mm) + bias (f32), GELU's bf16 output read by the next matmul, whose
    result the backward reads at once: GELU's backward of (out @ w) and pre."""
    module, fn, b = _step(Slot("batch", "x", tensor([8, 16], bf16)), Slot("param", "w1", tensor([16, 32], bf16)),
                          Slot("param", "bias", tensor([32], f32)), Slot("param", "w2", tensor([32, 16], bf16)),
                          Slot("param", "w", tensor([16, 32], bf16)))  # fmt: skip
    x, w1, bias, w2, w = fn.body.block.args
    pre = b.add(b.cast(b.reshape(b.matmul(x, w1), [2, 4, 32]), f32), bias)
    y = b.cast(b.one(nv.GeluOp, [pre], {"approximate": "tanh"}), bf16)
    out = b.matmul(b.reshape(y, [8, 32]), w2)
    dpre = b.cast(b.reshape(b.matmul(out, w), [2, 4, 32]), f32)
    dgelu = b.one(nv.GeluBackwardOp, [dpre, pre], {"approximate": "tanh"})
    set_results(fn, [("loss", "out", out), ("loss", "dgelu", dgelu)])
    return module


@pytest.mark.usefixtures("gelu_backward_in_epilogues")
def test_a_widening_recompute_is_recomputed_in_the_backward_matmuls_epilogue():
    """The bf16 matmul result widened and biased is cloned into GELU's backward, which
    joins the backward matmul's epilogue with it: the epilogue reads the bf16 value
    and the bias, the recompute's kernel yields only GELU's bf16 output, and the f32
    pre-activation is never written (1 + 12 FLOPs: within the epilogue's budget)."""
    ops = _fused(_recomputed_pre_activation(remat=True))
    (ew,) = [o for o in ops if isinstance(o, nv.FusedOp) and o.props()["kind"] == "elementwise"]
    (ep,) = [o for o in ops if isinstance(o, nv.FusedOp) and o.contraction() is not None]
    assert _inner(ew) == ["nova.cast", "nova.add", "nova.gelu", "nova.cast"]
    assert [elem_of(r.type) for r in ew.results] == [bf16]
    assert _inner(ep) == ["nova.matmul", "nova.reshape", "nova.cast", "nova.cast", "nova.add", "nova.gelu_backward"]
    assert ew.operands[0] in ep.operands  # both read the bf16 matmul result


def test_a_narrowing_recompute_is_computed_once():
    """Narrowing (f32 read twice costs more than bf16 written once and read): the chain
    is not cloned, one add of the bias."""
    ops = _fused(_recomputed_pre_activation(remat=True, narrow=True))
    inner = [o for op in ops for o in (op.inner_ops() if isinstance(op, nv.FusedOp) else [op])]
    assert sum(isinstance(o, nv.AddOp) for o in inner) == 1


@pytest.mark.usefixtures("gelu_backward_in_epilogues")
def test_a_widening_chain_remat_did_not_make_is_computed_where_each_reader_is():
    """Not remat's recompute but widening (bf16 + a broadcast bias in, f32 out: GPT-2's
    last MLP, whose pre-activation remat leaves saved): cloned too, since its inputs
    are smaller than its value; and the clone stays with GELU's backward in the
    backward matmul's epilogue (never moved up into its producer's group, where it
    would be written for it): no op of the step yields the f32 pre-activation."""
    ops = _fused(_recomputed_pre_activation(remat=False))
    inner = [o for op in ops for o in (op.inner_ops() if isinstance(op, nv.FusedOp) else [op])]
    assert sum(isinstance(o, nv.AddOp) for o in inner) == 2
    (ep,) = [o for o in ops if isinstance(o, nv.FusedOp) and o.contraction() is not None]
    assert _inner(ep) == ["nova.matmul", "nova.reshape", "nova.cast", "nova.cast", "nova.add", "nova.gelu_backward"]
    (ew,) = [o for o in ops if isinstance(o, nv.FusedOp) and o.props()["kind"] == "elementwise"]
    assert _inner(ew) == ["nova.cast", "nova.add", "nova.gelu", "nova.cast"]
    assert [elem_of(r.type) for r in ew.results] == [bf16], "the f32 pre-activation is written"
    # the forward matmul's epilogue takes the chain and GELU; the clone stays in the backward's
    ops = _fused(_last_mlp())
    fwd, bwd = [o for o in ops if isinstance(o, nv.FusedOp) and o.contraction() is not None]
    assert _inner(fwd) == ["nova.matmul", "nova.reshape", "nova.cast", "nova.add", "nova.gelu", "nova.cast"]
    assert _inner(bwd) == ["nova.matmul", "nova.reshape", "nova.cast", "nova.cast", "nova.add", "nova.gelu_backward"]
    assert [elem_of(r.type) for r in fwd.results] == [bf16, bf16], "the f32 pre-activation is written"


def test_the_reduction_group_verifies_its_structure():
    from xdsl.utils.exceptions import VerifyException

    module, fn, b = _step(Slot("batch", "x", tensor([2, 4, 6, 8], bf16)))
    wide = b.reshape(b.cast(fn.body.block.args[0], f32), [2, 4, 48])
    set_results(fn, [("loss", "s", b.create(nv.ReduceSumOp, [wide], {"dims": (0, 1), "keepdim": False}).results[0])])
    _, op = _fused(module)
    block = op.body.block
    cast, red = op.inner_ops()
    # an op on the reduce_sum's result, whose template takes no epilogue
    neg = nv.NegOp.create(operands=[red.results[0]], result_types=[red.results[0].type])
    block.insert_op_before(neg, block.last_op)
    block.last_op.operands = [neg.results[0]]
    with pytest.raises(VerifyException, match="reads nova.reduce_sum's result"):
        op.verify()
    block.last_op.operands = [red.results[0]]
    block.erase_op(neg)
    op.verify()
    # a prologue value read by another op of the prologue, even yielded: a reduce kernel stores it
    twice = nv.AddOp.create(operands=[cast.results[0], cast.results[0]], result_types=[cast.results[0].type])
    block.insert_op_before(twice, red)
    block.last_op.operands = [red.results[0], twice.results[0]]
    with pytest.raises(VerifyException, match="do not match the results"):
        op.verify()
    block.last_op.operands = [red.results[0]]
    block.erase_op(twice)
    op.verify()

    # a layer_norm stores the prologue values its group yields (``PROLOGUE_ROW_STORES``), but no
    # other op of the group may read one: its row kernel computes no such op
    module, fn, b = _step(Slot("batch", "x", tensor([4, 8], bf16)), Slot("param", "w", tensor([8], f32)),
                          Slot("param", "lb", tensor([8], f32)))  # fmt: skip
    x, w, lb = fn.body.block.args
    set_results(fn, [("loss", "y", _ln(b, b.cast(x, f32), w, lb)[0])])
    (op,) = [o for o in _fused(module) if isinstance(o, nv.FusedOp)]
    block = op.body.block
    cast, ln = op.inner_ops()
    yields = list(block.last_op.operands)
    block.last_op.operands = [*yields, cast.results[0]]
    op._verify_reduction(op.inner_ops())  # the group's structure (its results' types aside): stored
    block.last_op.operands = yields
    # a side op (``prologue_sides``: neither read by the head nor reading its result), stored
    twice = nv.AddOp.create(operands=[cast.results[0], cast.results[0]], result_types=[cast.results[0].type])
    block.insert_op_before(twice, ln)
    assert op.prologue_sides() == {twice}
    block.last_op.operands = [*yields, twice.results[0]]
    op._verify_reduction(op.inner_ops())
    # an epilogue op (on the head's first result) reading a prologue value: refused
    both = nv.MulOp.create(operands=[ln.results[0], cast.results[0]], result_types=[cast.results[0].type])
    block.insert_op_before(both, block.last_op)
    block.last_op.operands = [both.results[0]]
    with pytest.raises(VerifyException, match="read outside the prologue"):
        op._verify_reduction(op.inner_ops())

    # a LayerNorm backward stores them too (its side ops: the LayerNorm recompute beside it)
    module, fn, mm = _ln_backward_step()
    (op,) = [o for o in _fused(module) if isinstance(o, nv.FusedOp)]
    block = op.body.block
    widened = op.inner_ops()[0]
    block.last_op.operands = [*block.last_op.operands, widened.results[0]]
    op._verify_reduction(op.inner_ops())


# ----------------------------------------------------------------------------
# whole steps


def _compile(model, batch, precision, fused: bool, monkeypatch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    c = pipeline.Compilation(model, batch, opt, precision, torch.float32)
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(pipeline, "STAGES", [s for s in pipeline.STAGES if s[0] != "fuse"])
        pipeline.run(c)
    return c


def _models():
    yield "mlp", lambda: MLPLM(MLPLMConfig(vocab_size=64, block_size=8, n_layer=2, n_embd=32, hidden=64))
    yield "gpt", lambda: GPT(gpt_tiny(dropout=0.1))
    yield "gpt-manual", lambda: GPT(gpt_tiny(attention="manual", bias=False))


_CASES = [(k, m, p) for k, m in _models() for p in ("bf16", "fp32") if (k, p) not in (("gpt", "fp32"), ("gpt-manual", "bf16"))]


@pytest.mark.parametrize("kind,make,precision", _CASES, ids=[f"{k}-{p}" for k, _, p in _CASES])
def test_a_fused_step_is_bit_identical_to_the_unfused_one(kind, make, precision, monkeypatch):
    torch.manual_seed(0)
    model = make()
    vocab = 64 if kind == "mlp" else 256
    x = torch.randint(0, vocab, (2, 8 if kind == "mlp" else 32), generator=torch.Generator().manual_seed(3))
    plain = _compile(model, (x, x), precision, False, monkeypatch)
    fused = _compile(model, (x, x), precision, True, monkeypatch)
    fn = step_func(fused.module)
    assert "fuse" in [n for n, _ in pipeline.STAGES]
    before = run_function(step_func(plain.module), step_args(plain), precision)
    after = run_function(fn, step_args(fused), precision)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)
    def kernels(c):  # elementwise kernels: every elementwise op but 0-d constants, or group
        tops = [o for o in step_func(c.module).body.block.ops if isinstance(o, nv.NovaOp)]
        return [o for o in tops if o.CATEGORY in ("elementwise", "fused") and c.memory.placements[o.results[0]].kind
                != "const"]  # fmt: skip

    assert any(isinstance(o, nv.FusedOp) for o in kernels(fused))
    assert len(kernels(fused)) * 3 < len(kernels(plain))
    if precision == "bf16":  # every LayerNorm writes its bf16 output, every backward widens its bf16 gradient
        tops = list(fn.body.block.ops)
        assert not any(isinstance(o, (nv.LayerNormOp, nv.LayerNormBackwardOp)) for o in tops)
        heads = [o.reduction() for o in tops if isinstance(o, nv.FusedOp) and o.reduction() is not None]
        backward = [h for h in heads if isinstance(h, nv.LayerNormBackwardOp)]
        assert backward and all(isinstance(h.operands[0].owner, nv.CastOp) for h in backward)
    # each parameter's update is one kernel writing the param and its two moments in place
    inplace = {ip.name: ip.how for ip in fused.memory.inplace}
    for name in fused.captured.params:
        assert inplace[name] == inplace[name + "::exp_avg"] == inplace[name + "::exp_avg_sq"] == "inplace"
        writer = {fused.memory.placements[v].arg: v.owner for v in fused.memory.placements
                  if fused.memory.placements[v].kind == "inplace"}  # fmt: skip
        owner = writer[name]
        assert isinstance(owner, nv.FusedOp)
        assert writer[name + "::exp_avg"] is owner and writer[name + "::exp_avg_sq"] is owner


# ----------------------------------------------------------------------------
# in-place updates (plan_memory)


def _update(read_transposed: bool):
    module, fn, b = _step(Slot("param", "p", tensor([8, 8], f32)), Slot("state", "p::m", tensor([8, 8], f32)),
                          Slot("batch", "g", tensor([8, 8], f32)), Slot("hyper", "lr", tensor([], f64)))  # fmt: skip
    p, m, g, lr = fn.body.block.args
    m2 = b.add(b.mul(m, b.scalar(0.9, m)), b.mul(g, b.scalar(0.1, g)))
    step = b.mul(m2, b.cast(lr, f32))
    if read_transposed:
        step = b.add(step, b.transpose(p, [1, 0]))
    set_results(fn, [("param", "p", b.sub(p, step)), ("state", "p::m", m2)])
    return module, fn


@pytest.mark.parametrize("read_transposed", [False, True])
def test_a_fused_update_writes_the_param_and_state_in_place(read_transposed):
    from nova.transforms.plan_memory import plan_memory

    module, fn = _update(read_transposed)
    (op,) = [o for o in _fused(module) if isinstance(o, nv.FusedOp)]
    plan = plan_memory(module)
    how = {ip.name: ip.how for ip in plan.inplace}
    assert how["p::m"] == "inplace"  # m is read at the index it is written
    if not read_transposed:
        assert how["p"] == "inplace"
        assert {plan.placements[r].kind for r in op.results} == {"inplace"}
    else:  # lane i reads p[j, i] that lane j writes: never over a transposed read
        (ip,) = [ip for ip in plan.inplace if ip.name == "p"]
        assert ip.how == "copy" and "still read" in ip.reason


def test_the_report_names_each_group():
    module, fn, b = _step(Slot("param", "x", tensor([4, 8], f32)))
    set_results(fn, [("loss", "y", b.neg(b.one(nv.ExpOp, [fn.body.block.args[0]])))])
    assert fz.report(module) == ["fuse: no groups"]
    _fused(module)
    assert fz.report(module) == [
        "fuse: 1 groups (one kernel each; 0 of them a contraction with its epilogue, 0 a reduction with its "
        "prologue and epilogue) holding 2 ops (scalars "
        "recomputed in each group count in each)",
        "  [4x8] 2 ops, 1 inputs, 1 outputs: exp neg",
    ]


@pytest.mark.parametrize("multi_tensor", [True, False], ids=["multi-tensor", "per-param"])
def test_scalars_only_the_return_reads_run_last_together(multi_tensor, monkeypatch):
    """Adam's step counters: each update recomputes step + 1 from the old counter, and
    the counters' new values are written last (TAIL_OUTPUTS to a kernel), after every
    read of the old ones, so every counter and param is written in place. The three
    small params' updates are one multi-tensor kernel (``batch_small``), or, with
    SMALL_ARGS too small for two of them, one kernel each."""
    from nova.transforms.plan_memory import plan_memory

    monkeypatch.setattr(fz, "TAIL_OUTPUTS", 2)
    if not multi_tensor:
        monkeypatch.setattr(fz, "SMALL_ARGS", 5)
    slots = [Slot("hyper", "ok", tensor([], f32))]
    for k in range(3):
        slots += [Slot("param", f"p{k}", tensor([16], f32)), Slot("state", f"p{k}::step", tensor([], f32))]
    module, fn, b = _step(*slots)
    ok, *args = fn.body.block.args
    results = []
    for k in range(3):
        p, step = args[2 * k], args[2 * k + 1]
        new_step = b.add(step, b.scalar(1.0, step))
        gate = b.one(nv.GtOp, [ok, b.scalar(0.0, ok)])  # as the guard gates every result
        step_out = b.where(gate, new_step, step)  # written before the update reads step + 1
        results += [("param", f"p{k}", b.where(gate, b.sub(p, b.div(p, new_step)), p)),
                    ("state", f"p{k}::step", step_out)]  # fmt: skip
    set_results(fn, results)
    ops = _fused(module)
    n = 1 if multi_tensor else 3
    assert [o.name for o in ops] == ["nova.fused"] * (n + 2)
    params, tails = ops[:n], ops[n:]
    assert all(g.iteration_shape() == (16,) and "nova.add" in _inner(g) for g in params)  # step + 1 inside
    assert sum(len(g.results) for g in params) == 3
    assert [len(g.results) for g in tails] == [2, 1] and all(g.iteration_shape() == () for g in tails)
    plan = plan_memory(module)
    assert {ip.how for ip in plan.inplace} == {"inplace"}


def test_updates_of_one_shape_launch_together_small_or_large():
    """Updates of two [16] params are one kernel, and so are those of two large ones
    ([64, 80], 5120 elements: the weights of a layer kind); a [16] update of another shape
    ([4, 4]), a lone large one ([96, 80]) and a small group that updates nothing stay
    kernels of their own. The merged kernels run their params as parts
    (``fused.segments_of``), the others as one."""
    from nova.codegen.triton.fused import segments_of

    slots = [Slot("param", "a", tensor([16], f32)), Slot("param", "b", tensor([16], f32)),
             Slot("param", "c", tensor([4, 4], f32)), Slot("param", "d", tensor([64, 80], f32)),
             Slot("param", "f", tensor([64, 80], f32)), Slot("param", "g", tensor([96, 80], f32)),
             Slot("param", "e", tensor([16], f32))]  # fmt: skip
    module, fn, b = _step(*slots)
    pa, pb, pc, pd, pf, pg, pe = fn.body.block.args
    upd = [("param", n, b.sub(p, b.mul(p, b.one(nv.ExpOp, [p])))) for n, p in zip("abcdfg", (pa, pb, pc, pd, pf, pg))]
    set_results(fn, [*upd, ("param", "e", pe), ("loss", "not_an_update", b.mul(pe, b.one(nv.ExpOp, [pe])))])
    ops = _fused(module)
    groups = [o for o in ops if isinstance(o, nv.FusedOp)]
    assert sorted(len(g.results) for g in groups) == [1, 1, 1, 2, 2]
    small, large = sorted((g for g in groups if len(g.results) == 2), key=lambda g: len(g.iteration_shape()))
    assert small.iteration_shape() == (16,) and {pa, pb} <= set(small.operands) and pe not in small.operands
    assert large.iteration_shape() == (64, 80) and {pd, pf} <= set(large.operands) and pg not in large.operands
    assert [len(p[2]) for p in segments_of(large)] == [1, 1] and len(segments_of(small)) == 2
    assert all(segments_of(g) is None for g in groups if len(g.results) == 1)


def test_weight_casts_of_one_shape_launch_together_before_their_first_reader():
    """The bf16 casts of three [8, 16] weights, each read by its own matmul down the
    forward, are one multi-tensor kernel (``batch_small``, parts per weight) placed
    before the first matmul; a weight of another shape, a cast of a computed value and a
    remat recompute of a weight's cast (``nova.remat``: it stays in the backward, where
    remat put it) stay kernels of their own, where they were."""
    from nova.codegen.triton.fused import segments_of

    slots = [Slot("param", "x", tensor([4, 8], f32))]
    slots += [Slot("param", f"w{k}", tensor([8, 16], f32)) for k in range(3)]
    slots += [Slot("param", "v", tensor([16, 8], f32))]
    module, fn, b = _step(*slots)
    x, w0, w1, w2, v = fn.body.block.args
    h = b.cast(x, bf16)
    outs = []
    for w in (w0, w1, w2):
        y = b.matmul(h, b.cast(w, bf16))  # [4, 16]
        outs.append(y)
        h = b.cast(b.matmul(b.cast(y, f32), v), bf16)  # [4, 8], through v's own f32 matmul
    again = b.cast(w1, bf16)
    again.owner.attributes["nova.remat"] = StringAttr("default")
    late = b.matmul(h, again)
    vt = b.cast(v, bf16)
    set_results(fn, [("loss", f"y{k}", y) for k, y in enumerate(outs)]
                + [("loss", "late", late), ("loss", "vt", vt)])  # fmt: skip
    ops = _fused(module)
    casts = [o for o in ops if isinstance(o, nv.FusedOp) or isinstance(o, nv.CastOp)]
    (multi,) = [o for o in casts if isinstance(o, nv.FusedOp) and len(o.results) == 3]
    assert multi.iteration_shape() == (8, 16) and list(multi.operands) == [w0, w1, w2]
    assert _inner(multi) == ["nova.cast"] * 3 and [len(p[2]) for p in segments_of(multi)] == [1, 1, 1]
    matmuls = [i for i, o in enumerate(ops) if isinstance(o, nv.MatmulOp)
               or isinstance(o, nv.FusedOp) and o.props()["kind"] == "contraction"]  # fmt: skip
    assert len(matmuls) == 7 and ops.index(multi) < matmuls[0]
    # the remat clone, the lone [16, 8] weight and x's cast stay ops of their own
    lone = [o for o in ops if isinstance(o, nv.CastOp)]
    assert {o.operands[0] for o in lone} == {w1, v, x}
    (clone,) = [o for o in lone if "nova.remat" in o.attributes]
    assert ops.index(clone) > matmuls[-2]  # after the forward's six matmuls, before its reader


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_remat_recasts_of_one_shape_launch_together_in_the_backward(batch, monkeypatch):
    """RECAST_BATCH: remat's recasts of three [8, 16] weights, each beside its matmul in
    the backward, launch up to ``batch`` at a time, each batch placed where the first of
    its recasts was (after the forward's matmuls, before its first reader); 1: each its
    own op where remat put it."""
    from nova.codegen.triton.fused import segments_of

    monkeypatch.setattr(fz, "RECAST_BATCH", batch)
    slots = [Slot("param", "x", tensor([4, 8], f32))]
    slots += [Slot("param", f"w{k}", tensor([8, 16], f32)) for k in range(3)]
    module, fn, b = _step(*slots)
    x, *ws = fn.body.block.args
    h = b.cast(x, bf16)
    fwd = [b.matmul(h, b.cast(w, bf16)) for w in ws]  # the forward's casts: one batch of three
    outs = []
    for w in reversed(ws):  # the backward, last layer first
        again = b.cast(w, bf16)
        again.owner.attributes["nova.remat"] = StringAttr("default")
        outs.append(b.matmul(h, again))
    set_results(fn, [("loss", f"f{k}", y) for k, y in enumerate(fwd)] + [("loss", f"b{k}", y) for k, y in enumerate(outs)])
    ops = _fused(module)
    matmuls = [i for i, o in enumerate(ops) if isinstance(o, nv.MatmulOp)]
    recasts = [o for o in ops if "nova.remat" in o.attributes
               or isinstance(o, nv.FusedOp) and all("nova.remat" in i.attributes for i in o.inner_ops())]  # fmt: skip
    assert [1 if isinstance(o, nv.CastOp) else len(o.results) for o in recasts] == {1: [1, 1, 1], 2: [2, 1], 3: [3]}[batch]
    assert list(recasts[0].operands)[:1] == [ws[2]]  # the last layer's weight first
    for o in recasts:
        assert matmuls[2] < ops.index(o)  # in the backward
        readers = [i for i, r in enumerate(ops) if any(v in o.results for v in r.operands)]
        assert ops.index(o) < min(readers)
        if isinstance(o, nv.FusedOp):
            assert _inner(o) == ["nova.cast"] * len(o.results) and len(segments_of(o)) == len(o.results)


def test_last_scalars_of_two_shapes_are_two_groups():
    module, fn, b = _step(Slot("hyper", "lr", tensor([], f64)), Slot("param", "w", tensor([1], f64)))
    lr, w = fn.body.block.args
    set_results(fn, [("loss", "a", b.neg(b.mul(lr, lr))), ("loss", "b", b.neg(b.mul(w, w))),
                     ("loss", "c", b.neg(b.add(lr, lr)))])  # fmt: skip
    ops = _fused(module)
    assert [(o.iteration_shape(), len(o.results)) for o in ops] == [((), 2), ((1,), 1)]


def test_a_view_of_a_scalar_sinks_with_its_operands():
    module, fn, b = _step(Slot("param", "x", tensor([], f64)), Slot("param", "y", tensor([1, 1], f64)))
    x, y = fn.body.block.args
    r = b.reshape(b.neg(b.mul(x, x)), [1, 1])  # a 0-d op whose operands are 0-d too: they move with it
    set_results(fn, [("loss", "r", b.add(r, y))])
    ops = _fused(module)
    (op,) = [o for o in ops if isinstance(o, nv.FusedOp)]
    assert op.iteration_shape() == (1, 1) and _inner(op) == ["nova.mul", "nova.neg", "nova.add"]
    assert all(isinstance(o, nv.ReshapeOp) and o.operands[0] is x for o in ops if o is not op)
