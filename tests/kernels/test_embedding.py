"""The generated embedding gather / scatter-add kernels against the reference
executor, through the Triton interpreter; out-of-range ids raise IndexError."""

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
def test_embedding_marker_id_raises_like_the_reference(dtype):
    """-1 (the out-of-range marker of a captured gather) raises the reference's
    IndexError, naming the op and the range, and nothing is read out of bounds."""
    w = table_of((7, 2), dtype, 13)
    ids = torch.tensor([3, -1, 0])
    op = build(nv.EmbeddingOp, [((7, 2), dtype), ((3,), I64)])
    message = r"nova\.embedding: index out of range \[0, 7\) \(min -1"
    with pytest.raises(IndexError, match=message):
        IMPLS[nv.EmbeddingOp](op, [w, ids])
    kernel = lowering_for(op)(op, None)
    with pytest.raises(IndexError, match=message):
        kernel.launch([w, ids])
    outs, flags = kernel.extra["launch_unchecked"]([w, ids])
    assert torch.equal(outs[0][0], w[3]) and not outs[0][1].any()  # the bad row reads nothing: zeros
    assert flags.tolist()[0] == -1


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


@pytest.mark.parametrize("bad,message", [(-2, r"min -2\)"), (13, r"max 13\)"), (None, r"min -1, max 20\)")])
def test_out_of_range_ids_raise(bad, message):
    V, D = 13, 4
    w = nonzero((V, D), F32, 5)
    ids = ids_of((2, 7), V, 6)
    if bad is None:
        ids[0, 0], ids[1, 6] = -1, 20
    else:
        ids[1, 3] = bad
    op = build(nv.EmbeddingOp, [((V, D), F32), ((2, 7), I64)])
    kernel = lowering_for(op)(op, None)
    with pytest.raises(IndexError, match=r"nova\.embedding: index out of range \[0, 13\) \(" + message):
        kernel.launch([w, ids])
    outs, flags = kernel.extra["launch_unchecked"]([w, ids])  # deferred: no sync, nothing read out of bounds
    assert torch.isfinite(outs[0]).all()
    with pytest.raises(IndexError, match="nova.embedding"):
        kernel.extra["check"](flags)

    g = nonzero((2, 7, D), F32, 7)
    op = build(nv.EmbeddingBackwardOp, [((2, 7, D), F32), ((2, 7), I64)], {"num_embeddings": V, "padding_idx": -1})
    with pytest.raises(IndexError, match=r"nova\.embedding_backward: index out of range \[0, 13\)"):
        lowering_for(op)(op, None).launch([g, ids])


def test_in_range_ids_flags_stay_zero():
    V, D = 5, 3
    op = build(nv.EmbeddingOp, [((V, D), F32), ((4,), I64)])
    kernel = lowering_for(op)(op, None)
    _, flags = kernel.extra["launch_unchecked"]([nonzero((V, D), F32, 8), torch.tensor([0, 4, 2, 4])])
    assert flags.tolist() == [0, 0]


def test_registered():
    assert LOWERINGS[nv.EmbeddingOp] is em.lower_embedding
    assert LOWERINGS[nv.EmbeddingBackwardOp] is em.lower_embedding_backward
