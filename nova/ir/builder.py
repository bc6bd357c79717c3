"""Creating nova ops: result types come from each op's own ``infer``.

Capture, autodiff and the optimizer pass all build IR through ``OpBuilder``,
which inserts new ops before a fixed anchor (normally the function's return).
"""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.dialects.builtin import TensorType
from xdsl.ir import Attribute, Block, Operation, SSAValue

from nova.ir import dialect as nv
from nova.ir.types import elem_of, shape_of, tensor


class OpBuilder:
    def __init__(self, block: Block, before: Operation | None = None, location: str | None = None):
        self.block = block
        self.before = before
        # a source location attached to every op created (capture sets it per node)
        self.location = location

    def create(
        self,
        op_cls: type[nv.NovaOp],
        operands: Sequence[SSAValue],
        props: dict | None = None,
        result_type: TensorType | None = None,
    ) -> Operation:
        props = op_cls.complete(dict(props or {}))
        types = op_cls.infer([o.type for o in operands], props, result_type)
        op = op_cls.create(
            operands=list(operands),
            result_types=list(types),
            properties={k: nv.make_prop(v) for k, v in props.items()},
        )
        if self.location is not None:
            from xdsl.dialects.builtin import StringAttr

            op.attributes["nova.loc"] = StringAttr(self.location)
        if self.before is None:
            self.block.add_op(op)
        else:
            self.block.insert_op_before(op, self.before)
        return op

    def one(self, op_cls, operands, props=None, result_type=None) -> SSAValue:
        return self.create(op_cls, operands, props, result_type).results[0]

    # --- elementwise -------------------------------------------------------
    def add(self, a, b):
        return self.one(nv.AddOp, [a, b])

    def sub(self, a, b):
        return self.one(nv.SubOp, [a, b])

    def mul(self, a, b):
        return self.one(nv.MulOp, [a, b])

    def div(self, a, b):
        return self.one(nv.DivOp, [a, b])

    def neg(self, a):
        return self.one(nv.NegOp, [a])

    def where(self, c, a, b):
        return self.one(nv.WhereOp, [c, a, b])

    def full(self, value: float, shape: Sequence[int], elem: Attribute) -> SSAValue:
        return self.one(nv.FullOp, [], {"value": float(value)}, tensor(shape, elem))

    def scalar(self, value: float, like: SSAValue) -> SSAValue:
        """A 0-d constant of ``like``'s element type."""
        return self.full(value, (), elem_of(like.type))

    def scale(self, x: SSAValue, c: float) -> SSAValue:
        return self.mul(x, self.scalar(c, x))

    def cast(self, x: SSAValue, elem: Attribute) -> SSAValue:
        if elem_of(x.type) == elem:
            return x
        return self.one(nv.CastOp, [x], None, tensor(shape_of(x.type), elem))

    # --- shapes ------------------------------------------------------------
    def reshape(self, x: SSAValue, shape: Sequence[int]) -> SSAValue:
        if shape_of(x.type) == tuple(shape):
            return x
        return self.one(nv.ReshapeOp, [x], None, tensor(shape, elem_of(x.type)))

    def transpose(self, x: SSAValue, perm: Sequence[int]) -> SSAValue:
        if list(perm) == list(range(len(perm))):
            return x
        return self.one(nv.TransposeOp, [x], {"perm": tuple(perm)})

    def swap_last(self, x: SSAValue) -> SSAValue:
        r = len(shape_of(x.type))
        return self.transpose(x, [*range(r - 2), r - 1, r - 2])

    def broadcast_to(self, x: SSAValue, shape: Sequence[int]) -> SSAValue:
        if shape_of(x.type) == tuple(shape):
            return x
        return self.one(nv.BroadcastToOp, [x], None, tensor(shape, elem_of(x.type)))

    def reduce_sum(self, x: SSAValue, dims: Sequence[int], keepdim: bool = False) -> SSAValue:
        return self.one(nv.ReduceSumOp, [x], {"dims": tuple(dims), "keepdim": keepdim})

    def sum_to(self, x: SSAValue, shape: Sequence[int]) -> SSAValue:
        """Sums a broadcast result back to ``shape`` (the adjoint of broadcasting)."""
        src = shape_of(x.type)
        shape = tuple(shape)
        if src == shape:
            return x
        lead = len(src) - len(shape)
        dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and src[lead + i] != 1]
        y = self.reduce_sum(x, dims, keepdim=False) if dims else x
        return self.reshape(y, shape)

    def matmul(self, a, b):
        return self.one(nv.MatmulOp, [a, b])
