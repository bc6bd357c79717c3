"""The generated embedding gather / scatter-add kernels against the reference
executor, through the Triton interpreter; out-of-range ids touch no memory (the
gather writes zeros for them, the scatter-add adds nothing)."""

from __future__ import annotations

import pytest
import torch

from nova.backends.reference import IMPLS
from nova.codegen.triton import embedding as em
from nova.codegen.triton.lowering import LOWERINGS, lowering_for
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import from_torch_dtype, tensor
from nova.schedule.config import LoweringConfig

F32, F64, BF16, F16, I64, BOOL = torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool


def build(cls, ins, props=None):
    slots = [Slot("batch", f"x{i}", tensor(s, from_torch_dtype(d))) for i, (s, d) in enumerate(ins)]
    _, fn = new_step(slots)
    return OpBuilder(fn.body.block).create(cls, list(fn.body.block.args), props)


def nonzero(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(shape, generator=g, dtype=F64)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    return (sign * (0.5 + u)).to(dtype)


def ids_of(shape, high, seed):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=str)
def test_embedding_gather(dtype):
    """A transposed (strided) weight: rows are gathered through its strides, exactly."""
    V, D = 13, 10
    w = nonzero((D, V), dtype, 1).t()
    ids = ids_of((3, 5), V, 2)
    op = build(nv.EmbeddingOp, [((V, D), dtype), ((3, 5), I64)])
    kernel = lowering_for(op)(op, LoweringConfig(kind="elementwise", block=4, num_warps=1))  # 3 D tiles
    assert kernel.needs_contiguous == (1,)
    out = kernel.launch([w, ids])[0]
    torch.testing.assert_close(out, IMPLS[nv.EmbeddingOp](op, [w, ids])[0], rtol=0, atol=0)


