"""nova.count_out_of_range and nova.count_nonfinite: the reference against torch,
the Triton lowering (interpreted on the CPU) against the reference, through
strided views, several programs, and given outputs that are views."""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32, f64, i64

from nova.backends.reference import run_function
from nova.codegen.triton.checks import lower_count
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, set_results
from nova.ir.types import from_torch_dtype, tensor
from nova.schedule.config import LoweringConfig

SMALL = LoweringConfig(kind="elementwise", block=16, num_warps=1)  # several programs on small inputs


def _count_op(cls, x: torch.Tensor, props: dict | None = None):
    module, fn = new_step([Slot("batch", "x", tensor(list(x.shape), from_torch_dtype(x.dtype)))])
    op = OpBuilder(fn.body.block).create(cls, [fn.body.block.args[0]], props)
    set_results(fn, [("status", "n", op.results[0])])
    module.verify()
    return op, fn


def _ids(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-4, 24, shape, generator=g)
    ids.view(-1)[::5] = -100
    return ids


@pytest.mark.parametrize("ignore", [None, -100])
def test_count_out_of_range_reference(ignore):
    ids = _ids((7, 9))
    props = {"low": 0, "high": 20} | ({} if ignore is None else {"ignore": ignore})
    op, fn = _count_op(nv.CountOutOfRangeOp, ids, props)
    bad = (ids < 0) | (ids >= 20)
    if ignore is not None:
        bad &= ids != ignore
    (got,) = run_function(fn, [ids])
    assert got.dtype == torch.int64 and got.shape == () and got.item() == int(bad.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_count_nonfinite_reference(dtype):
    x = torch.randn(5, 33).to(dtype)
    x[0, 1], x[3, 4], x[4, 32] = float("nan"), float("inf"), -float("inf")
    op, fn = _count_op(nv.CountNonfiniteOp, x)
    (got,) = run_function(fn, [x])
    assert got.item() == int((~torch.isfinite(x)).sum()) == 3


def test_verifiers():
    module, fn = new_step([Slot("batch", "x", tensor([3], f32)), Slot("batch", "i", tensor([3], i64))])
    b = OpBuilder(fn.body.block)
    x, i = fn.body.block.args
    with pytest.raises(Exception, match="integer"):
        b.create(nv.CountOutOfRangeOp, [x], {"low": 0, "high": 3})
    with pytest.raises(Exception, match="empty range"):
        b.create(nv.CountOutOfRangeOp, [i], {"low": 4, "high": 3})
    with pytest.raises(Exception, match="floating-point"):
        b.create(nv.CountNonfiniteOp, [i])
    for e in (f64, bf16):
        assert str(b.create(nv.CountNonfiniteOp, [b.cast(x, e)]).results[0].type) == "tensor<i64>"


def _cases():
    ids = _ids((6, 11), seed=1)
    x = torch.randn(8, 40)
    x.view(-1)[::7] = float("nan")
    x[2, 3] = float("inf")
    return [
        ("ids", nv.CountOutOfRangeOp, ids, {"low": 0, "high": 20, "ignore": -100}),
        ("ids-no-ignore", nv.CountOutOfRangeOp, ids, {"low": 0, "high": 20}),
        ("ids-transposed", nv.CountOutOfRangeOp, ids.t(), {"low": 0, "high": 20}),
        ("f32", nv.CountNonfiniteOp, x, None),
        ("f32-transposed", nv.CountNonfiniteOp, x.t(), None),
        ("f32-broadcast", nv.CountNonfiniteOp, x[:1].expand(5, 40), None),
        ("f32-slice", nv.CountNonfiniteOp, x[1:7:2, 3:], None),
        ("bf16", nv.CountNonfiniteOp, x.bfloat16(), None),
        ("f64", nv.CountNonfiniteOp, x.double(), None),
        ("0-d", nv.CountNonfiniteOp, torch.tensor(float("-inf")), None),
        ("empty", nv.CountNonfiniteOp, torch.randn(0, 3), None),
    ]


@pytest.mark.parametrize("cfg", [None, SMALL], ids=["default", "many-programs"])
@pytest.mark.parametrize("name, cls, x, props", _cases(), ids=[c[0] for c in _cases()])
def test_triton_matches_reference(name, cls, x, props, cfg, device):
    x = x.to(device)
    op, fn = _count_op(cls, x.contiguous(), props)
    (want,) = run_function(fn, [x.cpu()])
    kernel = lower_count(op, cfg)
    assert kernel.needs_contiguous == () and "@triton.jit" in kernel.source
    (got,) = kernel.launch([x])
    assert got.dtype == torch.int64 and got.shape == () and got.item() == want.item()
    # into a given output: a 0-d view inside a larger buffer, nothing else touched
    arena = torch.full((5,), -7, dtype=torch.int64, device=device)
    (into,) = kernel.launch([x], outs=[arena[3]])
    assert into.data_ptr() == arena[3].data_ptr()
    assert arena.tolist() == [-7, -7, -7, want.item(), -7]
    programs = kernel.extra["programs"]
    assert kernel.scratch_bytes == (0 if programs == 1 else 8 * programs)
    if cfg is SMALL and x.numel() > 16:
        assert programs > 1


def test_the_range_is_in_the_kernel_name():
    ids = _ids((4,))
    a, _ = _count_op(nv.CountOutOfRangeOp, ids, {"low": 0, "high": 20})
    b, _ = _count_op(nv.CountOutOfRangeOp, ids, {"low": 0, "high": 20, "ignore": -100})
    assert lower_count(a).name != lower_count(b).name
