"""The optimizer stage: appends the parameter and state update to @train_step.

The update is written as nova ops with PyTorch's own formulas (the
single-tensor implementations in torch/optim/adam.py and sgd.py), in the same
order of operations. Hyper-parameters are 0-d f64 arguments (role ``hyper``)
read from ``param_groups`` at every call, and PyTorch's scalar arithmetic
(bias corrections, step size) is done on them in f64, as Python does it, before
one cast to the parameter's dtype. So a learning-rate scheduler needs no
recompilation, and the numbers match eager PyTorch.

State tensors keep PyTorch's layout (``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``, ``momentum_buffer``); they enter as ``state`` arguments
named ``<param>::<key>`` and leave as ``state`` results of the same name.
Parameters without a gradient are skipped, as PyTorch skips ``grad is None``:
frozen ones (``requires_grad`` False, captured as inputs like buffers) and those
that do not reach the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from xdsl.dialects.builtin import ModuleOp, f64
from xdsl.ir import SSAValue

from nova.errors import CaptureError, UnsupportedError
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, add_arg, arg_slots, return_op, returned, set_results, step_func
from nova.ir.types import elem_of, from_torch_dtype, tensor

ADAM_HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")
SGD_HYPER = ("lr", "momentum", "dampening", "weight_decay")
# param-group options that change the update's structure (a program per value); the rest are read each call
STRUCTURAL = ("maximize", "amsgrad", "nesterov", "decoupled_weight_decay")


def group_structure(group: dict) -> tuple:
    """A param group's options that change the update's structure (one program per value)."""
    return tuple((k, group[k]) for k in STRUCTURAL if k in group) + (group.get("momentum", 0) != 0,)


@dataclass(frozen=True)
class GroupSpec:
    """The structure of one param group: what changes the program, not the values."""

    kind: str  # "adam" | "adamw" | "sgd"
    params: tuple[str, ...]  # names of the parameters (as in the IR)
    maximize: bool = False
    amsgrad: bool = False
    momentum: bool = False  # SGD: momentum != 0 (a momentum buffer exists)
    nesterov: bool = False


@dataclass(frozen=True)
class OptimizerSpec:
    groups: tuple[GroupSpec, ...]

    @staticmethod
    def from_torch(opt: torch.optim.Optimizer, names: dict[int, str]) -> "OptimizerSpec":
        """``names`` maps id(parameter) to its IR name; every optimizer parameter must be there."""
        problems = []
        groups = []
        for g, group in enumerate(opt.param_groups):
            pnames = []
            for i, p in enumerate(group["params"]):
                if not p.requires_grad:
                    continue  # frozen: its grad is None, so torch.optim skips it (no decay, state or step)
                if id(p) not in names:
                    raise CaptureError(
                        f"optimizer param_groups[{g}] parameter {i} (shape {tuple(p.shape)}) is not a "
                        "parameter of the model: Nova updates only the model's own parameters"
                    )
                pnames.append(names[id(p)])
            groups.append(_group_spec(opt, group, tuple(pnames), g, problems))
        if problems:
            raise UnsupportedError(problems)
        return OptimizerSpec(tuple(groups))


def _group_spec(opt, group, pnames, g, problems) -> GroupSpec:
    where = f"param_groups[{g}]"
    if isinstance(opt, torch.optim.Adam):  # AdamW is an Adam subclass
        decoupled = isinstance(opt, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        for key in ("lr", "eps", "weight_decay", *(("betas",))):
            if isinstance(group[key], torch.Tensor) and key != "betas":
                problems.append((f"Adam {key} given as a tensor", where))
        return GroupSpec("adamw" if decoupled else "adam", pnames, bool(group["maximize"]), bool(group["amsgrad"]))
    if isinstance(opt, torch.optim.SGD):
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            problems.append(("SGD nesterov needs momentum > 0 and dampening 0 (torch rejects it too)", where))
        return GroupSpec("sgd", pnames, bool(group["maximize"]), momentum=group["momentum"] != 0,
                         nesterov=bool(group["nesterov"]))  # fmt: skip
    problems.append((f"optimizer {type(opt).__name__} (Nova supports Adam, AdamW and SGD)", "optimizer"))
    return GroupSpec("sgd", pnames)


def hyper_values(opt: torch.optim.Optimizer, spec: OptimizerSpec) -> dict[str, float]:
    """The current hyper-parameters, named as the IR's ``hyper`` arguments."""
    out = {}
    for g, (group, gs) in enumerate(zip(opt.param_groups, spec.groups, strict=True)):
        if gs.kind == "sgd":
            vals = {k: group[k] for k in SGD_HYPER}
        else:
            b1, b2 = group["betas"]
            vals = {"lr": group["lr"], "beta1": b1, "beta2": b2, "eps": group["eps"], "weight_decay": group["weight_decay"]}
        for k, v in vals.items():
            out[f"group{g}::{k}"] = float(v)
    return out


