"""The concat stage: sums of zero-pads become ``nova.cat``, and a cat moves as
few bytes as it can. Runs after precision (the casts it lifts are the bf16
policy's) and before simplify (whose cast rules and CSE finish the job).

Autodiff gives ``q, k, v = qkv.split(C, dim=2)`` the backward
``pad(dq) + pad(dk) + pad(dv)``: each slice's cotangent zero-padded to the full
width, then summed. On GPT-2 124M at batch 32 that is three 300 MB f32 pads and
their sum per layer. Eager's autograd writes one ``cat`` of the three
(``split_with_sizes_backward``), and so does this stage. The rules, each exact
(every element of the result is bit-identical to eager's cat):

  pads -> cat        an ``add`` tree (single-use inner adds, no broadcasting)
                     whose leaves are step-1 pads along one dim to one size, with
                     disjoint windows: ``cat`` of the pads' inputs in window
                     order; a gap between windows is a broadcast 0 piece (a
                     stride-0 view: the cat reads no bytes for it). The sum would
                     turn a -0.0 element into +0.0 (-0.0 + 0.0); the cat keeps
                     -0.0, as eager's split backward and torch.cat do. (A model
                     that slices one tensor twice and lets autograd add the two
                     pad-shaped gradients gets +0.0 from eager there: the two
                     differ only in the sign of a zero.)
  cat of casts       every piece is ``L(cast(x_i))``, L a chain of layout ops
                     (transpose, reshape, slice, broadcast_to: they commute with a
                     cast exactly), each cast an exact widening from one dtype
                     (bf16 -> f32): ``cast(cat(L(x_i)))``. The cat then moves the
                     narrow bytes, and where the policy casts the cat back to bf16
                     (for the matmuls), simplify's round-trip rule drops both casts.
                     So attention's bf16 dq, dk, dv are never widened one by one
                     (eager's cat is of the bf16 gradients too).
  cat of reshapes    every piece is ``reshape(z_i)`` keeping the dims before the
                     cat dim, the z_i equal outside that dim:
                     ``reshape(cat(z_i))`` (row-major order is the same). The
                     reshape of the dense cat result is a view, and the cat reads
                     each z_i through its strides: attention's ``[B, H, T, D]``
                     gradients transposed to ``[B, T, H, D]`` are read in place, not
                     first copied into ``[B, T, C]`` (a reshape the strides do not
                     allow as a view).

No rule matches a pad with step > 1, overlapping windows, a leaf that is no
pad, an inner add with another use, or a cast that rounds.
"""

from __future__ import annotations

import torch
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Attribute, Block, Operation, SSAValue
from xdsl.rewriter import Rewriter

from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.transforms.simplify import dce, widens_exactly

# layout ops a cast commutes with exactly (each moves elements without looking at them)
_LAYOUT = (nv.TransposeOp, nv.ReshapeOp, nv.BroadcastToOp, nv.SliceOp)


def _builder(at: Operation) -> OpBuilder:
    loc = at.attributes.get("nova.loc")
    return OpBuilder(at.parent_block(), before=at, location=loc.data if loc is not None else None)


# --------------------------------------------------------------------------- pads -> cat


def _add_leaves(root: nv.AddOp) -> list[SSAValue] | None:
    """The leaves of the add tree under ``root``: its inner adds have one use and the
    root's type on both operands (no broadcasting); None when the tree has none."""
    leaves, stack = [], [root]
    while stack:
        add = stack.pop()
        for v in reversed(add.operands):
            if v.type != root.results[0].type:
                return None
            o = v.owner
            if isinstance(o, nv.AddOp) and v.has_one_use():
                stack.append(o)
            else:
                leaves.append(v)
    return leaves


def _pads_as_cat(root: nv.AddOp) -> SSAValue | None:
    leaves = _add_leaves(root)
    if leaves is None or any(not isinstance(v.owner, nv.PadOp) for v in leaves):
        return None
    pads = [v.owner for v in leaves]
    p0 = pads[0].props()
    if any(p.props()["step"] != 1 or p.props()["dim"] != p0["dim"] or p.props()["size"] != p0["size"] for p in pads):
        return None
    d, size = p0["dim"], p0["size"]
    windows = sorted(((p.props()["start"], p.props()["start"] + shape_of(p.operands[0].type)[d], p) for p in pads),
                     key=lambda w: w[:2])  # two pads of one window (a real sum, below) are not compared themselves
    if any(windows[i][1] > windows[i + 1][0] for i in range(len(windows) - 1)):
        return None  # overlapping windows: a real sum
    b = _builder(root)
    out_shape = list(shape_of(root.results[0].type))
    elem = elem_of(root.results[0].type)
    pieces, at = [], 0
    for start, end, pad in windows:
        if start > at:
            pieces.append(_zeros(b, out_shape, d, start - at, elem))
        if end > start:
            pieces.append(pad.operands[0])
        at = end
    if at < size:
        pieces.append(_zeros(b, out_shape, d, size - at, elem))
    return b.one(nv.CatOp, pieces, {"dim": d})


