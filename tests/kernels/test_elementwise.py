"""The generated elementwise kernels against the reference executor, through the
Triton interpreter on the CPU (compiled on a GPU). Each case builds one nova op,
lowers it, and runs it on small random inputs (never zeros), including
broadcast, transposed, sliced and expanded views read in place."""

from __future__ import annotations

import pytest
import torch

from nova.backends.reference import IMPLS
from nova.codegen.triton import elementwise as ew
from nova.codegen.triton.lowering import LOWERINGS, lowering_for
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import from_torch_dtype, tensor
from nova.schedule.config import LoweringConfig

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inf/nan warnings inside the interpreter

F32, F64, BF16, F16, I64, BOOL = torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool
TOL = {F32: (1e-6, 1e-7), F64: (1e-12, 1e-14), BF16: (2**-7, 0.0), F16: (2**-10, 0.0)}


def build(cls, ins, props=None, hint=None):
    """One ``cls`` op over fresh arguments of (shape, dtype) ``ins``."""
    slots = [Slot("batch", f"x{i}", tensor(s, from_torch_dtype(d))) for i, (s, d) in enumerate(ins)]
    _, fn = new_step(slots)
    result = None if hint is None else tensor(hint[0], from_torch_dtype(hint[1]))
    return OpBuilder(fn.body.block).create(cls, list(fn.body.block.args), props, result)


def run(op, xs, cfg=None):
    """(kernel output, reference output)."""
    kernel = lowering_for(op)(op, cfg)
    out = kernel.launch(xs)
    ref = IMPLS[type(op)](op, [x.clone() for x in xs])
    assert len(out) == len(ref) == 1
    assert out[0].is_contiguous()
    return out[0], ref[0]


def check(out, ref, exact=False, atol=None):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    if exact or ref.dtype not in TOL:
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    else:
        rtol, default_atol = TOL[ref.dtype]
        atol = default_atol if atol is None else atol
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol, equal_nan=True)


