"""nova.capture.int_range: the interval each integer value of the IR lies in, the
proof capture needs before it computes a model's int32 values in int64."""

from __future__ import annotations

import pytest
import torch

from nova.capture.int_range import INT32, bounds, fits
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import f32, i64, tensor


@pytest.fixture
def b():
    _, fn = new_step([Slot("batch", "ids", tensor([2, 6], i64))])
    builder = OpBuilder(fn.body.block)
    builder.ids = fn.body.block.args[0]
    return builder


def arange(b, start, n, step=1):
    return b.one(nv.ArangeOp, [], {"start": start, "step": step}, tensor([n], i64))


def test_exact_sources_and_arithmetic(b):
    a = arange(b, 3, 10, step=-2)  # 3, 1, ..., -15
    assert bounds(a) == (-15, 3)
    c = b.full(7.0, [10], i64)
    assert bounds(c) == (7, 7)
    assert bounds(b.add(a, c)) == (-8, 10)
    assert bounds(b.sub(a, c)) == (-22, -4)
    assert bounds(b.mul(a, c)) == (-105, 21)
    assert bounds(b.one(nv.MaximumOp, [a, b.full(0.0, [10], i64)])) == (0, 3)
    assert bounds(arange(b, 5, 0)) == (0, 0)  # no elements


def test_booleans_casts_where_and_layout(b):
    m = b.one(nv.NeOp, [b.ids, b.full(0.0, [], i64)])
    assert bounds(m) == (0, 1)
    one = b.cast(m, i64)
    assert bounds(one) == (0, 1)
    w = b.where(m, b.full(4.0, [2, 6], i64), b.full(-9.0, [2, 6], i64))
    assert bounds(w) == (-9, 4)
    assert bounds(b.reshape(w, [12])) == (-9, 4)


def test_sums_over_their_element_count(b):
    m = b.cast(b.one(nv.NeOp, [b.ids, b.full(0.0, [], i64)]), i64)  # [2, 6] of 0 / 1
    assert bounds(b.one(nv.CumsumOp, [m], {"dim": 1, "reverse": False})) == (0, 6)
    neg = b.sub(m, b.full(1.0, [], i64))  # -1 / 0
    assert bounds(b.one(nv.CumsumOp, [neg], {"dim": 1, "reverse": False})) == (-6, 0)
    assert bounds(b.reduce_sum(m, [0, 1], False)) == (0, 12)


def test_unknowns_stay_unknown(b):
    assert bounds(b.ids) is None  # a step argument
    assert bounds(b.add(b.ids, b.full(1.0, [], i64))) is None
    assert bounds(b.cast(b.full(2.5, [3], f32), i64)) is None  # a float's truncation


def test_fits_int32_at_its_edges(b):
    assert fits(b.full(float(INT32[1]), [], i64), INT32)
    assert not fits(b.add(b.full(float(INT32[1]), [], i64), b.full(1.0, [], i64)), INT32)
    assert fits(b.full(float(INT32[0]), [], i64), INT32)
    assert not fits(b.ids, INT32)


def test_long_chains_do_not_recurse(b):
    x = arange(b, 0, 4)
    for _ in range(3000):
        x = b.add(x, b.full(1.0, [], i64))
    assert bounds(x) == (3000, 3003)
