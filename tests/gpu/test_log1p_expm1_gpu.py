"""nova.log1p and nova.expm1 on the GPU (tests/kernels/test_elementwise.py under the
interpreter): the generated kernels against torch's log1p / expm1 on CUDA, near 0, at the
edges (-1, overflow, +-inf, NaN) and over a wide range, fp32 and fp64, within a few ulp."""

from __future__ import annotations

import pytest
import torch

from nova.codegen.triton import elementwise  # noqa: F401 (registers the elementwise lowerings)
from nova.codegen.triton.lowering import lowering_for
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import from_torch_dtype, tensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("cls", [nv.Log1pOp, nv.Expm1Op], ids=lambda c: c.name)
def test_log1p_expm1_on_the_gpu_are_torchs(cls, dtype):
    g = torch.Generator().manual_seed(31)
    tiny = torch.logspace(-30, -1, 200, dtype=torch.float64) * torch.where(
        torch.rand(200, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    wide = (torch.rand(2000, generator=g, dtype=torch.float64) - 0.5) * 60
    edges = torch.tensor([0.0, -0.0, -1.0, -0.999999, 88.0, 89.0, 700.0, 710.0, 1e30, -1e30, float("inf"),
                          float("-inf"), float("nan")], dtype=torch.float64)  # fmt: skip
    x = torch.cat([tiny, wide, edges]).to(dtype)
    if cls is nv.Log1pOp:
        x = torch.where(x < -1, -x, x)  # and one value past -1: NaN
        x = torch.cat([x, torch.tensor([-2.0], dtype=dtype)])
    _, fn = new_step([Slot("batch", "x", tensor((x.numel(),), from_torch_dtype(dtype)))])
    op = OpBuilder(fn.body.block).create(cls, list(fn.body.block.args))
    (out,) = lowering_for(op)(op, None).launch([x.cuda()])
    want = (torch.log1p if cls is nv.Log1pOp else torch.expm1)(x.cuda())
    torch.testing.assert_close(out, want, equal_nan=True, rtol=4 * torch.finfo(dtype).eps, atol=0.0)