def rand(shape, dtype=F32, kind="signed", seed=0):
    """|x| in [0.5, 1.5] with random signs ("signed") or x in [0.5, 2] ("pos")."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(shape, generator=g, dtype=F64)
    if kind == "pos":
        return (0.5 + 1.5 * u).to(dtype)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    return (sign * (0.5 + u)).to(dtype)


def transposed(shape, dtype=F32, kind="signed", seed=0):
    """A non-contiguous view of ``shape`` (last two dims swapped in memory)."""
    t = rand((*shape[:-2], shape[-1], shape[-2]), dtype, kind, seed)
    return t.transpose(-1, -2)


# --------------------------------------------------------------------------- arithmetic

BINARY = [nv.AddOp, nv.SubOp, nv.MulOp, nv.DivOp, nv.MaximumOp, nv.PowOp]


@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=str)
@pytest.mark.parametrize("cls", BINARY, ids=lambda c: c.name)
def test_binary_broadcast_views(cls, dtype):
    """lhs a transposed [2, 3, 5] view, rhs a [3, 1] operand broadcast over two dims."""
    a = transposed((2, 3, 5), dtype, "pos" if cls is nv.PowOp else "signed", seed=1)
    b = rand((3, 1), dtype, seed=2)
    op = build(cls, [((2, 3, 5), dtype), ((3, 1), dtype)])
    check(*run(op, [a, b]))


def test_binary_expanded_scalar_and_sliced():
    """A stride-0 expanded view, a 0-d scalar and a sliced view with an offset."""
    base = rand((6, 8), seed=3)
    a = base[1::2, 2:7]  # [3, 5], strides (16, 1), storage offset
    b = rand((5,), seed=4).expand(3, 5)
    op = build(nv.MulOp, [((3, 5), F32), ((3, 5), F32)])
    check(*run(op, [a, b]))
    op = build(nv.DivOp, [((3, 5), F32), ((), F32)])
    check(*run(op, [a, torch.tensor(1.7)]))


def test_pow_special_cases():
    a = torch.tensor([-2.0, -2.0, -0.5, 2.0, 1.0, float("nan"), -1.0, 3.0, -8.0, 0.25])
    b = torch.tensor([3.0, 2.0, 0.5, -1.5, float("nan"), 0.0, float("inf"), 0.0, 1 / 3, 2.5])
    op = build(nv.PowOp, [((10,), F32), ((10,), F32)])
    check(*run(op, [a, b]))


def test_maximum_and_relu_propagate_nan():
    a = torch.tensor([1.0, float("nan"), -2.0, 3.0, float("-inf")])
    b = torch.tensor([float("nan"), 1.0, -3.0, 4.0, -1.0])
    check(*run(build(nv.MaximumOp, [((5,), F32), ((5,), F32)]), [a, b]))
    check(*run(build(nv.ReluOp, [((5,), F32)]), [a]))


UNARY = [nv.NegOp, nv.ExpOp, nv.LogOp, nv.SqrtOp, nv.RsqrtOp, nv.TanhOp, nv.SigmoidOp, nv.ReluOp, nv.CosOp, nv.SinOp,
         nv.AbsOp, nv.Log1pOp, nv.Expm1Op]  # fmt: skip


@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=str)
@pytest.mark.parametrize("cls", UNARY, ids=lambda c: c.name)
def test_unary(cls, dtype):
    kind = "pos" if cls in (nv.LogOp, nv.SqrtOp, nv.RsqrtOp, nv.Log1pOp) else "signed"
    x = transposed((3, 7), dtype, kind, seed=5) * (1 if kind == "pos" else 3)  # tanh: both branches
    check(*run(build(cls, [((3, 7), dtype)]), [x]))


@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_backward(approximate, dtype):
    """In fp32 the negative tail cancels (1 + erf(x) ~ 0), so the absolute error of
    any fp32 evaluation is ~ulp(1) * |x|; torch's CPU erf is ~10x off there (its
    vectorized polynomial), so fp32 is compared to the reference within 1e-6
    absolute, and to the float64 truth within 2e-7 (5e-7 for tanh)."""
    x = rand((4, 9), dtype, seed=6) * 2.5
    g = rand((4, 9), dtype, seed=7)
    props = {"approximate": approximate}
    atol = 1e-6 if dtype == F32 else None
    gelu = build(nv.GeluOp, [((4, 9), dtype)], props)
    out, ref = run(gelu, [x])
    check(out, ref, atol=atol)
    backward = build(nv.GeluBackwardOp, [((4, 9), dtype), ((4, 9), dtype)], props)
    out_b, ref_b = run(backward, [g, x.t().contiguous().t()])
    check(out_b, ref_b, atol=atol)
    if dtype == F32:
        truth = IMPLS[nv.GeluOp](gelu, [x.double()])[0].float()
        truth_b = IMPLS[nv.GeluBackwardOp](backward, [g.double(), x.double()])[0].float()
        atol = 2e-7 if approximate == "none" else 5e-7  # tanh: x sigmoid(2u), an exp2 and a reciprocal
        torch.testing.assert_close(out, truth, rtol=1e-6, atol=atol)
        torch.testing.assert_close(out_b, truth_b, rtol=1e-6, atol=atol)


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_tanh_gelu_tails_and_non_finite_inputs_are_torchs(dtype):
    """GELU's tanh approximation computed as x sigmoid(2u): far tails (the exp
    overflows to inf, the sigmoid to 0 or 1), +-inf and NaN give torch's values and
    signs (0.5 x (1 + tanh u): -0.0 far left, NaN at +-inf in the backward); where
    torch's fp32 1 + tanh(u) cancels (x = -3: 1.1e-5 relative off), Nova's is within
    1e-6 of the float64 value."""
    x = torch.tensor([-1e4, -30.0, -9.5, -3.0, -1e-30, 0.0, -0.0, 1e-30, 3.0, 9.5, 30.0, 1e4,
                      float("inf"), float("-inf"), float("nan")], dtype=dtype)  # fmt: skip
    g = torch.ones_like(x)
    props = {"approximate": "tanh"}
    gelu = build(nv.GeluOp, [((x.numel(),), dtype)], props)
    out, ref = run(gelu, [x])
    truth = IMPLS[nv.GeluOp](gelu, [x.double()])[0].to(dtype)
    torch.testing.assert_close(out, truth, equal_nan=True, rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=2e-5, atol=1e-30)
    assert torch.equal(torch.signbit(out[~out.isnan()]), torch.signbit(ref[~ref.isnan()]))
    backward = build(nv.GeluBackwardOp, [((x.numel(),), dtype), ((x.numel(),), dtype)], props)
    out_b, ref_b = run(backward, [g, x])
    truth_b = IMPLS[nv.GeluBackwardOp](backward, [g.double(), x.double()])[0].to(dtype)
    torch.testing.assert_close(out_b, truth_b, equal_nan=True, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out_b, ref_b, equal_nan=True, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16], ids=str)
@pytest.mark.parametrize("cls", [nv.CosOp, nv.SinOp], ids=lambda c: c.name)
def test_cos_sin_wide_range(cls, dtype):
    """Arguments up to 1e4 (rotary angles: position x frequency), their quadrant
    boundaries, zeros of the result, and the non-finite inputs (NaN out)."""
    g = torch.Generator().manual_seed(23)
    x = torch.cat([
        (torch.rand(40, generator=g, dtype=F64) - 0.5) * 2e4,
        torch.arange(-8, 9, dtype=F64) * (torch.pi / 4),
        torch.tensor([0.0, -0.0, 1e-30, 3.0, 355.0, float("inf"), float("-inf"), float("nan")], dtype=F64),
    ]).to(dtype)  # fmt: skip
    op = build(cls, [((x.numel(),), dtype)])
    # the result's absolute error is ~ulp(1) of the dtype (near a zero of cos or sin
    # any evaluation of the rounded argument is only that good)
    atol = {F32: 2e-7, F64: 1e-15, BF16: 2**-8, F16: 2**-11}[dtype]
    check(*run(op, [x]), atol=atol)


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
@pytest.mark.parametrize("cls", [nv.Log1pOp, nv.Expm1Op], ids=lambda c: c.name)
def test_log1p_expm1_small_large_and_non_finite(cls, dtype):
    """Where log(1 + x) and exp(x) - 1 lose everything (|x| near an ulp of 1 and below),
    at -1 (log1p: -inf), past it (NaN), at the overflow and at +-inf and NaN: within a
    few ulp of torch's log1p / expm1, relative."""
    g = torch.Generator().manual_seed(29)
    tiny = torch.logspace(-30, -1, 40, dtype=F64) * torch.where(torch.rand(40, generator=g, dtype=F64) < 0.5, -1.0, 1.0)
    wide = (torch.rand(40, generator=g, dtype=F64) - 0.5) * 60
    edges = [0.0, -0.0, -1.0, -0.999999, 1e30, 88.0, 89.0, 700.0, 710.0, -1e30, float("inf"), float("-inf"),
             float("nan")]  # fmt: skip
    x = torch.cat([tiny, wide, torch.tensor(edges + ([-2.0] if cls is nv.Log1pOp else []), dtype=F64)]).to(dtype)
    out, ref = run(build(cls, [((x.numel(),), dtype)]), [x])
    ulps = 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=ulps, atol=0.0)


