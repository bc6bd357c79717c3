"""A short, readable text of a step's IR, for people (``explain()`` and ``nova explain``).

``nova.ir.module.print_module`` prints MLIR's generic form: it parses back to
the same text, which the step cache's checks and the IR tests rely on, but every
op repeats its full ``nova.loc`` (a source path under site-packages and the line
of code) and every attribute in full, so a tiny MLP's step is 160 KB. This printer
gives the same IR in a short custom form, one op per line:

    #loc3 = "fc1 (Linear), node linear, torch/nn/modules/linear.py:134: return F.linear(...)"
    ...
    func @train_step(
        %0: tensor<32x16xf32> {param fc1.weight @external},
        ...
    ) -> (
        tensor<f32> {loss loss @output},
        ...
    ) {
      %25 = nova.matmul %4, %24 : tensor<8x32xf32>  [matmul 16x16x16 g1 w4 s1 fma, launch-bound] @arena+0  loc(#loc3)
      %40 = nova.fused "elementwise" (%41 = %3, %42 = %4) : tensor<8x32xf32> {
        %43 = nova.mul %41, %42 : tensor<8x32xf32>
        nova.yield %43
      }
      return %28, ...
    }

- every distinct ``nova.loc`` once, in a table at the top (``#locN``), each op
  ending in ``loc(#locN)``; paths under a ``site-packages`` directory are shown
  relative to it;
- properties as ``{name = value}`` with plain values, result types only (an
  operand's type is at its definition), the lowering config as its short
  summary (``nova.schedule.cost.schedule_summary``) and its regime, the memory
  plan's storage as ``@arena+OFFSET`` / ``@view`` / ``@inplace`` / ...;
- arguments and results with their role and name.

It is for reading only: xDSL 0.75 could parse a custom form (``assembly_format``
or ``parse``/``print`` on each op class), but this one drops what it summarizes
(the config's unused fields, the operand types), so it does not parse back;
``print_module`` stays the round-trip form.
"""

from __future__ import annotations

import io
import re

from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, DenseArrayBase, ModuleOp, StringAttr
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.printer import Printer

from nova.ir import dialect as nv
from nova.ir.module import step_func

# a path's prefix up to and including site-packages/ (a virtualenv's or the system's)
_SITE = re.compile(r"(?:[^\s,:]*/)?(?:site|dist)-packages/")
_SKIP_ATTRS = ("nova.loc", "nova.lowering_config", "nova.storage", "nova.offset")


def short_path(text: str) -> str:
    """``text`` with every ``.../site-packages/`` prefix taken out of its paths."""
    return _SITE.sub("", text)


def _generic(attr: Attribute) -> str:
    out = io.StringIO()
    Printer(stream=out).print_attribute(attr)
    return out.getvalue()


def _value(attr: Attribute) -> str:
    try:
        v = nv.prop_value(attr)
    except TypeError:
        return _generic(attr)
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, tuple):
        return "[" + ", ".join(map(str, v)) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


