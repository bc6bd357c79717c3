"""Arguments for a compiled step's @train_step, for pass tests that run it on the
reference executor: its params, buffers and batch, seeded random state, fixed hypers."""

from __future__ import annotations

import torch

from nova.ir.module import arg_slots, new_step, return_op, step_func
from nova.ir.types import elem_of, shape_of, to_torch_dtype


def step_args(c) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = []
    for s in arg_slots(step_func(c.module)):
        if s.role == "param":
            out.append(c.captured.params[s.name].detach().clone())
        elif s.role == "buffer":
            out.append(c.captured.buffers[s.name])
        elif s.role == "batch":
            out.append(c.batch[c.captured.batch_names.index(s.name)])
        elif s.role == "hyper":
            out.append(torch.tensor(0.9 if "beta" in s.name else 1e-3, dtype=torch.float64))
        elif s.role == "state":
            t = torch.rand(shape_of(s.type), generator=g).to(to_torch_dtype(elem_of(s.type)))
            out.append(t + (1.0 if "step" in s.name else 0))
        elif s.role == "guard":
            out.append(torch.tensor(0, dtype=torch.int64))  # nothing failed before this step
        else:
            out.append(torch.tensor(7, dtype=torch.int64))
    return out


def run_program(prog, args) -> list[torch.Tensor]:
    """A ``TritonProgram``'s launch list run step by step on ``args`` (no executable,
    no memory plan): what its @train_step returns."""
    env = dict(zip(prog.fn.body.block.args, args, strict=True))
    for st in prog.steps:
        env.update(zip(st.outputs, st.run([env[v] for v in st.inputs]), strict=True))
    return [env[v] for v in return_op(prog.fn).operands]


def policy_step(policy: str, *slots):
    """(module, fn, builder) of a new step of ``slots`` under precision policy ``policy``."""
    from xdsl.dialects.builtin import StringAttr

    from nova.ir.builder import OpBuilder

    module, fn = new_step(list(slots))
    module.attributes["nova.precision"] = StringAttr(policy)
    return module, fn, OpBuilder(fn.body.block, location="test.py:1")