def test_abs_exact_and_signed_zero():
    x = torch.tensor([-0.0, 0.0, -1.5, 2.0, float("-inf"), float("nan"), -1e-40, 3.4e38])
    out, ref = run(build(nv.AbsOp, [((8,), F32)]), [x])
    check(out, ref, exact=True)
    assert not torch.signbit(out).any()


# --------------------------------------------------------------------------- integer arithmetic

INTEGER_BINARY = [nv.AddOp, nv.SubOp, nv.MulOp, nv.MaximumOp]


@pytest.mark.parametrize("cls", INTEGER_BINARY, ids=lambda c: c.name)
def test_integer_binary_exact(cls):
    """i64 in, i64 out, bit-exact: a transposed view against a broadcast row, values
    past 2**31 and 2**53 (an fp64 path would round them), negatives, and a product
    that wraps around like torch's."""
    g = torch.Generator().manual_seed(24)
    a = torch.randint(-(2**40), 2**40, (5, 4), generator=g).t()  # [4, 5] view
    a[0, 0], a[1, 1] = 2**53 + 1, -(2**62)
    b = torch.randint(-(2**33), 2**33, (5,), generator=g)
    b[2] = 3  # 3 * -(2**62) wraps
    op = build(cls, [((4, 5), I64), ((5,), I64)])
    out, ref = run(op, [a, b])
    assert out.dtype == I64
    check(out, ref, exact=True)


def test_integer_position_ids():
    """arange-style position math: a 0-d offset plus a [T] index, times a stride."""
    pos = torch.arange(7)
    off = torch.tensor(2**35)
    add = build(nv.AddOp, [((7,), I64), ((), I64)])
    check(*run(add, [pos, off]), exact=True)
    mul = build(nv.MulOp, [((3, 1), I64), ((7,), I64)])
    check(*run(mul, [torch.tensor([[1], [-2], [2**31]]), pos]), exact=True)


# --------------------------------------------------------------------------- compares, where

COMPARES = [nv.EqOp, nv.NeOp, nv.LtOp, nv.LeOp, nv.GtOp, nv.GeOp]


