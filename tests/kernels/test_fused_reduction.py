"""Reductions with their prologue and epilogue (``nova.fused "reduction"``,
``fused.lower_reduction_group``) through the Triton interpreter: each group's one
launch of its template (reduce.py, rowwise.py) against the unfused launches of the
same IR (the same template and schedule, the elementwise kernels around it), bit
for bit, and against the reference executor; column and row sums and maxima with
widening casts and chains reading broadcast and transposed operands, one and two
passes; LayerNorm with its bf16 cast (and its f32 output kept where it is read),
in registers and looping over column blocks, f32 and f64; LayerNorm's backward
widening its bf16 gradient, adding the residual gradient and a dropout mask, with
its casts; then a small GPT's bf16 step with and without these groups."""

from __future__ import annotations

import copy

import pytest
import torch
from xdsl.dialects.builtin import StringAttr, bf16, f32, f64, i1

from nova.backends.reference import run_function
from nova.backends.triton import TritonProgram
from nova.codegen.triton import fused as fk
from nova.codegen.triton.elementwise import UnsupportedError
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, arg_slots, new_step, set_results, step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.schedule.config import LoweringConfig
from nova.transforms import fuse as fz
from nova.transforms.configure import config_attr

from step_inputs import run_program

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter suite (tests/gpu runs the device)"),
]


def _step(*slots):
    module, fn = new_step(list(slots))
    return module, fn, OpBuilder(fn.body.block, location="test.py:1")


def _args(fn, seed=0):
    """Normal values; bools; a reciprocal standard deviation (a step argument named
    rstd) positive."""
    g = torch.Generator().manual_seed(seed)
    names = [s.name for s in arg_slots(fn)]
    out = []
    for a, name in zip(fn.body.block.args, names, strict=True):
        dt, shape = to_torch_dtype(elem_of(a.type)), shape_of(a.type)
        if dt == torch.bool:
            out.append(torch.rand(shape, generator=g) > 0.3)
        elif name == "rstd":
            out.append(torch.rand(shape, generator=g, dtype=torch.float64).add(0.5).to(dt))
        else:
            out.append(torch.randn(shape, generator=g, dtype=torch.float64).to(dt))
    return out


def _check(module, cfg: LoweringConfig | None = None, tol=1e-5, heads=1):
    """Fuses ``module`` (``cfg`` on each reduction and on its group), runs it and the
    unfused IR on the Triton backend and the reference; returns the groups."""
    fn = step_func(module)
    unfused = module.clone()
    if cfg is not None:
        for op in step_func(unfused).body.block.ops:
            if fz.reduction_head(op):
                op.attributes["nova.lowering_config"] = config_attr(cfg)
    fz.fuse(module)
    module.verify()
    groups = [op for op in fn.body.block.ops if isinstance(op, nv.FusedOp) and op.reduction() is not None]
    assert len(groups) == heads
    if cfg is not None:
        for g in groups:
            g.attributes["nova.lowering_config"] = config_attr(cfg)
    args = _args(fn)
    prog = TritonProgram(fn, "bf16")
    got = run_program(prog, args)
    want = run_program(TritonProgram(step_func(unfused), "bf16"), args)
    ref = run_function(fn, args, "bf16")
    for g, w, r in zip(got, want, ref, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), (g.double() - w.double()).abs().max()  # the unfused kernels' rounding
        torch.testing.assert_close(g.double(), r.double(), rtol=tol, atol=tol)
    # one launch per group: no kernel of its prologue or epilogue runs
    assert not any(isinstance(st.op, (nv.CastOp, nv.LayerNormOp, nv.LayerNormBackwardOp)) for st in prog.steps)
    return groups


# ----------------------------------------------------------------------------
# reduce_sum / reduce_max with a prologue


