"""The generated reduce_sum / reduce_max kernels against the reference executor,
through the Triton interpreter: inner and outer reductions, several dims,
keepdim, strided inputs, the two-pass split, int64 indexing and NaN."""

from __future__ import annotations

import pytest
import torch

from nova.backends.reference import IMPLS
from nova.codegen.triton import reduce as rd
from nova.codegen.triton.elementwise import UnsupportedError
from nova.codegen.triton.lowering import LOWERINGS, lowering_for
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import from_torch_dtype, tensor
from nova.schedule.config import LoweringConfig

# the interpreter's range() over a 0-d array (triton's own code) warns under numpy >= 1.25
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

F32, F64, BF16, I64 = torch.float32, torch.float64, torch.bfloat16, torch.int64


def build(cls, shape, dtype, dims, keepdim):
    _, fn = new_step([Slot("batch", "x", tensor(shape, from_torch_dtype(dtype)))])
    return OpBuilder(fn.body.block).create(cls, list(fn.body.block.args), {"dims": tuple(dims), "keepdim": keepdim})


def draw(shape, dtype, seed=0):
    """Nonzero values of both signs; a transposed (non-contiguous) view when rank >= 2."""
    g = torch.Generator().manual_seed(seed)
    flip = (*shape[:-2], shape[-1], shape[-2]) if len(shape) >= 2 else shape
    u = torch.rand(flip, generator=g, dtype=F64)
    sign = torch.where(torch.rand(flip, generator=g) < 0.5, -1.0, 1.0).double()
    x = sign * (0.5 + u) * (50 if dtype == I64 else 1)
    x = x.to(dtype)
    return x.transpose(-1, -2) if len(shape) >= 2 else x


def check(out, ref, x):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    if ref.dtype == I64:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    elif ref.dtype == BF16:  # both accumulate in fp32 and round once: within one bf16 ulp
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=0, equal_nan=True)
    else:  # summation order differs: scale the tolerance by the sum of magnitudes
        eps = 1e-6 if ref.dtype == F32 else 1e-13
        scale = float(x.abs().double().nan_to_num(0.0, 0.0, 0.0).sum()) / max(1, ref.numel())
        torch.testing.assert_close(out, ref, rtol=eps, atol=eps * scale, equal_nan=True)


def run(cls, x, dims, keepdim, cfg=None):
    op = build(cls, tuple(x.shape), x.dtype, dims, keepdim)
    kernel = lowering_for(op)(op, cfg)
    out = kernel.launch([x])[0]
    assert out.is_contiguous()
    check(out, IMPLS[type(op)](op, [x])[0], x)
    return kernel


CASES = [  # shape, dims, keepdim
    ((4, 5, 6), (2,), False),  # inner: the contiguous (in the view: last) dim
    ((4, 5, 6), (0,), True),  # outer
    ((4, 5, 6), (0, 2), False),  # mixed, two dims
    ((3, 4, 5, 2), (1, 3), True),
    ((7, 33), (0, 1), False),  # everything: a 0-d result
    ((37,), (0,), True),
]


@pytest.mark.parametrize("dtype", [F32, F64, BF16, I64], ids=str)
@pytest.mark.parametrize("cls", [nv.ReduceSumOp, nv.ReduceMaxOp], ids=lambda c: c.name)
def test_reduce(cls, dtype):
    for i, (shape, dims, keepdim) in enumerate(CASES):
        run(cls, draw(shape, dtype, seed=i), dims, keepdim)


@pytest.mark.parametrize("cls", [nv.ReduceSumOp, nv.ReduceMaxOp], ids=lambda c: c.name)
@pytest.mark.parametrize("shape,dims", [((600, 5), (0,)), ((5, 70), (1,)), ((6, 5, 7), (0, 2))])
def test_split_reduction(cls, shape, dims):
    """The two-pass split (forced by the config): partials in an fp32 workspace."""
    cfg = LoweringConfig(kind="reduction", block=8, split_k=3, num_warps=1)
    for dtype in (F32, BF16):
        x = draw(shape, dtype, seed=3)
        assert run(cls, x, dims, False, cfg).extra["split"] == 3


