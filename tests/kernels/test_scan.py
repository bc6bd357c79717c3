"""The generated cumsum kernel against the reference executor, through the Triton
interpreter on the CPU (compiled on a GPU): every dim, forward and reverse,
strided views read in place, rows longer than one chunk (a carry across chunks),
floats within the float tolerance and i64 exactly."""

from __future__ import annotations

import pytest
import torch

from nova.backends.reference import IMPLS
from nova.codegen.triton import scan
from nova.codegen.triton.lowering import LOWERINGS, lowering_for
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import from_torch_dtype, tensor
from nova.schedule.config import LoweringConfig

F32, F64, BF16, F16, I64 = torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64
# a sum of n terms of |x| <= 1.5: the reference and the kernel add in other orders
TOL = {F32: (1e-5, 1e-5), F64: (1e-12, 1e-12), BF16: (2**-7, 2**-6), F16: (2**-10, 2**-8)}
CHUNK = LoweringConfig(kind="reduction", block=4, block_m=2, num_warps=1)  # chunks of 4 columns, 2 rows a program


def build(shape, dtype, dim, reverse):
    _, fn = new_step([Slot("batch", "x", tensor(shape, from_torch_dtype(dtype)))])
    return OpBuilder(fn.body.block).create(nv.CumsumOp, list(fn.body.block.args), {"dim": dim, "reverse": reverse})


def values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == I64:  # past 2**53: a float path would round them
        return torch.randint(-(2**55), 2**55, shape, generator=g)
    u = torch.rand(shape, generator=g, dtype=F64)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    return (sign * (0.5 + u)).to(dtype)


def check(op, x, cfg=None):
    kernel = lowering_for(op)(op, cfg)
    out = kernel.launch([x])[0]
    ref = IMPLS[nv.CumsumOp](op, [x.clone()])[0]
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    if x.dtype == I64:
        assert torch.equal(out, ref)
    else:
        rtol, atol = TOL[x.dtype]
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    return kernel


@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16, I64], ids=str)
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("cfg", [None, CHUNK], ids=["one-chunk", "carry"])
def test_cumsum_every_dim(dtype, reverse, cfg):
    """[3, 11, 5]: each dim in turn (dim 1 has 11 = 2 chunks of 4 and a ragged one)."""
    x = values((3, 11, 5), dtype, 1)
    for dim in range(3):
        kernel = check(build((3, 11, 5), dtype, dim, reverse), x, cfg)
        if cfg is CHUNK and dim == 1:
            assert kernel.extra["looping"]


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_cumsum_strided_views(reverse):
    """A transposed view and a sliced, offset view: read through their strides."""
    base = values((9, 13), F32, 2)
    check(build((13, 9), F32, 0, reverse), base.t(), CHUNK)
    view = base[1::2, 3:12]  # [4, 9], strides (26, 1), storage offset
    check(build((4, 9), F32, 1, reverse), view, CHUNK)
    ids = values((6, 7), I64, 3).t()
    check(build((7, 6), I64, 1, reverse), ids, CHUNK)


def test_cumsum_position_ids_from_a_mask():
    """The capture's position ids from an attention mask: cumsum of an i64 0/1 mask."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    op = build((2, 6), I64, 1, False)
    out = lowering_for(op)(op, None).launch([mask])[0]
    assert out.tolist() == [[0, 0, 1, 2, 3, 4], [1, 2, 3, 4, 5, 5]]


def test_cumsum_long_row_default_plan_and_nonfinite():
    """A row of 5000 (> SCAN_BLOCK: the default plan loops), and inf / NaN carried on."""
    x = values((2, 5000), F32, 4)
    x[1, 10] = float("inf")
    x[1, 3000] = float("nan")
    op = build((2, 5000), F32, 1, False)
    out = lowering_for(op)(op, None).launch([x])[0]
    ref = IMPLS[nv.CumsumOp](op, [x])[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-3, equal_nan=True)
    assert torch.isinf(out[1, 10:3000]).all() and torch.isnan(out[1, 3000:]).all()


def test_cumsum_scalar_and_empty():
    op = build((), F32, 0, True)
    x = torch.tensor(2.5)
    assert lowering_for(op)(op, None).launch([x])[0].item() == 2.5
    op = build((0, 3), F32, 1, False)
    assert lowering_for(op)(op, None).launch([torch.empty(0, 3)])[0].shape == (0, 3)


def test_cumsum_refuses_a_bad_block():
    op = build((3, 4), F32, 1, False)
    with pytest.raises(ValueError, match="power of two"):
        lowering_for(op)(op, LoweringConfig(kind="reduction", block=12))


def test_registered():
    assert LOWERINGS[nv.CumsumOp] is scan.lower_cumsum


def sm90_cases():
    cases = []
    for shape, dtype, dim, reverse in [((4, 5000), F32, 1, True), ((64, 8), I64, 0, False), ((3, 100), BF16, 1, False)]:
        op = build(shape, dtype, dim, reverse)
        cases.append((lambda op=op: lowering_for(op)(op, None), [torch.empty(shape, dtype=dtype)]))
    return cases


def test_kernels_build_for_sm90():
    """The generated text compiles to sm_90 cubins, i64 and looping scans included (no GPU needed)."""
    from test_rowwise import run_sm90_build

    assert run_sm90_build(__file__).split().count("nova_cumsum_4x5000_dim1_rev_f32") == 1


if __name__ == "__main__":
    from test_rowwise import build_for_sm90

    print(" ".join(build_for_sm90(sm90_cases())))