@pytest.mark.parametrize("split", [None, 3], ids=["one-pass", "split"])
def test_a_bias_gradient_sums_bf16_widened_in_registers(split):
    """The qkv bias gradient: [B, T, 3H, D] bf16, widened and summed over [B, T]."""
    module, fn, b = _step(Slot("batch", "g", tensor([3, 5, 6, 4], bf16)))
    wide = b.reshape(b.cast(fn.body.block.args[0], f32), [3, 5, 24])
    set_results(fn, [("loss", "s", b.create(nv.ReduceSumOp, [wide], {"dims": (0, 1), "keepdim": False}).results[0])])
    cfg = None if split is None else LoweringConfig(kind="reduction", block=8, split_k=split, num_warps=4)
    (g,) = _check(module, cfg)
    assert g.operands[0].type.element_type == bf16


@pytest.mark.parametrize("cls", [nv.ReduceSumOp, nv.ReduceMaxOp], ids=lambda c: c.name)
@pytest.mark.parametrize("dims", [(1,), (0,), (0, 2)], ids=["inner", "outer", "mixed"])
def test_a_chain_with_broadcast_and_transposed_operands_is_the_reductions_prologue(cls, dims):
    module, fn, b = _step(Slot("batch", "x", tensor([4, 6, 5], f32)), Slot("batch", "t", tensor([5, 6, 4], bf16)),
                          Slot("param", "s", tensor([5], f32)), Slot("hyper", "k", tensor([], f64)))  # fmt: skip
    x, t, s, k = fn.body.block.args
    tt = b.cast(b.transpose(t, [2, 1, 0]), f32)  # read through its transpose
    y = b.mul(b.add(b.mul(x, tt), s), b.cast(k, f32))  # a broadcast bias, a 0-d scale
    r = b.create(cls, [b.one(nv.TanhOp, [y])], {"dims": dims, "keepdim": False}).results[0]
    set_results(fn, [("loss", "r", r)])
    (g,) = _check(module)
    assert [o.name for o in g.inner_ops()][-1] == cls.name


@pytest.mark.parametrize("split", [None, 3], ids=["one-pass", "split"])
@pytest.mark.parametrize("rows", [(2, 8), (3, 5)], ids=["even", "ragged"])
def test_gelu_backward_is_summed_and_stored_from_the_bias_gradients_prologue(rows, split):
    """The c_fc layer's backward after a bare matmul: the bf16 incoming gradient widened,
    the pre-activation recomputed from the saved bf16 matmul result and the bias, GELU's
    backward summed into the bias gradient, its bf16 cast stored for the next matmuls,
    and the f32 pre-activation stored too (here returned): one reduce kernel, each
    element computed and stored once."""
    n = 24
    module, fn, b = _step(Slot("batch", "dh", tensor([*rows, n], bf16)), Slot("batch", "mm", tensor([*rows, n], bf16)),
                          Slot("param", "bias", tensor([n], f32)))  # fmt: skip
    dh, mm, bias = fn.body.block.args
    pre = b.add(b.cast(mm, f32), bias)
    d = b.one(nv.GeluBackwardOp, [b.cast(dh, f32), pre], {"approximate": "tanh"})
    set_results(fn, [("grad", "bias", b.reduce_sum(d, [0, 1])), ("loss", "d", b.cast(d, bf16)), ("loss", "pre", pre)])
    cfg = None if split is None else LoweringConfig(kind="reduction", block=8, split_k=split, num_warps=4)
    (g,) = _check(module, cfg, tol=2e-2)
    full = f"{rows[0]}x{rows[1]}x{n}"
    assert sorted(str(r.type) for r in g.results) == sorted([f"tensor<{n}xf32>", f"tensor<{full}xbf16>",
                                                             f"tensor<{full}xf32>"])  # fmt: skip
    head, fusion = fk.fusion_of(g)
    assert sorted(how for how, _ in fusion.outputs) == ["head", "prologue", "prologue"]
    prog = TritonProgram(fn, "bf16")
    assert [type(st.op) for st in prog.steps if st.run is not None] == [nv.FusedOp]  # one launch