def test_default_plan_splits_tall_outer_reductions():
    """A bias gradient [65536, 768] summed over tokens: 6 row programs alone would idle the GPU."""
    p = rd.plan((65536, 768), (0,), None)
    assert not p.inner and p.split > 1 and -(-p.R // p.block_r) * p.split >= rd.TARGET_PROGRAMS
    p = rd.plan((8192, 768), (1,), None)  # a row sum: plenty of rows, one pass
    assert p.inner and p.split == 1 and p.block_c == 1024


@pytest.mark.parametrize("cls", [nv.ReduceSumOp, nv.ReduceMaxOp], ids=lambda c: c.name)
def test_configured_column_reduction(cls):
    """The configure stage's schedule for an outer (bias-gradient) reduction runs as
    the split it declares and matches the reference."""
    from nova.schedule.devices import DEVICES
    from nova.transforms.configure import configure_op

    x = draw((2, 160, 48), F32).contiguous()
    op = build(cls, tuple(x.shape), F32, (0, 1), False)
    cfg = LoweringConfig.from_dict(dict(configure_op(op, DEVICES["H200"], "fp32").to_dict()))
    assert cfg.split_k > 1 and cfg.block == 64
    assert run(cls, x, (0, 1), False, cfg).extra["split"] == rd.plan(x.shape, (0, 1), cfg).split > 1


@pytest.mark.parametrize("cls", [nv.ReduceSumOp, nv.ReduceMaxOp], ids=lambda c: c.name)
def test_pipelined_column_loop_sums_the_same_chunks(cls, monkeypatch):
    """COLUMN_STAGES > 1 (off as shipped, for a device A/B): a column reduction's chunk
    loop as tl.range(num_stages=...), the same chunks in the same order: bit for bit the
    plain loop's result; a row reduction's loop is left as it is."""
    x = draw((600, 40), F32, seed=9).contiguous()
    cfg = LoweringConfig(kind="reduction", block=8, split_k=3, num_warps=1)
    plain = run(cls, x, (0,), False, cfg).launch([x])[0]
    monkeypatch.setattr(rd, "COLUMN_STAGES", 3)
    kernel = run(cls, x, (0,), False, cfg)
    assert "num_stages=3" in kernel.source
    assert torch.equal(kernel.launch([x])[0], plain)
    assert "num_stages" not in run(cls, x, (1,), False).source  # inner: unchanged


def test_reduce_max_nan_and_inf():
    x = draw((4, 6), F32, seed=4).contiguous()
    x[1, 2] = float("nan")
    x[2, :] = float("-inf")
    run(nv.ReduceMaxOp, x, (1,), False)
    run(nv.ReduceMaxOp, x, (0,), True)


def test_expanded_input_and_int64_indexing(monkeypatch):
    """A stride-0 (expanded) input, with int64 index math forced on."""
    x = draw((5,), F32, seed=5).expand(3, 5)
    run(nv.ReduceSumOp, x, (0,), False)
    monkeypatch.setattr(rd, "INT32_MAX", 4)
    run(nv.ReduceSumOp, draw((4, 6), F32, seed=6), (1,), False)
    run(nv.ReduceMaxOp, draw((6, 5, 7), F32, seed=7), (0, 2), False, LoweringConfig(kind="reduction", block=8, split_k=2))


def test_no_dims_is_a_copy():
    x = draw((3, 4), F32, seed=8)
    kernel = run(nv.ReduceSumOp, x, (), False)
    assert "copy" in kernel.name


def test_unsupported():
    with pytest.raises(UnsupportedError, match="reduce_max: cannot reduce over zero elements"):
        rd.reduction("max", (3, 0), (1,), False, F32)
    with pytest.raises(UnsupportedError, match="cannot reduce torch.bool"):
        rd.reduction("sum", (3, 4), (1,), False, torch.bool)


def test_registered():
    assert LOWERINGS[nv.ReduceSumOp] is rd.lower_reduce and LOWERINGS[nv.ReduceMaxOp] is rd.lower_reduce
