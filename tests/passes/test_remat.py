"""remat: IR in, IR out; the default rule lowers the predicted peak and never
raises it; a budget chooses more; an impossible budget names the reachable
peak; every result bit-identical to the step without remat (reference executor)."""

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
from nova.ir.module import Slot, new_step, parse_module, print_module, set_results, step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.models import GPT, gpt_tiny
from nova.transforms import remat as rm
from nova.transforms.plan_memory import plan_memory

from step_inputs import step_args

remat = rm.remat

# the step cache would hand a second compile of the same program the first one's IR
_NO_STEP_CACHE = dataclasses.replace(SETTINGS, step_cache=False) if hasattr(SETTINGS, "step_cache") else SETTINGS


def _kept_then_read_late():
    """y = bf16(gelu(x)) read by a forward matmul and, after a gap holding the
    largest live set, by a backward matmul (gelu_backward keeps nothing else alive:
    x is a param)."""
    module, fn = new_step([Slot("param", "x", tensor([128, 128], f32)), Slot("param", "w", tensor([128, 128], bf16))])
    b = OpBuilder(fn.body.block)
    x, w = fn.body.block.args
    y = b.cast(b.one(nv.GeluOp, [x], {"approximate": "tanh"}), bf16)
    a = b.matmul(y, w)
    z = b.one(nv.ExpOp, [x])
    s = b.add(z, b.one(nv.ExpOp, [z]))  # the gap: z, exp(z) and s live together
    dw = b.matmul(b.transpose(y, [1, 0]), a)
    gx = b.one(nv.GeluBackwardOp, [b.cast(dw, f32), x], {"approximate": "tanh"})
    set_results(fn, [("loss", "loss", b.reduce_sum(s, [0, 1])), ("grad", "x", gx)])
    return module, fn


def test_a_cheap_chain_is_recomputed_before_its_late_read():
    module, fn = _kept_then_read_late()
    args = [torch.randn(128, 128), torch.randn(128, 128).to(torch.bfloat16)]
    before = run_function(fn, args)
    peak_before = plan_memory(module.clone()).peak_bytes
    choices = rm.remat(module)
    module.verify()
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    assert [(c.what, c.rule) for c in choices] == [("gelu -> cast tensor<128x128xbf16>", "default")]
    assert choices[0].saved_bytes == 128 * 128 * 2
    ops = list(fn.body.block.ops)
    gelus = [o for o in ops if isinstance(o, nv.GeluOp)]
    assert len(gelus) == 2 and "nova.remat" not in gelus[0].attributes
    assert gelus[1].attributes["nova.remat"].data == "default" and gelus[1].operands[0] is fn.body.block.args[0]
    # the backward matmul reads the clone through a cloned transpose, the forward one the original
    mm = [o for o in ops if isinstance(o, nv.MatmulOp)]
    (use,) = gelus[1].results[0].uses
    clone_cast = use.operation
    assert mm[1].operands[0].owner.operands[0] is clone_cast.results[0]
    assert mm[0].operands[0] is not clone_cast.results[0]
    assert ops.index(gelus[1]) > ops.index(next(o for o in ops if isinstance(o, nv.AddOp)))
    assert plan_memory(module.clone()).peak_bytes < peak_before
    for x, y in zip(before, run_function(fn, args), strict=True):
        assert torch.equal(x, y)


def _bias_add_read_late(src):
    """p = add(cast(a @ w), bias) read by gelu in the forward and, after a gap
    holding the largest live set, by gelu_backward: the [128, 128] matmul output
    is read by nothing else (not live at the late read). ``src`` is the matmul's
    element type; with f32 the chain is neg -> add (a source as wide as p)."""
    module, fn = new_step([
        Slot("param", "a", tensor([128, 128], src)), Slot("param", "w", tensor([128, 128], src)),
        Slot("param", "bias", tensor([128], f32)), Slot("param", "x", tensor([128, 128], f32)),
    ])  # fmt: skip
    b = OpBuilder(fn.body.block)
    a, w, bias, x = fn.body.block.args
    mm = b.matmul(a, w)
    p = b.add(b.cast(mm, f32) if src == bf16 else b.neg(mm), bias)
    r1 = b.reduce_sum(b.one(nv.GeluOp, [p], {"approximate": "tanh"}), [0, 1])
    z = b.one(nv.ExpOp, [x])
    r2 = b.reduce_sum(b.add(z, b.one(nv.ExpOp, [z])), [0, 1])  # the gap
    gp = b.one(nv.GeluBackwardOp, [x, p], {"approximate": "tanh"})
    set_results(fn, [("loss", "loss", b.add(r1, r2)), ("grad", "x", gp)])
    dtype = to_torch_dtype(src)
    args = [torch.randn(128, 128).to(dtype), torch.randn(128, 128).to(dtype), torch.randn(128), torch.randn(128, 128)]
    return module, fn, args