def test_a_prologue_store_of_a_maximum_over_inner_rows():
    """A row maximum (the reduced axis contiguous: the tile's fast axis is the columns)
    storing the exp its prologue computes, as the rows of a softmax would."""
    module, fn, b = _step(Slot("batch", "x", tensor([5, 40], f32)))
    e = b.one(nv.ExpOp, [fn.body.block.args[0]])
    m = b.create(nv.ReduceMaxOp, [b.add(e, e)], {"dims": (1,), "keepdim": True}).results[0]
    set_results(fn, [("loss", "m", m), ("loss", "e", e)])
    (g,) = _check(module, LoweringConfig(kind="reduction", block=16, split_k=2, num_warps=4))
    assert len(g.results) == 2


# ----------------------------------------------------------------------------
# layer_norm with its epilogue


def _ln_step(shape, elem=f32, keep_y=False):
    n = shape[-1]
    module, fn, b = _step(Slot("batch", "x", tensor(list(shape), elem)), Slot("param", "w", tensor([n], elem)),
                          Slot("param", "b", tensor([n], elem)),
                          Slot("batch", "r", tensor(list(shape), elem)))  # fmt: skip
    x, w, bias, r = fn.body.block.args
    y, mean, rstd = b.create(nv.LayerNormOp, [x, w, bias], {"eps": 1e-5}).results
    out = [("loss", "y16", b.cast(b.add(y, r), bf16)), ("loss", "mean", mean), ("loss", "rstd", rstd)]
    set_results(fn, out + ([("loss", "y", y)] if keep_y else []))
    return module


@pytest.mark.parametrize("keep_y", [False, True], ids=["bf16-only", "f32-kept"])
@pytest.mark.parametrize("n", [32, 40], ids=["full", "ragged"])
def test_layer_norm_writes_its_cast_from_registers(n, keep_y):
    (g,) = _check(_ln_step((2, 3, n), keep_y=keep_y), tol=2**-7)
    assert len(g.results) == 3 + keep_y


@pytest.mark.parametrize("elem", [f32, f64], ids=["f32", "f64"])
def test_layer_norm_looping_over_column_blocks_takes_its_epilogue(elem):
    cfg = LoweringConfig(kind="reduction", block=16, num_warps=4)  # 40 columns: three blocks, the last ragged
    _check(_ln_step((3, 40), elem, keep_y=True), cfg, tol=2**-7)


@pytest.mark.parametrize("walk", [0, 1], ids=["row-programs", "walking-programs"])
@pytest.mark.parametrize("n, block", [(32, None), (40, None), (40, 16)], ids=["full", "ragged", "looping"])
def test_layer_norm_stores_the_residual_sum_its_prologue_computes(n, block, walk, monkeypatch):
    """The residual stream's sum after a bf16 projection, h = r + (cast(p) + bias), in
    the LayerNorm's prologue (``PROLOGUE_ROW_STORES``): stored in the first pass over
    each row for its other reader (here the return), the bf16 output cast in the
    epilogue; looping over column blocks (16 of 40), stored in the first of three
    passes. ``walk`` (rowwise.LN_FWD_PROGRAMS_PER_SM, a row in registers only):
    programs walking rows, the bias loaded once a program before them."""
    from nova.codegen.triton import rowwise

    monkeypatch.setattr(rowwise, "LN_FWD_PROGRAMS_PER_SM", walk)
    module, fn, b = _step(Slot("batch", "p", tensor([2, 3, n], bf16)), Slot("param", "bias", tensor([n], f32)),
                          Slot("batch", "r", tensor([2, 3, n], f32)), Slot("param", "w", tensor([n], f32)),
                          Slot("param", "lb", tensor([n], f32)))  # fmt: skip
    p, bias, r, w, lb = fn.body.block.args
    h = b.add(r, b.add(b.cast(p, f32), bias))
    y, mean, rstd = b.create(nv.LayerNormOp, [h, w, lb], {"eps": 1e-5}).results
    set_results(fn, [("loss", "y", b.cast(y, bf16)), ("loss", "h", h), ("loss", "mean", mean)])
    cfg = LoweringConfig(kind="reduction", block=block, num_warps=4) if block else None
    (g,) = _check(module, cfg, tol=2**-7)
    assert [o.name for o in g.inner_ops()] == ["nova.cast", "nova.add", "nova.add", "nova.layer_norm", "nova.cast"]
    assert len(g.results) == 3 and list(g.operands)[:3] == [p, bias, r]
    src = fk.lower_reduction_group(g, cfg).source
    walking = walk and block is None
    assert ("for row in" in src) == bool(walking)
    if walking:  # the bias before the rows
        assert "= tl.load(pptr1" in src[:src.index("for row in")]


