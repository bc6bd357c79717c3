"""The autodiff pass: appends the backward of ``@train_step`` to its body.

Reverse mode over the straight-line block: seed the loss with 1.0, visit the
forward ops last to first, and hand each op whose results received cotangents
to its rule in ``rules.VJP_RULES``. Cotangents of a value used several times
are summed with ``nova.add``. Only float values that depend on a float
``param`` argument take part, so ops that merely prepare batch data (masks,
ids) need no rule, exactly like tensors without ``requires_grad`` in torch.

Afterwards the function returns its previous results followed by one
``("grad", <param name>, value)`` per parameter that the loss depends on
through differentiable ops (the others get none: torch leaves their ``.grad``
None). Rules may build cotangents nobody needs (e.g. for a constant operand);
those backward ops are erased before the pass returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from nova.autodiff.rules import VJP_RULES
from nova.errors import AutodiffError
from nova.ir.dialect import StopGradientOp
from nova.ir.builder import OpBuilder
from nova.ir.module import arg_slots, return_op, returned, set_results, step_func
from nova.ir.types import elem_of, is_float, shape_of


def location(op: Operation) -> str | None:
    loc = op.attributes.get("nova.loc")
    return loc.data if isinstance(loc, StringAttr) else None


def _at(op: Operation) -> str:
    loc = location(op)
    return f" at {loc}" if loc else ""


def append_backward(module: ModuleOp) -> None:
    fn = step_func(module)
    block = fn.body.block
    ret = return_op(fn)
    results = returned(fn)
    if any(role == "grad" for role, _, _ in results):
        raise AutodiffError("@train_step already returns gradients; autodiff runs once")
    losses = [v for role, _, v in results if role == "loss"]
    if len(losses) != 1:
        raise AutodiffError(f"@train_step must return exactly one result with role 'loss', found {len(losses)}")
    (loss,) = losses
    if not is_float(loss.type) or shape_of(loss.type) != ():
        raise AutodiffError(f"the loss must be a 0-d float tensor, got {loss.type}")

    params = [(s.name, a) for s, a in zip(arg_slots(fn), block.args, strict=True) if s.role == "param" and is_float(a.type)]
    forward = [op for op in block.ops if op is not ret]
    active = _depends_on_params([a for _, a in params], forward)

    b = OpBuilder(block, before=ret)
    cts: dict[SSAValue, SSAValue] = {}
    if loss in active:
        cts[loss] = b.full(1.0, (), elem_of(loss.type))
    for op in reversed(forward):
        outs = [cts.get(r) for r in op.results]
        if all(c is None for c in outs):
            continue
        rule = VJP_RULES.get(type(op))
        if rule is None:
            raise AutodiffError(f"no VJP rule for {op.name}{_at(op)}")
        b.location = location(op)  # backward ops point at the source line of their forward op
        try:
            ins = rule(b, op, outs)
        except AutodiffError as e:
            raise AutodiffError(f"{e}{_at(op)}") from e
        if len(ins) != len(op.operands):
            raise AutodiffError(f"VJP rule of {op.name} returned {len(ins)} cotangents for {len(op.operands)} operands")
        for x, c in zip(op.operands, ins):
            if c is None or x not in active:
                continue
            if c.type != x.type:
                raise AutodiffError(f"VJP rule of {op.name} returned a cotangent of type {c.type} for an operand of type {x.type}")
            cts[x] = c if x not in cts else b.add(cts[x], c)
    b.location = None

    grads = [("grad", name, cts[a]) for name, a in params if a in cts]
    set_results(fn, results + grads)
    _erase_unused(block, set(forward))


def _depends_on_params(params: list[SSAValue], ops: list[Operation]) -> set[SSAValue]:
    """The float values computed from at least one parameter."""
    active = set(params)
    for op in ops:
        if isinstance(op, StopGradientOp):
            continue  # detach: the result carries no gradient back
        if any(x in active for x in op.operands):
            active.update(r for r in op.results if is_float(r.type))
    return active


def _erase_unused(block, keep: set[Operation]) -> None:
    """Erases backward ops whose results nothing uses (cotangents of constants
    or batch inputs that rules compute alongside the ones needed)."""
    for op in reversed(list(block.ops)):
        if op in keep or op is block.last_op:
            continue
        if not any(r.uses for r in op.results):
            block.erase_op(op)


@dataclass(frozen=True)
class AutodiffPass(ModulePass):
    """``append_backward`` as a registered xDSL module pass."""

    name = "autodiff"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        append_backward(op)
