"""The generated embedding gather / scatter-add kernels against the reference
executor, through the Triton interpreter; out-of-range ids touch no memory (the
gather writes zeros for them, the scatter-add adds nothing). The scatter-add is
deterministic: each row is its grad rows summed one by one in token order (bit
for bit, whatever the tiling), within rounding of the float64 scatter-add."""

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
    """Scatter-add with repeated ids (summed in fp32 / fp64, rounded once); padding row zero."""
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


@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=str)
def test_out_of_range_ids_add_nothing(dtype):
    """The scatter-add: bad ids (and padding_idx) add nothing; the result's fence
    stays NaN, so nothing was written out of bounds."""
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
    torch.testing.assert_close(out, expected, rtol=2**-7 if dtype == BF16 else 2**-10 if dtype == F16 else 1e-6, atol=0)
    assert torch.isnan(buf[:2]).all() and torch.isnan(buf[-2:]).all()


# --------------------------------------------------------------------------- deterministic scatter-add

ACC = {F32: F32, BF16: F32, F16: F32, F64: F64}  # the accumulator of each grad dtype


def bits(t):
    return t.reshape(-1).view(torch.uint8)


def backward_kernel(g, ids, V, pad=-1, cfg=None):
    op = build(nv.EmbeddingBackwardOp, [(tuple(g.shape), g.dtype), (tuple(ids.shape), I64)],
               {"num_embeddings": V, "padding_idx": pad})  # fmt: skip
    return lowering_for(op)(op, cfg)


def token_order_sum(g, ids, V, pad=-1):
    """Each row: its grad rows added one at a time in token order, in the
    accumulator dtype (from +0.0), then rounded once; bad ids and pad add nothing."""
    flat, rows = ids.reshape(-1).tolist(), g.reshape(len(ids.reshape(-1)), -1)
    acc = torch.zeros((V, rows.shape[1]), dtype=ACC[g.dtype])
    for t, r in enumerate(flat):
        if 0 <= r < V and r != pad:
            acc[r] = acc[r] + rows[t].to(acc.dtype)
    return acc.to(g.dtype)


def f64_scatter_add(g, ids, V, pad=-1):
    """(the float64 scatter-add, the bound on our error: the accumulator's rounding
    of each row's partial sums, plus one rounding to the grad's dtype)."""
    flat, rows = ids.reshape(-1), g.reshape(ids.numel(), -1).double()
    keep = (flat >= 0) & (flat < V) & (flat != pad)
    ref = torch.zeros((V, rows.shape[1]), dtype=F64).index_add_(0, flat[keep], rows[keep])
    mass = torch.zeros_like(ref).index_add_(0, flat[keep], rows[keep].abs())
    count = torch.zeros((V, 1), dtype=F64).index_add_(0, flat[keep], torch.ones((int(keep.sum()), 1), dtype=F64))
    u_acc, u_out = torch.finfo(ACC[g.dtype]).eps, torch.finfo(g.dtype).eps
    return ref, count * u_acc * mass + u_out * ref.abs()


def small_tiles(monkeypatch, block=8, positions=4):
    """A config of ``block`` columns and ``positions`` sorted positions per program
    (TILE is what bounds the positions), so that short runs cross block ends."""
    monkeypatch.setattr(em, "TILE", block * positions)
    return LoweringConfig(kind="elementwise", block=block, num_warps=1)


def long_runs(n, V, seed):
    """ids with runs longer than a block: few distinct values, one of them 3/8 of all."""
    ids = ids_of((n,), min(V, 5), seed)
    ids[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: 3 * n // 8]] = 2
    return ids


@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=str)
@pytest.mark.parametrize("ids_kind", ["long-runs", "one-id", "spread"])
def test_backward_is_the_token_order_sum_bit_for_bit(dtype, ids_kind, monkeypatch):
    """Every row is exactly the sequential sum of its grad rows in token order
    (so two launches give the same bits, and so does every tiling), and it is
    within rounding of the float64 scatter-add."""
    V, n, D = 11, 37, 20  # 3 column blocks of 8 (the last one partial), 10 position blocks of 4
    g = nonzero((n, D), dtype, 21)
    ids = {"long-runs": long_runs(n, V, 22), "one-id": torch.full((n,), 6), "spread": ids_of((n,), V, 23)}[ids_kind]
    expected = token_order_sum(g, ids, V)
    ref, bound = f64_scatter_add(g, ids, V)
    configs = (None, LoweringConfig(kind="elementwise", block=16, num_warps=2), lambda: small_tiles(monkeypatch))
    for make in configs:  # the default tiles (one position block), 16 columns, then 4 positions x 8 columns
        cfg = make() if callable(make) else make
        kernel = backward_kernel(g, ids, V, cfg=cfg)
        first, second = kernel.launch([g, ids])[0], kernel.launch([g, ids])[0]
        assert torch.equal(bits(first), bits(second))
        assert torch.equal(bits(first), bits(expected)), cfg
        assert ((first.double() - ref).abs() <= bound).all(), cfg
    hit = torch.zeros(V, dtype=torch.bool)
    hit[ids] = True
    assert not first[~hit].any()