# ----------------------------------------------------------------------------
# layer_norm_backward with its prologue and epilogue


def _ln_backward(n=40, rows=(2, 3), dropout=True, bias_sum=False, sum_dx=False):
    """A GPT block's LayerNorm backward: the incoming gradient a bf16 matmul result
    widened, the residual gradient added, a dropout mask applied, the sum cast."""
    m = rows[0] * rows[1]
    module, fn, b = _step(Slot("batch", "h", tensor([m, 16], bf16)), Slot("param", "wt", tensor([16, n], bf16)),
                          Slot("batch", "x", tensor([*rows, n], f32)), Slot("param", "w", tensor([n], f32)),
                          Slot("batch", "mean", tensor(list(rows), f32)),
                          Slot("batch", "rstd", tensor(list(rows), f32)), Slot("batch", "res", tensor([*rows, n], f32)),
                          Slot("batch", "keep", tensor([*rows, n], i1)))  # fmt: skip
    h, wt, x, w, mean, rstd, res, keep = fn.body.block.args
    dy = b.reshape(b.cast(b.matmul(h, wt), f32), [*rows, n])
    dx, dw, db = b.create(nv.LayerNormBackwardOp, [dy, x, w, mean, rstd], {}).results
    total = b.add(res, dx)
    if dropout:
        total = b.mul(total, b.cast(keep, f32))
    sums = [("grad", "proj_bias", b.reduce_sum(dx if sum_dx else total, [0, 1]))] if bias_sum else []
    set_results(fn, [("grad", "w", dw), ("grad", "b", db), ("loss", "total", total),
                     ("loss", "t16", b.cast(total, bf16)), *sums])  # fmt: skip
    return module


@pytest.mark.parametrize("n", [32, 40], ids=["full", "ragged"])
def test_layer_norm_backward_widens_its_gradient_and_adds_the_residual_gradient(n):
    (g,) = _check(_ln_backward(n), tol=2e-2)
    names = [o.name for o in g.inner_ops()]
    assert names[:2] == ["nova.cast", "nova.layer_norm_backward"] and names[-1] == "nova.cast"


@pytest.mark.parametrize("sum_dx", [False, True], ids=["residual-gradient", "head-result"])
@pytest.mark.parametrize("looping", [False, True], ids=["in-registers", "looping"])
@pytest.mark.parametrize("n", [32, 40], ids=["full", "ragged"])
def test_layer_norm_backward_sums_its_epilogue_value_over_its_rows(n, looping, sum_dx):
    """The projection's bias gradient, the column sum of the residual gradient the
    LayerNorm backward's epilogue adds, joins the group (``EPILOGUE_SUMS``): summed in
    the kernel's per-program partials beside the weight and bias gradients, then in
    their final pass. The other outputs stay bit-identical to the unfused kernels'; the
    sum, in another order than the reduce kernel's, within fp32 rounding of it, and
    the same bits run after run."""
    module = _ln_backward(n, rows=(3, 7), bias_sum=True, sum_dx=sum_dx)  # (or of dx itself, the epilogue's qin)
    fn = step_func(module)
    unfused = module.clone()
    cfg = LoweringConfig(kind="reduction", block=16, num_warps=4) if looping else None
    fz.fuse(module)
    module.verify()
    (g,) = [op for op in fn.body.block.ops if isinstance(op, nv.FusedOp) and op.reduction() is not None]
    assert [o.name for o in g.epilogue_sums()] == ["nova.reduce_sum"]
    assert not any(isinstance(op, nv.ReduceSumOp) for op in fn.body.block.ops)
    if cfg is not None:
        g.attributes["nova.lowering_config"] = config_attr(cfg)
        for op in step_func(unfused).body.block.ops:
            if isinstance(op, nv.LayerNormBackwardOp):
                op.attributes["nova.lowering_config"] = config_attr(cfg)
    args = _args(fn)
    got = run_program(TritonProgram(fn, "bf16"), args)
    again = run_program(TritonProgram(fn, "bf16"), args)
    want = run_program(TritonProgram(step_func(unfused), "bf16"), args)
    ref = run_function(fn, args, "bf16")
    for k, (x, y, r, z) in enumerate(zip(got, want, ref, again, strict=True)):
        assert torch.equal(x, z)
        if k == len(got) - 1:  # the column sum
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(x, y)
        torch.testing.assert_close(x.double(), r.double(), rtol=2e-2, atol=2e-2)


