"""The simplify stage: stop_gradient removal (it only steers autodiff),
common-subexpression elimination, then dead-code elimination, over @train_step.

Every nova op is pure (value semantics), so two ops with the same name,
operands, properties and result types compute the same value (``nova.loc``
is provenance, not semantics), and an op whose results are unused can go.
Capture and autodiff emit many such ops (repeated constants, the transposes
of a weight used forward and backward, the loss's unused statistics), so this
stage shrinks the program that later stages plan and fuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from nova.ir.dialect import NovaOp, StopGradientOp
from nova.ir.module import step_func


def _key(op: NovaOp):
    props = tuple(sorted((k, str(v)) for k, v in op.properties.items()))
    return (op.name, tuple(op.operands), props, tuple(r.type for r in op.results))


@dataclass(frozen=True)
class Simplify(ModulePass):
    name = "nova-simplify"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        block = step_func(op).body.block
        # stop_gradient has done its work once autodiff has run: it is the value itself
        for o in list(block.ops):
            if isinstance(o, StopGradientOp):
                Rewriter.replace_op(o, [], [o.operands[0]])
        seen: dict = {}
        for o in list(block.ops):
            if not isinstance(o, NovaOp):
                continue
            k = _key(o)
            if k in seen:
                Rewriter.replace_op(o, [], list(seen[k].results))
            else:
                seen[k] = o
        for o in reversed(list(block.ops)):
            if isinstance(o, NovaOp) and not any(r.uses for r in o.results):
                Rewriter.erase_op(o)