def test_backward_sums_in_token_order_not_in_any_other():
    """One row, three fp32 values whose sum depends on the order: the kernel's is
    the token order's ((2**24 + 1) + 1 rounds to 2**24 twice; 1 + 1 + 2**24 does not)."""
    g = torch.tensor([[2.0**24], [1.0], [1.0]])
    kernel = backward_kernel(g, torch.tensor([0, 0, 0]), 1)
    assert kernel.launch([g, torch.tensor([0, 0, 0])])[0].item() == 2.0**24
    g = torch.tensor([[1.0], [1.0], [2.0**24]])
    assert kernel.launch([g, torch.tensor([0, 0, 0])])[0].item() == 2.0**24 + 2


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_backward_bad_ids_and_padding_in_long_runs(dtype, monkeypatch):
    """Bad ids and padding_idx in runs that cross block ends, beside a long run of a
    real row: they add nothing anywhere, the padding row stays zero, nothing is
    written outside the result (NaN fence), and the rest is the token-order sum."""
    V, n, D, pad = 13, 45, 10, 4
    g = nonzero((n, D), dtype, 31)
    ids = ids_of((n,), V, 32)
    ids[5:14] = pad
    ids[14:23] = torch.tensor(BAD_IDS + [-1, 2**40, V])
    ids[23:35] = 7
    ids[[0, 40, 44]] = -(2**40)
    cfg = small_tiles(monkeypatch)
    buf, out = fenced((V, D), dtype)
    assert backward_kernel(g, ids, V, pad, cfg).launch([g, ids], [out])[0] is out
    assert torch.isnan(buf[:2]).all() and torch.isnan(buf[-2:]).all()
    assert not out[pad].any()
    assert torch.equal(bits(out), bits(token_order_sum(g, ids, V, pad)))


def test_backward_with_no_ids_is_zero():
    g, ids = torch.empty((0, 5)), torch.empty((0,), dtype=I64)
    kernel = backward_kernel(g, ids, 6)
    assert kernel.scratch_bytes == 0
    out = torch.full((6, 5), float("nan"))
    assert kernel.launch([g, ids], [out])[0] is out and not out.any()


def test_backward_source_has_no_atomics():
    kernel = backward_kernel(nonzero((4, 3), F32, 1), ids_of((4,), 5, 2), 5)
    assert "atomic" not in kernel.source and "torch.sort" in kernel.source


def test_registered():
    assert LOWERINGS[nv.EmbeddingOp] is em.lower_embedding
    assert LOWERINGS[nv.EmbeddingBackwardOp] is em.lower_embedding_backward


@pytest.mark.parametrize("start,V", [(0, 37), (3, 20)])
def test_backward_of_arange_ids_needs_no_sort(start, V, monkeypatch):
    """ids an increasing arange made (position ids): the kernel reads them as sorted and
    distinct, no torch.sort; each row is its one grad row (ids past V add nothing)."""
    n, D = 29, 12
    _, fn = new_step([Slot("batch", "g", tensor((n, D), from_torch_dtype(F32)))])
    b = OpBuilder(fn.body.block)
    ids_v = b.create(nv.ArangeOp, [], {"start": start, "step": 1}, tensor((n,), from_torch_dtype(I64))).results[0]
    op = b.create(nv.EmbeddingBackwardOp, [fn.body.block.args[0], ids_v], {"num_embeddings": V, "padding_idx": -1})
    kernel = lowering_for(op)(op, small_tiles(monkeypatch))
    assert "torch.sort" not in kernel.source and kernel.scratch_bytes == 0

    def no_sort(*a, **k):
        raise AssertionError("sorted")

    monkeypatch.setattr(torch, "sort", no_sort)
    g, ids = nonzero((n, D), F32, 41), torch.arange(start, start + n)
    out = kernel.launch([g, ids])[0]
    assert torch.equal(bits(out), bits(token_order_sum(g, ids, V)))