def test_a_narrower_source_is_kept_instead_of_its_f32_bias_add():
    module, fn, args = _bias_add_read_late(bf16)
    before = run_function(fn, args)
    peak_before = plan_memory(module.clone()).peak_bytes
    choices = rm.remat(module)
    module.verify()
    assert [(c.what, c.rule) for c in choices] == [("cast -> add tensor<128x128xf32>", "default")]
    assert choices[0].saved_bytes == 128 * 128 * 4
    ops = list(fn.body.block.ops)
    adds = [o for o in ops if isinstance(o, nv.AddOp) and o.attributes.get("nova.remat")]
    (clone,) = [o for o in adds if list(shape_of(o.results[0].type)) == [128, 128]]
    (late,) = [o for o in ops if isinstance(o, nv.GeluBackwardOp)]
    assert late.operands[1] is clone.results[0]
    cast = clone.operands[0].owner
    assert isinstance(cast, nv.CastOp) and cast.attributes["nova.remat"].data == "default"
    assert isinstance(cast.operands[0].owner, nv.MatmulOp)  # the bf16 matmul output, kept until the late read
    assert plan_memory(module.clone()).peak_bytes < peak_before
    for x, y in zip(before, run_function(fn, args), strict=True):
        assert torch.equal(x, y)


def test_a_source_as_wide_as_the_value_is_not_recomputed_by_default():
    module, fn, _ = _bias_add_read_late(f32)
    text = print_module(module)
    assert rm.remat(module) == [] and print_module(module) == text


def test_nothing_to_gain_leaves_the_ir_alone():
    module, fn = new_step([Slot("param", "x", tensor([64, 64], f32))])
    b = OpBuilder(fn.body.block)
    (x,) = fn.body.block.args
    set_results(fn, [("loss", "loss", b.reduce_sum(b.one(nv.ExpOp, [b.cast(x, bf16)]), [0, 1]))])
    text = print_module(module)
    assert rm.remat(module) == [] and print_module(module) == text


# ---------------------------------------------------------------------------
# a captured 2-layer GPT in bf16, large enough in tokens that activations dominate




def _gpt(n_layer=2, **kw):
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=n_layer, block_size=64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (8, 65))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    return pipeline.run(pipeline.Compilation(model, batch, opt, "bf16", torch.float32, **kw))


def _older_default(kernels, extended_bytes, size):
    """The default rule before narrower sources and layer_norm: elementwise chains
    from values live anyway only."""
    return not extended_bytes and len(kernels) <= rm.DEFAULT_OPS and all(isinstance(o, rm.ELEMENTWISE) for o in kernels)


