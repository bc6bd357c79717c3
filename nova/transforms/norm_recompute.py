"""The norm_recompute stage: a LayerNorm output that the remat stage recomputes for a
weight gradient is computed from the forward's statistics, beside the LayerNorm
backward that reads the same row, so that the backward's kernel writes it.

In a transformer block's backward the weight gradient of the matmul after a
LayerNorm reads the LayerNorm's output y, and the LayerNorm's backward reads its
input x and the forward's mean and rstd. remat keeps neither y nor x: it recomputes
x (the residual stream, from values live anyway) and clones the forward's
``layer_norm`` F for y, which then runs as a kernel of its own (GPT-2 124M bf16 at
batch 32: 24 launches, each reading x and writing y, 0.049 ms). This stage rewrites
such a clone R = layer_norm(x, w, b) into elementwise ops,

    y = ((x - mean_F) * rstd_F) * w + b

with F's mean and rstd (the LayerNorm kernel's and the reference executor's own
formula, on the same statistics they computed y from: the same bits as F's y), and
moves the ops that read y through anything but elementwise ops of its shape (its
views, the weight gradient's matmul and what reads that) to just after the
backward B (in their order; a collective of the distribute stage after a moved one
moves too, so the collectives keep their order). The fuse stage then computes y in
B's kernel from the row B holds (``fuse``'s "row sides", ``nv.row_sides``): the
recompute's read of x and its launch are gone, its store stays.

Where, precisely: R is a ``layer_norm`` of the remat stage (``nova.remat``) whose
mean and rstd nothing reads, of an f32 or f64 input (a narrower one is widened for
the statistics by the reference executor, and rounded after); B is a
``layer_norm_backward`` after R reading R's x (the same value) and w, and mean and
rstd that are the results of one ``layer_norm`` F with R's w, bias and eps (B is
F's backward: autodiff wrote it with F's input, which remat replaced by the same
recompute R reads, so x is F's input recomputed and F's statistics are x's); no op
B depends on reads y. Moving the weight gradient after B keeps its other operand
(the output gradient) live across B's kernel: one more full tensor there, in the
backward, where GPT-2's peak is not (the peak is at the LM head; the plan's
predicted peak is unchanged, 8.72 GiB at bf16 batch 32).
"""

from __future__ import annotations

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue

from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import step_func
from nova.ir.types import elem_of, shape_of, tensor
from nova.transforms.remat import REMAT_ATTR, is_recompute


def _statistics(r: nv.LayerNormOp, b: nv.LayerNormBackwardOp) -> tuple[SSAValue, SSAValue] | None:
    """F's (mean, rstd), where ``b`` is the backward of the forward ``layer_norm`` F that
    ``r`` recomputes (the module docstring), else None."""
    x, w, bias = r.operands
    if b.operands[1] is not x or b.operands[2] is not w:
        return None
    mean, rstd = b.operands[3], b.operands[4]
    f = mean.owner
    if not isinstance(f, nv.LayerNormOp) or f is r or rstd.owner is not f:
        return None
    if mean is not f.results[1] or rstd is not f.results[2] or f.operands[1] is not w or f.operands[2] is not bias:
        return None
    return (mean, rstd) if f.props()["eps"] == r.props()["eps"] else None


def _reads(op: Operation, values: set[SSAValue]) -> bool:
    return any(v in values for v in op.operands)


def _rewrite(block, r: nv.LayerNormOp) -> bool:
    """R's rewrite and the moves, where they apply (the module docstring)."""
    if r.results[1].uses or r.results[2].uses or str(elem_of(r.operands[0].type)) not in ("f32", "f64"):
        return False
    # the ops after r up to its backward: those reading y through elementwise ops of the row's
    # shape stay (y's casts: computed with it), the rest reading y, or reading what moves, move
    shape = shape_of(r.results[0].type)
    rows: set[SSAValue] = {r.results[0]}
    moved: list[Operation] = []
    moving: set[SSAValue] = set()
    back = stats = None
    op = r.next_op
    while op is not None:
        if isinstance(op, nv.LayerNormBackwardOp):
            stats = _statistics(r, op)
            if stats is not None:
                back = op
                break
        collective = isinstance(op, nv.NovaOp) and op.CATEGORY == "collective"
        if _reads(op, moving) or collective and any(
                isinstance(m, nv.NovaOp) and m.CATEGORY == "collective" for m in moved):  # fmt: skip
            moved.append(op)  # (a collective after a moved one moves too: their order stays)
            moving |= set(op.results)
        elif _reads(op, rows):
            if (isinstance(op, nv.NovaOp) and op.CATEGORY == "elementwise" and len(op.results) == 1
                    and shape_of(op.results[0].type) == shape):  # fmt: skip
                rows |= set(op.results)
            else:
                moved.append(op)
                moving |= set(op.results)
        op = op.next_op
    if back is None or _reads(back, rows | moving):
        return False
    mean, rstd = stats
    x, w, bias = r.operands
    lead = list(shape[:-1])
    b = OpBuilder(block, before=r)
    made = [b.create(nv.ReshapeOp, [mean], {}, tensor([*lead, 1], elem_of(mean.type))),
            b.create(nv.ReshapeOp, [rstd], {}, tensor([*lead, 1], elem_of(rstd.type)))]  # fmt: skip
    made.append(b.create(nv.SubOp, [x, made[0].results[0]]))
    made.append(b.create(nv.MulOp, [made[-1].results[0], made[1].results[0]]))
    made.append(b.create(nv.MulOp, [made[-1].results[0], w]))
    made.append(b.create(nv.AddOp, [made[-1].results[0], bias]))
    for m in made:  # recomputes of remat's, from where r was
        for key in (REMAT_ATTR, "nova.loc"):
            if key in r.attributes:
                m.attributes[key] = r.attributes[key]
    r.results[0].replace_all_uses_with(made[-1].results[0])
    block.erase_op(r)
    after = back
    for m in moved:
        block.detach_op(m)
        block.insert_op_after(m, after)
        after = m
    return True


def norm_recompute(module: ModuleOp) -> int:
    """Rewrites every such recompute (the module docstring); returns how many."""
    block = step_func(module).body.block
    recomputes = [op for op in block.ops if isinstance(op, nv.LayerNormOp) and is_recompute(op)]
    return sum(_rewrite(block, r) for r in recomputes)
