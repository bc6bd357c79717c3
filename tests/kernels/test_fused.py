"""Fused elementwise kernels (nova/codegen/triton/fused.py) through the Triton
interpreter: each group built by the fuse stage from small IR, run against the
chain of single-op kernels it replaces (bit for bit) and against the reference
executor (within each dtype's tolerance; exact ops exactly), with bf16 and f32
intermediates, broadcast and transposed operands, scalars recomputed inside,
several outputs, integer and bool values, dropout, and an output written over
its own input."""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32, f64, i1, i64

from nova.backends.reference import run_function, run_ops
from nova.codegen.triton import fused as fk
from nova.codegen.triton.lowering import lowering_for
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, set_results, step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.schedule.config import LoweringConfig
from nova.transforms.fuse import fuse

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 2**-7}


def _step(*slots):
    module, fn = new_step(list(slots))
    return module, fn, OpBuilder(fn.body.block)


def _args(fn, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for a in fn.body.block.args:
        dt = to_torch_dtype(elem_of(a.type))
        u = torch.rand(shape_of(a.type), generator=g, dtype=torch.float64)
        if dt == torch.int64:
            out.append((u * 10).to(dt))
        elif dt == torch.bool:
            out.append(u < 0.5)
        else:
            out.append((u + 0.5).to(dt))
    return out


def _unfused(op: nv.FusedOp, xs):
    """The group's results as the single-op kernels compute them, one after another."""
    block = op.body.block
    env = dict(zip(block.args, xs, strict=True))
    for inner in op.inner_ops():
        env[inner.results[0]] = lowering_for(inner)(inner, None).launch([env[v] for v in inner.operands])[0]
    return [env[v] for v in block.last_op.operands]


def check_groups(module, args=None, cfg=None, exact=False) -> list[nv.FusedOp]:
    """Fuses ``module`` and checks every group's kernel; returns the groups."""
    fn = step_func(module)
    args = _args(fn) if args is None else args
    fuse(module)
    module.verify()
    env = dict(zip(fn.body.block.args, args, strict=True))
    groups = []
    for op in fn.body.block.ops:
        if op.name == "func.return":
            continue
        xs = [env[v] for v in op.operands]
        run_ops([op], env, torch.device("cpu"))
        if not isinstance(op, nv.FusedOp):
            continue
        groups.append(op)
        kernel = lowering_for(op)(op, cfg)
        outs = kernel.launch(xs)
        for got, want, ref in zip(outs, _unfused(op, xs), [env[r] for r in op.results], strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=kernel.source)
            if exact or ref.dtype not in TOL:
                torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
            else:
                torch.testing.assert_close(got, ref, rtol=TOL[ref.dtype], atol=TOL[ref.dtype], equal_nan=True)
    return groups


def test_bf16_intermediates_round_where_the_unfused_kernels_store():
    module, fn, b = _step(Slot("param", "x", tensor([33, 40], f32)), Slot("param", "bias", tensor([40], bf16)))
    x, bias = fn.body.block.args
    e = b.one(nv.ExpOp, [b.cast(x, bf16)])  # exp of a bf16 value: computed in f32, rounded to bf16
    y = b.cast(b.mul(e, bias), f32)  # the bias row broadcast over 33 rows
    set_results(fn, [("loss", "e", e), ("loss", "y", y)])
    (g,) = check_groups(module)
    assert [o.name for o in g.inner_ops()] == ["nova.cast", "nova.exp", "nova.mul", "nova.cast"]
    assert len(g.results) == 2
    assert ".to(tl.bfloat16)" in lowering_for(g)(g, None).source


def test_f32_chain_reads_a_transposed_view_and_computes_gelu():
    module, fn, b = _step(Slot("param", "x", tensor([24, 16], f32)), Slot("param", "w", tensor([16, 24], f32)))
    x, w = fn.body.block.args
    h = b.add(x, b.transpose(w, [1, 0]))
    y = b.one(nv.GeluBackwardOp, [b.one(nv.GeluOp, [h], {"approximate": "tanh"}), h], {"approximate": "tanh"})
    set_results(fn, [("loss", "y", y)])
    (g,) = check_groups(module)
    assert isinstance(g.operands[1].owner, nv.TransposeOp)


def test_optimizer_scalars_are_recomputed_in_the_kernel():
    module, fn, b = _step(Slot("hyper", "beta", tensor([], f64)), Slot("state", "step", tensor([], f32)),
                          Slot("param", "p", tensor([300], f32)), Slot("param", "g", tensor([300], f32)))  # fmt: skip
    beta, step, p, grad = fn.body.block.args
    t = b.cast(b.add(step, b.scalar(1.0, step)), f64)
    corr = b.cast(b.one(nv.SqrtOp, [b.sub(b.scalar(1.0, beta), b.one(nv.PowOp, [beta, t]))]), f32)
    new = b.sub(p, b.div(grad, corr))
    set_results(fn, [("loss", "p", new)])
    args = [torch.tensor(0.999, dtype=torch.float64), torch.tensor(3.0), torch.rand(300), torch.rand(300)]
    (g,) = check_groups(module, args)
    assert any(isinstance(o, nv.PowOp) for o in g.inner_ops())
    src = lowering_for(g)(g, None).source
    assert "tl.load(in0)" in src and "tl.load(in1)" in src  # the scalars: one 0-d load each


def test_readers_of_one_input_write_several_outputs():
    module, fn, b = _step(Slot("param", "x", tensor([5, 7, 9], f32)))
    (x,) = fn.body.block.args
    set_results(fn, [("loss", "e", b.one(nv.ExpOp, [x])), ("loss", "n", b.neg(x)),
                     ("loss", "s", b.one(nv.SqrtOp, [x]))])  # fmt: skip
    (g,) = check_groups(module, cfg=LoweringConfig(kind="elementwise", block=64, num_warps=1))
    assert len(g.results) == 3 and len(g.operands) == 1


def test_integers_and_bools_inside_a_group():
    module, fn, b = _step(Slot("batch", "a", tensor([6, 10], i64)), Slot("batch", "c", tensor([10], i64)),
                          Slot("batch", "m", tensor([6, 10], i1)))  # fmt: skip
    a, c, m = fn.body.block.args
    lt = b.one(nv.LtOp, [a, c])
    both = b.where(m, lt, b.one(nv.GeOp, [a, c]))  # bools through where: stored as bytes
    s = b.add(b.mul(a, c), b.where(both, a, c))
    set_results(fn, [("loss", "s", s), ("loss", "both", both)])
    (g,) = check_groups(module, exact=True)
    assert [str(r.type) for r in g.results] == ["tensor<6x10xi1>", "tensor<6x10xi64>"]


def test_a_dropout_mask_fuses_with_its_reader_exactly():
    module, fn, b = _step(Slot("seed", "seed", tensor([], i64)), Slot("param", "x", tensor([4, 300], bf16)))
    seed, x = fn.body.block.args
    mask = b.one(nv.DropoutMaskOp, [seed], {"p": 0.25, "salt": 3}, tensor([4, 300], bf16))
    set_results(fn, [("loss", "y", b.mul(x, mask))])
    args = [torch.tensor(11), torch.rand(4, 300).to(torch.bfloat16) + 0.5]
    (g,) = check_groups(module, args, exact=True)
    assert [o.name for o in g.inner_ops()] == ["nova.dropout_mask", "nova.mul"]


def test_a_scalar_group():
    module, fn, b = _step(Slot("state", "s", tensor([], f32)), Slot("hyper", "lr", tensor([], f64)))
    s, lr = fn.body.block.args
    new = b.add(s, b.scalar(1.0, s))
    lrs = b.cast(b.mul(lr, b.cast(new, f64)), f32)
    set_results(fn, [("state", "s", b.add(new, b.mul(lrs, new))), ("loss", "n", new)])
    groups = check_groups(module)
    assert groups and all(g.iteration_shape() == () for g in groups)


def test_an_output_overwrites_its_own_input():
    """The in-place update plan_memory allows: an output of the iteration shape
    written over a dense input of its type; every lane reads before it writes."""
    module, fn, b = _step(Slot("param", "p", tensor([1000], f32)), Slot("state", "m", tensor([1000], f32)),
                          Slot("param", "g", tensor([1000], f32)), Slot("hyper", "lr", tensor([], f64)))  # fmt: skip
    p, m, grad, lr = fn.body.block.args
    m2 = b.add(b.mul(m, b.scalar(0.9, m)), b.mul(grad, b.scalar(0.1, grad)))
    p2 = b.sub(p, b.mul(m2, b.cast(lr, f32)))
    set_results(fn, [("param", "p", p2), ("state", "m", m2)])
    args = _args(fn)
    want = run_function(fn, args)
    (g,) = check_groups(module, args)
    kernel = lowering_for(g)(g, LoweringConfig(kind="elementwise", block=128, num_warps=1))
    xs = [a.clone() for a in args]
    ins = [xs[list(fn.body.block.args).index(v)] for v in g.operands]
    returned = list(fn.body.block.last_op.operands)  # p2, m2: results of g
    into = {returned[0]: xs[0], returned[1]: xs[1]}  # p2 over p, m2 over m
    outs = [into[r] for r in g.results]
    assert all(any(o is i for i in ins) for o in outs)  # both outputs are inputs of the kernel
    res = kernel.launch(ins, outs)
    assert all(r is o for r, o in zip(res, outs, strict=True))
    assert torch.equal(xs[0], want[0]) and torch.equal(xs[1], want[1])


def test_an_unknown_kind_is_refused():
    module, fn, b = _step(Slot("param", "x", tensor([4], f32)))
    set_results(fn, [("loss", "y", b.neg(b.one(nv.ExpOp, [fn.body.block.args[0]])))])
    fuse(module)
    (g,) = [o for o in fn.body.block.ops if isinstance(o, nv.FusedOp)]
    g.properties["kind"] = nv.make_prop("gather")
    with pytest.raises(fk.UnsupportedError, match="kind 'gather'"):
        fk.lower_fused(g)


def _one_group(loc: str, elem=f32, shape=(4, 3)) -> nv.FusedOp:
    module, fn, b = _step(Slot("param", "x", tensor(list(shape), elem)))
    b.location = loc
    x = fn.body.block.args[0]
    set_results(fn, [("loss", "y", b.mul(b.neg(b.one(nv.ExpOp, [x])), x))])
    fuse(module)
    (g,) = [o for o in fn.body.block.ops if isinstance(o, nv.FusedOp)]
    return g


def test_groups_of_one_structure_are_generated_once():
    """Two groups that differ only in where they are (their ops' nova.loc, their
    results' place in the arena) get one Kernel; a different dtype, shape or config
    is another structure, another kernel (fused.structure / lowered_once)."""
    a, b = _one_group("layer 0, node exp"), _one_group("layer 1, node exp")
    b.attributes["nova.offset"] = nv.make_prop([256])
    assert fk.structure(a, None) == fk.structure(b, None)
    ka = fk.lower_fused(a)
    assert fk.lower_fused(b) is ka
    for other, cfg in [(_one_group("x", elem=bf16), None), (_one_group("x", shape=(4, 5)), None),
                       (a, LoweringConfig("elementwise", block=32, num_warps=1))]:  # fmt: skip
        assert fk.structure(other, cfg) != fk.structure(a, None)
        assert fk.lower_fused(other, cfg) is not ka
    x = torch.rand(4, 3, dtype=torch.float32)
    for g in (a, b):  # the shared kernel computes each group's values
        assert torch.equal(fk.lower_fused(g).launch([x])[0], _unfused(g, [x])[0])


def test_updates_of_one_shape_run_as_parts_of_one_kernel():
    """Three Adam-like updates of one ragged [37, 53] shape, each with its own step count
    and bias correction and a shared beta (``batch_small``): one kernel whose parts
    (``segments_of``) each load, compute and store one parameter in a branch of their
    own, its own scalars inside the branch, the shared ones before; bit for bit the
    single-op kernels, as the reference within f32. One parameter reads a transposed
    view and one a broadcast row, so each part's operands keep their own strides."""
    slots = [Slot("hyper", "beta", tensor([], f64))]
    for k in range(3):
        slots += [Slot("param", f"p{k}", tensor([37, 53], f32)), Slot("state", f"p{k}::step", tensor([], f32))]
    slots += [Slot("param", "gt", tensor([53, 37], f32)), Slot("param", "row", tensor([53], f32))]
    module, fn, b = _step(*slots)
    beta, *rest = fn.body.block.args
    gt, row = rest[-2:]
    grads = [b.transpose(gt, [1, 0]), row, None]
    results = []
    for k in range(3):
        p, step = rest[2 * k], rest[2 * k + 1]
        t = b.cast(b.add(step, b.scalar(1.0, step)), f64)
        corr = b.cast(b.one(nv.SqrtOp, [b.sub(b.scalar(1.0, beta), b.one(nv.PowOp, [beta, t]))]), f32)
        g = grads[k] if grads[k] is not None else p
        results.append(("param", f"p{k}", b.sub(p, b.div(b.mul(g, p), corr))))
    set_results(fn, results)
    args = _args(fn)
    args[0] = torch.tensor(0.999, dtype=torch.float64)
    groups = check_groups(module, args)
    (g,) = [x for x in groups if len(x.results) == 3]
    parts = fk.segments_of(g)
    assert parts is not None and [len(js) for _, _, js in parts] == [1, 1, 1]
    src = lowering_for(g)(g, None).source
    assert "seg = tl.program_id(1)" in src and src.count("elif seg ==") == 2
    # each part's step count is loaded and its power computed in its own branch
    branches = src.split("if seg == 0:")[1]
    assert branches.count("tl.load(in") >= 3 * 2 and "pow" in branches.lower()
    assert fk.segments_of(g) == parts  # deterministic


def test_weight_casts_of_one_shape_run_as_parts_of_one_kernel():
    """The bf16 casts of three ragged [37, 53] weights, each read by a matmul of its own
    (``batch_small``'s argument-only groups): one kernel of three parts, each casting one
    weight; bit for bit the single casts (round to nearest even, ties and subnormals
    among the inputs), and the reference."""
    slots = [Slot("param", "x", tensor([5, 37], bf16))]
    slots += [Slot("param", f"w{k}", tensor([37, 53], f32)) for k in range(3)]
    module, fn, b = _step(*slots)
    x, *ws = fn.body.block.args
    set_results(fn, [("loss", f"y{k}", b.matmul(x, b.cast(w, bf16))) for k, w in enumerate(ws)])
    args = _args(fn)
    g = torch.Generator().manual_seed(1)
    for k in range(1, 4):  # signed values over many binades, exact bf16 ties, subnormals, zeros
        w = torch.randn(37, 53, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-130, 30, (37, 53), generator=g))
        w[0, :8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, -(2**-133), 0.0, -0.0, 3.0], dtype=torch.float64)
        args[k] = w.to(torch.float32)
    groups = check_groups(module, args, exact=True)
    (multi,) = [op for op in groups if len(op.results) == 3]
    parts = fk.segments_of(multi)
    assert parts is not None and [len(js) for _, _, js in parts] == [1, 1, 1]
    assert "seg = tl.program_id(1)" in lowering_for(multi)(multi, None).source


def test_a_group_sharing_an_input_is_one_part():
    """Two outputs computed from one [33, 40] input (horizontal fusion's shared load) stay
    one straight-line kernel: parts never load an operand twice."""
    module, fn, b = _step(Slot("param", "x", tensor([33, 40], f32)))
    (x,) = fn.body.block.args
    set_results(fn, [("loss", "a", b.one(nv.ExpOp, [x])), ("loss", "b", b.neg(x))])
    (g,) = check_groups(module)
    assert fk.segments_of(g) is None and "program_id(1)" not in lowering_for(g)(g, None).source