@pytest.mark.parametrize("dtype", [F32, BF16, I64, BOOL], ids=str)
def test_compares(dtype):
    g = torch.Generator().manual_seed(8)
    a = torch.randint(0, 3, (4, 6), generator=g).to(dtype)  # few values: ties on purpose
    b = torch.randint(0, 3, (6,), generator=g).to(dtype)
    if dtype.is_floating_point:
        a, b = a + 0.5, b + 0.5
    for cls in COMPARES:
        out, ref = run(build(cls, [((4, 6), dtype), ((6,), dtype)]), [a.t().contiguous().t(), b])
        assert out.dtype == torch.bool
        check(out, ref, exact=True)


@pytest.mark.parametrize("dtype", [F32, BF16, BOOL, I64], ids=str)
def test_where_broadcast(dtype):
    g = torch.Generator().manual_seed(9)
    c = torch.rand((3, 1, 5), generator=g) < 0.5
    if dtype == BOOL:
        a, b = torch.rand((4, 5), generator=g) < 0.5, torch.rand((3, 4, 1), generator=g) < 0.5
    elif dtype == I64:  # beyond fp64's integers: a float path would round them
        a, b = torch.randint(2**53, 2**62, (4, 5), generator=g), -torch.randint(2**53, 2**62, (3, 4, 1), generator=g)
    else:
        a, b = rand((4, 5), F32, seed=10).to(dtype), rand((3, 4, 1), F32, seed=11).to(dtype)
    op = build(nv.WhereOp, [((3, 1, 5), BOOL), ((4, 5), dtype), ((3, 4, 1), dtype)])
    check(*run(op, [c, a, b]), exact=True)


# --------------------------------------------------------------------------- casts and constants

CAST_DTYPES = [F32, F64, BF16, F16, I64, BOOL]


def cast_source(dtype):
    g = torch.Generator().manual_seed(12)
    x = torch.randn((5, 6), generator=g, dtype=F64) * 40
    # values where rounding twice (via fp32, as torch does) differs from rounding once
    x[0, :4] = torch.tensor([2**24 + 2**16 + 1, 2**24 + 1, -(2**24 + 3), 1 + 2**-8 + 2**-30])
    if dtype == BOOL:
        return x > 0
    return x.to(dtype)


@pytest.mark.parametrize("src", CAST_DTYPES, ids=str)
def test_cast(src):
    x = cast_source(src).t()  # a transposed view
    for dst in CAST_DTYPES:
        if dst == src:
            continue
        check(*run(build(nv.CastOp, [((6, 5), src)], hint=((6, 5), dst)), [x]), exact=True)


