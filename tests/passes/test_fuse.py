"""fuse: IR in, IR out, one test per grouping rule (vertical, views, horizontal,
scalars recomputed inside, no cycle, the matmul's bias add left alone,
singletons), each checked to verify, print and parse back, and to compute the
same values bit for bit as the IR before it on the reference executor; then
whole steps (the MLP LM and small GPTs) fused against unfused."""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32, f64

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
    y = b.add(a, m)  # a and y in one group would both feed and read the matmul
    r = b.reduce_sum(a, [1], keepdim=True)
    z = b.neg(a)  # z joins a's group, placed before the reduction (it reads no outside value after a)
    set_results(fn, [("loss", "y", y), ("loss", "r", r), ("loss", "z", z)])
    ops = _fused(module)
    assert [o.name for o in ops] == ["nova.fused", "nova.matmul", "nova.add", "nova.reduce_sum"]
    assert _inner(ops[0]) == ["nova.exp", "nova.neg"]


def test_the_bias_add_of_a_matmul_stays_in_its_epilogue():
    module, fn, b = _step(Slot("param", "x", tensor([4, 8], f32)), Slot("param", "w", tensor([8, 8], f32)),
                          Slot("param", "bias", tensor([8], f32)))  # fmt: skip
    x, w, bias = fn.body.block.args
    h = b.add(b.matmul(x, w), bias)
    y = b.cast(b.one(nv.GeluOp, [h], {"approximate": "tanh"}), bf16)
    set_results(fn, [("loss", "y", y)])
    ops = _fused(module)
    assert [o.name for o in ops] == ["nova.matmul", "nova.add", "nova.fused"]
    assert _inner(ops[2]) == ["nova.gelu", "nova.cast"]


def test_a_group_of_one_op_stays_that_op():
    module, fn, b = _step(Slot("param", "x", tensor([4, 8], f32)), Slot("param", "w", tensor([8, 8], f32)))
    x, w = fn.body.block.args
    y = b.scale(b.one(nv.ExpOp, [b.matmul(x, w)]), 2.0)  # exp, then mul by a 0-d constant
    z = b.matmul(b.one(nv.ExpOp, [x]), w)
    set_results(fn, [("loss", "y", y), ("loss", "z", z)])
    ops = _fused(module)
    assert [o.name for o in ops] == ["nova.matmul", "nova.fused", "nova.exp", "nova.matmul"]
    assert _inner(ops[1]) == ["nova.exp", "nova.full", "nova.mul"]
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
        "fuse: 1 groups (one kernel each) holding 2 elementwise ops (scalars recomputed in each group count in each)",
        "  [4x8] 2 ops, 1 inputs, 1 outputs: exp neg",
    ]


def test_scalars_only_the_return_reads_run_last_together(monkeypatch):
    """Adam's step counters: each update recomputes step + 1 from the old counter, and
    the counters' new values are written last (TAIL_OUTPUTS to a kernel), after every
    read of the old ones, so every counter and param is written in place."""
    from nova.transforms.plan_memory import plan_memory

    monkeypatch.setattr(fz, "TAIL_OUTPUTS", 2)
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
    assert [o.name for o in ops] == ["nova.fused"] * 5
    params, tails = ops[:3], ops[3:]
    assert all(g.iteration_shape() == (16,) and "nova.add" in _inner(g) for g in params)  # step + 1 inside
    assert [len(g.results) for g in tails] == [2, 1] and all(g.iteration_shape() == () for g in tails)
    plan = plan_memory(module)
    assert {ip.how for ip in plan.inplace} == {"inplace"}


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