def test_layer_norm_backward_looping_takes_its_prologue_and_epilogue():
    cfg = LoweringConfig(kind="reduction", block=16, num_warps=4)
    _check(_ln_backward(40, dropout=False), cfg, tol=2e-2)


@pytest.mark.parametrize("hoist", [False, True], ids=["per-row", "hoisted"])
@pytest.mark.parametrize("recomputed", [False, True], ids=["saved-x", "recomputed-x"])
@pytest.mark.parametrize("block", [None, 16], ids=["registers", "looping"])
def test_layer_norm_backward_computes_and_stores_the_layer_norm_recompute_beside_it(recomputed, block, hoist,
                                                                                    monkeypatch):
    """norm_recompute's LayerNorm output from the forward's statistics, y = ((x - mean)
    * rstd) * w + b in bf16, as side ops of the backward reading the same row
    (``nv.row_sides``): computed with its prologue, stored in the first pass over each
    row; x as it is (a saved residual) or the residual stream recomputed in the
    prologue (h = r + (cast(p) + bias), which the side ops read there). ``hoist``
    (rowwise.LN_BWD_HOIST_INVARIANTS): the row-invariant operands (bias, w, lb) loaded
    once before the rows where the row is in registers: the same bits."""
    from nova.codegen.triton import rowwise

    monkeypatch.setattr(rowwise, "LN_BWD_HOIST_INVARIANTS", hoist)
    n = 40
    module, fn, b = _step(Slot("batch", "p", tensor([2, 3, n], bf16)), Slot("param", "bias", tensor([n], f32)),
                          Slot("batch", "r", tensor([2, 3, n], f32)), Slot("param", "w", tensor([n], f32)),
                          Slot("param", "lb", tensor([n], f32)), Slot("batch", "g", tensor([2, 3, n], bf16)),
                          Slot("batch", "mean", tensor([2, 3], f32)), Slot("batch", "rstd", tensor([2, 3], f32)))  # fmt: skip
    p, bias, r, w, lb, g, mean, rstd = fn.body.block.args
    x = b.add(r, b.add(b.cast(p, f32), bias)) if recomputed else r
    centered = b.sub(x, b.reshape(mean, [2, 3, 1]))
    y16 = b.cast(b.add(b.mul(b.mul(centered, b.reshape(rstd, [2, 3, 1])), w), lb), bf16)
    o = y16.owner
    while o is not centered.owner.prev_op:  # norm_recompute's ops: recomputes of remat's
        o.attributes["nova.remat"] = StringAttr("default")
        o = o.prev_op
    dx, dw, db = b.create(nv.LayerNormBackwardOp, [b.cast(g, f32), x, w, mean, rstd], {}).results
    set_results(fn, [("loss", "y16", y16), ("loss", "dx", b.cast(dx, bf16)), ("grad", "w", dw), ("grad", "b", db)])
    cfg = LoweringConfig(kind="reduction", block=block, num_warps=4) if block else None
    (grp,) = _check(module, cfg, tol=2e-2)
    assert isinstance(grp.reduction(), nv.LayerNormBackwardOp)
    assert {o.name for o in grp.prologue_sides()} == {"nova.sub", "nova.mul", "nova.add", "nova.cast"}
    assert len(grp.results) == 4
    src = fk.lower_reduction_group(grp, cfg).source
    before_rows = src[:src.index("for row in")]
    # w and lb (and bias where the residual is recomputed) before the rows, or none of them
    assert before_rows.count("= tl.load(pptr") == ((3 if recomputed else 2) if hoist and block is None else 0)