def table_of(shape, dtype, seed):
    """A table whose values are distinct and survive no conversion they should not
    (i64 beyond 2**53, NaN and -0.0 in float tables, both bool values)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == I64:
        return torch.randint(-(2**62), 2**62, shape, generator=g)
    if dtype == BOOL:
        return torch.rand(shape, generator=g) < 0.5
    t = nonzero(shape, dtype, seed)
    t.view(-1)[0], t.view(-1)[1] = float("nan"), -0.0
    return t


@pytest.mark.parametrize("dtype", [F32, F64, BF16, F16, I64, BOOL], ids=str)
@pytest.mark.parametrize("table", [(11, 1), (11, 3)], ids=["Nx1", "NxC"])
def test_embedding_any_table_dtype(dtype, table):
    """Integer and bool tables (gathers and advanced indexing of index tensors are
    captured as embedding on [N, 1] or [N, C]) move bit for bit; padding_idx does
    not change the forward."""
    w = table_of(table, dtype, 11)
    ids = ids_of((2, 6), table[0], 12)
    for pad in (-1, 4):
        op = build(nv.EmbeddingOp, [(table, dtype), ((2, 6), I64)], {"padding_idx": pad})
        out = lowering_for(op)(op, None).launch([w, ids])[0]
        ref = IMPLS[nv.EmbeddingOp](op, [w, ids])[0]
        assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))  # bits, NaN and -0.0 included


@pytest.mark.parametrize("dtype", [I64, BOOL], ids=str)
def test_embedding_marker_id_gathers_zeros(dtype):
    """-1 (the out-of-range marker of a captured gather) reads nothing: its row is zeros."""
    w = table_of((7, 2), dtype, 13)
    op = build(nv.EmbeddingOp, [((7, 2), dtype), ((3,), I64)])
    out = lowering_for(op)(op, None).launch([w, torch.tensor([3, -1, 0])])[0]
    assert torch.equal(out[0], w[3]) and torch.equal(out[2], w[0]) and not out[1].any()


@pytest.mark.parametrize("dtype,pad", [(F32, -1), (F64, 3), (BF16, 0)], ids=str)
def test_embedding_backward(dtype, pad):
    """Scatter-add with repeated ids (atomics into an fp32 / fp64 table); padding row zero."""
    V, D = 9, 6
    g = nonzero((4, 5, D), dtype, 3)
    ids = ids_of((4, 5), V, 4)
    ids[0, :3] = 3  # repeats, and the padding id when pad == 3
    op = build(nv.EmbeddingBackwardOp, [((4, 5, D), dtype), ((4, 5), I64)], {"num_embeddings": V, "padding_idx": pad})
    kernel = lowering_for(op)(op, None)
    assert kernel.needs_contiguous == (0, 1)
    out = kernel.launch([g, ids])[0]
    if dtype == BF16:  # the reference adds in bf16 one by one; we add in fp32 and round once
        ref = IMPLS[nv.EmbeddingBackwardOp](op, [g.float(), ids])[0].to(BF16)
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)
    else:
        ref = IMPLS[nv.EmbeddingBackwardOp](op, [g, ids])[0]
        eps = 1e-6 if dtype == F32 else 1e-13
        torch.testing.assert_close(out, ref, rtol=eps, atol=eps)
    assert out.dtype == dtype and out.shape == (V, D)
    if pad >= 0:
        assert not out[pad].any()


BAD_IDS = [-1, -2, 13, 14, -(2**40), 2**40]  # just outside the table, and far outside


def fenced(shape, dtype, fence=2):
    """A view of ``shape`` inside NaN rows (``fence`` before and after it): what a
    kernel reads or writes one row out of bounds shows there."""
    rows, d = shape
    buf = torch.full((rows + 2 * fence, d), float("nan"), dtype=dtype)
    return buf, buf[fence : fence + rows]


def test_out_of_range_ids_read_nothing():
    """The gather: every bad id's row is zeros (no NaN from the fence around the
    table), every other row is the table's."""
    V, D = 13, 4
    _, w = fenced((V, D), F32)
    w.copy_(nonzero((V, D), F32, 5))
    ids = ids_of((2, 7), V, 6)
    ids.view(-1)[: len(BAD_IDS)] = torch.tensor(BAD_IDS)
    op = build(nv.EmbeddingOp, [((V, D), F32), ((2, 7), I64)])
    out = lowering_for(op)(op, None).launch([w, ids])[0]
    bad = (ids < 0) | (ids >= V)
    assert not out[bad].any()
    assert torch.equal(out[~bad], w[ids[~bad]])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_out_of_range_ids_add_nothing(dtype):
    """The scatter-add: bad ids (and padding_idx) add nothing; the result's fence
    stays NaN, so nothing was written out of bounds (for bf16 the fp32 table is
    scratch, and the result is written by the rounding cast)."""
    V, D, pad = 13, 4, 5
    g = nonzero((2, 7, D), dtype, 7)
    ids = ids_of((2, 7), V, 8)
    ids.view(-1)[: len(BAD_IDS)] = torch.tensor(BAD_IDS)
    ids[1, -1] = pad
    op = build(nv.EmbeddingBackwardOp, [((2, 7, D), dtype), ((2, 7), I64)], {"num_embeddings": V, "padding_idx": pad})
    buf, out = fenced((V, D), dtype)
    assert lowering_for(op)(op, None).launch([g, ids], [out])[0] is out
    keep = (ids >= 0) & (ids < V) & (ids != pad)
    expected = torch.zeros((V, D), dtype=F64).index_add_(0, ids[keep], g[keep].double()).to(dtype)
    torch.testing.assert_close(out, expected, rtol=2**-7 if dtype == BF16 else 1e-6, atol=0)
    assert torch.isnan(buf[:2]).all() and torch.isnan(buf[-2:]).all()


def test_registered():
    assert LOWERINGS[nv.EmbeddingOp] is em.lower_embedding
    assert LOWERINGS[nv.EmbeddingBackwardOp] is em.lower_embedding_backward