@pytest.fixture(scope="module")
def steps():
    """The step without remat, with the older default rule and with the default rule
    (the step cache off: it would hand a later compile the first one's IR)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(pipeline, "SETTINGS", _NO_STEP_CACHE)
    mp.setattr(rm, "remat", lambda module, budget=None: [])
    plain = _gpt()
    mp.setattr(rm, "remat", remat)
    with pytest.MonkeyPatch.context() as older:
        older.setattr(rm, "ROW_LOCAL", ())
        older.setattr(rm, "_default_kind", _older_default)
        old = _gpt()
    default = _gpt()
    yield plain, default, old
    mp.undo()


def _producer(v):
    """The op computing ``v``, looking through nova.fused groups (the fuse stage's)."""
    from xdsl.ir import BlockArgument

    while True:
        if isinstance(v, BlockArgument) and isinstance(v.block.parent_op(), nv.FusedOp):
            v = v.block.parent_op().operands[v.index]  # a group's input: the value outside
        elif isinstance(v.owner, nv.FusedOp):
            v = v.owner.body.block.last_op.operands[v.index]  # a group's result: the op inside
        else:
            return v.owner


def _same_results(a, b):
    ra = run_function(step_func(a.module), step_args(a), "bf16")
    rb = run_function(step_func(b.module), step_args(b), "bf16")
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_the_default_rule_lowers_the_peak_of_a_gpt_step(steps):
    plain, default, _ = steps
    assert plain.remat == [] and default.remat
    assert all(c.rule == "default" for c in default.remat)
    assert default.memory.peak_bytes < plain.memory.peak_bytes
    kinds = {c.what.split(" tensor")[0] for c in default.remat}
    assert {"gelu -> cast", "cast"} <= kinds  # GELU's bf16 output, weight casts
    # attention's [B, T, C] reshape is a view of its [B, T, H, D]-laid-out output (plan_memory's
    # permuted placement): no copy to recompute
    assert "reshape" not in kinds
    assert all(c.loc for c in default.remat)
    _same_results(plain, default)
    lines = rm.report(default.remat)
    assert lines[0].startswith(f"remat: {len(default.remat)} values recomputed")


def test_the_default_rule_recomputes_the_pre_gelu_value_and_layer_norm_outputs(steps):
    plain, default, old = steps
    whats = [c.what for c in default.remat]
    # the f32 bias add before GELU, from the bf16 matmul output (kept instead: half the bytes)
    assert "cast -> add tensor<8x64x256xf32>" in whats
    # the bf16 LayerNorm outputs the matmuls' backward reads, from the input and params
    # layer_norm_backward keeps; never a layer_norm for its statistics alone
    assert whats.count("layer_norm -> cast tensor<8x64x64xbf16>") == 4
    assert not any(w.startswith("layer_norm tensor") for w in whats)
    assert not any("layer_norm" in c.what or c.what.startswith("cast -> add") for c in old.remat)
    gelu_bwd = [o for o in default.module.walk() if isinstance(o, nv.GeluBackwardOp)]  # (inside nova.fused groups)
    (bwd,) = [o for o in gelu_bwd if "h.0." in o.attributes["nova.loc"].data]
    pre = _producer(bwd.operands[1])
    assert isinstance(pre, nv.AddOp) and pre.attributes["nova.remat"].data == "default"
    src = _producer(pre.operands[0])
    while not isinstance(src, nv.MatmulOp):
        assert isinstance(src, (nv.CastOp, nv.ReshapeOp)) and src.attributes["nova.remat"].data == "default"
        src = _producer(src.operands[0])
    assert elem_of(src.results[0].type) == bf16 and "nova.remat" not in src.attributes
    assert default.memory.peak_bytes < old.memory.peak_bytes < plain.memory.peak_bytes
    _same_results(plain, default)


def test_a_budget_between_the_default_and_the_floor(monkeypatch):
    # three layers: with two, the fused step's peak is in the last layer's backward,
    # where forward and backward reads are adjacent and nothing is left to recompute
    monkeypatch.setattr(pipeline, "SETTINGS", _NO_STEP_CACHE)
    default = _gpt(n_layer=3)
    with pytest.raises(rm.MemoryBudgetError) as e:
        _gpt(n_layer=3, memory_budget=1)
    floor = e.value.reachable
    assert floor < default.memory.peak_bytes
    assert f"({floor} bytes" in str(e.value) and "memory_budget" in str(e.value) and "(1 bytes)" in str(e.value)
    budget = (floor + default.memory.peak_bytes) // 2
    fit = _gpt(n_layer=3, memory_budget=budget)
    # the budget holds for the final plan: after the fuse stage groups the recomputes too
    assert fit.memory.peak_bytes <= budget < default.memory.peak_bytes
    assert len(fit.remat) > len(default.remat) and any(c.rule == "budget" for c in fit.remat)
    assert fit.module.attributes["nova.memory_plan"].data["peak_bytes"].value.data == fit.memory.peak_bytes
    _same_results(default, fit)
    # a budget the default already meets adds nothing
    easy = _gpt(n_layer=3, memory_budget=default.memory.peak_bytes)
    assert [c.what for c in easy.remat] == [c.what for c in default.remat]


def test_remat_false_recomputes_nothing_with_the_same_results():
    """``nova.compile(remat=False)``: the remat stage chooses nothing (a higher peak),
    the steps' losses and parameters bit for bit those with it; the option keys the
    step cache (its choices are part of the cached IR); with a memory budget, or not a
    bool, it is an error."""
    import nova
    from nova.runtime import cache

    runs = []
    for flag in (True, False):
        torch.manual_seed(0)
        model = GPT(gpt_tiny(block_size=64))
        step = nova.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), precision="bf16",
                            backend="reference", remat=flag)
        g = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(2):
            x = torch.randint(0, 256, (8, 64), generator=g)
            losses.append(step(x, x.roll(1, 1)).item())
        c = step._last.compilation
        runs.append((losses, [p.detach().clone() for p in model.parameters()], c.remat, c.memory.peak_bytes,
                     cache.key_inputs(c, "x", None, [])["recompute"]))
    (l1, p1, ch1, peak1, k1), (l2, p2, ch2, peak2, k2) = runs
    assert ch1 and not ch2 and peak2 > peak1 and (k1, k2) == (True, False)
    assert l1 == l2 and all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True))
    model = GPT(gpt_tiny())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="memory_budget needs remat=True"):
        nova.compile(model, opt, backend="reference", remat=False, memory_budget="1GiB")
    with pytest.raises(TypeError, match="remat must be True or False"):
        nova.compile(model, opt, backend="reference", remat="off")
