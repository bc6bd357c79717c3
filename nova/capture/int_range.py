"""Bounds of integer values, proved from the IR: how capture takes int32 tensors (and int16,
int8 and uint8 ones, by the same rule against their own ranges).

Nova's integers are i64. A model's int32 tensors (RoBERTa's position ids built from
``input_ids.ne(pad).int()``, BLOOM's ALiBi exponents from ``arange(dtype=torch.int32)``)
are captured as i64 values, which is exact as long as eager's int32 arithmetic would
not have wrapped. So capture asks ``bounds`` for every value that eager computes in
int32 and refuses the op (``UnsupportedError``, with its source line) unless the
bounds lie inside int32: never a silent wrong result, and no check at run time.

``bounds(v)`` is an interval [lo, hi] that contains every element of ``v``, or None
where nothing is known (a step argument, a cast from a float, an op without a rule).
The rules are plain interval arithmetic over the ops integer code is made of: fills
and aranges (exact), booleans ([0, 1]), add / sub / mul / maximum, where,
layout ops (the source's bounds), cumsum and reduce_sum (n elements of [lo, hi] add
up to within [n lo, n hi]; a prefix sum to within [min(lo, n lo), max(hi, n hi)]).
"""

from __future__ import annotations

from xdsl.ir import BlockArgument, SSAValue

from nova.ir import dialect as nv
from nova.ir.types import elem_of, i1, is_float, numel, shape_of

INT32 = (-(2**31), 2**31 - 1)

Bounds = tuple[int, int] | None


def _span(*corners: int) -> tuple[int, int]:
    return min(corners), max(corners)


def _fill(op, ins):
    v = op.props()["value"]
    return (int(v), int(v)) if float(v).is_integer() else None


def _arange(op, ins):
    p = op.props()
    n = shape_of(op.results[0].type)[0]
    if n == 0:
        return (0, 0)
    return _span(p["start"], p["start"] + p["step"] * (n - 1))


def _cast(op, ins):
    src = op.operands[0]
    if elem_of(src.type) == i1:
        return (0, 1)
    return None if is_float(src.type) else ins[0]


def _binary(f):
    def rule(op, ins):
        a, b = ins
        return None if a is None or b is None else f(a, b)

    return rule


def _reduced(op) -> int:
    """How many elements each result element of a reduce_sum adds up."""
    shape = shape_of(op.operands[0].type)
    return numel([shape[d] for d in op.props()["dims"]])


def _sum(op, ins):
    (a,) = ins
    if a is None:
        return None
    n = _reduced(op)
    return _span(n * a[0], n * a[1])


def _cumsum(op, ins):
    (a,) = ins
    if a is None:
        return None
    n = shape_of(op.operands[0].type)[op.props()["dim"]]
    return _span(a[0], a[1], n * a[0], n * a[1])


def _union(op, ins):
    known = [b for b in ins if b is not None]
    return None if len(known) < len(ins) else _span(*(x for b in known for x in b))


RULES = {
    nv.FullOp: _fill,
    nv.ArangeOp: _arange,
    nv.CastOp: _cast,
    nv.AddOp: _binary(lambda a, b: (a[0] + b[0], a[1] + b[1])),
    nv.SubOp: _binary(lambda a, b: (a[0] - b[1], a[1] - b[0])),
    nv.MulOp: _binary(lambda a, b: _span(a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1])),
    nv.MaximumOp: _binary(lambda a, b: (max(a[0], b[0]), max(a[1], b[1]))),
    nv.WhereOp: lambda op, ins: _union(op, ins[1:]),
    nv.ReduceSumOp: _sum,
    nv.CumsumOp: _cumsum,
    # layout: the source's elements (a cat's pieces; a pad adds zeros)
    nv.ReshapeOp: _union, nv.TransposeOp: _union, nv.BroadcastToOp: _union, nv.SliceOp: _union, nv.CatOp: _union,
    nv.PadOp: lambda op, ins: None if ins[0] is None else _span(0, *ins[0]),
}  # fmt: skip


def bounds(v: SSAValue, memo: dict | None = None) -> Bounds:
    """An interval holding every element of the integer (or boolean) value ``v``,
    or None where the IR does not bound it."""
    memo = {} if memo is None else memo
    stack = [v]
    while stack:  # iterative: integer chains can be long, Python's recursion is not
        u = stack[-1]
        if u in memo:
            stack.pop()
            continue
        if is_float(u.type):
            memo[u] = None
        elif elem_of(u.type) == i1:
            memo[u] = (0, 1)
        elif isinstance(u, BlockArgument) or type(u.owner) not in RULES:
            memo[u] = None
        else:
            todo = [x for x in u.owner.operands if x not in memo]
            if todo:
                stack.extend(todo)
                continue
            memo[u] = RULES[type(u.owner)](u.owner, [memo[x] for x in u.owner.operands])
        stack.pop()
    return memo[v]


def fits(v: SSAValue, span: tuple[int, int], memo: dict | None = None) -> bool:
    """Whether ``bounds`` proves every element of ``v`` within ``span`` (a dtype's range)."""
    b = bounds(v, memo)
    return b is not None and span[0] <= b[0] and b[1] <= span[1]


__all__ = ["INT32", "bounds", "fits"]
