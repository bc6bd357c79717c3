"""The guard stage: the step's checks on the device, gating the update.

A step must not take effect when an id is out of range (an embedding's ids, a
cross-entropy's class targets) or, when asked (``skip_nonfinite``), when the
loss or a gradient is NaN or inf. Reading a flag on the host after each kernel
would be a stream sync per check; instead the checks are ops of the step:

  bad_ids   = sum of nova.count_out_of_range over every embedding's ids
              ([0, rows): a padding_idx row is in range) and every
              cross_entropy / linear_cross_entropy's targets ([0, classes),
              ignore_index not counted)
  nonfinite = sum of nova.count_nonfinite over the loss and every gradient
              (only with skip_nonfinite)
  ok        = (bad_ids + nonfinite) == 0   (counts are never negative)

and every param and state result ``r`` becomes ``where(ok, r, old)`` with
``old`` the argument of the same name, so a failed step leaves parameters and
optimizer state bit-identical. The counts leave the step as results of role
``status`` named ``bad_ids`` and ``nonfinite``. ``where`` is a same-index op, so
plan_memory still writes each gated update into its argument in place.

The host must not wait for a step to learn whether it failed, so a failure is
also remembered on the device: two ``guard`` arguments, updated in place,

  guard::failed  = failed + bad_ids     (sticky: nonzero once a step failed)
  guard::skipped = skipped + (step skipped for non-finite values only;
                   only with skip_nonfinite)

and ``ok`` also needs ``failed == 0``: once a step has failed, every later step
launched before the host read the failure writes nothing either. The host
(``nova.api``) reads both with one non-blocking copy per step when that step's
event has completed, raises for the first failed step, and zeroes ``failed``.

A program with nothing to check (no ids, no targets, no skip_nonfinite) is not
gated: its ``bad_ids`` is a constant 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from xdsl.dialects.builtin import ModuleOp, StringAttr, i64
from xdsl.ir import Operation, SSAValue

from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, add_arg, arg_slots, return_op, returned, set_results, step_func
from nova.ir.types import is_float, shape_of, tensor

STATUS = "status"
BAD_IDS, NONFINITE = "bad_ids", "nonfinite"
GUARD = "guard"  # the role of the device-side memory of failures (arguments and results)
FAILED, SKIPPED = "guard::failed", "guard::skipped"
# the attribute naming the op a count_out_of_range checks (for the error message)
CHECKED = "nova.checked"


def checked_ids(op: Operation) -> tuple[SSAValue, int, int | None] | None:
    """(ids, high, ignore) of an op whose integer operand must lie in [0, high)."""
    if isinstance(op, nv.EmbeddingOp):
        return op.operands[1], shape_of(op.operands[0].type)[0], None
    if isinstance(op, nv.CrossEntropyOp):
        return op.operands[1], shape_of(op.operands[0].type)[1], op.props()["ignore_index"]
    if isinstance(op, nv.LinearCrossEntropyOp):
        return op.operands[2], shape_of(op.operands[1].type)[0], op.props()["ignore_index"]
    if isinstance(op, nv.LinearCrossEntropyWithGradOp):  # made after this stage (loss_grad); the same check
        return op.operands[3], shape_of(op.operands[2].type)[0], op.props()["ignore_index"]
    return None  # the backward ops read the same ids as their forward: checked there


def _count_ids(b: OpBuilder, op: Operation, ids: SSAValue, high: int, ignore: int | None) -> SSAValue:
    props = {"low": 0, "high": high} | ({"ignore": ignore} if ignore is not None else {})
    count = b.create(nv.CountOutOfRangeOp, [ids], props)
    count.attributes[CHECKED] = StringAttr(op.name)
    if "nova.loc" in op.attributes:
        count.attributes["nova.loc"] = op.attributes["nova.loc"]
    return count.results[0]


def _total(b: OpBuilder, counts: Sequence[SSAValue]) -> SSAValue:
    if not counts:
        return b.full(0.0, (), i64)
    total = counts[0]
    for c in counts[1:]:
        total = b.add(total, c)
    return total


def guard(module: ModuleOp, skip_nonfinite: bool = False, grads: dict[str, SSAValue] | None = None) -> None:
    """Adds the checks, the gate and the status results to @train_step. ``grads``:
    the gradients by parameter name when the optimizer stage has consumed the
    ``grad`` results (else those results are used)."""
    fn = step_func(module)
    results = returned(fn)
    if any(role == STATUS for role, _, _ in results):
        raise ValueError("@train_step is guarded already (it has status results)")
    b = OpBuilder(fn.body.block, before=return_op(fn))
    id_counts = [_count_ids(b, op, *c) for op in list(fn.body.block.ops) if (c := checked_ids(op)) is not None]
    bad_ids = _total(b, id_counts)
    status = [(STATUS, BAD_IDS, bad_ids)]
    if skip_nonfinite:
        if grads is None:
            grads = {name: v for role, name, v in results if role == "grad"}
        checked = [v for role, _, v in results if role == "loss"] + list(grads.values())
        nonfinite = _total(b, [b.one(nv.CountNonfiniteOp, [v]) for v in checked if is_float(v.type)])
        status.append((STATUS, NONFINITE, nonfinite))
    if not id_counts and not skip_nonfinite:
        set_results(fn, results + status)  # nothing can fail: no gate
        return
    failed = add_arg(fn, Slot(GUARD, FAILED, tensor([], i64)))
    zero = b.full(0.0, (), i64)
    failed_now = b.add(failed, bad_ids)  # every count is >= 0: zero iff nothing failed, now or before
    total = failed_now if not skip_nonfinite else b.add(failed_now, status[1][2])
    ok = b.one(nv.EqOp, [total, zero])
    guards = [(GUARD, FAILED, failed_now)]
    if skip_nonfinite:
        skipped = add_arg(fn, Slot(GUARD, SKIPPED, tensor([], i64)))
        one = b.full(1.0, (), i64)
        was_skipped = b.where(b.one(nv.EqOp, [failed_now, zero]),
                              b.where(b.one(nv.EqOp, [status[1][2], zero]), zero, one), zero)  # fmt: skip
        guards.append((GUARD, SKIPPED, b.add(skipped, was_skipped)))
    args = {(s.role, s.name): a for s, a in zip(arg_slots(fn), fn.body.block.args, strict=True)}
    gated = []
    for role, name, v in results:
        old = args.get((role, name)) if role in ("param", "state", "buffer") else None
        # the 0-d flag broadcasts in where; an unchanged result needs no gate
        gated.append((role, name, b.where(ok, v, old) if old is not None and v is not old else v))
    set_results(fn, gated + status + guards)


def describe_bad_ids(fn, args: Sequence[torch.Tensor]) -> list[str]:
    """What each failing count_out_of_range of @train_step found, from the step's
    arguments: the error path only (it recomputes the checked ids on the host with
    the reference executor, over just the ops they depend on, usually a reshape of
    the batch)."""
    from nova.backends.reference import run_ops

    block = fn.body.block
    counts = [op for op in block.ops if isinstance(op, nv.CountOutOfRangeOp)]
    need, ops = {op.operands[0] for op in counts}, []
    for op in reversed(list(block.ops)):
        if any(r in need for r in op.results):
            ops.append(op)
            need.update(op.operands)
    env = dict(zip(block.args, args, strict=True))
    device = args[0].device if args else torch.device("cpu")
    run_ops(reversed(ops), env, device)
    lines = []
    for op in counts:
        lines += _describe(op, env[op.operands[0]])
    return lines


def _describe(op: nv.CountOutOfRangeOp, ids: torch.Tensor) -> list[str]:
    p = op.props()
    what = op.attributes[CHECKED].data if CHECKED in op.attributes else op.name
    loc = f" at {op.attributes['nova.loc'].data}" if "nova.loc" in op.attributes else ""
    seen = ids if p["ignore"] is None else ids[ids != p["ignore"]]
    n_bad = int(((seen < p["low"]) | (seen >= p["high"])).sum())
    if not n_bad:
        return []
    lo, hi = int(seen.min()), int(seen.max())
    if p["ignore"] is None:
        return [f"{what}: index out of range [{p['low']}, {p['high']}) (min {lo}, max {hi}; {n_bad} id(s)){loc}"]
    return [f"{what}: {n_bad} target id(s) out of range [{p['low']}, {p['high']}) "
            f"(min {lo}, max {hi}; ignore_index {p['ignore']}){loc}"]  # fmt: skip


__all__ = ["BAD_IDS", "FAILED", "GUARD", "NONFINITE", "SKIPPED", "STATUS", "checked_ids", "describe_bad_ids", "guard"]
