"""The attention_sums stage: a packed qkv projection's bias gradient is added up by
the attention backward's kernels, from the gradient tiles they hold, instead of by
a reduction reading the gradients back.

autodiff's backward of ``q, k, v = split(x @ w + b)`` (GPT-2's ``c_attn``) is a cat
of the attention backward's dq, dk, dv (each transposed from [B, H, T, D] to
[B, T, H, D]) and the bias gradient is that cat's column sum: a reduction over the
batch and the sequence of the whole [B, T, 3 H D] gradient (GPT-2 124M bf16 at
batch 32: 151 MB read by a kernel of its own each layer, 0.049 ms on the H200,
0.59 ms a step; bench/results/runs/epilogue_variants_graph_12l_lnhoist_11b6733.json).
The attention backward's dK/dV and dQ programs hold those gradients' tiles in
registers before they store them; adding up each tile's rows there costs a sum of
a tile a program. This stage sets the op's ``sums`` property (its fourth result
``grad_sums`` [3, H, D]: each gradient's sum over the batch and the sequence, as
returned, in the statistics type) and makes the bias gradient a reshape of it.

Rule: a column sum (``nv.column_sum``) whose operand is, through reshapes and at
most one cast, the cat along dim 2 of ``transpose(g, (0, 2, 1, 3))`` for g = dq,
dk, dv of one ``attention_backward`` without sums, in that order; the sum's type is
the gradients' statistics type (f32, or f64 for f64 gradients), and the cast (if
any) widens the gradients' type to it; the reduced operand's last dim is the cat's
3 H D (a row-major relabelling of the cat's [B, T] rows, so column j is cat
element (j // D, j % D) of every row). The op is recreated with the sums, and the
column sum replaced by ``reshape(grad_sums)`` [3 H D] where it was; the cast and
reshapes that then have no reader go. What stays as it was: any other order or
subset of the gradients, grouped-query attention (k and v with fewer heads), a sum
in another type (bf16 without the widening cast) or over other dims. (Grouped-query
attention reaches the op with k and v repeated to q's heads: one shape.)

The numerics: the kernels add up each program's tile rows and then the programs'
partials in a fixed order (no atomics: the same bits every run), not the reduce
kernel's order: the sum differs from the unfused one by fp32 (fp64) rounding. The
reference executor sums each gradient over (B, T) (``reference._attention_bwd``).
"""

from __future__ import annotations

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, OpResult, SSAValue
from xdsl.rewriter import Rewriter

from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import step_func
from nova.ir.types import elem_of, shape_of, tensor

_HEADS_FIRST = (0, 2, 1, 3)  # [B, H, T, D] -> [B, T, H, D]


def _source(x: SSAValue) -> tuple[nv.CatOp, list[Operation], nv.CastOp | None] | None:
    """The cat that ``x`` is, through reshapes and at most one cast, with the views
    and cast on the way (reader first), or None."""
    chain: list[Operation] = []
    cast = None
    while isinstance(x, OpResult):
        op = x.op
        if isinstance(op, nv.CatOp):
            return op, chain, cast
        if isinstance(op, nv.ReshapeOp) or (isinstance(op, nv.CastOp) and cast is None):
            cast = op if isinstance(op, nv.CastOp) else cast
            chain.append(op)
            x = op.operands[0]
            continue
        return None
    return None


def _attention_of(cat: nv.CatOp) -> nv.AttentionBackwardOp | None:
    """The attention backward whose dq, dk, dv the cat joins, heads-first-transposed
    along dim 2 in that order, or None."""
    if cat.props()["dim"] != 2 or len(cat.operands) != 3:
        return None
    owners = []
    for i, x in enumerate(cat.operands):
        t = x.owner if isinstance(x, OpResult) else None
        if not isinstance(t, nv.TransposeOp) or tuple(t.props()["perm"]) != _HEADS_FIRST:
            return None
        g = t.operands[0]
        if not isinstance(g, OpResult) or not isinstance(g.op, nv.AttentionBackwardOp) or g.index != i:
            return None
        owners.append(g.op)
    a = owners[0]
    return None if any(o is not a for o in owners) or a.props()["sums"] else a


def _matches(red: Operation) -> tuple[nv.AttentionBackwardOp, list[Operation]] | None:
    """(the attention backward, the views and cast between it and the column sum ``red``)
    where the module docstring's rule holds, else None."""
    if not nv.column_sum(red):
        return None
    found = _source(red.operands[0])
    if found is None:
        return None
    cat, chain, cast = found
    a = _attention_of(cat)
    if a is None:
        return None
    grad_t = a.results[0].type
    stat = nv.stat_elem(grad_t)
    if elem_of(red.results[0].type) != stat:
        return None
    if cast is None and elem_of(grad_t) != stat:
        return None
    if cast is not None and (elem_of(cast.operands[0].type) != elem_of(grad_t) or elem_of(cast.results[0].type) != stat):
        return None
    b, t, heads, d = shape_of(cat.results[0].type)
    if shape_of(red.operands[0].type)[-1] != heads * d:
        return None
    return a, chain


def _with_sums(a: nv.AttentionBackwardOp) -> nv.AttentionBackwardOp:
    """``a`` recreated with ``sums`` at its place; its gradients' readers read the new op's."""
    b = OpBuilder(a.parent_block(), before=a)
    b.location = a.attributes["nova.loc"].data if "nova.loc" in a.attributes else None
    new = b.create(nv.AttentionBackwardOp, list(a.operands), {**a.props(), "sums": True})
    for k, v in a.attributes.items():
        new.attributes.setdefault(k, v)
    Rewriter.replace_op(a, [], list(new.results[:3]))
    return new


def attention_sums(module: ModuleOp) -> int:
    """Rewrites every column sum of @train_step that the module docstring's rule
    matches; returns how many."""
    block = step_func(module).body.block
    done = 0
    for red in list(block.ops):
        m = _matches(red)
        if m is None:
            continue
        a, chain = m
        a = _with_sums(a)
        b = OpBuilder(block, before=red)
        b.location = red.attributes["nova.loc"].data if "nova.loc" in red.attributes else None
        flat = b.one(nv.ReshapeOp, [a.results[3]], None, tensor(shape_of(red.results[0].type), elem_of(a.results[3].type)))
        Rewriter.replace_op(red, [], [flat])
        for op in chain:  # reader first: each may have lost its last reader
            if all(not r.uses for r in op.results):
                Rewriter.erase_op(op)
        done += 1
    return done


__all__ = ["attention_sums"]
