"""The step function: one ``func.func @train_step`` in a module.

Every argument and result carries ``nova.role`` and ``nova.name`` attributes,
so the IR itself says what binds to what:

  arguments  param (a model parameter), state (an optimizer state tensor),
             hyper (a 0-d hyper-parameter read from param_groups each call),
             buffer (a model buffer), batch (a user input), seed (dropout RNG)
  results    loss, buffer (from capture: the new value of a buffer the forward
             writes, batch norm's running statistics), grad (after autodiff), param
             and state (after the optimizer); param, state and buffer results are
             the new value of the argument with the same name, status (after
             the guard: 0-d i64 counts of what made the step write nothing,
             "bad_ids" and, when asked for, "nonfinite")
  both       guard (after the guard: 0-d i64 device-side memory of failed and
             skipped steps, "guard::failed" and "guard::skipped", updated in place)

Printing uses MLIR's generic form, which parses back to identical IR.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, Builtin, DictionaryAttr, ModuleOp, StringAttr, TensorType
from xdsl.ir import Block, Region, SSAValue
from xdsl.parser import Parser
from xdsl.printer import Printer

from nova.ir.dialect import Nova

ROLES = ("param", "state", "hyper", "buffer", "batch", "seed", "loss", "grad", "status", "guard")
STEP = "train_step"


@dataclass(frozen=True)
class Slot:
    role: str
    name: str
    type: TensorType

    def attrs(self) -> DictionaryAttr:
        assert self.role in ROLES, self.role
        return DictionaryAttr({"nova.role": StringAttr(self.role), "nova.name": StringAttr(self.name)})


def new_step(args: list[Slot]) -> tuple[ModuleOp, func.FuncOp]:
    """A module holding an empty ``@train_step`` over ``args`` (results come later)."""
    block = Block(arg_types=[a.type for a in args])
    fn = func.FuncOp(STEP, ([a.type for a in args], []), Region(block))
    fn.arg_attrs = ArrayAttr([a.attrs() for a in args])
    module = ModuleOp([fn])
    return module, fn


def step_func(module: ModuleOp) -> func.FuncOp:
    for op in module.ops:
        if isinstance(op, func.FuncOp) and op.sym_name.data == STEP:
            return op
    raise ValueError(f"module has no func.func @{STEP}")


def _slots(attrs: ArrayAttr | None, types) -> list[Slot]:
    if attrs is None:
        return []
    return [Slot(a.data["nova.role"].data, a.data["nova.name"].data, t) for a, t in zip(attrs.data, types, strict=True)]


def arg_slots(fn: func.FuncOp) -> list[Slot]:
    return _slots(fn.arg_attrs, fn.function_type.inputs.data)


def result_slots(fn: func.FuncOp) -> list[Slot]:
    return _slots(fn.res_attrs, fn.function_type.outputs.data)


def return_op(fn: func.FuncOp) -> func.ReturnOp:
    last = fn.body.block.last_op
    if not isinstance(last, func.ReturnOp):
        raise ValueError("@train_step does not end in func.return")
    return last


def set_results(fn: func.FuncOp, results: list[tuple[str, str, SSAValue]]) -> None:
    """Replaces the function's return with one returning (role, name, value)s."""
    block = fn.body.block
    last = block.last_op
    if isinstance(last, func.ReturnOp):
        block.erase_op(last)
    block.add_op(func.ReturnOp(*[v for _, _, v in results]))
    fn.function_type = func.FunctionType.from_lists(fn.function_type.inputs.data, [v.type for _, _, v in results])
    fn.res_attrs = ArrayAttr([Slot(r, n, v.type).attrs() for r, n, v in results])


def returned(fn: func.FuncOp) -> list[tuple[str, str, SSAValue]]:
    ret = return_op(fn)
    return [(s.role, s.name, v) for s, v in zip(result_slots(fn), ret.operands, strict=True)]


def context() -> Context:
    ctx = Context()
    ctx.load_dialect(Builtin)
    ctx.load_dialect(func.Func)
    ctx.load_dialect(Nova)
    return ctx


def print_module(module: ModuleOp) -> str:
    out = io.StringIO()
    Printer(stream=out, print_generic_format=True).print_op(module)
    return out.getvalue() + "\n"


def parse_module(text: str) -> ModuleOp:
    return Parser(context(), text).parse_module()


def add_arg(fn: func.FuncOp, slot: Slot) -> SSAValue:
    """Appends an argument to ``@train_step``, keeping its signature in step."""
    block = fn.body.block
    arg = block.insert_arg(slot.type, len(block.args))
    fn.function_type = func.FunctionType.from_lists([*fn.function_type.inputs.data, slot.type], fn.function_type.outputs.data)
    fn.arg_attrs = ArrayAttr([*(fn.arg_attrs.data if fn.arg_attrs else ()), slot.attrs()])
    return arg
