"""The precision stage: the bf16 and tf32 policies.

``bf16`` follows ``torch.autocast(dtype=torch.bfloat16)``: every matmul and
attention takes bf16 operands and rounds its result to bf16 (autocast's
outputs are bf16), accumulating in f32 inside; everything else (master
weights, norms, softmax, the loss, the optimizer) stays f32. Since this stage
runs after autodiff, the backward contractions are bf16 too, as autograd of a
bf16 matmul is. ``tf32`` changes no op: it is a property of how f32
contractions run, recorded on the module for the backend (on the CPU, tf32
equals fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr, bf16, f32
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import step_func
from nova.ir.types import elem_of

PRECISIONS = ("fp32", "tf32", "bf16")
# ops whose tensor operands run in bf16 under the bf16 policy (autocast's lower-precision list)
CONTRACTIONS = (nv.MatmulOp, nv.AttentionOp, nv.AttentionBackwardOp,
                nv.LinearCrossEntropyOp, nv.LinearCrossEntropyBackwardOp, nv.LinearCrossEntropyWithGradOp)


@dataclass(frozen=True)
class PrecisionPass(ModulePass):
    name = "nova-precision"
    precision: str = "fp32"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        op.attributes["nova.precision"] = StringAttr(self.precision)
        if self.precision != "bf16":
            return
        fn = step_func(op)
        for target in [o for o in fn.body.block.ops if isinstance(o, CONTRACTIONS)]:
            _lower_to_bf16(target)


def _lower_to_bf16(op: nv.NovaOp) -> None:
    if not any(elem_of(v.type) == f32 for v in op.operands):
        return  # f64 programs (tests) and already-lowered ops keep their types
    b = OpBuilder(op.parent_block(), before=op)
    b.location = op.attributes["nova.loc"].data if "nova.loc" in op.attributes else None
    operands = [b.cast(v, bf16) if elem_of(v.type) == f32 and not _is_stat(op, i) else v
                for i, v in enumerate(op.operands)]  # fmt: skip
    # an op that takes its result type (the fused head's loss) keeps it: its statistics stay f32
    new = b.create(type(op), operands, op.props(), op.results[0].type if op.FREE_RESULT else None)
    outs = []
    after = op.next_op
    b.before = after
    for r_old, r_new in zip(op.results, new.results, strict=True):
        outs.append(b.cast(r_new, elem_of(r_old.type)))
    Rewriter.replace_op(op, [], outs)


def _is_stat(op: nv.NovaOp, i: int) -> bool:
    # attention_backward's log-sum-exp operand stays f32; so do the fused LM head's
    # bias (the unfused bias add follows the matmul's cast back to f32) and the
    # loss's cotangent of its backward: only h and w are the matmuls' operands
    if isinstance(op, nv.LinearCrossEntropyOp):
        return i == 3
    if isinstance(op, (nv.LinearCrossEntropyBackwardOp, nv.LinearCrossEntropyWithGradOp)):
        return i in (0, 4)
    return isinstance(op, nv.AttentionBackwardOp) and i == 5
