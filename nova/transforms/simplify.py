"""The simplify stage: stop_gradient removal (it only steers autodiff), cast
canonicalization, common-subexpression elimination, then dead-code
elimination, over @train_step.

Every nova op is pure (value semantics), so two ops with the same name,
operands, properties and result types compute the same value (``nova.loc``
is provenance, not semantics), and an op whose results are unused can go.
Capture and autodiff emit many such ops (repeated constants, the transposes
of a weight used forward and backward, the loss's unused statistics), so this
stage shrinks the program that later stages plan and fuse.

Cast canonicalization (exact rewrites: every result is bit-identical) gives
CSE casts it can merge. The bf16 policy casts a contraction's operand where
the contraction reads it: the forward reads ``cast(x)``, the backward's weight
gradient ``cast(transpose(x))``; as written the two never merge and the f32
``x`` stays alive from the forward into the backward. The rules:

  cast(L(x)) -> L(cast(x))   L a layout op: transpose, reshape, broadcast_to,
                             slice (they move elements, a cast converts each
                             element alone, so the two commute exactly). A slice
                             only when ``cast(x)`` to that type exists already or
                             the slices of ``x`` that reach such casts together
                             hold at least ``x``'s elements (q/k/v cut from one
                             projection): else casting all of ``x`` would
                             convert (and keep) more than the slice.
  cast(cast(x)) -> x         the inner cast widens exactly (bf16/f16 -> f32/f64,
                             f32 -> f64) and the outer returns to x's type
  cast(x) -> x               x already has the target type

The new cast is created where the old one was, so CSE keeps the forward's
(the earlier) copy and the backward reads it through its own layout ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Attribute, Block, Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from nova.ir import dialect as nv
from nova.ir.dialect import NovaOp, StopGradientOp
from nova.ir.module import step_func
from nova.ir.types import elem_of, numel, shape_of, tensor, to_torch_dtype

LAYOUT_OPS = (nv.TransposeOp, nv.ReshapeOp, nv.BroadcastToOp, nv.SliceOp)

# (from, to): every value of ``from`` is exactly representable in ``to``
_EXACT_WIDENING = {
    (torch.bfloat16, torch.float32), (torch.bfloat16, torch.float64),
    (torch.float16, torch.float32), (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}  # fmt: skip


def _key(op: NovaOp):
    props = tuple(sorted((k, str(v)) for k, v in op.properties.items()))
    return (op.name, tuple(op.operands), props, tuple(r.type for r in op.results))


def widens_exactly(src: Attribute, dst: Attribute) -> bool:
    try:
        return (to_torch_dtype(src), to_torch_dtype(dst)) in _EXACT_WIDENING
    except TypeError:
        return False


def _reaches_cast(v: SSAValue, elem: Attribute) -> bool:
    """Some use of ``v``, directly or through layout ops, casts it to ``elem``."""
    for u in v.uses:
        op = u.operation
        if isinstance(op, nv.CastOp) and elem_of(op.results[0].type) == elem:
            return True
        if isinstance(op, LAYOUT_OPS) and _reaches_cast(op.results[0], elem):
            return True
    return False


def _slice_sinks(x: SSAValue, elem: Attribute) -> bool:
    """Whether ``cast(slice(x))`` may become ``slice(cast(x))`` (see the module docstring)."""
    if any(isinstance(u.operation, nv.CastOp) and elem_of(u.operation.results[0].type) == elem for u in x.uses):
        return True
    cut: dict[tuple, int] = {}
    for u in x.uses:
        op = u.operation
        if isinstance(op, nv.SliceOp) and _reaches_cast(op.results[0], elem):
            cut[tuple(sorted(op.props().items()))] = numel(shape_of(op.results[0].type))
    return sum(cut.values()) >= numel(shape_of(x.type))


def _cast_of(x: SSAValue, elem: Attribute, before: Operation, cast: Operation) -> SSAValue | None:
    """A value equal to ``cast(x)`` to ``elem`` built by the rules above, new ops
    inserted before ``before``; None when no rule applies (``cast`` stays)."""
    if elem_of(x.type) == elem:
        return x
    d = x.owner
    if isinstance(d, nv.CastOp) and widens_exactly(elem_of(d.operands[0].type), elem_of(x.type)):
        if elem_of(d.operands[0].type) == elem:
            return d.operands[0]
    if isinstance(d, LAYOUT_OPS) and (not isinstance(d, nv.SliceOp) or _slice_sinks(d.operands[0], elem)):
        inner = _cast_of(d.operands[0], elem, before, cast)
        if inner is None:
            inner = _new_cast(d.operands[0], elem, before, cast)
        layout = type(d).create(
            operands=[inner],
            result_types=[tensor(shape_of(x.type), elem)],
            properties=dict(d.properties),
            attributes=dict(d.attributes),
        )
        before.parent_block().insert_op_before(layout, before)
        return layout.results[0]
    return None


def _new_cast(x: SSAValue, elem: Attribute, before: Operation, cast: Operation) -> SSAValue:
    op = nv.CastOp.create(operands=[x], result_types=[tensor(shape_of(x.type), elem)],
                          attributes=dict(cast.attributes))  # fmt: skip
    before.parent_block().insert_op_before(op, before)
    return op.results[0]


def canonicalize_casts(block: Block) -> None:
    for op in list(block.ops):
        if not isinstance(op, nv.CastOp) or op.parent is None:
            continue
        v = _cast_of(op.operands[0], elem_of(op.results[0].type), op, op)
        if v is not None:
            Rewriter.replace_op(op, [], [v])


def cse(block: Block) -> None:
    seen: dict = {}
    for o in list(block.ops):
        if not isinstance(o, NovaOp):
            continue
        k = _key(o)
        if k in seen:
            Rewriter.replace_op(o, [], list(seen[k].results))
        else:
            seen[k] = o


def dce(block: Block) -> int:
    """Erases the nova ops whose results nothing reads; returns how many."""
    n = 0
    for o in reversed(list(block.ops)):
        if isinstance(o, NovaOp) and not any(r.uses for r in o.results):
            Rewriter.erase_op(o)
            n += 1
    return n


@dataclass(frozen=True)
class Simplify(ModulePass):
    name = "nova-simplify"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        block = step_func(op).body.block
        # stop_gradient has done its work once autodiff has run: it is the value itself
        for o in list(block.ops):
            if isinstance(o, StopGradientOp):
                Rewriter.replace_op(o, [], [o.operands[0]])
        canonicalize_casts(block)
        cse(block)
        dce(block)
