"""The fuse_loss stage: the LM head and the loss become one op.

``cross_entropy(matmul(h [N, D], transpose(w [V, D])) [+ bias [V]], target)``,
with any reshapes between (capture's ``linear`` on [B, T, D] and ``.view(-1,
V)`` give two) and at most one widening cast (transformers' ``logits.float()``
of a 16-bit model), becomes ``nova.linear_cross_entropy(h, w, target [, bias])``:
its reference implementation and its Triton lowering compute the loss and the
gradients ``chunk`` rows of tokens at a time, so the [N, V] logits (the largest
buffer of a GPT step) never exist in full.

It applies only where nothing else reads the logits (every value of the chain
has exactly one use) and the reduction is "mean" or "sum"; anything else stays
the unfused ops, visibly in the IR. It runs before autodiff, so the backward
is the fused op's own (``nova.linear_cross_entropy_backward``).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, f32
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import VerifyException

from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import step_func
from nova.ir.types import elem_of, shape_of, tensor

# rows of tokens per chunk: the chunk's [4096, 50304] logits are 412 MB in bf16, against
# 3.3 GB for the [32768, 50304] of GPT-2 at batch 32. The backward's buffers (logits
# chunk + f32 dw accumulator) are planned into the arena at the start of the backward:
# at 4096 rows they raise GPT-2's b32 plan by 0.19 GiB over 2048 (8.65 vs 8.46 GiB
# predicted, within the 9 GiB of issue 9). Measured per step on the H200
# (scripts/lm_head_parts.py): 15.7 ms of LM head at 2048 rows, 13.5 at 4096, 13.1 at 8192
# (786 MB of logits): the dh = d @ w matmul, [chunk, 768] with K = V, has 3 x chunk / 128
# output tiles to fill 132 SMs, and each chunk adds the [V, 768] f32 dw accumulator's
# read and write to its weight-gradient matmul (0.10 ms a chunk)
DEFAULT_CHUNK = 4096
_SIXTEEN_BIT = ("bf16", "f16")


@dataclass
class HeadMatch:
    ce: nv.CrossEntropyOp
    matmul: nv.MatmulOp
    h: SSAValue
    w: SSAValue | None  # None: the matmul's rhs is not a transpose, w is made from it
    bias: SSAValue | None
    chain: list[Operation]  # the ops the fused op replaces, from the loss up to the matmul


def _single_use(v: SSAValue) -> bool:
    return len(list(v.uses)) == 1


def match_head(ce: nv.CrossEntropyOp) -> HeadMatch | None:
    """The LM head feeding ``ce``, or None where the pattern does not hold."""
    if ce.props()["reduction"] not in ("mean", "sum"):
        return None
    n, v_size = shape_of(ce.operands[0].type)
    x = ce.operands[0]
    chain: list[Operation] = []
    bias = None
    casts = 0
    while True:
        if not _single_use(x):
            return None  # the logits (or a view of them) are read elsewhere
        op = x.owner
        if isinstance(op, nv.ReshapeOp):
            pass
        elif isinstance(op, nv.CastOp) and casts == 0:
            src = elem_of(op.operands[0].type)
            if not (elem_of(x.type) == f32 and str(src) in _SIXTEEN_BIT):
                return None  # only the widening of 16-bit logits to f32
            casts += 1
        elif isinstance(op, nv.AddOp) and bias is None:
            a, b = op.operands
            if shape_of(b.type) == (v_size,) and shape_of(a.type) == shape_of(x.type):
                x_in, bias = a, b
            elif shape_of(a.type) == (v_size,) and shape_of(b.type) == shape_of(x.type):
                x_in, bias = b, a
            else:
                return None
            if not shape_of(x.type) or shape_of(x.type)[-1] != v_size:
                return None  # not a bias over the vocabulary
            chain.append(op)
            x = x_in
            continue
        elif isinstance(op, nv.MatmulOp):
            break
        else:
            return None
        chain.append(op)
        x = op.operands[0]
    mm = x.owner
    lhs, rhs = mm.operands
    if shape_of(lhs.type) != (n, shape_of(lhs.type)[-1]) or len(shape_of(lhs.type)) != 2:
        return None
    if shape_of(mm.results[0].type) != (n, v_size):
        return None
    w = rhs.owner.operands[0] if isinstance(rhs.owner, nv.TransposeOp) and rhs.owner.props()["perm"] == (1, 0) else None
    chain.append(mm)
    return HeadMatch(ce, mm, lhs, w, bias, chain)


def _fuse(m: HeadMatch, chunk: int) -> bool:
    ce = m.ce
    b = OpBuilder(ce.parent_block(), before=ce)
    b.location = ce.attributes["nova.loc"].data if "nova.loc" in ce.attributes else None
    w = m.w
    if w is None:
        w = b.transpose(m.matmul.operands[1], [1, 0])
    props = {**ce.props(), "chunk": chunk}
    operands = [m.h, w, ce.operands[1], *([m.bias] if m.bias is not None else [])]
    try:
        fused = b.create(nv.LinearCrossEntropyOp, operands, props, tensor([], elem_of(ce.results[0].type)))
    except VerifyException:  # a combination the fused op does not define (e.g. a bias of another type): stays unfused
        if m.w is None:
            w.owner.detach()
            w.owner.erase()
        return False
    ce.results[0].replace_all_uses_with(fused.results[0])
    ce.detach()
    ce.erase()
    for op in m.chain:  # from the loss up: each is now unused
        op.detach()
        op.erase()
    return True


@dataclass(frozen=True)
class FuseLoss(ModulePass):
    name = "nova-fuse-loss"
    chunk: int = DEFAULT_CHUNK

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        block = step_func(op).body.block
        for ce in [o for o in block.ops if isinstance(o, nv.CrossEntropyOp)]:
            m = match_head(ce)
            if m is None:
                continue
            w_view = m.matmul.operands[1].owner if m.w is not None else None
            if _fuse(m, self.chunk) and w_view is not None and not list(w_view.results[0].uses):
                w_view.detach()
                w_view.erase()


def fuse_loss(module: ModuleOp, chunk: int = DEFAULT_CHUNK) -> None:
    FuseLoss(chunk).apply(Context(), module)
