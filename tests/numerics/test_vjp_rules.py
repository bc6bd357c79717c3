"""Every op's VJP rule against torch.autograd (float64) and, for a sample,
against central finite differences.

Each case builds ``@train_step`` around one op: its float operands are
``param`` arguments, everything else (ids, targets, conditions, seeds) and a
random cotangent per float result are ``batch`` arguments, and
``loss = sum_j reduce_sum(result_j * cotangent_j)``. After ``append_backward``
the reference executor runs the step; torch.autograd differentiates the same
computation (the reference executor's implementation of the op, which defines
its semantics, or a torch.nn.functional equivalent).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from xdsl.dialects.builtin import f32, f64, i64

from nova.autodiff import NON_DIFFERENTIABLE, VJP_RULES, append_backward
from nova.backends.reference import IMPLS, run_function
from nova.errors import AutodiffError
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, returned, set_results
from nova.ir.types import from_torch_dtype, is_float, shape_of, tensor

RTOL, ATOL = 1e-10, 1e-12


@dataclass
class In:
    """One operand: a shape and how to draw it (or an explicit value)."""

    shape: tuple[int, ...] = ()
    kind: str = "float"  # float: |x| in [0.5, 1.5]; pos: x in [0.5, 2]; ids; bool; seed
    high: int = 0  # ids are drawn from [0, high)
    value: torch.Tensor | None = None
    dtype: torch.dtype = torch.float64


@dataclass
class Case:
    id: str
    op: type[nv.NovaOp]
    inputs: list[In]
    props: dict = field(default_factory=dict)
    hint: tuple | None = None  # (shape, element type) of ops that take their result type
    results: tuple[int, ...] | None = None  # results the loss uses; default: every float one
    torch_fn: Callable | None = None  # the torch computation; default: the reference impl
    fd: bool = False  # also check against finite differences

    def __str__(self) -> str:
        return self.id


def P(*shape, **kw) -> In:
    return In(tuple(shape), **kw)


def _draw(spec: In, gen: torch.Generator) -> torch.Tensor:
    if spec.value is not None:
        return spec.value.clone()
    if spec.kind == "ids":
        return torch.randint(0, spec.high, spec.shape, generator=gen)
    if spec.kind == "bool":
        return torch.rand(spec.shape, generator=gen) < 0.5
    if spec.kind == "seed":
        return torch.tensor(7)
    u = torch.rand(spec.shape, generator=gen, dtype=torch.float64)
    if spec.kind == "pos":
        return (0.5 + 1.5 * u).to(spec.dtype)
    sign = torch.where(torch.rand(spec.shape, generator=gen) < 0.5, -1.0, 1.0).double()
    return (sign * (0.5 + u)).to(spec.dtype)  # never zero: no kinks hit, no division by ~0


def _cotangent(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return _draw(In(tuple(t.shape), dtype=t.dtype), gen)


BINARY = [nv.AddOp, nv.SubOp, nv.MulOp, nv.DivOp, nv.MaximumOp]
BROADCASTS = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (3, 4)), ((1, 4), (3, 1))]
UNARY = [nv.NegOp, nv.ExpOp, nv.TanhOp, nv.SigmoidOp, nv.ReluOp, nv.CosOp, nv.SinOp, nv.AbsOp, nv.Expm1Op]
UNARY_POS = [nv.LogOp, nv.SqrtOp, nv.RsqrtOp, nv.Log1pOp]


def _ties(shape_a, shape_b) -> list[In]:
    """maximum operands equal in about half of the positions."""
    gen = torch.Generator().manual_seed(3)
    a = _draw(P(*shape_a), gen)
    b = _draw(P(*shape_b), gen)
    same = torch.rand(torch.broadcast_shapes(a.shape, b.shape), generator=gen) < 0.5
    if b.shape == a.shape:
        b = torch.where(same, a, b)
    else:  # b [4] broadcast against a [3, 4]: make row 0 of a tie with b
        a = a.clone()
        a[0] = b
    return [In(value=a), In(value=b)]


def _sdpa(causal):
    def fn(q, k, v):
        return [F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.5)]

    return fn


def _sdpa_bias(q, k, v, bias):
    return [F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.5)]


def _masked_bias(shape, dead_row: bool) -> torch.Tensor:
    """A finite random additive bias with -inf holes; optionally one query row masked entirely."""
    gen = torch.Generator().manual_seed(11)
    bias = torch.randn(shape, generator=gen, dtype=torch.float64)
    bias = bias.masked_fill(torch.rand(shape, generator=gen) < 0.3, float("-inf"))
    bias[..., :, 0] = 0.0  # every row keeps a key ...
    if dead_row:
        bias[..., 1, :] = float("-inf")  # ... except this one
    return bias


def _cases() -> list[Case]:
    cases = []
    for op in BINARY:
        for sa, sb in BROADCASTS:
            name = op.name.split(".")[1]
            cases.append(Case(f"{name}-{sa}-{sb}", op, [P(*sa), P(*sb)], fd=sa == (3, 4) and sb == (4,)))
    cases += [
        Case("maximum-ties", nv.MaximumOp, _ties((3, 4), (3, 4))),
        Case("maximum-ties-broadcast", nv.MaximumOp, _ties((3, 4), (4,))),
        Case("pow", nv.PowOp, [P(3, 4, kind="pos"), P(3, 4)], fd=True),
        Case("pow-broadcast", nv.PowOp, [P(2, 3, 4, kind="pos"), P(4)]),
        Case("pow-scalar-exponent", nv.PowOp, [P(3, 4, kind="pos"), P()]),
        # torch's conventions at 0 ** y (y >= 0) and x ** 0: zero, not nan
        Case("pow-zero-base", nv.PowOp, [In(value=torch.tensor([0.0, 0.0, 1.5, 0.7])), In(value=torch.tensor([2.0, 0.0, 0.0, 1.3]))]),
        Case("where", nv.WhereOp, [P(3, 4, kind="bool"), P(3, 4), P(3, 4)], fd=True),
        Case("where-broadcast", nv.WhereOp, [P(3, 1, kind="bool"), P(4), P(2, 3, 4)]),
        Case("where-cond-widest", nv.WhereOp, [P(2, 3, 4, kind="bool"), P(3, 4), P()]),
    ]
    for op in UNARY + UNARY_POS:
        kind = "pos" if op in UNARY_POS else "float"
        cases.append(Case(op.name.split(".")[1], op, [P(3, 5, kind=kind)], fd=op in (nv.TanhOp, nv.RsqrtOp)))
    cases += [
        Case("gelu-none", nv.GeluOp, [P(3, 5)], {"approximate": "none"}, fd=True),
        Case("gelu-tanh", nv.GeluOp, [P(3, 5)], {"approximate": "tanh"}, fd=True),
        Case("cast-f64-f32", nv.CastOp, [P(3, 4)], hint=((3, 4), f32)),
        Case("cast-f32-f64", nv.CastOp, [P(3, 4, dtype=torch.float32)], hint=((3, 4), f64)),
        Case("reshape", nv.ReshapeOp, [P(3, 4)], hint=((2, 6), f64)),
        Case("reshape-flat", nv.ReshapeOp, [P(2, 3, 2)], hint=((12,), f64)),
        Case("reshape-to-0d", nv.ReshapeOp, [P(1, 1)], hint=((), f64)),
        Case("transpose", nv.TransposeOp, [P(2, 3, 4)], {"perm": (2, 0, 1)}),
        Case("transpose-2d", nv.TransposeOp, [P(3, 4)], {"perm": (1, 0)}),
        Case("broadcast_to", nv.BroadcastToOp, [P(3, 1)], hint=((2, 3, 4), f64), fd=True),
        Case("broadcast_to-0d", nv.BroadcastToOp, [P()], hint=((2, 3), f64)),
        Case("slice-step3", nv.SliceOp, [P(3, 10)], {"dim": 1, "start": 1, "end": 9, "step": 3}, fd=True),
        Case("slice-step2-dim0", nv.SliceOp, [P(5, 2)], {"dim": 0, "start": 0, "end": 5, "step": 2}),
        Case("slice-step1", nv.SliceOp, [P(2, 6, 3)], {"dim": 1, "start": 2, "end": 5, "step": 1}),
        Case("pad-step2", nv.PadOp, [P(3, 3)], {"dim": 1, "start": 1, "step": 2, "size": 8}, fd=True),
        Case("pad-step1", nv.PadOp, [P(3, 2)], {"dim": 0, "start": 1, "step": 1, "size": 5}),
        Case("cat", nv.CatOp, [P(2, 3), P(2, 1), P(2, 4)], {"dim": 1}, fd=True),
        Case("cat-dim0", nv.CatOp, [P(1, 3), P(2, 3)], {"dim": 0}),
        Case("reduce_sum", nv.ReduceSumOp, [P(2, 3, 4)], {"dims": (0, 2), "keepdim": False}),
        Case("reduce_sum-keepdim", nv.ReduceSumOp, [P(2, 3, 4)], {"dims": (1,), "keepdim": True}),
        Case("reduce_sum-all", nv.ReduceSumOp, [P(2, 3)], {"dims": (0, 1), "keepdim": False}),
        Case("reduce_sum-none", nv.ReduceSumOp, [P(2, 3)], {"dims": (), "keepdim": False}),
        Case("reduce_max", nv.ReduceMaxOp, [P(2, 3, 4)], {"dims": (0, 2), "keepdim": False}, fd=True),
        Case("reduce_max-keepdim", nv.ReduceMaxOp, [P(2, 3, 4)], {"dims": (1,), "keepdim": True}),
        # ties: torch.amax divides the gradient evenly among the maxima
        Case("reduce_max-ties", nv.ReduceMaxOp, [In(value=torch.tensor([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, 0.5]]))], {"dims": (1,), "keepdim": False}),
        Case("reduce_max-ties-all", nv.ReduceMaxOp, [In(value=torch.tensor([[1.0, 3.0], [3.0, 3.0]]))], {"dims": (0, 1), "keepdim": True}),
        Case("matmul", nv.MatmulOp, [P(3, 4), P(4, 5)], fd=True),
        Case("matmul-batch-lhs", nv.MatmulOp, [P(2, 3, 4), P(4, 5)]),
        Case("matmul-batch-rhs", nv.MatmulOp, [P(3, 4), P(2, 4, 5)]),
        Case("matmul-batch-broadcast", nv.MatmulOp, [P(2, 1, 3, 4), P(3, 4, 2)], fd=True),
        Case("matmul-batch-size1", nv.MatmulOp, [P(1, 3, 4), P(2, 4, 5)]),
        Case("softmax-last", nv.SoftmaxOp, [P(3, 4, 5)], {"dim": -1}),
        Case("softmax-dim0", nv.SoftmaxOp, [P(3, 4, 5)], {"dim": 0}, fd=True),
        Case("softmax-dim1", nv.SoftmaxOp, [P(3, 4, 5)], {"dim": 1}),
        Case("log_softmax-last", nv.LogSoftmaxOp, [P(3, 5)], {"dim": 1}),
        Case("log_softmax-dim0", nv.LogSoftmaxOp, [P(3, 4, 5)], {"dim": 0}, fd=True),
        Case("log_softmax-dim-2", nv.LogSoftmaxOp, [P(3, 4, 5)], {"dim": -2}),
        Case("layer_norm", nv.LayerNormOp, [P(2, 3, 5), P(5), P(5)], {"eps": 1e-5}, fd=True),
        Case("layer_norm-output-only", nv.LayerNormOp, [P(4, 6), P(6), P(6)], {"eps": 1e-5}, results=(0,),
             torch_fn=lambda x, w, b: [F.layer_norm(x, (6,), w, b, 1e-5)]),
        Case("layer_norm-stats-only", nv.LayerNormOp, [P(2, 3, 5), P(5), P(5)], {"eps": 1e-3}, results=(1, 2)),
        Case("embedding-repeated", nv.EmbeddingOp, [P(6, 3), In(value=torch.tensor([[1, 2, 1], [5, 1, 0]]))], fd=True),
        Case("embedding-1d", nv.EmbeddingOp, [P(10, 4), P(7, kind="ids", high=10)]),
        Case("embedding-padding_idx", nv.EmbeddingOp, [P(6, 3), In(value=torch.tensor([[1, 2, 1], [5, 1, 0]]))],
             {"padding_idx": 1}, torch_fn=lambda w, ids: [F.embedding(ids, w, padding_idx=1)]),
        Case("abs-at-zero", nv.AbsOp, [In(value=torch.tensor([0.0, -0.0, 1.5, -2.0], dtype=torch.float64))]),
        Case("cumsum-dim1", nv.CumsumOp, [P(3, 5)], {"dim": 1, "reverse": False}, fd=True),
        Case("cumsum-dim0-reverse", nv.CumsumOp, [P(4, 2, 3)], {"dim": 0, "reverse": True},
             torch_fn=lambda x: [x.flip(0).cumsum(0).flip(0)]),
    ]
    ce_target = torch.tensor([0, 3, -100, 4, 4, -100])
    ce_target_valid_ignore = torch.tensor([1, 3, 1, 4, 0, 2])
    for reduction in ("mean", "sum"):
        cases += [
            Case(f"cross_entropy-{reduction}", nv.CrossEntropyOp, [P(6, 5), P(6, kind="ids", high=5)],
                 {"ignore_index": -100, "reduction": reduction}, fd=reduction == "mean"),
            Case(f"cross_entropy-ignored-{reduction}", nv.CrossEntropyOp, [P(6, 5), In(value=ce_target)],
                 {"ignore_index": -100, "reduction": reduction}, fd=True),
            Case(f"cross_entropy-ignore-class1-{reduction}", nv.CrossEntropyOp, [P(6, 5), In(value=ce_target_valid_ignore)],
                 {"ignore_index": 1, "reduction": reduction}),
        ]
    all_ignored = torch.full((6,), -100)
    for reduction in ("mean", "sum", "none"):
        ce = {"ignore_index": -100, "reduction": reduction, "label_smoothing": 0.1}
        ref = lambda x, t, r=reduction: [F.cross_entropy(x, t, reduction=r, label_smoothing=0.1)]  # noqa: E731
        cases += [
            Case(f"cross_entropy-smoothing-{reduction}", nv.CrossEntropyOp, [P(6, 5), In(value=ce_target)], ce,
                 torch_fn=ref, fd=reduction == "mean"),
            # a batch of padding: torch's mean loss is NaN but the gradient is 0
            Case(f"cross_entropy-all-ignored-{reduction}", nv.CrossEntropyOp, [P(6, 5), In(value=all_ignored)],
                 {**ce, "label_smoothing": 0.0}),
        ]
    for bias_shape, dead in (((1, 1, 4, 4), False), ((2, 1, 1, 4), False), ((2, 2, 4, 4), True)):
        qkv = [P(2, 2, 4, 3), P(2, 2, 4, 3), P(2, 2, 4, 3)]
        props = {"causal": False, "scale": 0.5}
        name = "x".join(map(str, bias_shape))
        cases.append(Case(f"attention-bias-{name}", nv.AttentionOp, [*qkv, In(value=_masked_bias(bias_shape, dead))],
                          props, results=(0,), torch_fn=_sdpa_bias))
        if not dead:  # lse of a row without keys is -inf: no gradient to compare
            cases.append(Case(f"attention-bias-{name}-lse", nv.AttentionOp, [*qkv, In(value=_masked_bias(bias_shape, dead))], props))
    cases.append(Case("attention-bias-finite-fd", nv.AttentionOp, [P(1, 2, 3, 2), P(1, 2, 4, 2), P(1, 2, 4, 2), P(1, 2, 3, 4)],
                      {"causal": True, "scale": 0.7}, fd=True))
    for causal in (False, True):
        props = {"causal": causal, "scale": 0.5}
        qkv = [P(2, 2, 4, 3), P(2, 2, 4, 3), P(2, 2, 4, 3)]
        cases += [
            Case(f"attention-causal={causal}", nv.AttentionOp, qkv, props, fd=True),  # both out and lse
            Case(f"attention-sdpa-causal={causal}", nv.AttentionOp, qkv, props, results=(0,), torch_fn=_sdpa(causal)),
            Case(f"attention-lse-only-causal={causal}", nv.AttentionOp, qkv, props, results=(1,)),
        ]
    cases.append(Case("attention-cross-tk6", nv.AttentionOp, [P(1, 2, 3, 4), P(1, 2, 6, 4), P(1, 2, 6, 4)], {"causal": False, "scale": 0.3}))
    # the LM head fused with the loss, against F.linear + F.cross_entropy; chunk 4 of 7 rows: a full and a partial chunk
    lce_target = torch.tensor([0, 4, -100, 2, 4, -100, 1])
    for reduction in ("mean", "sum"):
        for ls, bias, ign, tgt, tag in ((0.0, False, -100, lce_target, ""), (0.1, True, -100, lce_target, "-bias-smoothing"),
                                        (0.0, True, 4, lce_target.clamp(min=0), "-bias-ignore-class4"),
                                        (0.0, True, -100, torch.full((7,), -100), "-bias-all-ignored")):
            props = {"ignore_index": ign, "reduction": reduction, "label_smoothing": ls, "chunk": 4}

            def ref(h, w, t, *b, props=props):
                logits = F.linear(h, w, *b)
                return [F.cross_entropy(logits, t, ignore_index=props["ignore_index"], reduction=props["reduction"],
                                        label_smoothing=props["label_smoothing"])]

            inputs = [P(7, 3), P(5, 3), In(value=tgt)] + ([P(5)] if bias else [])
            cases.append(Case(f"linear_cross_entropy{tag}-{reduction}", nv.LinearCrossEntropyOp, inputs, props,
                              torch_fn=ref, fd=reduction == "mean" and tag == "-bias-smoothing"))
    return cases


CASES = _cases()

# Ops that are deliberately without a gradient: comparisons (boolean results),
# constants, the dropout mask (a function of the seed only), and the adjoint
# ops themselves (second order is not supported), and ops made after autodiff.
NON_DIFFERENTIABLE_OPS = {
    nv.EqOp, nv.NeOp, nv.LtOp, nv.LeOp, nv.GtOp, nv.GeOp,
    nv.FullOp, nv.ArangeOp, nv.DropoutMaskOp, nv.StopGradientOp,
    nv.GeluBackwardOp, nv.SoftmaxBackwardOp, nv.LogSoftmaxBackwardOp, nv.LayerNormBackwardOp,
    nv.EmbeddingBackwardOp, nv.CrossEntropyBackwardOp, nv.AttentionBackwardOp,
    nv.LinearCrossEntropyBackwardOp, nv.LinearCrossEntropyWithGradOp, nv.CountOutOfRangeOp, nv.CountNonfiniteOp,
    nv.RoundTf32Op,  # made after autodiff (the tf32_operands stage)
}  # fmt: skip


def test_every_op_is_tested_or_declared_nondifferentiable():
    covered = {c.op for c in CASES}
    untested = [op.name for op in nv.NOVA_OPS if op not in covered and op not in NON_DIFFERENTIABLE_OPS]
    assert not untested, f"ops without a VJP test case: {untested}"
    assert not covered & NON_DIFFERENTIABLE_OPS
    assert NON_DIFFERENTIABLE_OPS == NON_DIFFERENTIABLE


def test_every_op_has_a_rule():
    assert [op.name for op in nv.NOVA_OPS if op not in VJP_RULES] == []


# ----------------------------------------------------------------------------
# the harness


def _build(case: Case, values: list[torch.Tensor]):
    """``@train_step`` around ``case.op``; returns (module, fn, op, cotangent values)."""
    in_types = [tensor(v.shape, from_torch_dtype(v.dtype)) for v in values]
    hint = tensor(*case.hint) if case.hint else None
    out_types = case.op.infer(in_types, case.props, hint)
    used = case.results if case.results is not None else [j for j, t in enumerate(out_types) if is_float(t)]
    slots = [Slot("param" if v.is_floating_point() else "batch", f"x{i}", t) for i, (v, t) in enumerate(zip(values, in_types))]
    slots += [Slot("batch", f"ct{j}", out_types[j]) for j in used]
    module, fn = new_step(slots)
    block = fn.body.block
    b = OpBuilder(block)
    op = b.create(case.op, block.args[: len(values)], case.props, hint)
    loss = None
    for j, ct in zip(used, block.args[len(values) :]):
        r = op.results[j]
        term = b.reduce_sum(b.mul(r, ct), range(len(shape_of(r.type))))
        loss = term if loss is None else b.add(loss, term)
    set_results(fn, [("loss", "loss", loss)])
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + 1)
    cts = []
    for j in used:
        shape = shape_of(out_types[j])
        cts.append(_cotangent(torch.empty(shape, dtype=torch.float32 if out_types[j].element_type == f32 else torch.float64), gen))
    return module, fn, op, used, cts


def _inputs(case: Case) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    return [_draw(spec, gen) for spec in case.inputs]


def _ir_grads(fn, values, cts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    outs = run_function(fn, [*values, *cts])
    res = returned(fn)
    assert res[0][0] == "loss"
    return outs[0], {name: t for (role, name, _), t in zip(res, outs) if role == "grad"}


def _torch_grads(case: Case, op, values, used, cts):
    xs = [v.clone().requires_grad_(v.is_floating_point()) for v in values]
    outs = case.torch_fn(*xs) if case.torch_fn else IMPLS[case.op](op, xs)
    if case.torch_fn:  # torch_fn returns just the used results
        outs = dict(zip(used, outs))
    loss = sum((outs[j] * ct).sum() for j, ct in zip(used, cts))
    floats = [x for x in xs if x.is_floating_point()]
    grads = torch.autograd.grad(loss, floats, allow_unused=True)
    names = [f"x{i}" for i, x in enumerate(xs) if x.is_floating_point()]
    return loss.detach(), dict(zip(names, grads))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_vjp_matches_torch_autograd(case: Case):
    values = _inputs(case)
    module, fn, op, used, cts = _build(case, values)
    append_backward(module)
    module.verify()
    loss, grads = _ir_grads(fn, values, cts)
    t_loss, t_grads = _torch_grads(case, op, values, used, cts)
    torch.testing.assert_close(loss, t_loss, rtol=RTOL, atol=ATOL, equal_nan=True)
    for name, expected in t_grads.items():
        if expected is None:
            assert name not in grads
        else:
            assert name in grads, f"no gradient for {name}"
            torch.testing.assert_close(grads[name], expected, rtol=RTOL, atol=ATOL)
    assert set(grads) <= set(t_grads)


FD_CASES = [c for c in CASES if c.fd]


@pytest.mark.parametrize("case", FD_CASES, ids=str)
def test_vjp_matches_finite_differences(case: Case):
    values = _inputs(case)
    module, fn, op, used, cts = _build(case, values)
    append_backward(module)
    _, grads = _ir_grads(fn, values, cts)
    eps = 1e-6
    for i, v in enumerate(values):
        if not v.is_floating_point():
            continue
        fd = torch.zeros_like(v)
        for k in range(v.numel()):
            hi, lo = v.clone(), v.clone()
            hi.view(-1)[k] += eps
            lo.view(-1)[k] -= eps
            f_hi = _ir_grads(fn, [*values[:i], hi, *values[i + 1 :]], cts)[0]
            f_lo = _ir_grads(fn, [*values[:i], lo, *values[i + 1 :]], cts)[0]
            fd.view(-1)[k] = (f_hi - f_lo) / (2 * eps)
        torch.testing.assert_close(grads[f"x{i}"], fd, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------
# ops without a gradient


def _single_op_step(op_cls, arg_types, roles, props=None, hint=None, result=0):
    slots = [Slot(r, f"x{i}", t) for i, (r, t) in enumerate(zip(roles, arg_types))]
    module, fn = new_step(slots)
    block = fn.body.block
    b = OpBuilder(block)
    op = b.create(op_cls, block.args, props, hint)
    out = op.results[result]
    loss = b.reduce_sum(out, range(len(shape_of(out.type))))
    set_results(fn, [("loss", "loss", loss)])
    return module, fn


T = lambda *shape, e=f64: tensor(shape, e)  # noqa: E731

SECOND_ORDER = [
    (nv.GeluBackwardOp, [T(3), T(3)], {"approximate": "none"}),
    (nv.SoftmaxBackwardOp, [T(2, 3), T(2, 3)], {"dim": 1}),
    (nv.LogSoftmaxBackwardOp, [T(2, 3), T(2, 3)], {"dim": 1}),
    (nv.LayerNormBackwardOp, [T(2, 3), T(2, 3), T(3), T(2), T(2)], {}),
    (nv.EmbeddingBackwardOp, [T(4, 3), T(4, e=i64)], {"num_embeddings": 5, "padding_idx": -1}),
    (nv.CrossEntropyBackwardOp, [T(), T(4, 3), T(4, e=i64)], {"ignore_index": -100, "reduction": "mean"}),
    (nv.AttentionBackwardOp, [T(1, 1, 2, 3)] * 5 + [T(1, 1, 2)], {"causal": False, "scale": 1.0}),
    (nv.LinearCrossEntropyBackwardOp, [T(), T(4, 3), T(5, 3), T(4, e=i64)], {"ignore_index": -100, "reduction": "mean"}),
    (nv.LinearCrossEntropyWithGradOp, [T(), T(4, 3), T(5, 3), T(4, e=i64)], {"ignore_index": -100, "reduction": "mean"}),
    (nv.RoundTf32Op, [T(3, e=f32)], {}),
]


@pytest.mark.parametrize("op_cls,types,props", SECOND_ORDER, ids=lambda x: getattr(x, "name", ""))
def test_second_order_is_a_clear_error(op_cls, types, props):
    roles = ["param" if is_float(t) else "batch" for t in types]
    module, _ = _single_op_step(op_cls, types, roles, props)
    with pytest.raises(AutodiffError, match=f"second-order differentiation of {op_cls.name} is not supported"):
        append_backward(module)


def test_second_order_list_covers_every_backward_op():
    # (the merged loss-and-gradients op of the loss_grad stage is a hand-written adjoint too)
    assert {c for c, _, _ in SECOND_ORDER} == {op for op in nv.NOVA_OPS if op.name.endswith(("_backward", "_with_grad"))} | {
        nv.RoundTf32Op}  # made by the tf32_operands stage, after autodiff


@pytest.mark.parametrize("op_cls", [nv.EqOp, nv.NeOp, nv.LtOp, nv.LeOp, nv.GtOp, nv.GeOp])
def test_comparisons_pass_no_gradient(op_cls):
    # where(x > y, x, 0): x gets its gradient through where's value operand only
    module, fn = new_step([Slot("param", "x", T(3, 4)), Slot("param", "y", T(4))])
    block = fn.body.block
    b = OpBuilder(block)
    x, y = block.args
    mask = b.one(op_cls, [x, y])
    out = b.where(mask, x, b.scalar(0.0, x))
    set_results(fn, [("loss", "loss", b.reduce_sum(out, (0, 1)))])
    append_backward(module)
    module.verify()
    res = returned(fn)
    assert [(r, n) for r, n, _ in res] == [("loss", "loss"), ("grad", "x")]  # y only feeds the comparison
    xv, yv = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    _, gx = run_function(fn, [xv, yv])
    expected = IMPLS[op_cls](mask.owner, [xv, yv])[0].double()
    torch.testing.assert_close(gx, expected, rtol=0, atol=0)


def test_full_arange_and_dropout_mask_pass_no_gradient():
    module, fn = new_step([Slot("param", "x", T(2, 3)), Slot("seed", "seed", T(e=i64))])
    block = fn.body.block
    b = OpBuilder(block)
    x, seed = block.args
    mask = b.one(nv.DropoutMaskOp, [seed], {"p": 0.5, "salt": 3}, T(2, 3))
    ar = b.cast(b.one(nv.ArangeOp, [], {"start": 1, "step": 2}, T(3, e=i64)), f64)
    out = b.mul(b.mul(b.mul(x, mask), ar), b.full(2.0, (2, 3), f64))
    set_results(fn, [("loss", "loss", b.reduce_sum(out, (0, 1)))])
    append_backward(module)
    module.verify()
    xv = torch.randn(2, 3, dtype=torch.float64)
    _, gx = run_function(fn, [xv, torch.tensor(11)])
    m = IMPLS[nv.DropoutMaskOp](mask.owner, [torch.tensor(11)])[0]
    torch.testing.assert_close(gx, m * torch.tensor([1.0, 3.0, 5.0], dtype=torch.float64) * 2.0)
    # nothing flows into the seed, the constants or the arange
    assert [r for r, _, _ in returned(fn)] == ["loss", "grad"]


@pytest.mark.parametrize("op_cls", sorted(NON_DIFFERENTIABLE_OPS - {c for c, _, _ in SECOND_ORDER}, key=lambda c: c.name), ids=lambda c: c.name)
def test_nondifferentiable_rules_return_none(op_cls):
    # calling the rule directly: one None per operand, and no IR created
    module, fn = new_step([Slot("batch", "x", T(3)), Slot("batch", "y", T(3)), Slot("seed", "s", T(e=i64))])
    block = fn.body.block
    b = OpBuilder(block)
    x, y, s = block.args
    if op_cls is nv.FullOp:
        op = b.create(op_cls, [], {"value": 1.0}, T(3))
    elif op_cls is nv.ArangeOp:
        op = b.create(op_cls, [], {"start": 0, "step": 1}, T(3, e=i64))
    elif op_cls is nv.DropoutMaskOp:
        op = b.create(op_cls, [s], {"p": 0.1, "salt": 0}, T(3))
    elif op_cls is nv.CountOutOfRangeOp:
        op = b.create(op_cls, [s], {"low": 0, "high": 3})
    elif op_cls is nv.CountNonfiniteOp:
        op = b.create(op_cls, [x])
    else:
        op = b.create(op_cls, [x, y])
    n_ops = len(list(block.ops))
    ct = b.full(1.0, shape_of(op.results[0].type), f64) if is_float(op.results[0].type) else None
    assert VJP_RULES[op_cls](b, op, [ct]) == [None] * len(op.operands)
    assert len(list(block.ops)) == n_ops + (ct is not None)