def state_keys(gs: GroupSpec) -> tuple[str, ...]:
    if gs.kind == "sgd":
        return ("momentum_buffer",) if gs.momentum else ()
    return ("step", "exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if gs.amsgrad else ()))


def append_optimizer(module: ModuleOp, spec: OptimizerSpec, step_dtype=None) -> None:
    """Consumes the ``grad`` results; returns loss, new params and new state (and the
    new values of the buffers the forward writes, as they were)."""
    fn = step_func(module)
    results = returned(fn)
    loss = [r for r in results if r[0] == "loss"]
    grads = {name: v for role, name, v in results if role == "grad"}
    params = {s.name: a for s, a in zip(arg_slots(fn), fn.body.block.args) if s.role == "param"}
    b = OpBuilder(fn.body.block, before=return_op(fn))
    # PyTorch keeps ``step`` as a 0-d float32 (float64 when that is the default dtype)
    step_elem = from_torch_dtype(step_dtype or torch.float32)
    new_results: list[tuple[str, str, SSAValue]] = list(loss) + [r for r in results if r[0] == "buffer"]

    for g, gs in enumerate(spec.groups):
        hyper = {}
        for k in SGD_HYPER if gs.kind == "sgd" else ADAM_HYPER:
            hyper[k] = add_arg(fn, Slot("hyper", f"group{g}::{k}", tensor([], f64)))
        for pname in gs.params:
            if pname not in grads:
                continue  # no gradient: PyTorch skips the parameter
            p, grad = params[pname], grads[pname]
            state = {}
            for key in state_keys(gs):
                t = tensor([], step_elem) if key == "step" else p.type
                state[key] = add_arg(fn, Slot("state", f"{pname}::{key}", t))
            if gs.kind == "sgd":
                fresh = add_arg(fn, Slot("hyper", f"{pname}::momentum_buffer_fresh", tensor([], f64))) if gs.momentum else None
                new_p, new_state = _sgd(b, gs, hyper, p, grad, state, fresh)
            else:
                new_p, new_state = _adam(b, gs, hyper, p, grad, state)
            new_results.append(("param", pname, new_p))
            new_results += [("state", f"{pname}::{k}", v) for k, v in new_state.items()]
    set_results(fn, new_results)


def _as(b: OpBuilder, x: SSAValue, like: SSAValue) -> SSAValue:
    """A 0-d f64 scalar cast to ``like``'s dtype, as torch casts a Python scalar operand."""
    return b.cast(x, elem_of(like.type))


def _adam(b: OpBuilder, gs: GroupSpec, h: dict, p, grad, st):
    one = b.full(1.0, (), f64)
    if gs.maximize:
        grad = b.neg(grad)
    new_step = b.add(st["step"], b.scalar(1.0, st["step"]))
    if gs.kind == "adamw":
        # param.mul_(1 - lr * weight_decay)
        p = b.mul(p, _as(b, b.sub(one, b.mul(h["lr"], h["weight_decay"])), p))
    else:
        # grad = grad.add(param, alpha=weight_decay)
        grad = b.add(grad, b.mul(_as(b, h["weight_decay"], p), p))
    # exp_avg.lerp_(grad, 1 - beta1); torch's lerp for weight < 0.5: self + w * (end - self)
    w1 = _as(b, b.sub(one, h["beta1"]), p)
    m = st["exp_avg"]
    m = b.add(m, b.mul(w1, b.sub(grad, m)))
    # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    v = b.mul(st["exp_avg_sq"], _as(b, h["beta2"], p))
    v = b.add(v, b.mul(b.mul(_as(b, b.sub(one, h["beta2"]), p), grad), grad))
    # scalar math in f64, like Python: bias corrections, step size
    s = b.cast(new_step, f64)
    bc1 = b.sub(one, b.one(nv.PowOp, [h["beta1"], s]))
    bc2 = b.sub(one, b.one(nv.PowOp, [h["beta2"], s]))
    step_size = b.div(h["lr"], bc1)
    bc2_sqrt = b.one(nv.SqrtOp, [bc2])
    new_state = {"step": new_step, "exp_avg": m, "exp_avg_sq": v}
    second = v
    if gs.amsgrad:
        second = b.one(nv.MaximumOp, [st["max_exp_avg_sq"], v])
        new_state["max_exp_avg_sq"] = second
    # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    denom = b.add(b.div(b.one(nv.SqrtOp, [second]), _as(b, bc2_sqrt, p)), _as(b, h["eps"], p))
    # param.addcdiv_(exp_avg, denom, value=-step_size)
    p = b.add(p, b.mul(_as(b, b.neg(step_size), p), b.div(m, denom)))
    return p, new_state


def _sgd(b: OpBuilder, gs: GroupSpec, h: dict, p, grad, st, fresh):
    one = b.full(1.0, (), f64)
    if gs.maximize:
        grad = b.neg(grad)
    # grad = grad.add(param, alpha=weight_decay)
    grad = b.add(grad, b.mul(_as(b, h["weight_decay"], p), p))
    new_state = {}
    if gs.momentum:
        # first step: buf = clone(grad); later: buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        cont = b.add(b.mul(st["momentum_buffer"], _as(b, h["momentum"], p)),
                     b.mul(_as(b, b.sub(one, h["dampening"]), p), grad))  # fmt: skip
        is_fresh = b.one(nv.NeOp, [fresh, b.full(0.0, (), f64)])
        buf = b.where(is_fresh, grad, cont)
        new_state["momentum_buffer"] = buf
        grad = b.add(grad, b.mul(_as(b, h["momentum"], p), buf)) if gs.nesterov else buf
    # param.add_(grad, alpha=-lr)
    p = b.add(p, b.mul(_as(b, b.neg(h["lr"]), p), grad))
    return p, new_state