def _zeros(b: OpBuilder, shape: list[int], d: int, n: int, elem: Attribute) -> SSAValue:
    gap = list(shape)
    gap[d] = n
    return b.broadcast_to(b.full(0.0, (), elem), gap)


# --------------------------------------------------------------------------- cat of casts


def _under_layout(v: SSAValue) -> tuple[list[Operation], SSAValue]:
    """The layout ops from ``v`` down (outermost first) and the value below them."""
    chain = []
    while isinstance(v.owner, _LAYOUT):
        chain.append(v.owner)
        v = v.owner.operands[0]
    return chain, v


def _narrow_of(v: SSAValue) -> Attribute | None:
    """The source type of the exact widening cast under ``v``'s layout ops, if any."""
    o = _under_layout(v)[1].owner
    if isinstance(o, nv.CastOp) and widens_exactly(elem_of(o.operands[0].type), elem_of(o.results[0].type)):
        return elem_of(o.operands[0].type)
    return None


def _exact_zero_piece(v: SSAValue, narrow: Attribute) -> bool:
    """``v`` is L(full(c)) with c exact in ``narrow`` (a gap piece of pads -> cat)."""
    o = _under_layout(v)[1].owner
    if not isinstance(o, nv.FullOp):
        return False
    c = o.props()["value"]
    return torch.tensor(c, dtype=to_torch_dtype(narrow)).item() == c


def _narrowed(v: SSAValue, narrow: Attribute, b: OpBuilder) -> SSAValue:
    """``v`` rebuilt in the ``narrow`` type: its layout ops over the cast's source
    (or over the same constant made in ``narrow``)."""
    chain, x = _under_layout(v)
    o = x.owner
    u = o.operands[0] if isinstance(o, nv.CastOp) else b.full(o.props()["value"], shape_of(x.type), narrow)
    for layout in reversed(chain):
        u = b.one(type(layout), [u], layout.props(), tensor(shape_of(layout.results[0].type), narrow))
    return u


def _lift_casts(cat: nv.CatOp) -> SSAValue | None:
    pieces = list(cat.operands)
    narrows = {_narrow_of(v) for v in pieces} - {None}
    if len(narrows) != 1:
        return None  # no cast under the pieces, or casts from different types
    (narrow,) = narrows
    if any(_narrow_of(v) is None and not _exact_zero_piece(v, narrow) for v in pieces):
        return None
    b = _builder(cat)
    return b.cast(b.one(nv.CatOp, [_narrowed(v, narrow, b) for v in pieces], cat.props()),
                  elem_of(cat.results[0].type))  # fmt: skip


# --------------------------------------------------------------------------- cat of reshapes


def _reshapes_into(cat: nv.CatOp) -> SSAValue | None:
    d = cat.props()["dim"]
    pieces = list(cat.operands)
    if not all(isinstance(v.owner, nv.ReshapeOp) for v in pieces):
        return None
    zs = [v.owner.operands[0] for v in pieces]
    z0 = shape_of(zs[0].type)
    for v, z in zip(pieces, zs, strict=True):
        zs_shape = shape_of(z.type)
        if len(zs_shape) <= d or zs_shape[:d] != shape_of(v.type)[:d]:
            return None  # the reshape moves elements across the dims before the cat dim
        if len(zs_shape) != len(z0) or zs_shape[:d] + zs_shape[d + 1:] != z0[:d] + z0[d + 1:]:
            return None  # the z's cannot be concatenated along d
    if all(shape_of(z.type) == shape_of(v.type) for v, z in zip(pieces, zs, strict=True)):
        return None  # only unit reshapes (simplify's business)
    b = _builder(cat)
    return b.reshape(b.one(nv.CatOp, zs, {"dim": d}), shape_of(cat.results[0].type))


# --------------------------------------------------------------------------- the pass


def _replace(op: Operation, v: SSAValue) -> None:
    Rewriter.replace_op(op, [], [v])


def concat(module: ModuleOp) -> int:
    """Applies the rules over @train_step; returns how many ops it rewrote."""
    block: Block = step_func(module).body.block
    n = 0
    for op in reversed(list(block.ops)):  # an add tree's root before its inner adds
        if isinstance(op, nv.AddOp) and op.parent is not None and op.results[0].uses:
            v = _pads_as_cat(op)
            if v is not None:
                _replace(op, v)
                n += 1
    changed = True
    while changed:
        changed = False
        for op in list(block.ops):
            if not isinstance(op, nv.CatOp) or op.parent is None or not op.results[0].uses:
                continue
            v = _lift_casts(op)
            if v is None:
                v = _reshapes_into(op)
            if v is not None:
                _replace(op, v)
                n += 1
                changed = True
    if n:
        dce(block)  # the pads and casts the rewrites left unused
    return n