def test_a_remat_recompute_runs_in_a_layer_norm_and_its_backward():
    """remat's residual-stream recompute (bf16 projection widened, + bias, + the
    residual) in both prologues: a LayerNorm recompute and its backward."""
    module, fn, b = _step(Slot("batch", "p", tensor([2, 3, 40], bf16)), Slot("param", "bias", tensor([40], f32)),
                          Slot("batch", "r", tensor([2, 3, 40], f32)), Slot("param", "w", tensor([40], f32)),
                          Slot("param", "lb", tensor([40], f32)), Slot("batch", "g", tensor([2, 3, 40], bf16)))  # fmt: skip
    p, bias, r, w, lb, g = fn.body.block.args
    x = b.add(r, b.add(b.cast(p, f32), bias))
    for o in (x.owner, x.owner.operands[1].owner, x.owner.operands[1].owner.operands[0].owner):
        o.attributes["nova.remat"] = StringAttr("default")
    y, mean, rstd = b.create(nv.LayerNormOp, [x, w, lb], {"eps": 1e-5}).results
    dx, dw, db = b.create(nv.LayerNormBackwardOp, [b.cast(g, f32), x, w, mean, rstd], {}).results
    set_results(fn, [("loss", "y", b.cast(y, bf16)), ("loss", "dx", b.cast(dx, bf16)), ("grad", "w", dw),
                     ("grad", "b", db)])  # fmt: skip
    groups = _check(module, tol=2e-2, heads=2)
    assert all(o.name == "nova.cast" for o in [groups[0].inner_ops()[0], groups[1].inner_ops()[0]])


def test_a_reduction_group_whose_head_takes_no_fusion_is_refused(monkeypatch):
    from nova.codegen.triton import lowering as lw

    module = _ln_step((2, 8))
    fz.fuse(module)
    (g,) = [o for o in step_func(module).body.block.ops if isinstance(o, nv.FusedOp)]
    monkeypatch.setitem(lw.LOWERINGS, nv.LayerNormOp, lambda op, cfg=None: None)
    fk.lower_fused.cache.clear()
    with pytest.raises(UnsupportedError, match="takes no prologue or epilogue"):
        fk.lower_fused(g)


# ----------------------------------------------------------------------------
# a whole step