class _Pretty:
    def __init__(self):
        self.names: dict[SSAValue, str] = {}
        self.locs: dict[str, int] = {}
        self.lines: list[str] = []

    def name(self, v: SSAValue) -> str:
        n = self.names.get(v)
        if n is None:
            n = self.names[v] = f"%{len(self.names)}"
        return n

    def loc(self, op: Operation) -> str:
        a = op.attributes.get("nova.loc")
        if not isinstance(a, StringAttr):
            return ""
        k = self.locs.setdefault(a.data, len(self.locs))
        return f"  loc(#loc{k})"

    def storage(self, op: Operation) -> str:
        kinds, offsets = op.attributes.get("nova.storage"), op.attributes.get("nova.offset")
        if not isinstance(kinds, ArrayAttr):
            return ""
        offs = offsets.get_values() if isinstance(offsets, DenseArrayBase) else [-1] * len(kinds.data)
        parts = [f"@{k.data}" + (f"+{o}" if o >= 0 else "") for k, o in zip(kinds.data, offs)]
        return " " + ",".join(parts)

    def schedule(self, op: Operation) -> str:
        from nova.schedule.cost import config_of, schedule_summary

        cfg = config_of(op)
        if cfg is None:
            return ""
        return f"  [{cfg.kind} {schedule_summary(cfg)}" + (f", {cfg.regime}" if cfg.regime else "") + "]"

    def op(self, op: Operation, indent: str) -> None:
        results = ", ".join(self.name(r) for r in op.results)
        head = f"{indent}{results} = " if op.results else indent
        props = ", ".join(f"{k} = {_value(v)}" for k, v in op.properties.items())
        other = [f"{k} = {_generic(v)}" for k, v in op.attributes.items() if k not in _SKIP_ATTRS]
        attrs = ", ".join(x for x in (props, ", ".join(other)) if x)
        types = ", ".join(str(r.type) for r in op.results)
        if isinstance(op, nv.FusedOp):
            block = op.body.block
            binds = ", ".join(f"{self.name(a)} = {self.name(o)}" for a, o in zip(block.args, op.operands))
            self.lines.append(f'{head}nova.fused "{op.props()["kind"]}" ({binds}) : {types}'
                              f"{self.schedule(op)}{self.storage(op)}{self.loc(op)} {{")  # fmt: skip
            for inner in block.ops:
                self.op(inner, indent + "  ")
            self.lines.append(indent + "}")
            return
        operands = ", ".join(self.name(o) for o in op.operands)
        text = f"{head}{op.name}" + (f" {operands}" if operands else "") + (f" {{{attrs}}}" if attrs else "")
        if types:
            text += f" : {types}"
        self.lines.append(text + self.schedule(op) + self.storage(op) + self.loc(op))


def _slot(attrs: Attribute | None) -> str:
    """``{param fc1.weight @arena+0}`` from an argument's or a result's attributes."""
    if attrs is None:
        return ""
    d = attrs.data
    role, name = d.get("nova.role"), d.get("nova.name")
    words = [a.data for a in (role, name) if isinstance(a, StringAttr)]
    storage = d.get("nova.storage")
    if isinstance(storage, StringAttr):
        off = d.get("nova.offset")
        words.append(f"@{storage.data}" + (f"+{off.value.data}" if off is not None else ""))
    rest = [f"{k} = {_generic(v)}" for k, v in d.items() if k not in ("nova.role", "nova.name", "nova.storage", "nova.offset")]
    return " {" + " ".join(words + rest) + "}"


def pretty(module: ModuleOp) -> str:
    """The short form of a module holding ``@train_step`` (see the module docstring)."""
    fn = step_func(module)
    p = _Pretty()
    block = fn.body.block
    arg_attrs = fn.arg_attrs.data if fn.arg_attrs else [None] * len(block.args)
    res_attrs = fn.res_attrs.data if fn.res_attrs else [None] * len(fn.function_type.outputs.data)
    args = [f"    {p.name(a)}: {a.type}{_slot(at)}" for a, at in zip(block.args, arg_attrs)]
    results = [f"    {t}{_slot(at)}" for t, at in zip(fn.function_type.outputs.data, res_attrs)]
    fn_attrs = [f"{k} = {_generic(v)}" for k, v in fn.attributes.items()]
    for op in block.ops:
        if isinstance(op, func.ReturnOp):
            p.lines.append("  return " + ", ".join(p.name(v) for v in op.operands))
        else:
            p.op(op, "  ")
    head = [f'#loc{k} = "{short_path(text)}"' for text, k in p.locs.items()]
    head += [f"// module attribute {k} = {_generic(v)}" for k, v in module.attributes.items()]
    if fn_attrs:
        head.append("// @train_step attributes: " + ", ".join(fn_attrs))
    signature = [f"func @{fn.sym_name.data}(", ",\n".join(args), ") -> (", ",\n".join(results), ") {"]
    return "\n".join([*head, *signature, *p.lines, "}"]) + "\n"


def counts(module: ModuleOp) -> dict[str, int]:
    """Ops of ``@train_step`` by name, a nova.fused group counted as one (its body's
    ops are not counted again)."""
    out: dict[str, int] = {}
    for op in step_func(module).body.block.ops:
        if not isinstance(op, func.ReturnOp):
            out[op.name] = out.get(op.name, 0) + 1
    return out


__all__ = ["pretty", "short_path", "counts"]