def test_cast_f32_to_bf16_rounding_specials():
    """Round to nearest even (ties both ways, carries into the exponent), inf, NaN."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x3FFFFFFF, 0x00008001], dtype=torch.int32)
    x = torch.cat([bits.view(F32), torch.tensor([float("inf"), float("-inf"), float("nan"), -1e-40])])
    check(*run(build(nv.CastOp, [((10,), F32)], hint=((10,), BF16)), [x]), exact=True)


@pytest.mark.parametrize(
    "value,dtype,shape",
    [(1.5, F32, (3, 5)), (0.1, F64, (7,)), (float("-inf"), BF16, (2, 3)), (-3.7, I64, (4,)), (0.5, BOOL, (3,)),
     (2.25, F32, ())],
)  # fmt: skip
def test_full(value, dtype, shape):
    op = build(nv.FullOp, [], {"value": value}, (shape, dtype))
    out = lowering_for(op)(op, None).launch([], device="cpu")[0]
    check(out, IMPLS[nv.FullOp](op, [])[0], exact=True)


@pytest.mark.parametrize("dtype,start,step", [(I64, 3, -2), (F32, -5, 3), (BF16, 250, 1), (BOOL, -2, 1)])
def test_arange(dtype, start, step):
    op = build(nv.ArangeOp, [], {"start": start, "step": step}, ((37,), dtype))
    out = lowering_for(op)(op, None).launch([], device="cpu")[0]
    check(out, IMPLS[nv.ArangeOp](op, [])[0], exact=True)


@pytest.mark.parametrize("p,dtype,seed", [(0.1, F32, 7), (0.5, BF16, -123456789012), (0.9, F64, 2**40 + 5), (0.0, F32, 1)])
def test_dropout_mask_bit_exact(p, dtype, seed):
    op = build(nv.DropoutMaskOp, [((), I64)], {"p": p, "salt": 977}, ((5, 67), dtype))
    out, ref = run(op, [torch.tensor(seed)])
    check(out, ref, exact=True)
    if p:
        assert 0 < int((out == 0).sum()) < out.numel()


# --------------------------------------------------------------------------- data movement


def test_broadcast_to_from_view():
    x = transposed((3, 1, 4), seed=13)
    check(*run(build(nv.BroadcastToOp, [((3, 1, 4), F32)], hint=((2, 3, 5, 4), F32)), [x]), exact=True)


def test_transpose_rank4_of_a_view():
    x = transposed((2, 3, 4, 5), BF16, seed=14)
    op = build(nv.TransposeOp, [((2, 3, 4, 5), BF16)], {"perm": (2, 0, 3, 1)})
    check(*run(op, [x]), exact=True)


def test_reshape_of_noncontiguous():
    x = transposed((2, 3, 4), F64, seed=15)
    check(*run(build(nv.ReshapeOp, [((2, 3, 4), F64)], hint=((4, 6), F64)), [x]), exact=True)


@pytest.mark.parametrize("dim,start,end,step", [(1, 1, 7, 2), (0, 2, 3, 1), (2, 0, 5, 3)])
def test_slice(dim, start, end, step):
    x = transposed((4, 7, 5), seed=16)
    op = build(nv.SliceOp, [((4, 7, 5), F32)], {"dim": dim, "start": start, "end": end, "step": step})
    check(*run(op, [x]), exact=True)


@pytest.mark.parametrize(
    "dim,start,step,size,shape", [(1, 2, 1, 9, (3, 4, 2)), (0, 1, 3, 8, (3, 4, 2)), (2, 3, 2, 6, (3, 4, 1))]
)
def test_pad(dim, start, step, size, shape):
    x = transposed(shape, seed=17)
    op = build(nv.PadOp, [(shape, F32)], {"dim": dim, "start": start, "step": step, "size": size})
    out, ref = run(op, [x])
    check(out, ref, exact=True)


def test_copy_kernel_and_int64_indexing(monkeypatch):
    """copy_kernel reads any view; IDX64 (forced here by lowering the threshold) gives the same result."""
    base = rand((5, 9, 4), seed=18)
    view = base.permute(2, 0, 1)[1:, ::2, 3:]
    kernel = ew.copy_kernel(tuple(view.shape), F32)
    check(kernel.launch([view])[0], view.contiguous(), exact=True)
    monkeypatch.setattr(ew, "INT32_MAX", 8)
    check(kernel.launch([view])[0], view.contiguous(), exact=True)
    op = build(nv.AddOp, [((3, 5), F32), ((5,), F32)])
    check(*run(op, [rand((3, 5), seed=19), rand((5,), seed=20)], LoweringConfig(kind="elementwise", block=16, num_warps=1)))


def test_dense_flag_and_config_block():
    """Contiguous operands take the DENSE path; a small cfg.block means many programs."""
    cfg = LoweringConfig(kind="elementwise", block=32, num_warps=1)
    a, b = rand((7, 11), seed=21), rand((7, 11), seed=22)
    op = build(nv.SubOp, [((7, 11), F32), ((7, 11), F32)])
    kernel = lowering_for(op)(op, cfg)
    assert "DENSE0" in kernel.source and "tl.arange(0, 32)" in kernel.source
    torch.testing.assert_close(kernel.launch([a, b])[0], a - b, rtol=0, atol=0)


COVERED = [
    *BINARY, *COMPARES, nv.WhereOp, *UNARY, nv.GeluOp, nv.GeluBackwardOp, nv.CastOp, nv.FullOp, nv.ArangeOp,
    nv.DropoutMaskOp, nv.BroadcastToOp, nv.TransposeOp, nv.ReshapeOp, nv.SliceOp, nv.PadOp,
]  # fmt: skip


def test_every_elementwise_op_is_registered():
    missing = [c.name for c in COVERED if LOWERINGS.get(c) is None]
    assert not missing, missing


def test_float_only_ops_reject_integers():
    op = build(nv.EqOp, [((3,), I64), ((3,), I64)])  # fine: compares take any type
    lowering_for(op)(op, None)
    lowering_for(build(nv.AddOp, [((3,), I64), ((3,), I64)]))  # fine: integer arithmetic
    for cls in (nv.DivOp, nv.PowOp, nv.CosOp, nv.ExpOp):
        with pytest.raises(ew.UnsupportedError, match=cls.name):
            ew.lower_elementwise(_fake_on_ints(cls), None)


def _fake_on_ints(cls):
    """``cls`` over i64 (the dialect forbids it; the lowering must refuse it, not miscompute)."""
    from xdsl.dialects.builtin import i64

    binary = issubclass(cls, nv.BinaryOp)
    slots = [Slot("batch", n, tensor((3,), i64)) for n in ("ab" if binary else "a")]
    _, fn = new_step(slots)
    return cls.create(operands=list(fn.body.block.args), result_types=[tensor((3,), i64)])