def test_a_gpt_step_with_reduction_groups_is_the_step_without_them(monkeypatch):
    """A small GPT (with biases, dropout) in bf16 on the Triton backend: with the
    reduction groups, the loss and every parameter after two AdamW steps are
    bit-identical to the same step with every reduction alone. The LayerNorm
    backward's epilogue column sums are off in both (they change the bias gradient's
    summation order: the test below)."""
    import nova
    from nova.models import GPT, GPTConfig

    monkeypatch.setattr(fz._Grouping, "_join_row_sum", lambda self, op, x, target: None)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, bias=True, dropout=0.1))
    plain, fused = copy.deepcopy(ref), copy.deepcopy(ref)
    step = nova.compile(fused, torch.optim.AdamW(fused.parameters(), lr=1e-3), backend="triton", precision="bf16")
    with monkeypatch.context() as m:
        m.setattr(fz, "reduction_head", lambda op: False)
        unfused = nova.compile(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), backend="triton",
                               precision="bf16")  # fmt: skip
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))
                   for _ in range(2)]  # fmt: skip
        torch.manual_seed(5)  # the dropout seeds
        want = [unfused(x, y).item() for x, y in batches]
    torch.manual_seed(5)
    got = [step(x, y).item() for x, y in batches]
    assert got == want
    for p, q in zip(fused.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    final = step_func(step._last.compilation.module).body.block.ops
    heads = [type(op.reduction()) for op in final if isinstance(op, nv.FusedOp) and op.reduction() is not None]
    assert set(heads) == {nv.LayerNormOp, nv.LayerNormBackwardOp, nv.ReduceSumOp}
    assert not any(isinstance(op, nv.FusedOp) and op.reduction() is not None
                   for op in step_func(unfused._last.compilation.module).body.block.ops)


def test_a_gpt_step_with_its_layer_norm_recomputes_in_the_backwards_is_the_step_without(monkeypatch):
    """A small GPT in bf16 on the Triton backend: remat's LayerNorm recomputes as
    norm_recompute writes them (the formula on the forward's statistics, computed in
    the LayerNorm backward's kernel) against the step without that stage (a
    layer_norm kernel of their own): the loss and every parameter after two AdamW
    steps bit-identical."""
    import nova
    from nova import pipeline
    from nova.models import GPT, GPTConfig

    torch.manual_seed(0)  # (remat recomputes both LayerNorm outputs at this size: asserted below)
    ref = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32, bias=True))
    plain, mine = copy.deepcopy(ref), copy.deepcopy(ref)
    step = nova.compile(mine, torch.optim.AdamW(mine.parameters(), lr=1e-3), backend="triton", precision="bf16")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (4, 32), generator=g), torch.randint(0, 64, (4, 32), generator=g))
               for _ in range(2)]  # fmt: skip
    got = [step(x, y).item() for x, y in batches]
    with monkeypatch.context() as m:
        m.setattr(pipeline, "STAGES", [s for s in pipeline.STAGES if s[0] != "norm_recompute"])
        without = nova.compile(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), backend="triton",
                               precision="bf16")  # fmt: skip
        want = [without(x, y).item() for x, y in batches]
    assert got == want
    for p, q in zip(mine.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    ops = step_func(step._last.compilation.module).body.block.ops
    assert sum(isinstance(op, nv.FusedOp) and bool(op.prologue_sides()) for op in ops) == 2
    assert sum(isinstance(o, nv.LayerNormOp) and "nova.remat" in o.attributes
               for o in without._last.compilation.module.walk()) == 2  # fmt: skip


def test_a_gpt_step_with_the_layer_norm_backwards_bias_sums_matches_the_reference():
    """A small GPT (with biases) in bf16 on the Triton backend: the attention and MLP
    projections' bias gradients (column sums of the residual gradient) join the
    LayerNorm backward groups whose epilogue adds it (no reduce kernel of their own),
    two AdamW steps stay within the epilogue tests' tolerances of the reference
    executor, and a second run is bit-identical."""
    import nova
    from nova.models import GPT, GPTConfig

    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32, bias=True))
    mine, again = copy.deepcopy(ref), copy.deepcopy(ref)
    oracle = nova.compile(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), backend="reference", precision="bf16")
    steps = [nova.compile(m, torch.optim.AdamW(m.parameters(), lr=1e-3), backend="triton", precision="bf16")
             for m in (mine, again)]  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
        want = oracle(x, y).item()
        for step in steps:
            assert abs(step(x, y).item() - want) <= 1e-4 * abs(want)
    for p, q, r in zip(mine.parameters(), again.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
        assert (p - r).abs().max().item() <= 2 * 2 * 1e-3 * 1.01  # as test_matmul_epilogue's GPT step
    ops = step_func(steps[0]._last.compilation.module).body.block.ops
    summing = [op for op in ops if isinstance(op, nv.FusedOp) and op.epilogue_sums()]
    assert len(summing) >= 2 and all(isinstance(op.reduction(), nv.LayerNormBackwardOp) for op in summing)
