"""The fold stage: values that depend only on static shapes are computed once,
at compile time, instead of in every step.

Model code builds much of its bookkeeping from nothing but the (static) shapes:
position ids from ``arange``, causal masks from ``arange`` compares and ``&``,
fill values and their broadcasts (transformers' ``create_causal_mask``,
nanoGPT's ``torch.tril(torch.ones(...))``). Such a value is *static*: its ops
read no argument of the step (no parameter, buffer, batch, state or seed), so it
is the same in every step. This stage evaluates the static ops with the
reference executor on the model's device and passes each static value that the
rest of the step reads as a ``buffer`` argument named ``folded.<n>``: its
tensor lives in ``Captured.buffers`` beside the model's own buffers.

What stays an op: constants that cost nothing to recompute and nothing to
store (``full``, ``arange``) and views of folded values (``reshape``,
``transpose``, ``broadcast_to``), so a mask broadcast to [B, H, T, T] is kept
as its [T, T] source. A static value larger than ``MAX_FOLDED_ELEMENTS`` whose
op is elementwise keeps its op and folds its operands instead: a step reading
a large constant from memory costs as much as computing it from small ones.

Values that depend on the batch (label shifting, a user's ``attention_mask``)
are not static and stay in the step.
"""

from __future__ import annotations

import torch
from xdsl.dialects import func
from xdsl.ir import Operation, SSAValue
from xdsl.rewriter import Rewriter

from nova.backends.reference import run_ops
from nova.ir import dialect as nv
from nova.ir.module import Slot, add_arg, step_func
from nova.ir.types import numel, shape_of

# ops kept as ops at the boundary of a static region: free to compute, or views
_CHEAP = (nv.FullOp, nv.ArangeOp)
_VIEWS = (nv.ReshapeOp, nv.TransposeOp, nv.BroadcastToOp)
# ops whose result may be recomputed from folded operands when it is large
_ELEMENTWISE = (nv.BinaryOp, nv.CompareOp, nv.WhereOp, nv.UnaryOp, nv.CastOp)
# a folded constant of up to 4 Mi elements (16 MiB in f32) is cheaper to read
# than a chain of ops to recompute; above that, an elementwise op recomputes it
MAX_FOLDED_ELEMENTS = 1 << 22
PREFIX = "folded."


def fold_static(module, buffers: dict[str, torch.Tensor], device: torch.device) -> list[str]:
    """Folds the static values of ``@train_step``; adds their tensors to
    ``buffers`` and returns the names of the new buffer arguments."""
    fn = step_func(module)
    block = fn.body.block
    static_ops = [op for op in _static_ops(block)]
    if not static_ops:
        return []
    static = {r for op in static_ops for r in op.results}
    boundary = _boundary(block, static)
    to_fold: list[SSAValue] = []
    for v in boundary:
        _choose(v, to_fold)
    to_fold = list(dict.fromkeys(to_fold))  # unique, in order
    if not to_fold:
        return []
    env: dict[SSAValue, torch.Tensor] = {}
    run_ops(static_ops, env, device)
    names = []
    for v in to_fold:
        name = f"{PREFIX}{_next_index(buffers)}"
        arg = add_arg(fn, Slot("buffer", name, v.type))
        buffers[name] = env[v].contiguous()
        v.replace_all_uses_with(arg)
        names.append(name)
    _erase_dead(static_ops)
    return names


def _static_ops(block) -> list[Operation]:
    args = set(block.args)
    static: set[SSAValue] = set()
    out = []
    for op in block.ops:
        if isinstance(op, func.ReturnOp) or isinstance(op, nv.DropoutMaskOp):
            continue
        if any(o in args or o not in static for o in op.operands):
            continue
        static.update(op.results)
        out.append(op)
    return out


def _boundary(block, static: set[SSAValue]) -> list[SSAValue]:
    """Static values read by a non-static op (or returned)."""
    out = []
    for op in block.ops:
        if any(r in static for r in op.results):
            continue
        out += [o for o in op.operands if o in static]
    return list(dict.fromkeys(out))


def _choose(v: SSAValue, to_fold: list[SSAValue]) -> None:
    op = v.owner
    if isinstance(op, _CHEAP):
        return
    if isinstance(op, _VIEWS) or (isinstance(op, _ELEMENTWISE) and numel(shape_of(v.type)) > MAX_FOLDED_ELEMENTS):
        for o in op.operands:
            _choose(o, to_fold)
        return
    to_fold.append(v)


def _next_index(buffers: dict) -> int:
    return sum(1 for k in buffers if k.startswith(PREFIX))


def _erase_dead(ops: list[Operation]) -> None:
    for op in reversed(ops):
        if not any(r.uses for r in op.results):
            Rewriter.erase_op(op)
